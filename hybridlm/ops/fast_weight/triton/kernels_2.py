"""Triton kernels of rule 2 (regression / delta rule with step sizes and log decays per value column, window 1).

Imported only by `chunk_2.py` (lazily; this file needs triton at import time). Each value column j runs its own
rule-1 recurrence with scalar eta_t[j] and log gamma_t[j]; all columns share the keys x_t (and the Gram X X^T):

    S_t[:, j] = exp(lg_t[j]) S_{t-1}[:, j] + eta_t[j] x_t (y_t[j] - x_t^T S_{t-1}[:, j])

Per (n, h) and chunk c of BT steps (t, s steps inside the chunk), with chunk-local L[t, j] = sum_{r<=t} lg[r, j],
Lp[t, j] = L[t-1, j] (0 at t = 0; the decay of the state a residual reads), Lr = L (read after) or Lp (read
before), M[t, s] = [s <= t] (after) or [s < t] (before), L_last[j] = L[BT-1, j], G[t, s] = x_t . x_s,
P[t, s] = q_t . x_s, S = S_c the entry state, u = eta * r, b0[s, j] = exp(L_last[j] - L[s, j]):

    A^j[t, s] = [s < t] exp(Lp[t, j] - L[s, j]) eta[s, j] G[t, s]     (strictly lower, one [BT, BT] per column)  (F1)
    Tinv^j = (I + A^j)^-1 (forward substitution on the [BT, BT, BV] tensor)                                     (F2)
    z = Y - exp(Lp) * (X S)      r[:, j] = Tinv^j z[:, j]                                                      (F3)
    S_{c+1}[:, j] = exp(L_last[j]) S[:, j] + X^T (b0 * u)[:, j]                                               (F4)
    o[t, j] = exp(Lr[t, j]) (q_t^T S)[j] + sum_s M exp(Lr[t, j] - L[s, j]) P[t, s] u[s, j]                   (F5)

F5 is rule 2A's output with y replaced by the residuals r (`kernels_2a.output_2a_kernel`). Backward, with dO and
dS' = dL/dS_{c+1} (rule 1's derivation, `kernels_delta.py`, per column; D[t, s, j] = M exp(Lr[t, j] - L[s, j]),
Ad[t, s, j] = [s < t] exp(Lp[t, j] - L[s, j])):

    du[s, j] = sum_t P[t, s] D[t, s, j] dO[t, j]                       (F5, chunk-local)
    dr = eta * (du + b0 * (X dS'))                                     (F5, F4)                                 (B1)
    dZ[:, j] = Tinv^jT dr[:, j],  dy = dZ,  dA^j[t, s] = -dZ[t, j] r[s, j]                                     (B2)
    dS_c = exp(L_last) dS' + Q^T (exp(Lr) * dO) - X^T (exp(Lp) * dZ)                                          (B3)
    dq_t = sum_j exp(Lr[t, j]) dO[t, j] S[:, j] + sum_s dP[t, s] x_s,  dP[t, s] = sum_j D u[s, j] dO[t, j]      (B4)
    dx_s = sum_t dP[t, s] q_t + dS' (b0 * u)_s - S (exp(Lp) * dZ)_s + sum_s' (dG[s, s'] + dG[s', s]) x_s',
           dG[t, s] = -sum_j Ad[t, s, j] dZ[t, j] u[s, j]                                                     (B5)
    deta[s, j] = r[s, j] (du + b0 * (X dS') - GAdZ)[s, j],   GAdZ[s, j] = sum_t G[t, s] Ad[t, s, j] dZ[t, j]    (B6)

The log decays, per column (every term of o[t, j] carries exp(Lr[t, j]); every term in which u[s, j] enters, F1, F4,
F5, carries exp(-L[s, j]); F1 and F3 carry exp(Lp[t, j]); F4 exp(L_last[j]) on both terms):

    dL/dLr[t, j]  = dO o                      dL/dL[s, j] (direct) = -u (du + b0 (X dS') - GAdZ) = -eta * deta
    dL/dLp[t, j]  = -dZ (exp(Lp) (X S) + A r) = -dZ (y - r)           ((I + A) r = z = y - exp(Lp) X S)
    dL/dL_last[j] = exp(L_last) <dS'[:, j], S[:, j]> + sum_s b0 u (X dS')
    dlg[r, j] = sum_{t>=r} (dL/dL + dL/dLp + dL/dLr)[t, j] - dL/dLp[r, j] - [before] dL/dLr[r, j] + dL/dL_last[j]
                                                                                                               (B7)
Numerics: every exponent is a sum of log decays (<= 0) inside one chunk, masked entries are -inf before the
exponential, as in `kernels_2a.py`; the intra-chunk tensors are O(BT^2 BV), so the front door runs chunks of 16.

Stages: `delta2_pass_kernel` (F1-F4, sequential over chunks, per value block, all of K: entry states, residuals r,
final state); the outputs (`kernels_2a.output_2a_kernel` on r); `delta2_grad_pass_kernel` (B1-B3, sequential in
reverse: dS' of every chunk into dh, dZ, dS_0); then all chunks in parallel `grad_v_2_kernel` (dy, d eta,
d log_gamma per value tile) and `grad_qx_2_kernel` (dq, dx per key tile). The residuals and dZ are float32
[N, T, H, V] (the layout of y); per-chunk states [N * H, n_chunks, K, V] float32. (I + A)^-1 is recomputed in each
pass rather than stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.kernels import (
    _SIZES,
    _autotune,
    _carried_block,
    _load_rows,
    _state_offsets,
    _store_rows,
)
from hybridlm.ops.fast_weight.triton.kernels_2a import _causal_decay_3d, _decays_2a

_KEY = ["K", "V", "BT", "READ_AFTER"]


@triton.jit
def _tinv_2(gram, eta, L, Lp, BT: tl.constexpr):
    """(F1, F2) (I + A^j)^-1 of every value column j of the tile, [BT(t), BT(s), BV], by forward substitution:
    after step s the rows <= s hold (I + A)^-1 - I, the rows below still -A."""
    i = tl.arange(0, BT)
    b = -(_causal_decay_3d(L, Lp, BT, False) * eta[None, :, :] * gram[:, :, None])        # -A
    for s in range(1, BT):
        here = (i == s)[:, None, None]
        row = tl.sum(tl.where(here, b, 0.0), axis=0)                                        # -A[s, :, :] [BT, BV]
        row = row + tl.sum(row[:, None, :] * b, axis=0)
        b = tl.where(here, row[None, :, :], b)
    eye = (i[:, None] == i[None, :])[:, :, None]
    return b + tl.where(eye, 1.0, 0.0)


@triton.jit
def _delta2_step(x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, PREC: tl.constexpr,
                 PREC32: tl.constexpr):
    """(F1-F4) One chunk: record the entry state S, the residuals r (stored), return S_{c+1}."""
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)                                     # [BT, BT] fp32
    xf = x.to(tl.float32)
    y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                          # [BT, BV]
    eta = _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    L, Lp, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    tinv = _tinv_2(gram, eta, L, Lp, BT)                                                    # [BT, BT, BV]
    z = y - tl.exp(Lp) * tl.dot(xf, S, input_precision=PREC32)
    r = tl.sum(tinv * z[None, :, :], axis=1)                                                # [BT, BV]
    _store_rows(r_ptr, r, i_n, i_h, t, T, H, V, rv)
    coef = tl.exp(L_last[None, :] - L) * eta
    return tl.exp(L_last)[None, :] * S + tl.dot(tl.trans(xf), coef * r, input_precision=PREC32)


@triton.jit(do_not_specialize=_SIZES)
def delta2_pass_kernel(x_ptr, y_ptr, eta_ptr, L_ptr, init_ptr, h_ptr, r_ptr, final_ptr, T, T_pad, n_chunks, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_INIT: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """The forward's sequential pass for one [K, BV] column block of the state (BK covers all of K): entry states
    into h, residuals into r, the final state into final. Grid (nV, N * H). INTERPRET: a while loop (Triton 3.6's
    interpreter cannot `range` over a runtime int with numpy >= 2.4)."""
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    # One key block covers all of K, so program 0's index is the value block's.
    S, rk, rv, offs0, mask = _carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
    if INTERPRET:
        i_c = 0
        while i_c < n_chunks:
            S = _delta2_step(x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks,
                             H, K, V, BT, rk, rv, PREC, PREC32)
            i_c += 1
    else:
        for i_c in range(n_chunks):
            S = _delta2_step(x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks,
                             H, K, V, BT, rk, rv, PREC, PREC32)
    tl.store(final_ptr + offs0, S, mask=mask)


@triton.jit
def _delta2_grad_step(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T, T_pad,
                      n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv,
                      READ_AFTER: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """One chunk of the reverse pass, dS = dS' = dL/dS_{c+1} on entry: store dS' into dh[c], dZ (B1, B2) into dz,
    return dS_c (B3)."""
    i_c = n_chunks - 1 - i
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(dh_ptr + offs, dS, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    P = tl.dot(q, tl.trans(x), input_precision=PREC)                                        # q_t . x_s
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)
    qf, xf = q.to(tl.float32), x.to(tl.float32)
    eta = _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    _, Lp, _ = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    du = tl.sum(P[:, :, None] * _causal_decay_3d(L, Lr, BT, READ_AFTER) * do[:, None, :], axis=0)  # [BT(s), BV]
    b0 = tl.exp(L_last[None, :] - L)
    dr = eta * (du + b0 * tl.dot(xf, dS, input_precision=PREC32))                           # (B1)
    tinv = _tinv_2(gram, eta, L, Lp, BT)
    dz = tl.sum(tinv * dr[:, None, :], axis=0)                                              # (B2) Tinv^T dr
    _store_rows(dz_ptr, dz, i_n, i_h, t, T, H, V, rv)
    return tl.exp(L_last)[None, :] * dS + tl.dot(tl.trans(qf), do * tl.exp(Lr), input_precision=PREC32) \
        - tl.dot(tl.trans(xf), dz * tl.exp(Lp), input_precision=PREC32)                     # (B3)


@triton.jit(do_not_specialize=_SIZES)
def delta2_grad_pass_kernel(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, init_ptr, dh_ptr, dz_ptr, final_ptr, T, T_pad,
                            n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, READ_AFTER: tl.constexpr, HAS_INIT: tl.constexpr,
                            INTERPRET: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """The backward's reverse pass for one [K, BV] column block of dS (BK covers all of K): dh[c] = dL/dS_{c+1},
    dz = dZ (= dL/dy), final = dL/dS_0; init: dL/dS_final (HAS_INIT) or zeros. Grid (nV, N * H)."""
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    # One key block covers all of K, so program 0's index is the value block's.
    dS, rk, rv, offs0, mask = _carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
    if INTERPRET:
        i = 0
        while i < n_chunks:
            dS = _delta2_grad_step(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                   T_pad, n_chunks, H, K, V, BT, rk, rv, READ_AFTER, PREC, PREC32)
            i += 1
    else:
        for i in range(n_chunks):
            dS = _delta2_grad_step(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                   T_pad, n_chunks, H, K, V, BT, rk, rv, READ_AFTER, PREC, PREC32)
    tl.store(final_ptr + offs0, dS, mask=mask)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_v_2_kernel(q_ptr, x_ptr, y_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr, dz_ptr, dy_ptr, deta_ptr,
                    dlg_ptr, T, T_pad, n_chunks, H,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    READ_AFTER: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """dy (= dZ), d eta (B6) and d log_gamma (B7) for a [BT, BV] block, with S_c = h[c], dS' = dh[c]; recomputes o.
    Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    P = tl.zeros([BT, BT], dtype=tl.float32)                                                # q_t . x_s
    gram = tl.zeros([BT, BT], dtype=tl.float32)                                             # x_t . x_s
    qS = tl.zeros([BT, BV], dtype=tl.float32)                                               # q_t^T S_c
    xdS = tl.zeros([BT, BV], dtype=tl.float32)                                              # x_s^T dS'
    s_dot = tl.zeros([BV], dtype=tl.float32)                                                # <dS'[:, j], S_c[:, j]>
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        P += tl.dot(q, tl.trans(x), input_precision=PREC)
        gram += tl.dot(x, tl.trans(x), input_precision=PREC)
        qS += tl.dot(q.to(tl.float32), S, input_precision=PREC32)
        xdS += tl.dot(x.to(tl.float32), dS, input_precision=PREC32)
        s_dot += tl.sum(S * dS, axis=0)
    L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    _, Lp, _ = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    r = _load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                         # fp32
    eta = _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    dz = _load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                       # fp32
    u = eta * r
    PD = P[:, :, None] * _causal_decay_3d(L, Lr, BT, READ_AFTER)                            # [BT(t), BT(s), BV]
    du = tl.sum(PD * do[:, None, :], axis=0)                                                # [BT(s), BV]
    o = tl.exp(Lr) * qS + tl.sum(PD * u[None, :, :], axis=1)                                # (F5) recomputed
    GA = gram[:, :, None] * _causal_decay_3d(L, Lp, BT, False)                              # G Ad
    GAdZ = tl.sum(GA * dz[:, None, :], axis=0)                                              # [BT(s), BV]
    b0 = tl.exp(L_last[None, :] - L)
    deta = r * (du + b0 * xdS - GAdZ)                                                       # (B6)
    dL = -eta * deta
    dLp = -dz * (y - r)
    dLr = do * o
    dL_last = tl.exp(L_last) * s_dot + tl.sum(b0 * u * xdS, axis=0)
    dlg = tl.cumsum(dL + dLp + dLr, axis=0, reverse=True) - dLp + dL_last[None, :]          # (B7)
    if not READ_AFTER:
        dlg -= dLr
    _store_rows(dy_ptr, dz, i_n, i_h, t, T, H, V, rv)
    _store_rows(deta_ptr, deta, i_n, i_h, t, T, H, V, rv)
    _store_rows(dlg_ptr, dlg, i_n, i_h, t, T, H, V, rv)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_qx_2_kernel(q_ptr, x_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr, dz_ptr, dq_ptr, dx_ptr,
                     T, T_pad, n_chunks, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     READ_AFTER: tl.constexpr, PREC32: tl.constexpr):
    """(B4, B5) dq and dx for a [BT, BK] block, summing over all value tiles. Grid (nK, n_chunks, N * H)."""
    i_k, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = i_k * BK + tl.arange(0, BK)
    qf = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    xf = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dG = tl.zeros([BT, BT], dtype=tl.float32)                                               # dL/dG (strictly lower)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dx = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        L, Lr, L_last = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
        _, Lp, _ = _decays_2a(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
        r = _load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        eta = _load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
        do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
        dz = _load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                   # fp32
        u = eta * r
        dP += tl.sum(_causal_decay_3d(L, Lr, BT, READ_AFTER) * u[None, :, :] * do[:, None, :], axis=2)
        dG -= tl.sum(_causal_decay_3d(L, Lp, BT, False) * dz[:, None, :] * u[None, :, :], axis=2)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dq += tl.dot(do * tl.exp(Lr), tl.trans(S), input_precision=PREC32)
        dx += tl.dot(u * tl.exp(L_last[None, :] - L), tl.trans(dS), input_precision=PREC32) \
            - tl.dot(dz * tl.exp(Lp), tl.trans(S), input_precision=PREC32)
    dq += tl.dot(dP, xf, input_precision=PREC32)
    dx += tl.dot(tl.trans(dP), qf, input_precision=PREC32) + tl.dot(dG + tl.trans(dG), xf, input_precision=PREC32)
    _store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    _store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
