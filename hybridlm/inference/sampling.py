"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

    token = sample_next(logits, temperature=0.8, top_k=50, top_p=0.95, generator=g)   # [B]

Order: logits / temperature, then top-k, then top-p, then one draw from the softmax. `temperature=0`
is greedy (argmax; the filters cannot change the argmax, so they are not applied). Everything runs in
float32.
"""

from __future__ import annotations

import math

import torch


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row [..., V] (ties with the k-th kept too); the rest -> -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one token);
    the rest -> -inf. p = 1 keeps everything."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly ahead of each token
    drop_sorted = before >= p  # the set already reached p without this token; the first is never dropped
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(*, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the option when a sampling setting is out of range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature >= 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p!r}")
