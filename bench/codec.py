"""Codec micro-benchmark: throughput, wire size and error of every codec, on gaussian data and real
pseudo-gradients.

    python -m bench.codec [--numel N] [--repeats R] [--steps S] [--preset small] [--data gaussian,pseudograd] [--quick]

For each data set, device (cpu, and cuda when available) and codec with and without zstd it prints:
encode and decode GB/s (GB of fp32 input per second, median of R timed runs after one warm-up, or with ``--cpu-time``
one thread's best CPU time of R, steadier on a loaded machine; encode
includes the device-to-host copy and zstd, decode the checks, zstd and the host-to-device copy), wire bytes
as a fraction of the fp32 bytes (headers included) and as "x fewer bytes than fp32", and the relative L2
error ||x - decode(encode(x))|| / ||x||. After each CPU table, one line per codec states its encode and decode GB/s
against the CPU goal (ENCODE_GOAL / DECODE_GOAL GB/s, set for int8 and int4 on a 10M-value vector), with and without
zstd. ``--quick`` runs gaussian data only, 2M values, 5 repeats.

Pseudo-gradients come from the repo's own model: ``--steps`` AdamW steps of ``trainer.model.GPT`` on the
Python standard library's sources read as bytes, then ``params_before - params_after`` flattened, which is
what a DiLoCo peer sends after that many inner steps.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

from peerd.codecs import CODEC_NAMES, make_codec
from peerd.codecs.compression import DEFAULT_LEVEL

TEXT_BYTES = 4 << 20
ENCODE_GOAL, DECODE_GOAL = 1.5, 2.0  # GB/s of fp32 input, one call on a 10M-value vector, CPU


def stdlib_text(max_bytes: int = TEXT_BYTES) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted, so every run reads the same text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no .py files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def pseudo_gradient(preset: str, steps: int, batch: int, seq: int, lr: float, seed: int = 0) -> torch.Tensor:
    """``params_before - params_after`` of ``steps`` AdamW steps of the built-in model, flattened."""
    from trainer.model import GPT, ModelConfig

    cfg = ModelConfig.preset(preset)
    seq = min(seq, cfg.seq_len)
    model = GPT(cfg, seed=seed)
    text = stdlib_text().long()
    gen = torch.Generator().manual_seed(seed)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, text.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([text[s : s + seq + 1] for s in starts.tolist()])
        _, loss = model(window[:, :-1], window[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"pseudo-gradient: {preset} model, {after.numel():,} params, {steps} AdamW steps, final loss {loss:.3f}")
    return (before - after).contiguous()


CPU_TIME = False  # --cpu-time: this process's CPU seconds, best of the repeats (set by main)


def median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall seconds of `fn`; with --cpu-time the best CPU seconds instead (steady on a loaded machine)."""
    fn()  # warm-up
    sync()
    clock = time.process_time if CPU_TIME else time.perf_counter
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return min(times) if CPU_TIME else statistics.median(times)


def bench_one(x: torch.Tensor, name: str, zstd: bool, repeats: int, zstd_level: int) -> dict[str, float]:
    codec = make_codec(name, zstd=zstd, zstd_level=zstd_level)
    device = x.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    frame = codec.encode(x)
    y = codec.decode(frame, x.numel(), device=device)
    x64, y64 = x.double(), y.double()
    rel = float((x64 - y64).norm() / x64.norm()) if bool(x.any()) else 0.0
    gb = x.numel() * 4 / 1e9
    enc = median_seconds(lambda: codec.encode(x), repeats, sync)
    dec = median_seconds(lambda: codec.decode(frame, x.numel(), device=device), repeats, sync)
    return {"enc": gb / enc, "dec": gb / dec, "ratio": len(frame) / (x.numel() * 4), "rel": rel}


def print_table(title: str, rows: list[tuple[str, str, dict[str, float]]]) -> None:
    print(f"\n{title}")
    print(f"{'codec':<6} {'zstd':<5} {'enc GB/s':>9} {'dec GB/s':>9} {'wire/fp32':>10} {'fewer':>7} {'rel L2 err':>11}")
    for name, zstd, r in rows:
        print(
            f"{name:<6} {zstd:<5} {r['enc']:>9.2f} {r['dec']:>9.2f} {r['ratio']:>10.4f} "
            f"{1 / r['ratio']:>6.2f}x {r['rel']:>11.3e}"
        )


def print_goals(rows: list[tuple[str, str, dict[str, float]]]) -> None:
    """One line per codec: encode/decode GB/s with and without zstd, against the CPU goals."""
    by_codec: dict[str, dict[str, dict[str, float]]] = {}
    for name, zstd, r in rows:
        by_codec.setdefault(name, {})[zstd] = r
    for name, runs in by_codec.items():
        parts = []
        for zstd in ("on", "off"):
            r = runs.get(zstd)
            if r is not None:
                met = "met" if r["enc"] >= ENCODE_GOAL and r["dec"] >= DECODE_GOAL else "below"
                parts.append(f"zstd {zstd}: encode {r['enc']:.2f} GB/s, decode {r['dec']:.2f} GB/s ({met})")
        print(f"{name:<6} {'; '.join(parts)} (goal {ENCODE_GOAL} / {DECODE_GOAL})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="elements of the gaussian tensor")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--data", default="gaussian,pseudograd", help="comma list: gaussian, pseudograd")
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES), help="comma list of codecs")
    parser.add_argument("--devices", default=None, help="comma list (default: cpu, and cuda if available)")
    parser.add_argument("--zstd-level", type=int, default=DEFAULT_LEVEL)
    parser.add_argument("--preset", default="small", help="trainer.model preset for pseudo-gradients")
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps behind the pseudo-gradient")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--quick", action="store_true", help="gaussian data only, 2M values, 5 repeats")
    parser.add_argument(
        "--cpu-time", action="store_true", help="one thread, CPU seconds, best of the repeats (for a loaded machine)"
    )
    args = parser.parse_args(argv)
    if args.cpu_time:
        global CPU_TIME
        CPU_TIME = True
        torch.set_num_threads(1)
    if args.quick:
        args.data, args.numel, args.repeats = "gaussian", 2_000_000, 5

    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    codecs = [c for c in args.codecs.split(",") if c]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, devices: {', '.join(devices)}")
    datasets: dict[str, torch.Tensor] = {}
    for kind in args.data.split(","):
        if kind == "gaussian":
            datasets[f"gaussian N(0,1), {args.numel:,} elements"] = torch.randn(
                args.numel, generator=torch.Generator().manual_seed(0)
            )
        elif kind == "pseudograd":
            delta = pseudo_gradient(args.preset, args.steps, args.batch, args.seq, args.lr)
            datasets[f"pseudo-gradient ({args.preset}, {args.steps} AdamW steps), {delta.numel():,} elements"] = delta
        else:
            parser.error(f"unknown data set {kind!r}")
    for label, data in datasets.items():
        for device in devices:
            x = data.to(device)
            rows = [
                (name, "on" if zstd else "off", bench_one(x, name, zstd, args.repeats, args.zstd_level))
                for name in codecs
                for zstd in (False, True)
            ]
            how = f"one thread, best CPU time of {args.repeats}" if args.cpu_time else f"median of {args.repeats}"
            print_table(f"{label} on {device} ({how})", rows)
            if device == "cpu":
                print_goals(rows)


if __name__ == "__main__":
    main()
