"""Combining experts' predictive distributions (domain-expert ensembles, HDEE arXiv 2502.19385). No network code.

Given each expert's log-probability of every target token, the ensemble predicts

    p(x_t | x_<t) = sum_k w_k(t) p_k(x_t | x_<t)

with either uniform weights, or posterior weights (Bayesian model averaging over the sequence so far):
w_k(t) ∝ prior_k * prod_{s<t} p_k(x_s | x_<s). The posterior learns within a few tokens which expert knows this
text, so on each domain the mixture comes close to that domain's expert, and it can beat every single expert on
text between domains. Computed in log space (logsumexp), so long sequences do not underflow.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """[B, T, V] logits and [B, T] targets -> [B, T] log-probabilities of the targets (fp32)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def mixture_logprobs(expert_logprobs: Tensor, mode: str = "posterior", prior: Tensor | None = None) -> Tensor:
    """[K, B, T] per-expert target log-probs -> [B, T] log-probs of the mixture.

    `mode`: "posterior" (weights from each expert's likelihood of the sequence so far, restarted every sequence) or
    "uniform"."""
    if expert_logprobs.dim() != 3:
        raise ValueError(f"expected [experts, batch, time] log-probs, got shape {tuple(expert_logprobs.shape)}")
    k = expert_logprobs.shape[0]
    log_prior = (
        torch.full((k, 1, 1), -math.log(k), dtype=expert_logprobs.dtype)
        if prior is None
        else torch.log(prior / prior.sum()).view(k, 1, 1).to(expert_logprobs.dtype)
    )
    if mode == "uniform":
        log_w = log_prior.expand_as(expert_logprobs)
    elif mode == "posterior":
        # exclusive cumulative sum: the weight at t uses tokens before t only
        seen = torch.cumsum(expert_logprobs, dim=-1) - expert_logprobs
        log_w = torch.log_softmax(log_prior + seen, dim=0)
    else:
        raise ValueError(f"mixture mode must be 'posterior' or 'uniform', not {mode!r}")
    return torch.logsumexp(log_w + expert_logprobs, dim=0)


def perplexity(logprobs: Tensor) -> float:
    """exp of the mean negative log-likelihood."""
    return float(torch.exp(-logprobs.float().mean()))
