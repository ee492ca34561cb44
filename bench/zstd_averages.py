"""Why round bytes on the wire grow a little faster than 2 (n-1)/n with fp32 + zstd (BENCHMARKS.md, "Scale"): an
average of many peers' updates has more distinct values than an average of two, so zstd shrinks it less. This
separates that from the cost of cutting the vector into n smaller frames.

    python -m bench.zstd_averages [--params 262144] [--peers 2,8,64] [--inner-steps 1,20]

Each peer's update is a one-step Adam-like move of bench.scale_model's vector (lr times the sign of its gradient, plus
weight decay), as bench.scale's peers sent before its model's targets got per-coordinate noise (a minibatch
gradient's noise, which makes every update's values distinct, as a real model's are). Printed per n: the wire size,
as a share of fp32, of one peer's own update and of the n-peer average, each cut into n frames (what a round sends)
and into 2 frames (the 2-peer cut).

With --inner-steps, a second table trains the payloads instead: each of n peers runs H AdamW steps of
bench.scale_model's noisy vector model from the shared global for 3 outer steps, and sends its pseudo-gradient, as
bench.scale's daemons do with H = 1. It prints the round bytes per peer that the shares predict at n peers (n-1 of n
frames of the own update out, as many of the average back) against 2 peers, on the wire, and the same cut as a round
cuts it (`round_bytes`: shards in parts of at most 256 KiB, so a 2-peer round sends 64K-value frames, not halves).
A one-step update is lr * sign(grad) plus decay, so a mean of two has far fewer distinct values than a mean of 64;
after H steps both are sums of many steps, and the ratio nears 2 (n-1)/n / 1.

What is left after H steps is the exact mean's own cost (`spare_bits`, printed per table row): a pseudo-gradient is
global - local, a difference of two nearby floats, so its low mantissa bits end in zeros; an exact mean of n such
values needs up to log2 n more bits, which it takes from those zeros. The mean of two keeps most of them, the mean
of 64 almost none, and zstd cannot shrink bits that carry information. Lossless fp32 pays that on the wire.
"""

from __future__ import annotations

import argparse

import torch

from bench.scale_model import Indices, Vector
from peerd.codecs import make_codec
from peerd.config import InnerSection, OuterSection
from peerd.layout import part_bounds, part_elems, shard_bounds

LR, DECAY = 3e-3, 0.1


def updates(params: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n peers' updates from one shared vector: each peer's batch pulls it towards its own target."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(params, generator=gen) * 0.02
    return [w - (w - LR * torch.sign(w - 0.01 * (k % 7)) - LR * DECAY * w) for k in range(n)]


def wire_share(v: torch.Tensor, frames: int) -> float:
    codec = make_codec("fp32")
    step = v.numel() // frames
    return sum(len(codec.encode(v[i * step : (i + 1) * step])) for i in range(frames)) / (4 * v.numel())


def spare_bits(v: torch.Tensor) -> float:
    """Mean trailing zero bits of the values' 23-bit mantissas, beyond the 1 a random mantissa has on average: the
    low-order bits a lossless codec has to spare, which an exact mean of several values fills."""
    mant = v.float().contiguous().view(torch.int32) & 0x7FFFFF
    zeros = torch.full(mant.shape, 23, dtype=torch.int32)
    for bit in range(22, -1, -1):  # the lowest set bit wins: walk from the top so that it is written last
        zeros = torch.where((mant >> bit) & 1 == 1, torch.tensor(bit, dtype=torch.int32), zeros)
    return float(zeros.float().mean()) - 1.0


def trained_updates(params: int, n: int, steps: int, outer: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer 0's pseudo-gradient and the n-peer mean after `outer` DiLoCo steps of `steps` AdamW steps each (the
    product's default inner lr and weight decay; outer SGD at the default outer lr, without momentum), each peer
    drawing its own batches."""
    torch.manual_seed(0)
    glob = Vector(params, 0).weight.detach().clone()
    models = [Vector(params, 0) for _ in range(n)]
    inner = InnerSection()
    opts = [torch.optim.AdamW(m.parameters(), lr=inner.lr, weight_decay=inner.weight_decay) for m in models]
    data, gens = Indices(8), [torch.Generator().manual_seed(100 + k) for k in range(n)]
    for _ in range(outer):
        deltas = []
        for k, (model, opt) in enumerate(zip(models, opts, strict=True)):
            with torch.no_grad():
                model.weight.copy_(glob)
            for _ in range(steps):
                x, y = data.batch(1, shard=k, num_shards=n, generator=gens[k])
                _, loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            deltas.append(glob - model.weight.detach())
        avg = torch.stack(deltas).mean(0)
        glob = glob - OuterSection().lr * avg
    return deltas[0], avg


def round_bytes(own: torch.Tensor, avg: torch.Tensor, n: int) -> int:
    """The wire bytes one member of an n-peer round sends, cut as a round cuts the vector (layout.py: one shard per
    member, shards in parts of at most PART_BYTES): its own update for every other member's shard, and its average
    of the shard it owns to every other member."""
    codec = make_codec("fp32")
    size = part_elems(codec)
    shards = shard_bounds(own.numel(), n)
    out = sum(len(codec.encode(own[a:b])) for lo, hi in shards[1:] for a, b in part_bounds(lo, hi, size))
    back = sum(len(codec.encode(avg[a:b])) for a, b in part_bounds(*shards[0], size))
    return out + (n - 1) * back


def _trained_table(params: int, peers: list[int], steps: list[int]) -> None:
    print()
    print(
        "| inner steps | peers | own update, n frames | average, n frames | round bytes per peer vs 2 peers | "
        "the same, cut into the round's parts | spare bits: own, average |"
    )
    print("|---|---|---|---|---|---|---|")
    for h in steps:
        base = base_parts = None
        for n in sorted(set(peers) | {2}):
            own, avg = trained_updates(params, n, h)
            o, a = wire_share(own, n), wire_share(avg, n)
            per_peer = (n - 1) / n * (o + a)  # shares of the vector: its n-1 frames out, as many averaged ones back
            parts = round_bytes(own, avg, n)
            base = per_peer if n == 2 else base
            base_parts = parts if n == 2 else base_parts
            print(
                f"| {h} | {n} | {100 * o:.1f}% | {100 * a:.1f}% | {per_peer / base:.3f}x | {parts / base_parts:.4f}x | "
                f"{spare_bits(own):.2f}, {spare_bits(avg):.2f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zstd_averages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1 << 18)
    ap.add_argument("--peers", default="2,8,64")
    ap.add_argument("--inner-steps", default="", help="comma-separated H: also train the payloads (e.g. 1,20)")
    args = ap.parse_args(argv)
    print("| peers | own update, n frames | own update, 2 frames | average, n frames | average, 2 frames |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.peers.split(",")):
        ups = updates(args.params, n)
        avg = torch.stack(ups).mean(0)
        cells = [wire_share(ups[0], n), wire_share(ups[0], 2), wire_share(avg, n), wire_share(avg, 2)]
        print(f"| {n} | " + " | ".join(f"{100 * c:.1f}%" for c in cells) + " |")
    if args.inner_steps:
        peers = [int(x) for x in args.peers.split(",")]
        _trained_table(args.params, peers, [int(x) for x in args.inner_steps.split(",")])


if __name__ == "__main__":
    main()
