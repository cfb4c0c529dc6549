"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

    token = sample_next(logits, temperature=0.8, top_k=50, top_p=0.95, generator=g)   # [B]

Order: logits / temperature, then top-k, then top-p, then one draw from the softmax. `temperature=0`
is greedy (argmax; the filters cannot change the argmax, so they are not applied, but their settings are
still checked). Off is None for both filters; `top_k=0` is an error here (transformers reads it as off:
`HybridForCausalLM.generate`, the transformers-style entry point, maps it to None).

Precision: the sampled distribution is computed in float64 from the (any dtype) logits. The row's largest
logit is subtracted before dividing by the temperature, so every scaled score is <= 0 and the largest is 0:
no temperature > 0, however small, overflows to inf and NaN (a tiny temperature samples among the tied
maxima, the limit of the distribution). Top-p sums the sorted probabilities in float64 and counts a set as
having reached p when it is within `TOP_P_TOLERANCE` of it, so exact boundaries come out as on paper (ten
equal tokens and p = 0.6 keep six; float32 sums kept seven).
"""

from __future__ import annotations

import math

import torch

TOP_P_TOLERANCE = 1e-9  # far above float64 summation error over any vocabulary, far below a meaningful probability


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row [..., V] (ties with the k-th kept too); the rest -> -inf.
    k: an int >= 1 (k >= V keeps everything)."""
    _check_top_k(k)
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one token);
    the rest -> -inf. p in (0, 1]; p = 1 keeps everything. The probabilities and their running sums are
    float64, and a sum within TOP_P_TOLERANCE of p has reached it (the module docstring)."""
    _check_top_p(p)
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.double(), dim=-1)  # [..., V] float64
    # probability mass strictly ahead of each token: an exclusive running sum (no subtraction, no cancellation)
    before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
    before[..., 0] = 0.0
    drop_sorted = before >= p - TOP_P_TOLERANCE  # the set already reached p without this token
    drop_sorted[..., 0] = False  # the most likely token stays, however small p is
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
    """logits [B, V] -> token ids [B] (int64). The settings are checked as `generate` checks them
    (`check_sampling`: a ValueError naming the option)."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.double()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature  # <= 0, largest 0: no overflow (docstring)
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
    if top_k is not None:
        _check_top_k(top_k)
    if top_p is not None:
        _check_top_p(top_p)


def _check_top_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k must be an int >= 1, or None for no top-k filter (what transformers writes as 0), "
                         f"got {k!r}")


def _check_top_p(p) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None for no top-p filter), got {p!r}")
