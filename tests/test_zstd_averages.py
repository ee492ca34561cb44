"""bench.zstd_averages' trained payloads: the effect the Scale section explains, on a small vector."""

from __future__ import annotations

import torch

from bench.zstd_averages import round_bytes, trained_updates, wire_share


def test_one_step_means_of_many_peers_compress_less_than_means_of_two_and_many_steps_close_the_gap() -> None:
    """A one-step AdamW update is lr * sign(grad) plus decay: a mean of two takes few distinct values, a mean of eight
    many. After ten steps both are sums of many steps and compress alike."""
    params = 1 << 14
    share = {}
    for steps in (1, 10):
        for n in (2, 8):
            own, avg = trained_updates(params, n, steps)
            assert own.shape == avg.shape == (params,) and bool(torch.isfinite(avg).all())
            share[steps, n] = wire_share(avg, 2)
    gap_one_step = share[1, 8] - share[1, 2]
    gap_ten_steps = share[10, 8] - share[10, 2]
    assert gap_one_step > 0.03, share
    assert gap_ten_steps < gap_one_step / 2, share


def test_round_bytes_are_what_one_member_sends_in_a_round() -> None:
    """Its own update for the n-1 shards it does not own, and its average of its own shard to each of the others."""
    from peerd.codecs import make_codec

    own, avg = torch.zeros(1000), torch.ones(1000)
    fp32 = make_codec("fp32")
    assert round_bytes(own, avg, 2) == len(fp32.encode(own[500:])) + len(fp32.encode(avg[:500]))
    assert round_bytes(own, avg, 4) == 3 * len(fp32.encode(own[:250])) + 3 * len(fp32.encode(avg[:250]))


def test_an_exact_mean_of_many_updates_fills_the_low_bits_a_mean_of_two_leaves_zero() -> None:
    """A pseudo-gradient is a difference of nearby floats, so its mantissas end in zeros; the exact mean of n of them
    needs up to log2 n more bits, so a mean of 8 keeps fewer spare bits than a mean of 2, which keeps fewer than one
    update. Random mantissas have none to spare."""
    from bench.zstd_averages import spare_bits

    assert abs(spare_bits(torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)))) < 0.05
    assert spare_bits(torch.tensor([1.5, 0.75])) == 21.0  # mantissa 0x400000: 22 trailing zeros, 1 beyond random
    own2, avg2 = trained_updates(1 << 14, 2, 10)
    _, avg8 = trained_updates(1 << 14, 8, 10)
    assert spare_bits(own2) > spare_bits(avg2) + 0.3 > spare_bits(avg8) + 0.6, (own2, avg2, avg8)
