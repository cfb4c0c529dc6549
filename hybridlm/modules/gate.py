"""The SiLU gate y = x * SiLU(z) with float32 math: the gated MLP's up * SiLU(gate) and a mixer's output gate
without a norm.

Spelled out in torch under autocast, the gate keeps three tensors of its width for the backward (x, z and SiLU(z);
float32 copies where they are upcast) and launches two or more kernels each way. `silu_gate` keeps x and z as they
come (bf16 under autocast; a slice of a projection's output stays where it is) and recomputes SiLU in the backward:
on a GPU in one Triton launch each way (`hybridlm.ops.silu_gate`), elsewhere in the torch form below. Both round the
result once, from float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.silu_gate import silu_gate_triton
from hybridlm.ops.utils import MAX_KERNEL_ROWS, TRITON_DTYPES, compute_dtype, runs_kernels, triton_available


class _SiluGate(torch.autograd.Function):
    """The torch form: float32 math (float64 for float64), x and z kept, SiLU recomputed in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, z)
        dtype = compute_dtype(torch.promote_types(x.dtype, z.dtype))
        y = x.to(dtype) * F.silu(z.to(dtype))
        # No cast where the dtypes agree: a no-op .to() on the result loses the gradient under torch.compile in torch
        # 2.11 (the traced backward returns zeros).
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, z = ctx.saved_tensors
        dtype = compute_dtype(torch.promote_types(x.dtype, z.dtype))
        g, zf = grad.to(dtype), z.to(dtype)
        s = torch.sigmoid(zf)
        dx = (g * zf * s).to(x.dtype) if ctx.needs_input_grad[0] else None
        dz = (g * x.to(dtype) * s * (1.0 + zf * (1.0 - s))).to(z.dtype) if ctx.needs_input_grad[1] else None
        return dx, dz


def silu_gate(x: torch.Tensor, z: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """x [..., D] * SiLU(z [..., D]) in float32 (float64 for float64 inputs), returned in x's dtype; the backward keeps
    x and z only. backend: "torch" (the form above), "triton" (`hybridlm.ops.silu_gate`'s kernels: 32- or 16-bit x
    and z) or "auto" (the kernels for CUDA tensors they take, outside torch.compile, whose inductor fuses the torch
    form, when triton is installed; else "torch")."""
    if x.shape != z.shape:
        raise ValueError(f"silu_gate: x {tuple(x.shape)} and the gate z {tuple(z.shape)} must have one shape")
    if runs_kernels("silu_gate", backend, x, lambda: _auto_takes_kernels(x, z)):
        return silu_gate_triton(x, z)
    return _SiluGate.apply(x, z)


def _auto_takes_kernels(x: torch.Tensor, z: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in TRITON_DTYPES and z.dtype in TRITON_DTYPES and x.dim() > 0 and x.numel() > 0
            and x.numel() // x.shape[-1] <= MAX_KERNEL_ROWS and not torch.compiler.is_compiling()
            and triton_available())
