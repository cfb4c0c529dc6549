"""Scale-free RMS normalization over the last dim that keeps its output, not its input, for the backward:

    n = u / sqrt(mean(u^2) + eps)                     (float32 math, n in u's dtype)
    du = rstd (dn - n mean(dn n)),  rstd = 1 / sqrt(mean(u^2) + eps)

The second line is the exact gradient written in n and rstd (dn/du = rstd (I - n n^T / D)), so the backward needs
only what the forward returns and one float32 per row. A fast-weight mixer's QK norm normalizes slices of its short
conv's output whose normalized copies the scan keeps anyway: kept this way, the conv's output is freed after the
forward, where `F.rms_norm`'s autograd (input-saving) keeps all of it for the backward.

- `rms_normalize_naive(u, eps)`: the float64 reference;
- `rms_normalize_triton(u, eps)`: Triton kernels, one launch each way (`kernels.py`; imported on the first call, so
  importing this package never needs triton). Rows of at most `MAX_DIM` channels.

`hybridlm.modules.norm.rms_normalize` is the entry point: these kernels for bf16 CUDA tensors outside torch.compile
(`backend="auto"`), else `F.rms_norm`.
"""

from __future__ import annotations

import torch

from hybridlm.ops.rms_norm.limits import MAX_DIM
from hybridlm.ops.utils import TRITON_DTYPES


def rms_normalize_naive(u: torch.Tensor, eps: float) -> torch.Tensor:
    """u / sqrt(mean(u^2) + eps) over the last dim, in float64."""
    u = u.double()
    return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize_triton(u: torch.Tensor, eps: float) -> torch.Tensor:
    """u [..., D] (float32, bfloat16 or float16; 1 <= D <= MAX_DIM) -> u / sqrt(mean(u^2) + eps) over the last dim, in
    u's dtype and shape, differentiable in u, on the Triton kernels (`kernels.py`); the backward keeps the output and
    1 / rms per row only. A [..., H, D] slice of a wider tensor is read in place."""
    if u.dim() < 1 or u.shape[-1] == 0:
        raise ValueError(f"rms_normalize_triton: u must be [..., D] with D >= 1, got shape {tuple(u.shape)}")
    if u.dtype not in TRITON_DTYPES:
        raise ValueError(f"rms_normalize_triton: u must be float32, bfloat16 or float16 (float32 math), got {u.dtype}; "
                         "run float64 on `hybridlm.modules.norm.rms_normalize(..., backend='torch')`")
    if u.shape[-1] > MAX_DIM:
        raise ValueError(f"rms_normalize_triton: rows of {u.shape[-1]} channels exceed the kernels' {MAX_DIM}; run "
                         "`hybridlm.modules.norm.rms_normalize(..., backend='torch')`")
    from hybridlm.ops.rms_norm.kernels import rms_normalize_triton as run

    return run(u, eps)


__all__ = ["MAX_DIM", "rms_normalize_naive", "rms_normalize_triton"]
