"""The short causal depthwise conv in float64, one tap at a time: the reference of the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.utils import seq_idx_segments

ACTIVATIONS = (None, "silu")


def short_conv_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     seq_idx: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """x [B, T, C], weight [C, K], bias [C] or None, seq_idx [B, T] (a document index per step; None: one document
    per row) -> y [B, T, C] in float64 (differentiable).

    Tap k of step t reads x_{t-K+1+k}: zero before the row's start and wherever that step's document index differs
    from step t's (an index that comes back after another document starts a new document)."""
    B, T, C = x.shape
    K = weight.shape[1]
    x, weight = x.double(), weight.double()
    if seq_idx is None:
        segments = torch.zeros(B, T, dtype=torch.int64, device=x.device)
    else:
        segments = seq_idx_segments(seq_idx, (B, T))  # [B, T]
    y = torch.zeros_like(x) if bias is None else bias.double().expand(B, T, C).clone()
    for k in range(K):
        shift = K - 1 - k  # tap k reads `shift` steps back
        src = F.pad(x, (0, 0, shift, 0))[:, :T]  # [B, T, C]: x_{t - shift}, zeros before the row
        src_segments = F.pad(segments, (shift, 0), value=-1)[:, :T]  # -1: before the row
        y = y + src * weight[:, k] * (src_segments == segments)[..., None]
    return F.silu(y) if activation == "silu" else y
