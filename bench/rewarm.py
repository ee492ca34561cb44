"""Does re-warming help when training continues from a checkpoint on shifted data?

    python -m bench.rewarm [--quick] [--seeds 3] [--pretrain 300] [--steps 60] [--rewarm 20] [--lr 3e-3]

Single process, the trainer's own parts (no swarm: the question is the inner optimizer's): a tiny byte-level GPT is
trained on domain A (the Python stdlib's sources), its weights are saved as safetensors and loaded back through
``--init-from``'s loader, and training continues on domain B (English prose: /usr/share/common-licenses, or the
stdlib's text files where that is missing) with a fresh AdamW, as ``peerd start --init-from`` does:

  (a) no rewarm: the full lr from the first step (inner.rewarm_steps = 0)
  (b) rewarm:    linear warmup over --rewarm steps (inner.rewarm_steps), then the full lr

Every step the eval loss on fixed held-out batches of domain B is measured. Reported, as medians over seeds:
``spike`` = the highest eval loss in the first --window steps minus the loss before the switch (the pretrained model
on B), ``recover`` = steps until the eval loss is back at or below that, the eval loss on B after --steps steps,
and ``A after``: the eval loss on domain A at the end (what the continued training forgot of A).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sysconfig
import tempfile
from pathlib import Path

import torch

from trainer.data import TokenData
from trainer.flat import ParamLayout
from trainer.initfrom import load_init
from trainer.inner import make_inner_optimizer
from trainer.model import GPT, ModelConfig
from trainer.safetensors import save_safetensors

SEQ, BATCH = 64, 8


def domain_b() -> str:
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir() and any(licenses.iterdir()):
        tmp = Path(tempfile.mkdtemp(prefix="peerd-rewarm-"))
        for f in sorted(licenses.iterdir()):  # the reader takes .txt files; the licenses have no suffix
            if f.is_file():
                (tmp / f"{f.name}.txt").write_bytes(f.read_bytes())
        return str(tmp)
    return str(Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data")


@torch.no_grad()
def evaluate(model: GPT, batches: list) -> float:
    model.eval()
    return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)


def train(model: GPT, data: TokenData, steps: int, lr: float, warmup: int, seed: int, evals: list | None) -> list:
    opt, sched = make_inner_optimizer(model, lr=lr, weight_decay=0.1, warmup_steps=warmup, total_steps=None)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        model.train()
        x, y = data.batch(BATCH, shard=0, num_shards=1, generator=gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if evals is not None:
            curve.append(evaluate(model, evals))
    return curve


def one_seed(
    seed: int, args: argparse.Namespace, a: TokenData, b: TokenData, b_eval: list, a_eval: list
) -> dict[str, dict]:
    model = GPT(ModelConfig.preset("tiny"), seed=seed)
    train(model, a, args.pretrain, args.lr, 20, seed, None)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pretrained.safetensors"
        save_safetensors(path, model.state_dict())
        for name, warmup in (("no rewarm", 0), ("rewarm", args.rewarm)):
            cont = GPT(ModelConfig.preset("tiny"), seed=999)
            load_init(path, cont)
            assert torch.equal(ParamLayout.of(cont).flatten(cont), ParamLayout.of(model).flatten(model))
            before = evaluate(cont, b_eval)
            curve = train(cont, b, args.steps, args.lr, warmup, seed + 1, b_eval)
            window = curve[: args.window]
            recover = next((i + 1 for i, v in enumerate(curve) if v <= before), None)
            out[name] = {
                "curve": curve,
                "spike": max(window) - before,
                "recover": recover,
                "final": curve[-1],
                "before": before,
                "a_after": evaluate(cont, a_eval),
            }
    return out


def print_curve(runs: list[dict[str, dict]], every: int) -> None:
    """The eval loss on domain B after each continued step, median over seeds, for both arms side by side."""
    curves = {
        name: [statistics.median(vals) for vals in zip(*(r[name]["curve"] for r in runs), strict=True)]
        for name in runs[0]
    }
    before = statistics.median(r["no rewarm"]["before"] for r in runs)
    print(f"eval loss on B by step (median over seeds; step 0 = the loaded weights, {before:.4f})")
    print(f"{'step':>5} | {'no rewarm':>9} | {'rewarm':>9}")
    steps = len(curves["no rewarm"])
    for i in sorted({*range(0, steps, every), *range(min(every, steps)), steps - 1}):
        print(f"{i + 1:>5} | {curves['no rewarm'][i]:9.4f} | {curves['rewarm'][i]:9.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 seeds, 120 pretraining and 30 continued steps")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--pretrain", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=20, help="steps after the switch in which the spike is measured")
    ap.add_argument("--rewarm", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--every", type=int, default=5, help="print the loss curve every this many steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.pretrain, args.steps, args.window, args.rewarm = 2, 120, 30, 15, 10
    torch.set_num_threads(1)
    a = TokenData.from_path(None, seq_len=SEQ, split="train", max_bytes=2_000_000)
    a_eval = TokenData.from_path(None, seq_len=SEQ, split="eval", max_bytes=2_000_000).eval_batches(BATCH, 4, 99)
    b_path = domain_b()
    try:
        b = TokenData.from_path(b_path, seq_len=SEQ, split="train")
        b_eval = TokenData.from_path(b_path, seq_len=SEQ, split="eval").eval_batches(BATCH, 4, seed=1234)
    finally:
        if b_path.startswith(tempfile.gettempdir()):
            shutil.rmtree(b_path, ignore_errors=True)
    print(f"domain A: {a.source} ({len(a)} tokens); domain B: {b_path} ({len(b)} tokens)")
    print(f"tiny GPT, lr {args.lr}, {args.pretrain} steps on A, then {args.steps} on B; rewarm {args.rewarm} steps")
    runs = [one_seed(s, args, a, b, b_eval, a_eval) for s in range(args.seeds)]
    rows = {}
    for name in ("no rewarm", "rewarm"):
        recs = [r[name] for r in runs]
        recovered = [r["recover"] for r in recs if r["recover"] is not None]
        rows[name] = {
            "spike": statistics.median(r["spike"] for r in recs),
            "recover": statistics.median(recovered) if len(recovered) == len(recs) else None,
            "final": statistics.median(r["final"] for r in recs),
            "before": statistics.median(r["before"] for r in recs),
            "a_after": statistics.median(r["a_after"] for r in recs),
        }
    print(f"{'':>10} | {'B before':>8} | {'spike (max - before)':>20} | {'steps to recover':>16} | B final | A after")
    for name, r in rows.items():
        rec = "never" if r["recover"] is None else f"{r['recover']:.0f}"
        cells = f"{r['before']:8.4f} | {r['spike']:+20.4f} | {rec:>16} | {r['final']:7.4f} | {r['a_after']:.4f}"
        print(f"{name:>10} | {cells}")
    print_curve(runs, args.every)
    base, rew = rows["no rewarm"], rows["rewarm"]
    if base["spike"] > 0:
        print(f"spike ratio rewarm / no rewarm: {rew['spike'] / base['spike']:.2f}")
    print(f"final loss ratio rewarm / no rewarm: {rew['final'] / base['final']:.4f} (medians over {args.seeds} seeds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
