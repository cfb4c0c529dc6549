"""The SiLU output gate of a mixer without an output norm: y = x * SiLU(z), with float32 math.

Spelled out in torch (`x.float() * F.silu(z.float())`) autograd keeps three float32 tensors of the mixer's width for
the backward (x, z and SiLU(z) upcast). `silu_gate` keeps x and z as they come (bf16 under autocast; z is a slice of
the input projection's output, which stays alive for the short conv's backward anyway) and recomputes SiLU in the
backward: the same values and gradients, a fraction of the memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.utils import compute_dtype


class _SiluGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, z)
        dtype = compute_dtype(torch.promote_types(x.dtype, z.dtype))
        return (x.to(dtype) * F.silu(z.to(dtype))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, z = ctx.saved_tensors
        dtype = compute_dtype(torch.promote_types(x.dtype, z.dtype))
        g, zf = grad.to(dtype), z.to(dtype)
        s = torch.sigmoid(zf)
        dx = (g * zf * s).to(x.dtype) if ctx.needs_input_grad[0] else None
        dz = (g * x.to(dtype) * s * (1.0 + zf * (1.0 - s))).to(z.dtype) if ctx.needs_input_grad[1] else None
        return dx, dz


def silu_gate(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x [..., D] * SiLU(z [..., D]) in float32 (float64 for float64 inputs), returned in x's dtype; the backward keeps
    x and z only (module docstring)."""
    if x.shape != z.shape:
        raise ValueError(f"silu_gate: x {tuple(x.shape)} and the gate z {tuple(z.shape)} must have one shape")
    return _SiluGate.apply(x, z)
