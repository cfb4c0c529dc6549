"""Triton kernels of the short causal depthwise conv for training, forward and backward, with documents restarting
inside rows (`naive.py` is the reference; the math in `__init__.py`).

The rows are laid end to end as one row of L = B T steps, with a segment id per step that changes at every row start and
every document start, so both kernels see one packed row: tap k of step t reads x_{t-K+1+k} where that step exists and
has t's segment. With documents the ids come in a buffer (HAS_SEG); without, a step's segment is its row, t // T,
computed where it is needed. Each program walks STEPS blocks of BT steps in one block of BC channels; warps and pipeline
stages are autotuned per channel count, taps and flags, as for every kernel of `hybridlm.ops`. x is read where it lies
whenever its channels are adjacent, at any row stride: the mixers pass a slice of their input projection's output, which
the backward then keeps instead of a contiguous copy.

- Forward: y_t = act(bias + sum_k w_k x_{t-K+1+k}), float32 accumulation, stored in x's dtype.
- Backward, two kernels: the first recomputes the pre-activations, stores g = dL/d(pre-activation) = dy act'(pre)
  in x's dtype (without an activation g is dy, nothing stored; a transient [L, C] buffer, 2 bytes per element
  for 16-bit activations) and sums its program's share of dw_k = sum_t g_t x_{t-K+1+k} and db = sum_t g_t [same
  segment] from the float32 g, into a [programs, ...] buffer that torch sums (no atomics: the same sum every run);
  the second reads g at the K steps that read each input: dx_t = sum_j w_{K-1-j} g_{t+j} [same segment]. g goes
  through memory because recomputing it there would take K x K taps per input (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from hybridlm.ops.short_conv.naive import ACTIVATIONS
from hybridlm.ops.triton_utils import autotune
from hybridlm.ops.utils import TRITON_DTYPES, cdiv, next_power_of_2, on_tensor_device, seq_idx_segments

BT, BC, STEPS = 32, 64, 16  # steps per block, channels per block, blocks per program
KEY = ["C", "K", "HAS_BIAS", "SILU", "HAS_SEG"]  # the tuning key (warps x stages, `hybridlm.ops.triton_utils`)


@triton.jit
def _segment(seg_ptr, steps, mask, other, T, HAS_SEG: tl.constexpr):
    """The segment ids of `steps` (`other` where masked): loaded from seg_ptr, or without documents each step's row
    steps // T (rows of T steps), with no buffer to build or read."""
    if HAS_SEG:
        return tl.load(seg_ptr + steps, mask=mask, other=other)
    return tl.where(mask, steps // T, other)


@triton.jit
def _tap(x_ptr, seg_ptr, src, inside, seg_t, c, C, SX, T, HAS_SEG: tl.constexpr):
    """x[src, c] (rows SX elements apart) as float32 where `inside` holds and step src has segment seg_t, else 0:
    [len(src), len(c)]."""
    keep = inside & (src >= 0)
    keep = keep & (_segment(seg_ptr, src, keep, -1, T, HAS_SEG) == seg_t)
    offs = src.to(tl.int64)[:, None] * SX + c[None, :]
    return tl.load(x_ptr + offs, mask=keep[:, None] & (c[None, :] < C), other=0.0).to(tl.float32)


@triton.jit
def _pre_activation(x_ptr, w_ptr, seg_ptr, t, inside, bias, c, C, SX, T, K: tl.constexpr, HAS_SEG: tl.constexpr):
    """bias + sum_k w_k x_{t-K+1+k} (same segment as t) at steps t: [len(t), len(c)] float32."""
    seg_t = _segment(seg_ptr, t, inside, -2, T, HAS_SEG)
    acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32) + bias[None, :]
    for k in tl.static_range(K):
        w_k = tl.load(w_ptr + c * K + k, mask=c < C, other=0.0).to(tl.float32)
        acc += _tap(x_ptr, seg_ptr, t - (K - 1) + k, inside, seg_t, c, C, SX, T, HAS_SEG) * w_k[None, :]
    return acc


