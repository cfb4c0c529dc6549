"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as Falcon-H1 computes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.utils import compute_dtype


def rms_normalize(u: torch.Tensor, *, eps: float) -> torch.Tensor:
    """u / sqrt(mean(u^2) + eps) over the last dim, no scale, with float32 math (float64 for float64).

    Through `F.rms_norm`: one fused kernel each way on a GPU, where the spelled-out formula launches seven. A bfloat16
    CUDA tensor goes in as it is and comes back bfloat16, under autocast too (float32 math inside the kernel, the
    result rounded once; the backward keeps the bfloat16 input and a float32 1/rms per row, where autocast, which runs
    `rms_norm` in float32, would keep a float32 copy of the input); anything else goes in, and comes back, in the
    compute dtype (on the CPU the same numbers as the spelled-out formula)."""
    if u.is_cuda and u.dtype == torch.bfloat16:
        with torch.autocast("cuda", enabled=False):
            return F.rms_norm(u, (u.shape[-1],), eps=eps)
    u = u.to(compute_dtype(u.dtype))
    return F.rms_norm(u, (u.shape[-1],), eps=eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Normalize the last dim of `x` [..., D] by its root mean square, then scale by `weight` [D].

    The statistics run in float32 (float64 stays float64); the normalized tensor goes back to `x.dtype` before the
    scale, so a float32 `weight` returns float32 (Falcon-H1's RMSNorm does the same).
    """
    return weight * rms_normalize(x, eps=eps).to(x.dtype)


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
