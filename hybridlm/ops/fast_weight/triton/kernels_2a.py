"""Triton kernels of the rule-2A chunk scan: gated linear attention with a log decay per value column.

Imported only by `chunk_2a.py`, which is itself imported lazily (this file needs triton at import time).
Per (n, h) and per chunk c of BT steps (t, s steps inside the chunk; j a value column; u_s = eta_s * y_s per column;
L[t, j] = sum_{r<=t} log gamma[r, j] chunk-local; Lr[t, j] = L[t, j] (read after) or L[t-1, j] with L[-1] = 0 (read
before); M[t, s] = [s <= t] (after) or [s < t] (before); L_last[j] = L[BT-1, j]; P[t, s] = q_t . x_s;
D[t, s, j] = M[t, s] exp(Lr[t, j] - L[s, j]); b[s, j] = exp(L_last[j] - L[s, j])):

    forward
    (F1) contrib_c[k, j] = sum_s x[s, k] b[s, j] u[s, j]                       (X^T (b * u), a dot over s)
    (F2) S_{c+1}[:, j]   = exp(L_last[j]) S_c[:, j] + contrib_c[:, j]          (sequential over chunks)
    (F3) o[t, j]         = exp(Lr[t, j]) (S_c^T q_t)[j] + sum_s P[t, s] D[t, s, j] u[s, j]

    backward, with dO = dL/do and dS' = dL/dS_{c+1} (the exit state's gradient)
    (B1) dS_c[k, j] = exp(L_last[j]) dS'[k, j] + sum_t q[t, k] exp(Lr[t, j]) dO[t, j]       (reverse pass of F2)
    (B2) du[s, j]   = sum_t P[t, s] D[t, s, j] dO[t, j] + b[s, j] (x_s^T dS')[j]            (F3, F1)
         dy = eta * du,   d eta = y * du                                                   (u = eta * y)
    (B3) dP[t, s]   = sum_j D[t, s, j] u[s, j] dO[t, j]
         dq_t = sum_j exp(Lr[t, j]) dO[t, j] S_c[:, j] + sum_s dP[t, s] x_s                (F3)
         dx_s = sum_t dP[t, s] q_t + sum_j b[s, j] u[s, j] dS'[:, j]                       (F3, F1)
    (B4) the log decays, per column. In F3 every term of o[t, j] carries exp(Lr[t, j]) as a factor, so
         dL/dLr[t, j] = dO[t, j] o[t, j]; every term in which u[s, j] enters (F1, F3) carries exp(-L[s, j]), so the
         direct dL/dL[s, j] = -u[s, j] du[s, j]; F2 (with F1) carries exp(L_last[j]) on both terms, so
         dL/dL_last[j] = <dS'[:, j], S_{c+1}[:, j]> = exp(L_last[j]) <dS'[:, j], S_c[:, j]> + sum_s u[s, j] b[s, j]
         (x_s^T dS')[j]. With L[t] = sum_{r<=t} lg[r], Lr[t] = sum_{r<=t} lg[r] (after) or sum_{r<t} lg[r] (before),
         L_last = sum_r lg[r]:
             dlg[r, j] = sum_{t>=r} (dO o - u du)[t, j] + dL/dL_last[j]                     (read after)
             dlg[r, j] = sum_{t>=r} (dO o - u du)[t, j] - (dO o)[r, j] + dL/dL_last[j]      (read before)
         (a reverse cumulative sum inside the chunk; the chunks before see lg through dS').

Numerics: the intra-chunk term is computed as a [BT, BT, BV] tensor D (per value tile), with the masked entries set to
-inf before the exponential: every exponent is Lr[t, j] - L[s, j] <= 0 with s <= t (log decays are <= 0), so nothing
overflows for any decay, however strong (no factorisation exp(Lr - ref) exp(ref - L) through a per-chunk reference,
whose factors overflow when the decay inside a chunk is strong: gamma = 1e-6 gives |L| ~ 14 per step). The cost is
O(BT^2 BV) exponentials per (chunk, value tile), which is why the front door runs 2A with chunks of 16 (as the torch
chunk path's PER_COLUMN_MAX_CHUNK). The inter-chunk factors exp(Lr), exp(L_last - L), exp(L_last) are <= 1 as well.

Layouts (contiguous): q, x [N, T, H, K]; y, eta, log_gamma, o [N, T, H, V]; L [N * H, T_pad, V] float32; per-chunk
states [N * H, n_chunks, K, V] float32. Steps t >= T are masked on load (zeros: no write, no decay).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.kernels import (
    _SIZES,
    _autotune,
    _carried_block,
    _load_rows,
    _scores_and_read,
    _state_offsets,
    _store_rows,
)

_KEY = ["K", "V", "BT", "READ_AFTER"]


@triton.jit(do_not_specialize=_SIZES)
def cumsum_2a_kernel(lg_ptr, L_ptr, T, T_pad, H, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """L[nh, c * BT + i, j] = sum_{r <= i} log_gamma[n, c * BT + r, h, j]. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    lg = _load_rows(lg_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    offs = (i_nh.to(tl.int64) * T_pad + t[:, None]) * V + rv[None, :]
    tl.store(L_ptr + offs, tl.cumsum(lg, axis=0), mask=rv[None, :] < V)


@triton.jit
def _decays_2a(L_ptr, i_nh, i_c, T_pad, V: tl.constexpr, BT: tl.constexpr, rv, READ_AFTER: tl.constexpr):
    """The chunk's L [BT, BV], read decays Lr [BT, BV] and last cumulative decay L_last [BV] of value columns rv."""
    base = L_ptr + (i_nh.to(tl.int64) * T_pad + i_c * BT) * V
    i = tl.arange(0, BT)
    vmask = rv < V
    L = tl.load(base + i[:, None] * V + rv[None, :], mask=vmask[None, :], other=0.0)
    if READ_AFTER:
        Lr = L
    else:
        Lr = tl.load(base + (i[:, None] - 1) * V + rv[None, :], mask=(i[:, None] > 0) & vmask[None, :], other=0.0)
    L_last = tl.load(base + (BT - 1) * V + rv, mask=vmask, other=0.0)
    return L, Lr, L_last


@triton.jit
def _causal_decay_3d(L, Lr, BT: tl.constexpr, READ_AFTER: tl.constexpr):
    """D[t, s, j] = exp(Lr[t, j] - L[s, j]) where s <= t (after) / s < t (before), else 0: [BT, BT, BV], every
    exponent <= 0 (the masked ones are -inf before the exponential)."""
    i = tl.arange(0, BT)
    if READ_AFTER:
        seen = i[:, None] >= i[None, :]
    else:
        seen = i[:, None] > i[None, :]
    return tl.exp(tl.where(seen[:, :, None], Lr[:, None, :] - L[None, :, :], float("-inf")))


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def outer_2a_kernel(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, T, T_pad, n_chunks, H,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    READ_AFTER: tl.constexpr, GRAD: tl.constexpr, PREC: tl.constexpr):
    """h[nh, c] = a^T (coef * b), one [BK, BV] block; a is [N, T, H, K], b and coef [BT, V] (per column).
    (F1) a = x, b = y, coef = exp(L_last - L) * eta: the chunk's contribution to its exit state.
    (B1) GRAD: a = q, b = dO, coef = exp(Lr): the chunk's outputs' contribution to dL/dS_c.
    Grid (nK * nV, n_chunks, N * H)."""
    i_kv, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk, rv = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    a = _load_rows(a_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    b = _load_rows(b_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                          # [BT, BV]
    L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    if GRAD:
        coef = tl.exp(Lr)
    else:
        coef = tl.exp(L_last[None, :] - L) * _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    h = tl.dot(tl.trans(a), (b * coef).to(a.dtype), input_precision=PREC)                  # [BK, BV] fp32
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, h, mask=mask)


@triton.jit
def _pass_step_2a(h_ptr, L_ptr, S, i, i_nh, T_pad, n_chunks, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  rk, rv, mask, REVERSE: tl.constexpr):
    """One chunk of the pass: swap h[c] (the contribution) for S, return exp(L_last_c) S + contribution, the decay
    per value column."""
    if REVERSE:
        i_c = n_chunks - 1 - i
    else:
        i_c = i
    offs, _ = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    contrib = tl.load(h_ptr + offs, mask=mask, other=0.0)
    tl.store(h_ptr + offs, S, mask=mask)
    L_last = tl.load(L_ptr + (i_nh.to(tl.int64) * T_pad + i_c * BT + BT - 1) * V + rv, mask=rv < V, other=0.0)
    return tl.exp(L_last)[None, :] * S + contrib


@triton.jit(do_not_specialize=_SIZES)
def pass_2a_kernel(h_ptr, init_ptr, final_ptr, L_ptr, T_pad, n_chunks,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """(F2)/(B1) The sequential pass over chunks, in place, with the decay per value
    column: h[c] holds chunk c's contribution on entry and the value carried into chunk c on exit (the entry states;
    REVERSE: dS' of every chunk). The last carried value goes to final [N * H, K, V]. Grid (nK * nV, N * H)."""
    i_nh = tl.program_id(1)
    S, rk, rv, offs0, mask = _carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
    if INTERPRET:  # Triton 3.6's interpreter cannot `range` over a runtime int with numpy >= 2.4
        i = 0
        while i < n_chunks:
            S = _pass_step_2a(h_ptr, L_ptr, S, i, i_nh, T_pad, n_chunks, K, V, BT, rk, rv, mask, REVERSE)
            i += 1
    else:
        for i in range(n_chunks):
            S = _pass_step_2a(h_ptr, L_ptr, S, i, i_nh, T_pad, n_chunks, K, V, BT, rk, rv, mask, REVERSE)
    tl.store(final_ptr + offs0, S, mask=mask)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def output_2a_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, o_ptr, T, T_pad, n_chunks, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(F3) o[t, j] = exp(Lr[t, j]) (S_c^T q_t)[j] + sum_s P[t, s] D[t, s, j] u[s, j], a [BT, BV] block.
    Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    P, o_inter = _scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K, V, BT, BK, BV, rv,
                                  PREC)
    L, Lr, _ = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    u = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32) \
        * _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    D = _causal_decay_3d(L, Lr, BT, READ_AFTER)                                             # [BT, BT, BV]
    o = o_inter * tl.exp(Lr) + tl.sum(P[:, :, None] * D * u[None, :, :], axis=1)
    _store_rows(o_ptr, o, i_n, i_h, t, T, H, V, rv)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_v_2a_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr, dy_ptr, deta_ptr, dlg_ptr,
                     T, T_pad, n_chunks, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(B2) + (B4) for a [BT, BV] block: dy, d eta and d log_gamma (everything per value column), with S_c = h[c] and
    dS' = dh[c]. Recomputes o (dL/dLr = dO * o). Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    P = tl.zeros([BT, BT], dtype=tl.float32)                                                # q_t . x_s
    o_inter = tl.zeros([BT, BV], dtype=tl.float32)                                          # q_t^T S_c
    du_out = tl.zeros([BT, BV], dtype=tl.float32)                                           # x_s^T dS'
    s_dot = tl.zeros([BV], dtype=tl.float32)                                                # <dS'[:, j], S_c[:, j]>
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        P += tl.dot(q, tl.trans(x), input_precision=PREC)
        o_inter += tl.dot(q, S.to(q.dtype), input_precision=PREC)
        du_out += tl.dot(x, dS.to(x.dtype), input_precision=PREC)
        s_dot += tl.sum(S * dS, axis=0)
    L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    eta = _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    u = y * eta
    PD = P[:, :, None] * _causal_decay_3d(L, Lr, BT, READ_AFTER)                            # [BT(t), BT(s), BV]
    o = o_inter * tl.exp(Lr) + tl.sum(PD * u[None, :, :], axis=1)                           # (F3) recomputed
    b = tl.exp(L_last[None, :] - L)                                                         # [BT(s), BV]
    du = tl.sum(PD * do[:, None, :], axis=0) + b * du_out                                   # (B2)
    ub_out = u * b * du_out
    dL_last = tl.exp(L_last) * s_dot + tl.sum(ub_out, axis=0)                               # <dS', S_{c+1}> per column
    do_o = do * o                                                                           # dL/dLr
    dlg = tl.cumsum(do_o - u * du, axis=0, reverse=True) + dL_last[None, :]                 # (B4)
    if not READ_AFTER:
        dlg -= do_o
    _store_rows(dy_ptr, eta * du, i_n, i_h, t, T, H, V, rv)
    _store_rows(deta_ptr, y * du, i_n, i_h, t, T, H, V, rv)
    _store_rows(dlg_ptr, dlg, i_n, i_h, t, T, H, V, rv)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_qx_2a_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr, dq_ptr, dx_ptr,
                      T, T_pad, n_chunks, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(B3) dq and dx for a [BT, BK] block, summing dP and the state terms over all value tiles.
    Grid (nK, n_chunks, N * H)."""
    i_k, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = i_k * BK + tl.arange(0, BK)
    q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dq_inter = tl.zeros([BT, BK], dtype=tl.float32)                                         # (exp(Lr) dO) S_c^T
    dx_out = tl.zeros([BT, BK], dtype=tl.float32)                                           # (b u) dS'^T
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
        u = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32) \
            * _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                  # [BT, BV]
        do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)
        D = _causal_decay_3d(L, Lr, BT, READ_AFTER)
        dP += tl.sum(D * u[None, :, :] * do.to(tl.float32)[:, None, :], axis=2)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dq_inter += tl.dot((do.to(tl.float32) * tl.exp(Lr)).to(q.dtype), tl.trans(S).to(q.dtype),
                           input_precision=PREC)
        dx_out += tl.dot((u * tl.exp(L_last[None, :] - L)).to(x.dtype), tl.trans(dS).to(x.dtype),
                         input_precision=PREC)
    dq = dq_inter + tl.dot(dP.to(x.dtype), x, input_precision=PREC)
    dx = dx_out + tl.dot(tl.trans(dP).to(q.dtype), q, input_precision=PREC)
    _store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    _store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
