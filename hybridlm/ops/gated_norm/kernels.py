"""Triton kernels of the grouped, gated RMSNorm, forward and backward (`naive.py` is the reference; the
math in `__init__.py`).

The leading dims are flattened into M rows of D channels, cut into G groups of DG = D / G channels. Each program
takes one group of up to STEPS blocks of BM rows (BD >= DG columns, masked), so a row's group is one block row and its
statistics one sum over the columns. Warps and pipeline stages are autotuned per group width and flags, as for
every kernel of `hybridlm.ops`.

- Forward: float32 math, y stored in x's dtype; 1 / rms per row and group kept ([M, G] float32) for the backward.
- Backward: u_hat = u / rms from x, z and the kept 1 / rms (no other saved activation), then, with s = SiLU(z):
    norm before the gate:  dz = dy w u_hat SiLU'(z);  g = dy s;  du = (w g - u_hat mean(w g u_hat)) / rms
    gate before the norm:  g = dy;  du as above;  dx = du s;  dz = du x SiLU'(z)
  and dw = sum over rows of g u_hat, from per-program partial sums ([programs, D], kept elementwise over the
  program's rows and reduced once) that torch sums (no atomics: the same sum every run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from hybridlm.ops.gated_norm.limits import MAX_GROUP
from hybridlm.ops.triton_utils import autotune, row_steps
from hybridlm.ops.utils import TRITON_DTYPES, cdiv, next_power_of_2, on_tensor_device

STEPS = 8  # row blocks per program (fewer where the rows need fewer: `row_steps`)
ROW_ELEMENTS = 2048  # BM x BD: rows per block shrink as the groups widen
KEY = ["DG", "STEPS", "HAS_GATE", "BEFORE"]  # the tuning key (warps x stages, `hybridlm.ops.triton_utils`)


@triton.jit
def _gate(z_ptr, offs, mask):
    """z as float32, SiLU(z) and SiLU'(z) at offs."""
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    return z, z * sig, sig * (1.0 + z * (1.0 - sig))


@autotune(KEY, fixed_warps=4)
@triton.jit(do_not_specialize=["M"])
def gated_norm_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr, M, D, G, stride_z, eps, DG: tl.constexpr,
                          BD: tl.constexpr, BM: tl.constexpr, STEPS: tl.constexpr, HAS_GATE: tl.constexpr,
                          BEFORE: tl.constexpr):
    """y [M, D] and 1 / rms [M, G] of x [M, D], z [M, D] (HAS_GATE; rows stride_z apart), w [D]. Grid
    (cdiv(M, STEPS BM), G)."""
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BD)
    in_col = cols < DG
    c = i_g * DG + cols
    w = tl.load(w_ptr + c, mask=in_col, other=0.0).to(tl.float32)
    for step in range(STEPS):
        rows = (i_m * STEPS + step) * BM + tl.arange(0, BM)
        in_row = rows < M
        offs = rows.to(tl.int64)[:, None] * D + c[None, :]
        mask = in_row[:, None] & in_col[None, :]
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BM, BD]
        if HAS_GATE:
            _, s, _ = _gate(z_ptr, rows.to(tl.int64)[:, None] * stride_z + c[None, :], mask)
            if not BEFORE:
                u = u * s
        rstd = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / DG + eps)  # [BM]
        y = u * rstd[:, None] * w[None, :]
        if HAS_GATE and BEFORE:
            y = y * s
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows.to(tl.int64) * G + i_g, rstd, mask=in_row)


@autotune(KEY, fixed_warps=8)  # ptxas, sm_90: 4 warps take 255 registers at groups of 64 and spill at 4096
@triton.jit(do_not_specialize=["M"])
def gated_norm_bwd_kernel(x_ptr, z_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, M, D, G, stride_z,
                          DG: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, STEPS: tl.constexpr,
                          HAS_GATE: tl.constexpr, BEFORE: tl.constexpr):
    """dx [M, D] (its dtype), dz [M, D] (its dtype; HAS_GATE; z's rows stride_z apart, dz's D) and this program's
    partial dw [D] (float32) of dy [M, D]. Grid (cdiv(M, STEPS BM), G); dw_ptr: [grid 0, D]."""
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BD)
    in_col = cols < DG
    c = i_g * DG + cols
    w = tl.load(w_ptr + c, mask=in_col, other=0.0).to(tl.float32)
    dw = tl.zeros([BM, BD], dtype=tl.float32)
    for step in range(STEPS):
        rows = (i_m * STEPS + step) * BM + tl.arange(0, BM)
        in_row = rows < M
        offs = rows.to(tl.int64)[:, None] * D + c[None, :]
        mask = in_row[:, None] & in_col[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # becomes dL/d(w u_hat)
        rstd = tl.load(rstd_ptr + rows.to(tl.int64) * G + i_g, mask=in_row, other=0.0)
        u = x
        if HAS_GATE:
            z, s, ds = _gate(z_ptr, rows.to(tl.int64)[:, None] * stride_z + c[None, :], mask)
            if not BEFORE:
                u = x * s
        u_hat = u * rstd[:, None]
        if HAS_GATE and BEFORE:
            dz = g * (w[None, :] * u_hat) * ds
            tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            g = g * s
        dw += g * u_hat
        d_hat = g * w[None, :]  # dL/du_hat
        du = (d_hat - u_hat * (tl.sum(d_hat * u_hat, axis=1) / DG)[:, None]) * rstd[:, None]
        dx = du
        if HAS_GATE and not BEFORE:
            tl.store(dz_ptr + offs, (du * x * ds).to(dz_ptr.dtype.element_ty), mask=mask)
            dx = du * s
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + i_m.to(tl.int64) * D + c, tl.sum(dw, axis=0), mask=in_col)


