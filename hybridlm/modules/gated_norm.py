"""Grouped, gated RMSNorm: the output norm of the Mamba-2 mixer.

Channels are cut into `groups` equal groups, each normalized on its own (so the norm stays local to
a tensor-parallel shard that holds whole groups). The gate multiplies by SiLU(z) either after the
norm (`norm_before_gate=True`: y = norm(x) * silu(z)) or before it (`False`: y = norm(x * silu(z))).
The math runs in `compute_dtype(x.dtype)` (float32, or float64 for float64 inputs) and the result goes
back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.utils import compute_dtype


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    groups: int = 1,
    eps: float = 1e-6,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """x [..., D], gate [..., D] or None, weight [D] -> [..., D] in `x.dtype`."""
    dim = x.shape[-1]
    if dim % groups != 0:
        raise ValueError(f"gated_rms_norm: groups={groups} must divide the channel count {dim}")
    dtype = compute_dtype(x.dtype)
    out = x.to(dtype)
    if gate is not None and not norm_before_gate:
        out = out * F.silu(gate.to(dtype))
    # [..., G, D/G]: out / sqrt(mean out^2 + eps) per group (`F.rms_norm`: one fused kernel each way on a GPU)
    out = F.rms_norm(out.unflatten(-1, (groups, dim // groups)), (dim // groups,), eps=eps)
    out = (weight.to(dtype).view(groups, dim // groups) * out).flatten(-2)  # [..., D]
    if gate is not None and norm_before_gate:
        out = out * F.silu(gate.to(dtype))
    return out.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with a learned scale [D] (initialized to ones)."""

    def __init__(self, hidden_size: int, *, groups: int = 1, eps: float = 1e-6, norm_before_gate: bool = True) -> None:
        super().__init__()
        if hidden_size % groups != 0:
            raise ValueError(f"GatedRMSNorm: groups={groups} must divide hidden_size={hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.groups = groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return gated_rms_norm(
            x, self.weight, gate, groups=self.groups, eps=self.eps, norm_before_gate=self.norm_before_gate
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, groups={self.groups}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