@autotune(KEY, fixed_warps=4)
@triton.jit(do_not_specialize=["L", "T"])
def short_conv_fwd_kernel(x_ptr, w_ptr, b_ptr, seg_ptr, y_ptr, L, C, SX, T, K: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, STEPS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          HAS_SEG: tl.constexpr):
    """y [L, C] (contiguous) of x [L, C] (rows SX elements apart), w [C, K], b [C], segments [L] (HAS_SEG; else rows
    of T steps). Grid (cdiv(L, STEPS BT), cdiv(C, BC))."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    c = i_c * BC + tl.arange(0, BC)
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    for step in range(STEPS):
        t = (i_t * STEPS + step) * BT + tl.arange(0, BT)
        inside = t < L
        y = _pre_activation(x_ptr, w_ptr, seg_ptr, t, inside, bias, c, C, SX, T, K, HAS_SEG)
        if SILU:
            y = y * tl.sigmoid(y)
        offs = t.to(tl.int64)[:, None] * C + c[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside[:, None] & (c[None, :] < C))


@autotune(KEY, fixed_warps=8)  # 4 warps spill its [KP, BT, BC] sums
@triton.jit(do_not_specialize=["L", "T"])
def short_conv_bwd_weight_kernel(x_ptr, w_ptr, b_ptr, seg_ptr, dy_ptr, g_ptr, dw_ptr, db_ptr, L, C, SX, T,
                                 K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                                 STEPS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                 HAS_SEG: tl.constexpr):
    """g = dy act'(pre) [L, C] in x's dtype (stored with SILU; without it g is dy itself) and this program's partial
    dw [KP, C] / db [C] (float32, rows k < K of dw used), x's rows SX elements apart. Grid (cdiv(L, STEPS BT),
    cdiv(C, BC)); dw_ptr / db_ptr: [grid 0, KP, C] / [grid 0, C]."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    c = i_c * BC + tl.arange(0, BC)
    in_c = c < C
    kk = tl.arange(0, KP)
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=in_c, other=0.0).to(tl.float32)
    kk3 = kk[:, None, None]  # [KP, 1, 1]: the taps on a leading axis
    # Sums over the program's steps, reduced over them once at the end: dw_k = sum_t g_t x_{t-K+1+k}, db = sum_t g_t.
    dw3 = tl.zeros([KP, BT, BC], dtype=tl.float32)
    db2 = tl.zeros([BT, BC], dtype=tl.float32)
    for step in range(STEPS):
        t = (i_t * STEPS + step) * BT + tl.arange(0, BT)
        inside = t < L
        offs = t.to(tl.int64)[:, None] * C + c[None, :]
        mask = inside[:, None] & in_c[None, :]
        # All K taps of the block in one load, x3[k, i] = x_{t_i-K+1+k} where that step exists in t_i's segment, for
        # dw; the pre-activations from K loads of one tap each (a sum over x3's tap axis runs slower).
        seg_t = _segment(seg_ptr, t, inside, -3, T, HAS_SEG)
        src = t[None, :, None] - (K - 1) + kk3  # [KP, BT, 1]
        keep = (kk3 < K) & inside[None, :, None] & (src >= 0)
        keep = keep & (_segment(seg_ptr, src, keep, -1, T, HAS_SEG) == seg_t[None, :, None])
        x3 = tl.load(x_ptr + src.to(tl.int64) * SX + c[None, None, :], mask=keep & in_c[None, None, :],
                     other=0.0).to(tl.float32)  # [KP, BT, BC]
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            pre = _pre_activation(x_ptr, w_ptr, seg_ptr, t, inside, bias, c, C, SX, T, K, HAS_SEG)
            s = tl.sigmoid(pre)
            g = g * s * (1.0 + pre * (1.0 - s))
            tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)
        db2 += g
        dw3 += x3 * g[None, :, :]
    dw = tl.sum(dw3, axis=1)  # [KP, BC]
    db = tl.sum(db2, axis=0)
    part = i_t.to(tl.int64)
    tl.store(dw_ptr + (part * KP + kk[:, None]) * C + c[None, :], dw, mask=(kk[:, None] < K) & in_c[None, :])
    tl.store(db_ptr + part * C + c, db, mask=in_c)


