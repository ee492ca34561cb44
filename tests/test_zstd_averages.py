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
