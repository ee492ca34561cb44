"""Does a 4-bit exchange hurt training? The same 3-peer DiLoCo run (same seeds, shards and steps) with each codec.

    python -m bench.codec_convergence [--codecs fp32,e3m0,int4] [--peers 3] [--outer-steps 10] [--inner-steps 20]

Each run is a real `peerd demo` swarm (separate processes on loopback). Prints, per codec: final train loss (mean of
the last outer step's inner losses over peers), final eval loss of the global params on held-out text, the ratio of
both to the fp32 run, wire bytes and how many times fewer than fp32. The goal: 4-bit within 1% of fp32's final loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def run(codec: str, args: argparse.Namespace, feedback: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"peerd-cc-{codec}-") as tmp:
        cmd = [sys.executable, "-m", "peerd", "demo", "--peers", str(args.peers), "--outer-steps",
               str(args.outer_steps), "--inner-steps", str(args.inner_steps), "--codec", codec, "--preset",
               args.preset, "--json", "--workdir", tmp]  # fmt: skip
        if feedback:
            cmd += ["--set", "codec.error_feedback=true"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"{codec} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="fp32,e3m0,int4,e3m0+ef,int4+ef", help="+ef adds error feedback")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--outer-steps", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args(argv)
    rows = {}
    for spec in args.codecs.split(","):
        codec, _, ef = spec.partition("+")
        rows[spec] = run(codec, args, feedback=ef == "ef")
        r = rows[spec]
        print(
            f"{spec:>8}: train {r['loss_last']:.4f}  eval {r['eval_loss_last']:.4f}  "
            f"wire {r['wire_bytes_total'] / 1e6:.2f} MB  max param diff {r['max_param_diff']:.2g}",
            flush=True,
        )
    base = rows.get("fp32")
    print(
        f"\n{args.peers}-peer DiLoCo, {args.outer_steps} outer x {args.inner_steps} inner steps, preset {args.preset}"
    )
    print(
        f"{'codec':>8} {'train loss':>11} {'vs fp32':>8} {'eval loss':>10} {'vs fp32':>8} {'wire MB':>9} {'x fewer':>8}"
    )
    for spec, r in rows.items():
        tr = r["loss_last"] / base["loss_last"] - 1 if base else float("nan")
        ev = r["eval_loss_last"] / base["eval_loss_last"] - 1 if base else float("nan")
        fewer = base["wire_bytes_total"] / r["wire_bytes_total"] if base else float("nan")
        print(
            f"{spec:>8} {r['loss_last']:>11.4f} {tr:>+8.2%} {r['eval_loss_last']:>10.4f} {ev:>+8.2%} "
            f"{r['wire_bytes_total'] / 1e6:>9.2f} {fewer:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
