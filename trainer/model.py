"""A small decoder-only transformer language model (GPT) over bytes.

Every peer must start from bit-identical parameters, so initialisation draws only from a local, seeded
``torch.Generator`` on the CPU and never touches the global RNG. It also avoids ``normal_``, whose CPU kernel
takes a vectorised (SLEEF log/cos) or a scalar path depending on the CPU, so two machines can disagree in the
last bit. Uniform draws followed by exactly rounded scaling agree everywhere, so we use uniform noise with the
standard deviation a normal init would have.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INIT_STD = 0.02


@dataclass
class ModelConfig:
    """Shape of a :class:`GPT`. ``vocab_size`` is 256 for byte-level text."""

    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        self.dropout = float(self.dropout)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Named sizes: ``tiny`` (tests, 0.14M params), ``small`` (11M), ``medium`` (32M), ``base`` (115M)."""
        presets = {
            "tiny": dict(n_layer=2, n_head=4, d_model=64, seq_len=64),
            "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256),
            "medium": dict(n_layer=10, n_head=8, d_model=512, seq_len=512),
            "base": dict(n_layer=16, n_head=12, d_model=768, seq_len=1024),
        }
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
        return cls(**presets[name])

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a run-spec dict; unknown keys (e.g. ``seed``, ``preset``) are ignored."""
        base = asdict(cls.preset(str(config["preset"]))) if "preset" in config else {}
        known = {f.name for f in fields(cls)}
        base.update({k: v for k, v in config.items() if k in known})
        try:
            return cls(**base)
        except TypeError as exc:  # a missing required field
            raise ValueError(f"incomplete model config {config!r}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_params(self) -> int:
        """Parameter count computed from the shape alone (matches ``GPT(cfg).num_params()``)."""
        d, v, t = self.d_model, self.vocab_size, self.seq_len
        per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + self.n_layer * per_block + 2 * d + d * v


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; the kernel choice (flash, mem-efficient, math) is left to SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer LM.

    The head is *not* tied to ``tok_emb``: with a 256-byte vocabulary tying saves almost nothing, and untied
    weights keep every parameter in exactly one named place, which makes fragments and flat layouts simpler.
    Parameters are created on the CPU; move the model with ``.to(device)`` afterwards.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        # Build on the meta device so nn defaults do not consume the global RNG, then materialise and init.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.to_empty(device="cpu")
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init: zero biases, unit LayerNorm gains, uniform noise of std 0.02 elsewhere.

        Residual output projections are scaled by 1/sqrt(2 * n_layer) (as in GPT-2) so the variance of the
        residual stream does not grow with depth.
        """
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        norm_gains = {id(m.weight) for m in self.modules() if isinstance(m, nn.LayerNorm)}
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif id(p) in norm_gains:
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else INIT_STD
                half_width = std * math.sqrt(3.0)  # U(-a, a) has std a / sqrt(3)
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                p.copy_(u.mul_(2.0).sub_(1.0).mul_(half_width))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Return (logits [B, T, vocab], mean cross-entropy or None); the loss is fp32 even under autocast."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}")
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def build_gpt(config: dict[str, Any]) -> GPT:
    """Model factory with the plugin contract (see :mod:`trainer.plugin`): config dict in, module out.

    ``config`` holds :class:`ModelConfig` fields (or ``preset``) and an optional ``seed`` (default 0).
    """
    return GPT(ModelConfig.from_dict(config), seed=int(config.get("seed", 0)))
