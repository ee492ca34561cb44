"""Does every data shard look like the whole stream? Train one model per shard alone; evaluate on held-out text.

    python -m bench.shards [--steps 400] [--shards 0,1,2,3,-1] [--contiguous]

A shard unlike the rest skews any benchmark that gives it to one peer: with contiguous shards of the stdlib corpus
(read in file-name order), shard 3 of 16 was all `encodings/` code tables, and the slow peer of bench.uneven read it.
Each run starts from the same initial weights and trains the tiny model with AdamW (lr 1e-3, batch 8) on one shard
(-1: all 16 in turn), then prints its loss on 8 held-out batches and on batches of its own shard. `--contiguous`
measures the old layout (one contiguous sixteenth per shard) for comparison.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from peerd.config import RunConfig
from peerd.runmodel import build_run_model, model_seq_len
from trainer.data import TokenData

NUM_SHARDS = 16


def contiguous_batch(data: TokenData, shard: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The layout before striping: shard k is tokens [k n/16, (k+1) n/16)."""
    per = len(data) // NUM_SHARDS
    return data._windows(shard * per, (shard + 1) * per, batch, gen)  # the sampler batch() used on that range


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shards", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--shards", default="0,1,2,3,-1", help="shards to train on; -1: all of them in turn")
    ap.add_argument("--contiguous", action="store_true", help="the old layout: one contiguous sixteenth per shard")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = RunConfig.from_dict({"run": {"name": "shards"}, "model": {"preset": "tiny"}, "data": {"batch_size": 8}})
    torch.manual_seed(0)
    model = build_run_model(cfg)
    seq = model_seq_len(model, cfg)
    train = TokenData.from_path(None, seq_len=seq, split="train")
    held_out = TokenData.from_path(None, seq_len=seq, split="eval").eval_batches(8, 8, seed=4321)
    init = {k: v.clone() for k, v in model.state_dict().items()}

    def batch(shard: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        if args.contiguous:
            return contiguous_batch(train, shard, 8, gen)
        return train.batch(8, shard=shard, num_shards=NUM_SHARDS, generator=gen)

    print(f"{'shard':>5} {'eval':>7} {'own shard':>9}   ({'contiguous' if args.contiguous else 'striped'} shards)")
    for shard in (int(s) for s in args.shards.split(",")):
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        model.train()
        for i in range(args.steps):
            x, y = batch(i % NUM_SHARDS if shard < 0 else shard, gen)
            loss = model(x, y)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            ev = statistics.fmean(float(model(x, y)[1]) for x, y in held_out)
            own_gen = torch.Generator().manual_seed(9)
            own = statistics.fmean(float(model(*batch(max(shard, 0), own_gen))[1]) for _ in range(4))
        print(f"{shard:>5} {ev:>7.3f} {own:>9.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
