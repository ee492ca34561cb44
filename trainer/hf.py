"""Hugging Face ``transformers`` causal LMs as peerd models: ``model.factory = "trainer.hf:causal_lm"``.

The architecture comes from a config.json in the repo or on disk (``model.config``), never from the hub: the model
is built with ``AutoModelForCausalLM.from_config`` at random init, with hub access switched off. Every peer must
start from bit-identical weights, so whatever transformers drew is overwritten by the same deterministic uniform
init as the built-in GPT (see :mod:`trainer.model`: a seeded local generator, no ``normal_``). Parameter names are
transformers' own (``model.layers.0.self_attn.q_proj.weight``), so a safetensors file of the same architecture
loads with ``--init-from``. transformers is an optional extra (``pip install 'peerd[hf]'``), imported only here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.model import INIT_STD
from trainer.plugin import PluginError

SPEC = "trainer.hf:causal_lm"
MAX_CONFIG_BYTES = 1 << 20
# peerd's model overrides (model.n_layer, ...) -> the names transformers configs understand (via attribute_map)
OVERRIDES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "d_model": "hidden_size"}


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise PluginError(f"model.factory {SPEC!r} needs transformers: pip install 'peerd[hf]'") from None
    return transformers


def _read_config(path: str) -> dict[str, Any]:
    if not path:
        raise PluginError(f"model.factory {SPEC!r} needs model.config: the path of a transformers config.json")
    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise PluginError(f"model.config {p} is larger than 1 MB; is it really a config.json?")
        raw = json.loads(p.read_text())
    except OSError as exc:
        raise PluginError(f"model.config {p}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise PluginError(f"model.config {p} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise PluginError(f'model.config {p} must be a JSON object with a model_type (e.g. "llama", "gpt2")')
    return raw


def hf_config(config: dict[str, Any]) -> Any:
    """The transformers config: model.config's JSON with peerd's overrides (layers, heads, width, the tokenizer's
    vocab size, seq_len as the longest position) applied before it is built, so derived sizes stay consistent."""
    tf = _transformers()
    raw = _read_config(str(config.get("config", "")))
    model_type = raw.pop("model_type")
    try:
        cls = tf.CONFIG_MAPPING[model_type]
    except KeyError:
        raise PluginError(f"model.config: transformers has no model_type {model_type!r}") from None
    amap = getattr(cls, "attribute_map", {}) or {}
    for ours, theirs in OVERRIDES.items():
        if config.get(ours):
            raw[amap.get(theirs, theirs)] = int(config[ours])
            if ours in ("n_head", "d_model"):
                raw.pop("head_dim", None)  # derived from width / heads
            if ours == "n_head" and "num_key_value_heads" in raw:
                raw["num_key_value_heads"] = int(config[ours])
    if config.get("vocab_size"):
        raw["vocab_size"] = int(config["vocab_size"])
    for key in ("architectures", "auto_map", "_name_or_path", "transformers_version"):  # no remote code, no hub
        raw.pop(key, None)
    try:
        return tf.AutoConfig.for_model(model_type, **raw)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"model.config: transformers refused it: {exc}") from None


class CausalLM(nn.Module):
    """A transformers causal LM behind peerd's contract: ``forward(idx, targets) -> (logits, loss)``.

    The wrapped model's children are registered directly on this module, so parameter names are exactly
    transformers' (no ``lm.`` prefix); the wrapped object itself is kept out of the module tree.
    """

    def __init__(self, lm: nn.Module, seq_len: int, vocab_size: int) -> None:
        super().__init__()
        for name, child in lm.named_children():
            self.add_module(name, child)
        for name, p in lm.named_parameters(recurse=False):  # rare, but keep them trainable and in the layout
            self.register_parameter(name, p)
        object.__setattr__(self, "_lm", lm)
        self.config = _Shape(seq_len=seq_len, vocab_size=vocab_size)

    def train(self, mode: bool = True) -> CausalLM:
        super().train(mode)
        self._lm.training = mode
        return self

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds seq_len {self.config.seq_len}")
        logits = self._lm(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


class _Shape:
    """What the worker reads of a model's config: ``seq_len`` (window length) and ``vocab_size``."""

    def __init__(self, seq_len: int, vocab_size: int) -> None:
        self.seq_len, self.vocab_size = seq_len, vocab_size


@torch.no_grad()
def deterministic_init(model: nn.Module, seed: int, std: float = INIT_STD) -> None:
    """Zero biases, unit norm gains, uniform noise of standard deviation ``std`` elsewhere, drawn in
    ``named_parameters()`` order from one seeded CPU generator: the same bits on every machine."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    gains = {id(m.weight) for m in model.modules() if "norm" in type(m).__name__.lower() and hasattr(m, "weight")}
    half_width = std * math.sqrt(3.0)
    for name, p in model.named_parameters():
        if id(p) in gains:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(u.mul_(2.0).sub_(1.0).mul_(half_width))


def causal_lm(config: dict[str, Any]) -> CausalLM:
    """Model factory (see :mod:`trainer.plugin`): ``config`` holds ``config`` (the config.json path), ``seed`` and
    optional ``n_layer``, ``n_head``, ``d_model``, ``seq_len``, ``vocab_size`` overrides."""
    tf = _transformers()
    cfg = hf_config(config)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG: leave it untouched
        torch.manual_seed(0)
        lm = tf.AutoModelForCausalLM.from_config(cfg).float()
    std = float(getattr(cfg, "initializer_range", INIT_STD) or INIT_STD)
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    seq_len = int(config.get("seq_len") or max_pos or 128)
    if max_pos and seq_len > max_pos:
        raise PluginError(f"model.seq_len {seq_len} exceeds the config's max_position_embeddings {max_pos}")
    model = CausalLM(lm, seq_len=seq_len, vocab_size=int(cfg.vocab_size))
    deterministic_init(model, int(config.get("seed", 0)), std)
    return model
