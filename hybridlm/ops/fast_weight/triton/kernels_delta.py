"""Triton kernels of the rule-1 forward (regression / delta rule, scalar decay, window 1): the WY factors and the
sequential residual/state pass. The outputs reuse `kernels.output_kernel` with the residuals r in place of y.

Imported only by `chunk_1.py` (lazily; this file needs triton at import time). Per (n, h) and chunk c of BT steps,
with chunk-local L_t = sum_{r<=t} log gamma_r and Lp_t = L_{t-1} (Lp_0 = 0):

    A[s, s'] = [s' < s] exp(Lp_s - L_s') eta_s' (x_s . x_s')                      (strictly lower, [BT, BT])
    Tinv = (I + A)^-1 (forward substitution)    U = Tinv Y    W = Tinv diag(exp Lp) X                   (wy)
    r_c = U_c - W_c S_c      S_{c+1} = exp(L_last) S_c + X_c^T diag(exp(L_last - L_s) eta_s) r_c      (pass)

Buffers: U [N * H, T_pad, V] and W [N * H, T_pad, K] float32; residuals r [N, T, H, V] float32 (the layout of y,
so that `output_kernel` reads them); per-chunk entry states [N * H, n_chunks, K, V] float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.kernels import (
    _SIZES,
    _configs,
    _decays,
    _load_rows,
    _load_steps,
    _state_offsets,
    _store_rows,
)


@triton.jit
def _buffer_offsets(i_nh, t, T_pad, D: tl.constexpr, cols):
    """Offsets and mask of rows t, columns cols of one head of a [N * H, T_pad, D] buffer."""
    offs = (i_nh.to(tl.int64) * T_pad + t[:, None]) * D + cols[None, :]
    return offs, (t[:, None] < T_pad) & (cols[None, :] < D)


@triton.autotune(configs=_configs(), key=["K", "V", "BT"])
@triton.jit(do_not_specialize=_SIZES)
def wy_kernel(x_ptr, y_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, T, T_pad, n_chunks, H,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              PREC: tl.constexpr, PREC32: tl.constexpr):
    """One chunk's WY factors U = (I + A)^-1 Y and W = (I + A)^-1 diag(exp Lp) X (float32). BK covers all of K.
    Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)                                     # [BT, BT] fp32
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, _ = _decays(L_ptr, i_nh, i_c, T_pad, BT, False)                                  # Lp_s = L_{s-1}
    i = tl.arange(0, BT)
    earlier = i[:, None] > i[None, :]                                                       # s' < s
    decay = tl.exp(tl.where(earlier, Lp[:, None] - L[None, :], float("-inf")))
    b = -(decay * eta[None, :] * gram)                                                      # -A
    # Forward substitution: row s of (I + A)^-1 - I is -A[s] - sum_{s' < s} A[s, s'] ((I + A)^-1 - I)[s'];
    # after step s the rows <= s of b hold (I + A)^-1 - I, the rows below still -A.
    for s in range(1, BT):
        row = tl.sum(tl.where(i[:, None] == s, b, 0.0), axis=0)                             # -A[s, :]  [BT]
        row = row + tl.sum(row[:, None] * b, axis=0)
        b = tl.where(i[:, None] == s, row[None, :], b)
    tinv = b + tl.where(i[:, None] == i[None, :], 1.0, 0.0)                                 # (I + A)^-1
    xs = x.to(tl.float32) * tl.exp(Lp)[:, None]
    w = tl.dot(tinv, xs, input_precision=PREC32)                                            # [BT, BK]
    offs, mask = _buffer_offsets(i_nh, t, T_pad, K, rk)
    tl.store(w_ptr + offs, w, mask=mask)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                     # [BT, BV]
        u = tl.dot(tinv, y, input_precision=PREC32)
        offs, mask = _buffer_offsets(i_nh, t, T_pad, V, rv)
        tl.store(u_ptr + offs, u, mask=mask)


@triton.jit
def _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks, H,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, PREC32: tl.constexpr):
    """One chunk: record the entry state S, r = U - W S (stored), return exp(L_last) S + X^T (coef r)."""
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    w_offs, w_mask = _buffer_offsets(i_nh, t, T_pad, K, rk)
    u_offs, u_mask = _buffer_offsets(i_nh, t, T_pad, V, rv)
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)                                     # [BT, BK] fp32
    u = tl.load(u_ptr + u_offs, mask=u_mask, other=0.0)                                     # [BT, BV] fp32
    r = u - tl.dot(w, S, input_precision=PREC32)
    _store_rows(r_ptr, r, i_n, i_h, t, T, H, V, rv)
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                         # [BT, BK]
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, _, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, True)
    coef = tl.exp(L_last - L) * eta
    return tl.exp(L_last) * S + tl.dot(tl.trans(x * coef[:, None]), r, input_precision=PREC32)


@triton.jit(do_not_specialize=_SIZES)
def delta_pass_kernel(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, init_ptr, h_ptr, r_ptr, final_ptr, T, T_pad, n_chunks,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """The sequential pass over chunks for one [K, BV] column block of the state (BK covers all of K, since
    r = U - W S needs every row of S): entry states into h, residuals into r, the final state into final.
    Grid (nV, N * H); float32 throughout. INTERPRET: a while loop (see `kernels.state_pass_kernel`)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = _state_offsets(i_nh, 0, 1, K, V, rk, rv)
    if HAS_INIT:
        S = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    if INTERPRET:
        i_c = 0
        while i_c < n_chunks:
            S = _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad,
                            n_chunks, H, K, V, BT, rk, rv, PREC32)
            i_c += 1
    else:
        for i_c in range(n_chunks):
            S = _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad,
                            n_chunks, H, K, V, BT, rk, rv, PREC32)
    tl.store(final_ptr + offs0, S, mask=mask)
