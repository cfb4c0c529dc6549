"""Scale-free RMS normalization over the last dim that keeps its output, not its input, for the backward:

    n = u / sqrt(mean(u^2) + eps)                     (float32 math, n in u's dtype)
    du = rstd (dn - n mean(dn n)),  rstd = 1 / sqrt(mean(u^2) + eps)

The second line is the exact gradient written in n and rstd (dn/du = rstd (I - n n^T / D)), so the backward needs
only what the forward returns and one float32 per row. Where the caller keeps the output anyway (the model norm's
scale keeps the normalized tensor; a fast-weight mixer's scan keeps its normalized q), the input is freed: the
residual stream, or the short conv's output that the QK norm reads q and k from, which `F.rms_norm`'s input-keeping
autograd holds whole until the backward.

Precision: the backward reads the output as stored, so for 16-bit u the part of dn along n, which the exact gradient
cancels, cancels only to that dtype's precision: exact for float32 u (the model norm under autocast), within 16-bit
rounding where dn is mostly across n (the QK norm: its parallel part is about a tenth), worse for a dn nearly parallel
to n. The backward is once-differentiable (no double backward: use `F.rms_norm` for that).

- `rms_normalize_naive(u, eps)`: the float64 reference;
- `rms_normalize_triton(u, eps)`: Triton kernels, one launch each way (`kernels.py`; imported on the first call, so
  importing this package never needs triton). Rows of at most `MAX_DIM` channels.
- `rms_norm_scaled_triton(x, weight, eps, residuals=())`: inference's whole RMSNorm in one launch, without autograd:
  up to two residuals added first (h = x + r1 + r2, written out), then the normalization and the scale, with the
  roundings of the adds, the normalization and the scale apart.

`hybridlm.modules.norm.rms_normalize` is the entry point: these kernels for 32- or 16-bit CUDA tensors outside
torch.compile (`backend="auto"`), else `F.rms_norm`.
"""

from __future__ import annotations

import torch

from hybridlm.ops.rms_norm.limits import MAX_DIM
from hybridlm.ops.utils import MAX_KERNEL_ROWS, TRITON_DTYPES


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
    if u.numel() // u.shape[-1] > MAX_KERNEL_ROWS:
        raise ValueError(f"rms_normalize_triton: at most {MAX_KERNEL_ROWS} rows (the kernels index rows in int32), got "
                         f"{u.numel() // u.shape[-1]}: split the call")
    from hybridlm.ops.rms_norm.kernels import rms_normalize_triton as run

    return run(u, eps)


def rms_norm_scaled_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residuals: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference's RMSNorm in one launch, without autograd: x [..., D] (float32, bfloat16 or float16), weight [D],
    up to two residuals shaped like x -> (h, y) with h = (x + residuals[0]) + residuals[1] (x itself without any)
    and y = weight * (h / sqrt(mean(h^2) + eps) rounded to h's dtype): the values torch's adds, then
    `rms_normalize_triton` and the scale give apart, in the dtypes torch's promotion gives. With two residuals, the
    first sum's dtype must be the whole sum's (x + residuals[0] already in the promoted dtype)."""
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] > MAX_DIM or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_scaled_triton: x [..., D] with 1 <= D <= {MAX_DIM} and weight [D]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if len(residuals) > 2 or any(r.shape != x.shape for r in residuals):
        raise ValueError(f"rms_norm_scaled_triton: up to two residuals shaped like x {tuple(x.shape)}, got "
                         f"{[tuple(r.shape) for r in residuals]}")
    dtypes = [x.dtype, weight.dtype] + [r.dtype for r in residuals]
    if any(dtype not in TRITON_DTYPES for dtype in dtypes):
        raise ValueError(f"rms_norm_scaled_triton: float32, bfloat16 or float16 tensors, got {dtypes}")
    if len(residuals) == 2 and not sums_in_one_dtype(x, residuals):
        raise ValueError(f"rms_norm_scaled_triton: x + residuals[0] ({x.dtype} + {residuals[0].dtype}) would be "
                         f"rounded to another dtype than the sum with {residuals[1].dtype}: add the first apart")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *residuals)):
        raise ValueError("rms_norm_scaled_triton records no gradient: run it under torch.no_grad(), or train on "
                         "`hybridlm.modules.norm.rms_norm`")
    if x.numel() // x.shape[-1] > MAX_KERNEL_ROWS:
        raise ValueError(f"rms_norm_scaled_triton: at most {MAX_KERNEL_ROWS} rows, got {x.numel() // x.shape[-1]}")
    from hybridlm.ops.rms_norm.kernels import rms_norm_scaled_triton as run

    return run(x, weight, eps, tuple(residuals))


def sums_in_one_dtype(x: torch.Tensor, residuals: tuple[torch.Tensor, ...]) -> bool:
    """Whether every partial sum x + residuals[0] + ... has the whole sum's dtype (what one launch rounds to)."""
    dtype, whole = x.dtype, x.dtype
    for r in residuals:
        whole = torch.promote_types(whole, r.dtype)
    for r in residuals[:-1]:
        dtype = torch.promote_types(dtype, r.dtype)
        if dtype != whole:
            return False
    return True


__all__ = ["MAX_DIM", "rms_norm_scaled_triton", "rms_normalize_naive", "rms_normalize_triton", "sums_in_one_dtype"]
