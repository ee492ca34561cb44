"""`peerd ensemble-eval`: how well a domain-expert ensemble predicts held-out text, per domain.

Loads finished experts (each peer's checkpoint.pt of a `run.algorithm = "ensemble"` run, or any peerd checkpoint),
evaluates each on every domain's held-out split, combines their predictive distributions (trainer/mixture.py:
posterior-weighted and uniform), and, with `--baseline`, compares them with one model trained on all the domains
with the same total compute. Checkpoints are read with weights_only (trainer/checkpoint.py); nothing is unpickled.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peerd.config import ConfigError, RunConfig
from peerd.errors import UserError
from trainer.checkpoint import CheckpointError, load_checkpoint
from trainer.data import DataError, TokenData
from trainer.mixture import mixture_logprobs, perplexity, token_logprobs


@dataclass
class Expert:
    name: str
    domain: str
    model: torch.nn.Module
    seq_len: int
    tokenizer: str


def load_expert(spec: str) -> Expert:
    """A checkpoint (or a data dir holding checkpoint.pt) rebuilt into its model; one clear line if it cannot be."""
    from peerd.runmodel import build_run_model, model_seq_len

    path = Path(spec)
    ckpt = path / "checkpoint.pt" if path.is_dir() else path
    try:
        state = load_checkpoint(ckpt)
    except CheckpointError as exc:
        raise UserError(f"--expert {spec}: {exc}") from None
    if state is None:
        raise UserError(f"--expert {spec}: no checkpoint at {ckpt}; point it at an expert's --data-dir")
    if not isinstance(state.get("model_config"), dict) or not isinstance(state.get("model"), dict):
        raise UserError(f"--expert {spec}: this checkpoint does not say how to rebuild its model (written by an older "
                        f"peerd?); train the expert with this release")  # fmt: skip
    data_cfg = state.get("data_config") if isinstance(state.get("data_config"), dict) else {}
    try:
        cfg = RunConfig.from_dict({"model": state["model_config"]})
    except ConfigError as exc:
        raise UserError(f"--expert {spec}: its model config is unusable: {exc}") from None
    torch.manual_seed(0)
    model = build_run_model(cfg)
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else str(exc)
        raise UserError(f"--expert {spec}: weights do not fit its model config: {first}") from None
    model.eval()
    return Expert(
        name=path.name if path.is_dir() else path.stem,
        domain=str(data_cfg.get("domain", "")),
        model=model,
        seq_len=model_seq_len(model, cfg),
        tokenizer=str(data_cfg.get("tokenizer", "")),
    )


@torch.no_grad()
def logprobs(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[N, T] target log-probs of `model` over the batches (rows concatenated)."""
    out = []
    for x, y in batches:
        logits, _ = model(x, y)
        out.append(token_logprobs(logits, y))
    return torch.cat(out)


def evaluate(
    experts: list[Expert], domains: dict[str, str], baseline: Expert | None, batches: int, batch_size: int
) -> dict[str, Any]:
    """Per-domain perplexity of each expert, the posterior and uniform mixtures, and the baseline."""
    tokenizers = {e.tokenizer for e in experts + ([baseline] if baseline else [])}
    if len(tokenizers) > 1:
        raise UserError(f"experts use different tokenizers ({sorted(tokenizers)}): their predictions cannot be mixed; "
                        f"train every expert with the same data.tokenizer")  # fmt: skip
    tokenizer = tokenizers.pop() or None
    seq_len = min(e.seq_len for e in experts + ([baseline] if baseline else []))
    rows: dict[str, Any] = {}
    for domain, path in domains.items():
        try:
            data = TokenData.from_path(
                None if path in ("", "stdlib") else path, seq_len=seq_len, split="eval", tokenizer=tokenizer
            )
            held_out = data.eval_batches(batch_size, batches, seed=4321)
        except (DataError, OSError) as exc:
            raise UserError(f"--data {domain}={path}: {exc}") from None
        per = torch.stack([logprobs(e.model, held_out) for e in experts])
        row = {
            f"expert:{e.name}" + (f" ({e.domain})" if e.domain else ""): perplexity(lp)
            for e, lp in zip(experts, per, strict=True)
        }
        row["ensemble (posterior)"] = perplexity(mixture_logprobs(per, "posterior"))
        row["ensemble (uniform)"] = perplexity(mixture_logprobs(per, "uniform"))
        if baseline is not None:
            row["baseline (one model, same compute)"] = perplexity(logprobs(baseline.model, held_out))
        rows[domain] = row
    return rows


def parse_domains(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise UserError(f"--data {item!r}: give DOMAIN=PATH, e.g. --data code=/usr/lib/python3.11")
        out[name] = path
    return out


def run(args: argparse.Namespace) -> int:
    domains = parse_domains(args.data)
    if args.batches < 1 or args.batch_size < 1:
        raise UserError("--batches and --batch-size must be >= 1")
    experts = [load_expert(e) for e in args.expert]
    baseline = load_expert(args.baseline) if args.baseline else None
    rows = evaluate(experts, domains, baseline, args.batches, args.batch_size)
    if args.json:
        print(json.dumps({"perplexity": rows}, indent=2, sort_keys=True))
        return 0
    columns = list(next(iter(rows.values())))
    width = max(len(c) for c in columns)
    print(f"{'':<{width}}  " + "  ".join(f"{d:>12}" for d in rows))
    for col in columns:
        print(f"{col:<{width}}  " + "  ".join(f"{rows[d][col]:>12.3f}" for d in rows))
    return 0
