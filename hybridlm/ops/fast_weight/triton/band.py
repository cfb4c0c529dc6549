"""Rule 3A's band: the W - 1 newest pairs of a step's window, still being written, read directly beside the 1A scan
over delayed writes (`backend.py`; README.md, "Rule 3A as delayed writes"): its kernels, and the implementations of
the custom ops `hybridlm::fast_weight_delayed_fwd` / `_bwd` (`custom_ops.py`), the 1A scan over the first T ext rows
with the band added to its outputs, and in the backward the band's gradients added to the scan's.

Per row n, head h, step t
(x_ext / y_ext: the pairs with the carried tail in front, [N, W - 1 + T, H, *]; slot j of step t's window is ext row
t + j; c [N, T, H, W - 1] the band's coefficients, slot j in column j - 1; SHIFT = 1 reads step t - 1's band, whose
coefficients the caller has already moved to row t):

    o_t   = base_t + sum_{j=1..W-1} c_(t,j) (q_t . x_e) y_e,       e = t + j - SHIFT
    dq_t  = sum_j c_(t,j) (do_t . y_e) x_e                         dc_(t,j) = (q_t . x_e) (do_t . y_e)
    dx_e  = sum_j c_(t,j) (do_t . y_e) q_t                         dy_e = sum_j c_(t,j) (q_t . x_e) do_t

(the last two over the steps t = e - j + SHIFT in 0..T-1; d base = do). base is the 1A scan's output, which the
forward kernel adds to in place (rounded to its dtype once); the backward kernels add to the scan's dq, dx_ext and
dy_ext in place, so no gradient is summed by a separate pass. Products and sums in float32.

The band is O(W (K + V)) work per step and reads each input a few times: memory-bound, one program per block of
BT steps (or ext rows) and (row, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton import inner_product
from hybridlm.ops.utils import cdiv, next_power_of_2

BT, NUM_WARPS = 16, 4  # bwd_xy holds six [BT, 128] float32 blocks: 96 registers per thread at 16


@triton.jit
def row_offsets(n, h, rows, valid, length, H, D: tl.constexpr, BD: tl.constexpr):
    """Offsets [BR, BD] of rows `rows` of a [N, length, H, D] tensor and their mask."""
    cols = tl.arange(0, BD)
    offsets = ((n.to(tl.int64) * length + rows[:, None]) * H + h) * D + cols[None, :]  # past 2^31 elements
    return offsets, valid[:, None] & (cols[None, :] < D)


@triton.jit
def _load(ptr, n, h, rows, valid, length, H, D: tl.constexpr, BD: tl.constexpr):
    """Rows `rows` of a [N, length, H, D] tensor as float32 [BR, BD] (zeros where masked), their offsets and mask."""
    offsets, mask = row_offsets(n, h, rows, valid, length, H, D, BD)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32), offsets, mask


@triton.jit
def program_rows(length, H, BT: tl.constexpr):
    """This program's (row n, head h) and its BT rows of a sequence of `length`: (n, h, rows, rows < length)."""
    pid_t, pid_nh = tl.program_id(0), tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    return pid_nh // H, pid_nh % H, rows, rows < length


