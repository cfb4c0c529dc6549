"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as Falcon-H1 computes them)."""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops.utils import compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Normalize the last dim of `x` [..., D] by its root mean square, then scale by `weight` [D].

    The statistics run in float32 (float64 stays float64); the normalized tensor goes back to `x.dtype` before the
    scale, so a float32 `weight` returns float32 (Falcon-H1's RMSNorm does the same).
    """
    x32 = x.to(compute_dtype(x.dtype))
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    return weight * (x32 * inv_rms).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned scale (initialized to ones)."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
