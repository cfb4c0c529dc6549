"""Triton kernels of the SiLU gate, forward and backward (the math and the reference in `__init__.py`).

The leading dims are flattened into M rows of D channels; x and z are read where they lie (unit channel stride, any
row stride), the outputs are contiguous. Each program walks up to STEPS blocks of BM rows by BD channels. Warps and
pipeline stages are autotuned per flags, as for every kernel of `hybridlm.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from hybridlm.ops.triton_utils import autotune, row_steps
from hybridlm.ops.utils import cdiv, on_tensor_device

BM, BD, STEPS = 16, 128, 4  # rows and channels per block, row blocks per program (at most: `row_steps`)
KEY = ["D", "STEPS", "HAS_DX", "HAS_DZ"]  # the backward's tuning key (warps x stages, `hybridlm.ops.triton_utils`)


@triton.jit
def _block(step, M, D, BM: tl.constexpr, BD: tl.constexpr, STEPS: tl.constexpr):
    """This program's step-th block: row offsets [BM, 1] (int64), columns [1, BD] and their mask."""
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    rows = (tl.program_id(0) * STEPS + step) * BM + tl.arange(0, BM)
    return rows.to(tl.int64)[:, None], c[None, :], (rows < M)[:, None] & (c < D)[None, :]


@autotune(["D", "STEPS"], fixed_warps=4)
@triton.jit(do_not_specialize=["M"])
def silu_gate_fwd_kernel(x_ptr, z_ptr, y_ptr, M, D, stride_x, stride_z, BM: tl.constexpr, BD: tl.constexpr,
                         STEPS: tl.constexpr):
    """y [M, D] (contiguous, y's dtype) = x z sigmoid(z) of x, z [M, D] (rows stride_x / stride_z apart). Grid
    (cdiv(M, STEPS BM), cdiv(D, BD))."""
    for step in range(STEPS):
        r, c, mask = _block(step, M, D, BM, BD, STEPS)
        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * stride_z + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * D + c, (x * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@autotune(KEY, fixed_warps=4)
@triton.jit(do_not_specialize=["M"])
def silu_gate_bwd_kernel(dy_ptr, x_ptr, z_ptr, dx_ptr, dz_ptr, M, D, stride_x, stride_z, BM: tl.constexpr,
                         BD: tl.constexpr, STEPS: tl.constexpr, HAS_DX: tl.constexpr, HAS_DZ: tl.constexpr):
    """dx = dy SiLU(z), dz = dy x SiLU'(z) [M, D] (contiguous, x's / z's dtype) of dy [M, D] (contiguous). Grid
    (cdiv(M, STEPS BM), cdiv(D, BD))."""
    for step in range(STEPS):
        r, c, mask = _block(step, M, D, BM, BD, STEPS)
        g = tl.load(dy_ptr + r * D + c, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * stride_z + c, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(z)
        if HAS_DX:
            tl.store(dx_ptr + r * D + c, (g * z * s).to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DZ:
            x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            dz = g * x * s * (1.0 + z * (1.0 - s))
            tl.store(dz_ptr + r * D + c, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _grid(M: int, D: int) -> tuple[int, tuple[int, int]]:
    """The row blocks per program and the grid for M rows of D channels."""
    steps = row_steps(M, BM, STEPS)
    return steps, (cdiv(M, steps * BM), cdiv(D, BD))


class _SiluGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z):  # x, z [M, D]: unit channel stride, any row stride
        M, D = x.shape
        y = x.new_empty(M, D)
        if M and D:
            with on_tensor_device(x):
                steps, grid = _grid(M, D)
                silu_gate_fwd_kernel[grid](x, z, y, M, D, x.stride(0), z.stride(0), BM=BM, BD=BD, STEPS=steps)
        ctx.save_for_backward(x, z)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, z = ctx.saved_tensors
        M, D = x.shape
        has_dx, has_dz = ctx.needs_input_grad[:2]
        dx = x.new_empty(M, D) if has_dx else None
        dz = z.new_empty(M, D) if has_dz else None
        if M and D and (has_dx or has_dz):
            with on_tensor_device(x):
                dy = dy.contiguous()
                # an output not asked for is never written: its pointer is a stand-in (the kernel is built for typed
                # pointers only)
                steps, grid = _grid(M, D)
                silu_gate_bwd_kernel[grid](dy, x, z, dy if dx is None else dx, dy if dz is None else dz, M, D,
                                           x.stride(0), z.stride(0), BM=BM, BD=BD, STEPS=steps, HAS_DX=has_dx,
                                           HAS_DZ=has_dz)
        return dx, dz


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[M, D] rows the kernels read in place (channels adjacent, rows at any stride); a copy otherwise."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_gate_triton(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x * SiLU(z) (checked by the package's entry point) in x's dtype and shape, differentiable in x and z. CUDA
    tensors, or CPU tensors under Triton's interpreter."""
    return _SiluGate.apply(_rows(x), _rows(z)).reshape(x.shape)
