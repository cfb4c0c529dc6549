"""The SiLU gate y = x * SiLU(z) (the gated MLP's up * SiLU(gate), a mixer's output gate without a norm) as a pure
function, with float32 math:

    y = x z sigmoid(z)              dx = dy z sigmoid(z)              dz = dy x sigmoid(z) (1 + z (1 - sigmoid(z)))

- `silu_gate_naive(x, z)`: the float64 reference;
- `silu_gate_triton(x, z)`: Triton kernels, one launch each way, reading x and z in place at any row stride (a slice
  of a fused projection's output); the backward keeps x and z only and is once-differentiable (`kernels.py`; imported
  on the first call, so importing this package never needs triton).

`hybridlm.modules.gate.silu_gate` is the entry point: these kernels for CUDA tensors outside torch.compile
(`backend="auto"`), else its torch form.
"""

from __future__ import annotations

import torch

from hybridlm.ops.utils import MAX_KERNEL_ROWS, TRITON_DTYPES


def silu_gate_naive(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x * SiLU(z) in float64."""
    z = z.double()
    return x.double() * z * torch.sigmoid(z)


def silu_gate_triton(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x, z [..., D] of one shape (float32, bfloat16 or float16) -> x * SiLU(z) in x's dtype and shape, differentiable
    in both, on the Triton kernels (`kernels.py`)."""
    if x.shape != z.shape:
        raise ValueError(f"silu_gate_triton: x {tuple(x.shape)} and the gate z {tuple(z.shape)} must have one shape")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"silu_gate_triton: x and z must be [..., D] with D >= 1, got shape {tuple(x.shape)}")
    if x.numel() // x.shape[-1] > MAX_KERNEL_ROWS:
        raise ValueError(f"silu_gate_triton: at most {MAX_KERNEL_ROWS} rows (the kernels index rows in int32), got "
                         f"{x.numel() // x.shape[-1]}: split the call")
    for name, t in (("x", x), ("z", z)):
        if t.dtype not in TRITON_DTYPES:
            raise ValueError(f"silu_gate_triton: {name} must be float32, bfloat16 or float16 (float32 math), got "
                             f"{t.dtype}; run float64 on `hybridlm.modules.gate.silu_gate(..., backend='torch')`")
    from hybridlm.ops.silu_gate.kernels import silu_gate_triton as run

    return run(x, z)


__all__ = ["silu_gate_naive", "silu_gate_triton"]