def _blocks(M: int, DG: int) -> tuple[int, int, int, int]:
    """BD, BM, the row blocks per program and the grid's row-block count (times G) for M rows of groups of DG
    channels."""
    BD = next_power_of_2(DG)
    BM = max(1, ROW_ELEMENTS // BD)
    steps = row_steps(M, BM, STEPS)
    return BD, BM, steps, cdiv(M, steps * BM)


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, groups: int, eps: float, before: bool):
        M, D = x.shape
        DG = D // groups
        BD, BM, steps, row_blocks = _blocks(M, DG)
        y = torch.empty_like(x)
        rstd = torch.empty(M, groups, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, gate, rstd)
        ctx.groups, ctx.before = groups, before
        if M == 0:
            return y
        with on_tensor_device(x):
            gated_norm_fwd_kernel[(row_blocks, groups)](
                x, gate, weight, y, rstd, M, D, groups, _row_stride(gate), eps, DG=DG, BD=BD, BM=BM, STEPS=steps,
                HAS_GATE=gate is not None, BEFORE=before)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, gate, rstd = ctx.saved_tensors
        M, D = x.shape
        DG = D // ctx.groups
        BD, BM, steps, row_blocks = _blocks(M, DG)
        dx = torch.empty_like(x)
        dz = None if gate is None else torch.empty(M, D, dtype=gate.dtype, device=gate.device)
        if M == 0:
            return dx, torch.zeros_like(weight), dz, None, None, None
        dw = torch.empty(row_blocks, D, dtype=torch.float32, device=x.device)
        with on_tensor_device(x):
            gated_norm_bwd_kernel[(row_blocks, ctx.groups)](
                x, gate, weight, rstd, dy.contiguous(), dx, dz, dw, M, D, ctx.groups, _row_stride(gate), DG=DG, BD=BD,
                BM=BM, STEPS=steps, HAS_GATE=gate is not None, BEFORE=ctx.before)
        return dx, dw.sum(0).to(weight.dtype), dz, None, None, None


def _row_stride(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.stride(0)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """[M, D] rows the kernels read in place: channels adjacent, rows at any stride (the gate as a slice of a fused
    projection's output); a copy otherwise."""
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[1] else t.contiguous()


def gated_norm_triton(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None, *, groups: int = 1,
                      eps: float = 1e-6, norm_before_gate: bool = True) -> torch.Tensor:
    """x [..., D] and gate [..., D] or None (float32, bfloat16 or float16), weight [D] -> y [..., D] in x's dtype,
    differentiable in x, weight and gate (float32 math; `naive.gated_norm_naive` is the math). Groups of at most
    MAX_GROUP channels. CUDA tensors, or CPU tensors under Triton's interpreter."""
    if x.dim() < 1:
        raise ValueError("gated_norm_triton: x must be [..., D], got a scalar")
    D = x.shape[-1]
    if D == 0 or groups < 1 or D % groups:
        raise ValueError(f"gated_norm_triton: groups={groups} must divide the channel count {D} (x {tuple(x.shape)})")
    if D // groups > MAX_GROUP:
        raise ValueError(f"gated_norm_triton: groups of {D // groups} channels exceed the kernels' {MAX_GROUP}; run "
                         "`hybridlm.modules.gated_rms_norm` instead")
    if tuple(weight.shape) != (D,):
        raise ValueError(f"gated_norm_triton: weight must be [{D}], got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_norm_triton: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    for name, t in (("x", x), ("gate", gate)):
        if t is not None and t.dtype not in TRITON_DTYPES:
            raise ValueError(f"gated_norm_triton: {name} must be float32, bfloat16 or float16 (float32 math), got "
                             f"{t.dtype}; run float64 on `hybridlm.modules.gated_rms_norm`")
    rows = x.reshape(-1, D).contiguous()
    gates = None if gate is None else _rows_of(gate.reshape(-1, D))
    y = _GatedNorm.apply(rows, weight.contiguous(), gates, groups, float(eps), norm_before_gate)
    return y.reshape(x.shape)