@autotune(["C", "K", "HAS_SEG"], fixed_warps=4)
@triton.jit(do_not_specialize=["L", "T"])
def short_conv_bwd_input_kernel(g_ptr, w_ptr, seg_ptr, dx_ptr, L, C, T, K: tl.constexpr, BT: tl.constexpr,
                                BC: tl.constexpr, STEPS: tl.constexpr, HAS_SEG: tl.constexpr):
    """dx [L, C] (its dtype) of g [L, C]: dx_t = sum_j w_{K-1-j} g_{t+j}, over the steps t + j of t's segment (the
    outputs that read x_t). Grid (cdiv(L, STEPS BT), cdiv(C, BC))."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    c = i_c * BC + tl.arange(0, BC)
    in_c = c < C
    for step in range(STEPS):
        t = (i_t * STEPS + step) * BT + tl.arange(0, BT)
        inside = t < L
        seg_t = _segment(seg_ptr, t, inside, -3, T, HAS_SEG)
        dx = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):  # the output step t + j reads x_t through tap K - 1 - j
            tj = t + j
            inside_j = tj < L
            same = inside_j & (_segment(seg_ptr, tj, inside_j, -4, T, HAS_SEG) == seg_t)
            g = tl.load(g_ptr + tj.to(tl.int64)[:, None] * C + c[None, :], mask=same[:, None] & in_c[None, :],
                        other=0.0).to(tl.float32)
            w_j = tl.load(w_ptr + c * K + (K - 1 - j), mask=in_c, other=0.0).to(tl.float32)
            dx += g * w_j[None, :]
        offs = t.to(tl.int64)[:, None] * C + c[None, :]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside[:, None] & in_c[None, :])


def _grid(L: int, C: int) -> tuple[int, int]:
    return cdiv(L, STEPS * BT), cdiv(C, BC)


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, segments, silu: bool, T: int):
        # x [L, C]: unit channel stride, any row stride >= C; segments [L] int32, or None: rows of T steps
        L, C = x.shape
        K = weight.shape[1]
        y = x.new_empty(L, C)
        with on_tensor_device(x):
            short_conv_fwd_kernel[_grid(L, C)](x, weight, bias, _or(segments, x), y, L, C, x.stride(0), T, K=K, BT=BT,
                                               BC=BC, STEPS=STEPS, HAS_BIAS=bias is not None, SILU=silu,
                                               HAS_SEG=segments is not None)
        ctx.save_for_backward(x, weight, bias, segments)
        ctx.silu, ctx.T = silu, T
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, segments = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        L, C = x.shape
        K = weight.shape[1]
        KP = next_power_of_2(K)
        grid = _grid(L, C)
        dy = dy.contiguous()
        g = x.new_empty(L, C) if ctx.silu else dy  # dL/d(pre-activation), in x's dtype
        dx = dweight = dbias = None
        with on_tensor_device(x):
            if needs_weight or needs_bias or (needs_x and ctx.silu):
                dw = torch.empty(grid[0], KP, C, dtype=torch.float32, device=x.device)
                db = torch.empty(grid[0], C, dtype=torch.float32, device=x.device)
                short_conv_bwd_weight_kernel[grid](x, weight, bias, _or(segments, x), dy, g, dw, db, L, C, x.stride(0),
                                                   ctx.T, K=K, KP=KP, BT=BT, BC=BC, STEPS=STEPS,
                                                   HAS_BIAS=bias is not None, SILU=ctx.silu,
                                                   HAS_SEG=segments is not None)
                dweight = dw.sum(0)[:K].t().contiguous().to(weight.dtype) if needs_weight else None
                dbias = db.sum(0).to(bias.dtype) if needs_bias else None
            if needs_x:
                dx = x.new_empty(L, C)
                short_conv_bwd_input_kernel[grid](g, weight, _or(segments, g), dx, L, C, ctx.T, K=K, BT=BT, BC=BC,
                                                  STEPS=STEPS, HAS_SEG=segments is not None)
        return dx, dweight, dbias, None, None, None


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """`t`, or a tensor that stands in for an absent pointer the kernel never reads."""
    return stand_in if t is None else t


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      seq_idx: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """x [B, T, C] (float32, bfloat16 or float16), weight [C, K], bias [C] or None, seq_idx [B, T] integers or None
    -> y [B, T, C] in x's dtype, differentiable in x, weight and bias (float32 accumulation; `naive.short_conv_naive`
    is the math). CUDA tensors, or CPU tensors under Triton's interpreter."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"short_conv_triton: unknown activation {activation!r}; choose one of {ACTIVATIONS}")
    if x.dim() != 3:
        raise ValueError(f"short_conv_triton: x must be [B, T, C], got shape {tuple(x.shape)}")
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"short_conv_triton: x must be float32, bfloat16 or float16 (float32 accumulation), got "
                         f"{x.dtype}; run float64 on `hybridlm.modules.causal_conv1d(..., backend='torch')`")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"short_conv_triton: weight must be [C, K] = [{C}, K >= 1], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"short_conv_triton: bias must be [{C}], got {tuple(bias.shape)}")
    most = 2**31 - 1 - STEPS * BT - weight.shape[1]  # the kernels index steps in int32, to a program's end + K - 1
    if B * T > most:
        raise ValueError(f"short_conv_triton: at most {most} steps in all (B x T = {B * T}): split the batch")
    segments = None  # plain rows: the kernels take each step's row as its segment (t // T), no buffer
    if seq_idx is not None:  # a segment per (row, document); a row start always starts one
        rows = torch.arange(B, device=x.device, dtype=torch.int64)[:, None] * T
        segments = (rows + seq_idx_segments(seq_idx, (B, T))).reshape(B * T).to(torch.int32)
    flat = x.reshape(B * T, C)  # read in place where its channels are adjacent (a slice of a projection's output)
    if flat.stride(1) != 1 or flat.stride(0) < C:
        flat = flat.contiguous()
    y = _ShortConv.apply(flat, weight.contiguous(), None if bias is None else bias.contiguous(), segments,
                         activation == "silu", T)
    return y.reshape(B, T, C)
