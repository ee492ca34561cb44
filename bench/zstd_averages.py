"""Why round bytes on the wire grow a little faster than 2 (n-1)/n with fp32 + zstd (BENCHMARKS.md, "Scale"): an
average of many peers' updates has more distinct values than an average of two, so zstd shrinks it less. This
separates that from the cost of cutting the vector into n smaller frames.

    python -m bench.zstd_averages [--params 262144] [--peers 2,8,64]

Each peer's update is a one-step Adam-like move of bench.scale_model's vector (lr times the sign of its gradient, plus
weight decay), as bench.scale's peers sent before its model's targets got per-coordinate noise (a minibatch
gradient's noise, which makes every update's values distinct, as a real model's are). Printed per n: the wire size,
as a share of fp32, of one peer's own update and of the n-peer average, each cut into n frames (what a round sends)
and into 2 frames (the 2-peer cut).
"""

from __future__ import annotations

import argparse

import torch

from peerd.codecs import make_codec

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zstd_averages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1 << 18)
    ap.add_argument("--peers", default="2,8,64")
    args = ap.parse_args(argv)
    print("| peers | own update, n frames | own update, 2 frames | average, n frames | average, 2 frames |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.peers.split(",")):
        ups = updates(args.params, n)
        avg = torch.stack(ups).mean(0)
        cells = [wire_share(ups[0], n), wire_share(ups[0], 2), wire_share(avg, n), wire_share(avg, 2)]
        print(f"| {n} | " + " | ".join(f"{100 * c:.1f}%" for c in cells) + " |")


if __name__ == "__main__":
    main()
