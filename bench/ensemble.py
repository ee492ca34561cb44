"""Domain-expert ensemble against one model of the same total compute, per domain.

    python -m bench.ensemble [--quick] [--steps 200] [--repeats 1] [--json]

Two domains that every machine has without downloading: `code` (Python standard library sources) and `prose` (this
project's Markdown docs and /usr/share/common-licenses, when present). Two experts, one per domain, are trained by
real `peerd start` processes of one ensemble run (`run.algorithm = "ensemble"`); the baseline is one peer of the same
model size trained on both domains for as many inner steps as the two experts together (same total compute and
tokens). Then `peerd ensemble-eval` reports per-domain perplexity of each expert, the posterior-weighted and uniform
mixtures, and the baseline. Medians over `--repeats` seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from bench.convergence import NETWORK, _peer_cmd, _wait_file
from peerd.demo import stop_processes, to_toml

REPO = Path(__file__).resolve().parent.parent


def make_domains(root: Path, code_bytes: int) -> dict[str, Path]:
    """Deterministic domain directories: the first `code_bytes` of stdlib sources, and English prose."""
    code, prose, both = root / "code", root / "prose", root / "both"
    for d in (code, prose, both):
        d.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for src in sorted(stdlib.glob("*.py")):
        if total >= code_bytes:
            break
        shutil.copy(src, code / src.name)
        total += src.stat().st_size
    for name in ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "SECURITY.md", "deploy/README.md"):
        shutil.copy(REPO / name, prose / name.replace("/", "-"))
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        for src in sorted(licenses.iterdir()):
            if src.is_file():
                shutil.copy(src, prose / f"{src.name}.txt")
    for domain in (code, prose):
        for src in domain.iterdir():
            shutil.copy(src, both / f"{domain.name}-{src.name}")
    return {"code": code, "prose": prose, "both": both}


def config(seed: int, steps: int, H: int, data: Path, domain: str) -> dict[str, Any]:
    return {
        "run": {"name": "bench-ensemble", "algorithm": "ensemble", "outer_steps": steps // H, "seed": seed},
        "model": {"preset": "tiny", "seq_len": 64},
        "data": {"path": str(data), "domain": domain, "batch_size": 8, "eval_batches": 2},
        "inner": {"steps": H, "warmup_steps": 20, "lr": 3e-3, "total_steps": steps},
        "network": dict(NETWORK),
    }


def train(root: Path, runs: list[tuple[str, dict[str, Any]]], timeout: float) -> None:
    """Start every peer of one ensemble run (they join each other) and wait for all to finish."""
    procs = []
    try:
        boot = None
        for i, (name, raw) in enumerate(runs):
            data = root / name
            data.mkdir()
            cfg = root / f"{name}.toml"
            cfg.write_text(to_toml(raw))
            cmd = _peer_cmd(cfg, data, "127.0.0.1:0", i, 0, boot)
            log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it
            env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
            if i == 0:
                boot = _wait_file(data / "address", procs[0], 120)
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        stop_processes(procs)


def one(args: argparse.Namespace, seed: int, root: Path) -> dict[str, dict[str, float]]:
    domains = make_domains(root / "data", args.code_bytes)
    H = 20
    runs = [
        ("expert-code", config(seed, args.steps, H, domains["code"], "code")),
        ("expert-prose", config(seed, args.steps, H, domains["prose"], "prose")),
        ("baseline", config(seed, 2 * args.steps, H, domains["both"], "both")),  # same total compute
    ]
    train(root, runs, args.timeout)
    cmd = [sys.executable, "-m", "peerd", "ensemble-eval", "--expert", str(root / "expert-code"), "--expert",
           str(root / "expert-prose"), "--baseline", str(root / "baseline"), "--data", f"code={domains['code']}",
           "--data", f"prose={domains['prose']}", "--batches", str(args.eval_batches), "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, cwd=REPO, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"ensemble-eval failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)["perplexity"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ensemble", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 steps per expert, one seed")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per expert (the baseline trains twice that)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--code-bytes", type=int, default=2_000_000)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 100, 1
    results = []
    for seed in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="peerd-ensemble-"))
        try:
            results.append(one(args, seed, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {
        d: {k: statistics.median(r[d][k] for r in results) for k in results[0][d]} for d in results[0]
    }  # domain -> column -> median perplexity
    if args.json:
        print(json.dumps({"steps_per_expert": args.steps, "repeats": args.repeats, "perplexity": med}, indent=2))
        return 0
    print(f"per-domain perplexity, medians of {args.repeats} seed(s); experts {args.steps} inner steps each, "
          f"baseline {2 * args.steps} on both domains")  # fmt: skip
    cols = list(next(iter(med.values())))
    w = max(len(c) for c in cols)
    print(f"{'':<{w}}  " + "  ".join(f"{d:>8}" for d in med))
    for c in cols:
        print(f"{c:<{w}}  " + "  ".join(f"{med[d][c]:>8.3f}" for d in med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
