"""Triton kernels of the output-keeping RMS normalization, forward and backward (the math and the reference in
`__init__.py`).

The input's rows are its last-dim vectors, addressed as [N, H, D] with any strides N and H (the rows of a [B, T, H, D]
slice of a wider tensor are read where they lie); the output is contiguous. Each program walks up to STEPS blocks of BR rows
(BD >= D columns, masked), so a row's statistics are one sum over the columns. The mean's division and 1 / sqrt are
IEEE-rounded (`div_rn`, `sqrt_rn`; Triton's `/` compiles to an approximate division on NVIDIA GPUs), as torch's. Warps
and pipeline stages are autotuned per width, as for every kernel of `hybridlm.ops`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from hybridlm.ops.triton_utils import autotune, row_steps
from hybridlm.ops.utils import cdiv, next_power_of_2, on_tensor_device

STEPS = 8  # row blocks per program (fewer where the rows need fewer: `row_steps`)
ROW_ELEMENTS = 2048  # BR x BD: rows per block shrink as the rows widen


@autotune(["D", "STEPS"], fixed_warps=4)
@triton.jit(do_not_specialize=["R"])
def rms_normalize_fwd_kernel(u_ptr, n_ptr, rstd_ptr, R, H, stride_n, stride_h, eps, D: tl.constexpr,
                             BD: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr):
    """n [R, D] (contiguous, n's dtype) and rstd [R] float32 of the R = N H rows of u (row r at (r // H) stride_n +
    (r % H) stride_h). Grid (cdiv(R, STEPS BR),)."""
    cols = tl.arange(0, BD)
    in_col = cols < D
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BR + tl.arange(0, BR)
        in_row = rows < R
        r = rows.to(tl.int64)
        src = (r // H) * stride_n + (r % H) * stride_h
        mask = in_row[:, None] & in_col[None, :]
        u = tl.load(u_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BR, BD]
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(u * u, axis=1), D * 1.0) + eps))  # [BR]
        tl.store(n_ptr + r[:, None] * D + cols[None, :], (u * rstd[:, None]).to(n_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=in_row)


@autotune(["D", "STEPS"], fixed_warps=4)
@triton.jit(do_not_specialize=["R"])
def rms_normalize_bwd_kernel(dn_ptr, n_ptr, rstd_ptr, du_ptr, R, D: tl.constexpr, BD: tl.constexpr,
                             BR: tl.constexpr, STEPS: tl.constexpr):
    """du = rstd (dn - n mean(dn n)) [R, D] (du's dtype) of dn, n [R, D] (contiguous) and rstd [R]. Grid
    (cdiv(R, STEPS BR),)."""
    cols = tl.arange(0, BD)
    in_col = cols < D
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BR + tl.arange(0, BR)
        in_row = rows < R
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        mask = in_row[:, None] & in_col[None, :]
        g = tl.load(dn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n = tl.load(n_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=in_row, other=0.0)
        dot = tl.math.div_rn(tl.sum(g * n, axis=1), D * 1.0)
        du = rstd[:, None] * (g - n * dot[:, None])
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


@autotune(["D", "STEPS", "RESIDUALS"], fixed_warps=4)
@triton.jit(do_not_specialize=["R"])
def rms_norm_scaled_kernel(x_ptr, r1_ptr, r2_ptr, w_ptr, h_ptr, y_ptr, R, stride_x, stride_r1, stride_r2, eps,
                           D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
                           RESIDUALS: tl.constexpr):
    """Inference's norm in one launch: h = (x + r1) + r2 (as many residuals as RESIDUALS, each sum rounded to h's
    dtype as torch's adds round it; h contiguous [R, D]) or h = x, then y = w n [R, D] (contiguous, y's dtype) with
    n = h rstd(h) rounded to h's dtype, as `rms_norm` computes it apart (the normalization's kernel, then the
    scale). Rows of x and the residuals at their row strides. Grid (cdiv(R, STEPS BR),)."""
    cols = tl.arange(0, BD)
    in_col = cols < D
    w = tl.load(w_ptr + cols, mask=in_col, other=0.0).to(tl.float32)  # [BD]
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BR + tl.arange(0, BR)
        r64 = rows.to(tl.int64)
        mask = (rows < R)[:, None] & in_col[None, :]
        h = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if RESIDUALS >= 1:
            r = tl.load(r1_ptr + r64[:, None] * stride_r1 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(h_ptr.dtype.element_ty).to(tl.float32)
        if RESIDUALS >= 2:
            r = tl.load(r2_ptr + r64[:, None] * stride_r2 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(h_ptr.dtype.element_ty).to(tl.float32)
        if RESIDUALS >= 1:
            tl.store(h_ptr + r64[:, None] * D + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(h * h, axis=1), D * 1.0) + eps))  # [BR]
        n = (h * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + r64[:, None] * D + cols[None, :], (n * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_scaled_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residuals: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs (the package's entry point) -> (h, y): h = x + residuals[0] + residuals[1] (x itself without
    any), y = weight * rms_normalize(h) in the dtype torch's product gives, both [..., D] contiguous. No autograd."""
    D = x.shape[-1]

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1, D)
        return t if t.stride(-1) == 1 else t.contiguous()

    rows = rows_of(x)
    extra = [rows_of(r) for r in residuals]
    h_dtype = x.dtype
    for r in residuals:
        h_dtype = torch.promote_types(h_dtype, r.dtype)
    R = rows.shape[0]
    h = torch.empty(R, D, dtype=h_dtype, device=x.device) if residuals else rows
    y = torch.empty(R, D, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    if R:
        BD, BR, steps, blocks = _blocks(R, D)
        r1, r2 = (extra + [rows, rows])[:2]
        with on_tensor_device(x):
            rms_norm_scaled_kernel[(blocks,)](rows, r1, r2, weight.contiguous(), h, y, R, rows.stride(0), r1.stride(0),
                                              r2.stride(0), eps, D=D, BD=BD, BR=BR, STEPS=steps,
                                              RESIDUALS=len(residuals))
    return (h.view(x.shape) if residuals else x), y.view(x.shape)


def _blocks(R: int, D: int) -> tuple[int, int, int, int]:
    """BD, BR, the row blocks per program and the grid for R rows of D channels."""
    BD = next_power_of_2(D)
    BR = max(1, ROW_ELEMENTS // BD)
    steps = row_steps(R, BR, STEPS)
    return BD, BR, steps, cdiv(R, steps * BR)


class _RMSNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u3, eps: float):  # u3 [N, H, D]: unit channel stride
        N, H, D = u3.shape
        R = N * H
        n = u3.new_empty(R, D)
        rstd = torch.empty(R, dtype=torch.float32, device=u3.device)
        if R:
            BD, BR, steps, blocks = _blocks(R, D)
            with on_tensor_device(u3):
                rms_normalize_fwd_kernel[(blocks,)](u3, n, rstd, R, H, u3.stride(0), u3.stride(1), eps, D=D, BD=BD,
                                                    BR=BR, STEPS=steps)
        ctx.save_for_backward(n, rstd)
        ctx.shape = u3.shape
        return n

    @staticmethod
    @once_differentiable
    def backward(ctx, dn):
        n, rstd = ctx.saved_tensors
        R, D = n.shape
        du = torch.empty_like(n)
        if R:
            BD, BR, steps, blocks = _blocks(R, D)
            with on_tensor_device(n):
                rms_normalize_bwd_kernel[(blocks,)](dn.contiguous(), n, rstd, du, R, D=D, BD=BD, BR=BR, STEPS=steps)
        return du.view(ctx.shape), None


def rms_normalize_triton(u: torch.Tensor, eps: float) -> torch.Tensor:
    """u [..., D] (checked by the package's entry point) -> the normalized u in its dtype and shape (contiguous),
    differentiable in u. CUDA tensors, or CPU tensors under Triton's interpreter."""
    D = u.shape[-1]
    H = u.shape[-2] if u.dim() >= 2 else 1
    # [N, H, D]: a view where the leading dims merge (a slice of a wider row included), read in place
    u3 = u.reshape(math.prod(u.shape[:-2]), H, D)
    if u3.stride(2) != 1:
        u3 = u3.contiguous()
    return _RMSNormalize.apply(u3, float(eps)).reshape(u.shape)