@triton.jit
def _slot(x_ptr, y_ptr, c_ptr, n, h, t, valid, j, T, H, SHIFT: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Slot j of steps t: x_e [BT, BK], y_e [BT, BV] (float32, e = t + j - SHIFT), c_(t,j) [BT] and its offsets."""
    e = t + j - SHIFT
    x, _, _ = _load(x_ptr, n, h, e, valid, T + W - 1, H, K, BK)
    y, _, _ = _load(y_ptr, n, h, e, valid, T + W - 1, H, V, BV)
    c_off = ((n.to(tl.int64) * T + t) * H + h) * (W - 1) + (j - 1)
    return x, y, tl.load(c_ptr + c_off, mask=valid, other=0.0), c_off


@triton.jit
def band_fwd_kernel(q_ptr, x_ptr, y_ptr, c_ptr, o_ptr, T, H, SHIFT: tl.constexpr, W: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """o += o_band, in place (o holds the 1A scan's outputs)."""
    n, h, t, valid = program_rows(T, H, BT)
    q, _, _ = _load(q_ptr, n, h, t, valid, T, H, K, BK)
    acc, o_off, o_mask = _load(o_ptr, n, h, t, valid, T, H, V, BV)
    for j in tl.static_range(1, W):
        x, y, c, _ = _slot(x_ptr, y_ptr, c_ptr, n, h, t, valid, j, T, H, SHIFT, W, K, V, BK, BV)
        acc += (tl.sum(q * x, axis=1) * c)[:, None] * y
    tl.store(o_ptr + o_off, acc.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def band_bwd_q_kernel(do_ptr, q_ptr, x_ptr, y_ptr, c_ptr, dq_ptr, dc_ptr, T, H, SHIFT: tl.constexpr,
                      W: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr):
    """dq += dq_band, in place, and dc."""
    n, h, t, valid = program_rows(T, H, BT)
    q, _, _ = _load(q_ptr, n, h, t, valid, T, H, K, BK)
    do, _, _ = _load(do_ptr, n, h, t, valid, T, H, V, BV)
    dq, q_off, q_mask = _load(dq_ptr, n, h, t, valid, T, H, K, BK)
    for j in tl.static_range(1, W):
        x, y, c, c_off = _slot(x_ptr, y_ptr, c_ptr, n, h, t, valid, j, T, H, SHIFT, W, K, V, BK, BV)
        dy_dot = tl.sum(do * y, axis=1)  # do_t . y_e
        dq += (c * dy_dot)[:, None] * x
        tl.store(dc_ptr + c_off, tl.sum(q * x, axis=1) * dy_dot, mask=valid)
    tl.store(dq_ptr + q_off, dq, mask=q_mask)


@triton.jit
def band_bwd_xy_kernel(do_ptr, q_ptr, x_ptr, y_ptr, c_ptr, dx_ptr, dy_ptr, T, H, SHIFT: tl.constexpr,
                       W: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr):
    """dx_ext += dx_band and dy_ext += dy_band, in place."""
    n, h, e, rows = program_rows(T + W - 1, H, BT)
    x, x_off, x_mask = _load(x_ptr, n, h, e, rows, T + W - 1, H, K, BK)
    y, y_off, y_mask = _load(y_ptr, n, h, e, rows, T + W - 1, H, V, BV)
    dx, _, _ = _load(dx_ptr, n, h, e, rows, T + W - 1, H, K, BK)
    dy, _, _ = _load(dy_ptr, n, h, e, rows, T + W - 1, H, V, BV)
    for j in tl.static_range(1, W):
        t = e - j + SHIFT
        valid = rows & (t >= 0) & (t < T)
        q, _, _ = _load(q_ptr, n, h, t, valid, T, H, K, BK)
        do, _, _ = _load(do_ptr, n, h, t, valid, T, H, V, BV)
        c = tl.load(c_ptr + ((n.to(tl.int64) * T + t) * H + h) * (W - 1) + (j - 1), mask=valid, other=0.0)
        dx += (c * tl.sum(do * y, axis=1))[:, None] * q
        dy += (c * tl.sum(q * x, axis=1))[:, None] * do
    tl.store(dx_ptr + x_off, dx, mask=x_mask)
    tl.store(dy_ptr + y_off, dy, mask=y_mask)


def _sizes(q, y_ext, c):
    N, T, H, K = q.shape
    V = y_ext.shape[-1]
    W = c.shape[-1] + 1
    return N, T, H, {"W": W, "K": K, "V": V, "BT": BT, "BK": max(16, next_power_of_2(K)),
                     "BV": max(16, next_power_of_2(V))}


def delayed_forward(q, x_ext, y_ext, eta, log_gamma, c, S0, read_after: bool, chunk_size: int):
    """The 1A scan over the first T rows of x_ext, y_ext, then its outputs plus the band: o [N, T, H, V] (q's dtype)
    and the scan's final state [N, H, K, V] float32 (contiguous, checked inputs: q [N, T, H, K], x_ext
    [N, W-1+T, H, K], y_ext [N, W-1+T, H, V], eta, log_gamma [N, T, H], c [N, T, H, W-1] float32, S0 or None)."""
    o, S = inner_product.forward_1a(q, x_ext, y_ext, eta, log_gamma, S0, read_after, chunk_size)
    N, T, H, sizes = _sizes(q, y_ext, c)
    band_fwd_kernel[(cdiv(T, BT), N * H)](q, x_ext, y_ext, c, o, T, H, SHIFT=_shift(read_after), **sizes,
                                          num_warps=NUM_WARPS)
    return o, S


def delayed_backward(do, dS_final, q, x_ext, y_ext, eta, log_gamma, c, S0, read_after: bool, chunk_size: int):
    """dq, dx_ext, dy_ext (the inputs' dtype), d eta, d log_gamma, dc and dS_0 (float32) for dL/do (q's dtype) and
    dL/dS_final (float32 or None): the 1A scan's gradients (`inner_product.backward_1a`; zeros on ext rows T..), to
    which the band's kernels add theirs."""
    dq, dx, dy, deta, dlg, dS0 = inner_product.backward_1a(do, dS_final, q, x_ext, y_ext, eta, log_gamma, S0,
                                                           read_after, chunk_size)
    N, T, H, sizes = _sizes(q, y_ext, c)
    dc = torch.empty_like(c)
    shift = _shift(read_after)
    band_bwd_q_kernel[(cdiv(T, BT), N * H)](do, q, x_ext, y_ext, c, dq, dc, T, H, SHIFT=shift,
                                            **sizes, num_warps=NUM_WARPS)
    band_bwd_xy_kernel[(cdiv(x_ext.shape[1], BT), N * H)](do, q, x_ext, y_ext, c, dx, dy, T, H,
                                                          SHIFT=shift, **sizes, num_warps=NUM_WARPS)
    return dq, dx, dy, deta, dlg, dc, dS0


def _shift(read_after: bool) -> int:
    """SHIFT: reading before, step t reads step t-1's band (the caller has moved its coefficients to row t)."""
    return 0 if read_after else 1
