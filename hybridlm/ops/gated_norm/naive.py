"""The grouped, gated RMSNorm in float64: the reference of the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_norm_naive(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None, *, groups: int = 1,
                     eps: float = 1e-6, norm_before_gate: bool = True) -> torch.Tensor:
    """x [..., D], weight [D], gate [..., D] or None -> y [..., D] in float64 (differentiable).

    Each of `groups` equal groups of channels is normalized on its own: u / sqrt(mean over the group of u^2 + eps),
    times the weight, with u = x and the result times SiLU(gate) (norm_before_gate), or u = x SiLU(gate)."""
    x, weight = x.double(), weight.double()
    silu = None if gate is None else F.silu(gate.double())
    u = x * silu if silu is not None and not norm_before_gate else x
    u = u.unflatten(-1, (groups, -1))  # [..., G, D/G]
    y = (u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    return y * silu if silu is not None and norm_before_gate else y
