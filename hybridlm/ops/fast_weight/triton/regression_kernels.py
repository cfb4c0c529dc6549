"""The regression family's kernels (rules 1, 3 and 2): the sequential residual / state passes and the backward's
reverse pass and per-chunk gradients. The WY factors are `wy.py`'s, the outputs (and the chunk-local part of dr)
the output stage's (`chunk_output.py`) with the residuals r in place of y.

Rules 1 and 3 (scalar decay). The rows are write events, SLOTS per step (a power of two, a constexpr): rule 1 has
one (SLOTS = 1); rule 3 lays each step's window out in time as (s, slot 0), ..., (s, slot SLOTS - 1), padded with
zero-weight events (`backend.py`), the step's decay on slot 0. The two differ only in which state a residual reads:
rule 3's events of one step do not see each other's writes, and all of them read S_{s-1}, before the step's decay
(README.md of the parent folder, "Write events"). Chunks hold whole steps (BT is a multiple of SLOTS), so a chunk's
entry state never holds part of a step.

Per (n, h) and chunk c of BT events, with chunk-local L_t = sum_{r<=t} log gamma_r, st(t) = t // SLOTS the step of
event t, Lp_t = L_{SLOTS st(t) - 1} the log decay of the state its residual reads (0 in the chunk's first step;
L_{t-1} for SLOTS = 1), Lr_t = L_t (read after) or L_{t-1} (read before, 0 at t = 0), M[t, s] = [s <= t] (after) or
[s < t] (before), b_s = exp(L_last - L_s) eta_s, S = S_c the entry state:

    A[s, s'] = [st(s') < st(s)] exp(Lp_s - L_s') eta_s' (x_s . x_s')         (strictly lower, [BT, BT])  (F1)
    Tinv = (I + A)^-1 (blocked: `wy.py`)    U = Tinv Y    W = Tinv diag(exp Lp) X                      (F2)
    r = U - W S = Tinv Z,   Z = Y - diag(exp Lp) X S                                                       (F3)
    S_{c+1} = exp(L_last) S + X^T diag(b) r                                                                (F4)
    o_t = exp(Lr_t) S^T q_t + sum_s M[t, s] exp(Lr_t - L_s) eta_s (q_t . x_s) r_s                          (F5)

(F1/F3 are r_t = y_t - S_{before t}^T x_t with S_{before t} = exp(Lp_t) S + sum_{s: st(s) < st(t)} exp(Lp_t - L_s)
eta_s x_s r_s^T: for rule 3 the state after the last event of the step before, whose L is Lp_t since the later slots
of a step do not decay.) Backward (dO given, dS' = dL/dS_{c+1} from the chunk after; the derivation, equation by
equation):

    dr_s = sum_t M exp(Lr_t - L_s) eta_s (q_t . x_s) dO_t + b_s dS'^T x_s            (F5, F4 in r)         (B1)
    dZ = Tinv^T dr,  dY = dZ,   dA = -dZ r^T on st(s') < st(s)                       (F3: (I + A) r = Z)    (B2)
    dS_c = exp(L_last) dS' + sum_t exp(Lr_t) q_t dO_t^T - X^T diag(exp Lp) dZ        (F4, F5, F3 in S)     (B3)
    dq_t = exp(Lr_t) S dO_t + sum_s G[t, s] eta_s x_s,   G[t, s] = M exp(Lr_t - L_s) (dO_t . r_s)         (B4)
    dx_s = eta_s (sum_t G[t, s] q_t + exp(L_last - L_s) dS' r_s)                     (F5, F4: rule 1A's)
           - exp(Lp_s) S dZ_s                                                          (F3)
           + sum_s' (dGr[s, s'] + dGr[s', s]) x_s',  dGr[s, s'] = dA[s, s'] exp(Lp_s - L_s') eta_s'   (F1) (B5)
    deta_s = x_s . (sum_t G[t, s] q_t + exp(L_last - L_s) dS' r_s)                   (F5, F4)
             + sum_s'' dA[s'', s] exp(Lp_s'' - L_s) (x_s'' . x_s)                     (F1, column s)       (B6)

The log decays: with E[s, s'] = dA[s, s'] A[s, s'] (F1 depends on Lp_s and -L_s'),
    dL/dL_t  (direct) = [after] q_t . dq_t - eta_t x_t . (rule 1A's dxt_t) - sum_s E[s, t]
    dL/dLr_t (before) = q_t . dq_t                                                   (F5 in Lr_t = L_{t-1})
    dL/dLp_t (direct) = sum_s' E[t, s'] - exp(Lp_t) x_t^T S dZ_t                    (F1, F3 in Lp)
    dL/dL_last       += <dS', S_{c+1}> = exp(L_last) <dS', S> + sum_s b_s x_s . (dS' r_s)         (F4)
and L_t = sum_{r<=t} lg_r, L_{t-1} = sum_{r<t} lg_r, Lp_t = sum_{r<SLOTS st(t)} lg_r give
    dlg_r = sum_{t>=r} dL/dL_t + [before] sum_{t>r} q_t . dq_t + sum_{t: st(t) > st(r)} dL/dLp_t
            + <dS', S_{c+1}>                                                                              (B7)
(every term of o_t that q_t enters carries exp(Lr_t); every term that x_s enters through F4/F5 carries exp(-L_s)).
With SLOTS = 1, Lp_t = L_{t-1} (= Lr_t when reading before) and st(t) > st(r) is t > r, so B7 is one reverse
cumulative sum over the chunk: dlg_r = sum_{t>=r} (dL/dL_t + dL/dLp_t) - dL/dLp_r + <dS', S_{c+1}>, with
[before] q_t . dq_t counted in dL/dLp_t. With SLOTS > 1 the sum over the later steps is a masked [BT, BT] column sum.

Stages: `delta_pass_kernel` runs F3 and F4 sequentially over the chunks (from `wy.py`'s U and W). Backward:
`delta_grad_pass_kernel` runs B1 (its dS' term; the chunk-local term comes from `chunk_output.grad_y_kernel`),
B2's dZ and B3, sequentially from the last chunk; then, for all chunks in parallel, `delta_grad_q_kernel` runs B4
(and q_t . dq_t), `delta_grad_state_kernel` the terms of B5-B7 that read S and dS' (over 64-column blocks of the
states: dS' r_s, S dZ_s and their dot products with x_s), and `delta_grad_kernel` the rest of B5-B7 with B2's dA,
walking K in 64-column blocks. Neither of these two holds a [BT, K] accumulator beside [BT, BT] ones: together they
spill registers. Buffers: residuals r, dr and dZ [N, T, H, V] float32 (the layout of y); the state terms of dx
[N, T, H, K] float32 and their column blocks' parts [nK, 3, N * H, T_pad] float32; per-chunk entry states
[N * H, n_chunks, K, V] (the forward's stored in the inputs' dtype for the outputs alone, the backward's
recomputed in float32) and their gradients dS' float32.

Rule 2 (regression with step sizes and log decays per value column, window 1). Each value column j runs its own
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

F5 is rule 2A's output with y replaced by the residuals r (`chunk_output.output_columns_kernel`). Backward, with dO
and dS' = dL/dS_{c+1} (rule 1's derivation above, per column; D[t, s, j] = M exp(Lr[t, j] - L[s, j]),
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
exponential, as for rule 2A; the intra-chunk tensors are O(BT^2 BV), so the backend runs chunks of 16.

Stages: `delta2_pass_kernel` (F1-F4, sequential over chunks, per value block, all of K: entry states, residuals r,
final state); the outputs (`chunk_output.output_columns_kernel` on r); `delta2_grad_pass_kernel` (B1-B3, sequential
in reverse: dS' of every chunk into dh, dZ, dS_0); then all chunks in parallel `grad_v_2_kernel` (dy, d eta,
d log_gamma per value tile) and `grad_qx_2_kernel` (dq, dx per key tile). The residuals and dZ are float32
[N, T, H, V] (the layout of y); per-chunk states [N * H, n_chunks, K, V] float32. (I + A)^-1 is recomputed in each
pass rather than stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunk_state import carried_block
from hybridlm.ops.fast_weight.triton.chunking import KEY, SIZES, autotuned
from hybridlm.ops.fast_weight.triton.decays import (
    causal_decay,
    causal_decay_columns,
    chunk_decays,
    column_decays,
    earlier_steps,
    residual_decays,
)
from hybridlm.ops.fast_weight.triton.wy import buffer_offsets, tinv_columns
from hybridlm.ops.triton_utils import load_rows, load_steps, state_offsets, store_rows


@triton.jit
def _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks, H,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, PREC32: tl.constexpr):
    """(F3, F4) One chunk: record the entry state S, r = U - W S (stored), return exp(L_last) S + X^T (coef r)."""
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S.to(h_ptr.dtype.element_ty), mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    w_offs, w_mask = buffer_offsets(i_nh, t, T_pad, K, rk)
    u_offs, u_mask = buffer_offsets(i_nh, t, T_pad, V, rv)
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)                                     # [BT, BK]
    u = tl.load(u_ptr + u_offs, mask=u_mask, other=0.0).to(tl.float32)                      # [BT, BV]
    r = u - tl.dot(w, S, input_precision=PREC32)
    store_rows(r_ptr, r, i_n, i_h, t, T, H, V, rv)
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                         # [BT, BK]
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, _, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, True)
    coef = tl.exp(L_last - L) * eta
    return tl.exp(L_last) * S + tl.dot(tl.trans(x * coef[:, None]), r, input_precision=PREC32)


@triton.jit(do_not_specialize=SIZES)
def delta_pass_kernel(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, init_ptr, h_ptr, r_ptr, final_ptr, T, T_pad, n_chunks,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """The sequential pass over chunks for one [K, BV] column block of the state (BK covers all of K, since
    r = U - W S needs every row of S): entry states into h, residuals into r, the final state into final.
    Grid (nV, N * H); states, residuals and the products' factors float32. INTERPRET: a while loop (see
    `chunk_state.state_scan_kernel`)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = state_offsets(i_nh, 0, 1, K, V, rk, rv)
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


@triton.jit
def _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T, T_pad,
                     n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SLOTS: tl.constexpr, rk, rv,
                     PREC32: tl.constexpr):
    """One chunk of the reverse pass, dS = dS' = dL/dS_{c+1} on entry: swap h[c] (sum_t exp(Lr_t) q_t dO_t^T) for
    dS', finish dr (B1), store dZ = Tinv^T dr (B2) and return dS_c (B3)."""
    i_c = n_chunks - 1 - i
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    dcontrib = tl.load(dh_ptr + offs, mask=mask, other=0.0)
    tl.store(dh_ptr + offs, dS, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                         # [BT, BK]
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, L_last = residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    dr = load_rows(dr_ptr, i_n, i_h, t, T, H, V, rv) \
        + (tl.exp(L_last - L) * eta)[:, None] * tl.dot(x, dS, input_precision=PREC32)       # (B1) [BT, BV]
    tinv_offs, tinv_mask = buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tinv = tl.load(tinv_ptr + tinv_offs, mask=tinv_mask, other=0.0)                         # [BT, BT]
    dz = tl.dot(tl.trans(tinv), dr, input_precision=PREC32)                                 # (B2)
    store_rows(dz_ptr, dz, i_n, i_h, t, T, H, V, rv)
    xs = x * tl.exp(Lp)[:, None]
    return tl.exp(L_last) * dS + dcontrib - tl.dot(tl.trans(xs), dz, input_precision=PREC32)  # (B3)


@triton.jit(do_not_specialize=SIZES)
def delta_grad_pass_kernel(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, init_ptr, dh_ptr, dz_ptr, final_ptr, T, T_pad,
                           n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, SLOTS: tl.constexpr, HAS_INIT: tl.constexpr, INTERPRET: tl.constexpr,
                           PREC32: tl.constexpr):
    """The reverse pass over chunks for one [K, BV] column block of dS (B3 acts on the rows of dS, so column blocks
    are independent; BK covers all of K). On entry dh[c] = sum_t exp(Lr_t) q_t dO_t^T and dr holds the chunk-local
    part of B1; on exit dh[c] = dL/dS_{c+1}, dz = dZ (B2), final = dL/dS_0. init: dL/dS_final (HAS_INIT) or zeros.
    Grid (nV, N * H); float32 buffers and factors. INTERPRET: a while loop (see
    `chunk_state.state_scan_kernel`)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = state_offsets(i_nh, 0, 1, K, V, rk, rv)
    if HAS_INIT:
        dS = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    if INTERPRET:
        i = 0
        while i < n_chunks:
            dS = _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                  T_pad, n_chunks, H, K, V, BT, SLOTS, rk, rv, PREC32)
            i += 1
    else:
        for i in range(n_chunks):
            dS = _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                  T_pad, n_chunks, H, K, V, BT, SLOTS, rk, rv, PREC32)
    tl.store(final_ptr + offs0, dS, mask=mask)


@autotuned(["K", "V", "BT", "READ_AFTER"])
@triton.jit(do_not_specialize=SIZES)
def delta_grad_q_kernel(q_ptr, x_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dq_ptr, qdq_ptr, T, T_pad, n_chunks, H,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        READ_AFTER: tl.constexpr, PREC32: tl.constexpr):
    """(B4) dq_t = exp(Lr_t) S dO_t + sum_s G[t, s] eta_s x_s with S = h[c], and q_t . dq_t (float32 [N, T, H], for
    B7). BK covers all of K. Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    dOr = tl.zeros([BT, BT], dtype=tl.float32)                                              # dO_t . r_s
    dq = tl.zeros([BT, BK], dtype=tl.float32)                                               # S dO_t
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                    # [BT, BV]
        r = load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dOr += tl.dot(do, tl.trans(r), input_precision=PREC32)
        dq += tl.dot(do, tl.trans(S), input_precision=PREC32)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, _ = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    G = dOr * causal_decay(L, Lr, BT, READ_AFTER)                                          # [BT(t), BT(s)]
    xf = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    dq = dq * tl.exp(Lr)[:, None] + tl.dot(G * eta[None, :], xf, input_precision=PREC32)
    qf = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
    store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    tl.store(qdq_ptr + (i_n.to(tl.int64) * T + t) * H + i_h, tl.sum(qf * dq, axis=1), mask=t < T)


@autotuned(["K", "V", "BT", "SLOTS"])
@triton.jit(do_not_specialize=SIZES)
def delta_grad_state_kernel(x_ptr, r_ptr, eta_ptr, L_ptr, h_ptr, dh_ptr, dz_ptr, dxs_ptr, part_ptr, T, T_pad,
                            n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, SLOTS: tl.constexpr, PREC32: tl.constexpr):
    """The terms of B5-B7 that read the chunk's states, for one [BT, BK] column block of dx: with S = h[c] (entry
    state) and dS' = dh[c],

        dxs_s = exp(L_last - L_s) eta_s dS' r_s - exp(Lp_s) S dZ_s                    (B5's F4 and F3 terms)

    into dxs (float32, the layout of x), and the block's parts of the sums over K that B6/B7 need: x_s . (dS' r_s),
    x_s^T S dZ_s [BT] and <dS', S> (one number per chunk, in the chunk's first row), into part
    [nK, 3, N * H, T_pad]. Grid (nK, n_chunks, N * H): the states' rows are split over programs, so that no program
    holds a [BT, K] accumulator beside the [BT, BT] ones of `delta_grad_kernel` (together they spill registers)."""
    i_k, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = i_k * BK + tl.arange(0, BK)
    dSr = tl.zeros([BT, BK], dtype=tl.float32)                                              # dS' r_s  (rows s)
    SdZ = tl.zeros([BT, BK], dtype=tl.float32)                                              # S dZ_s
    s_dot = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        r = load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # [BT, BV] fp32
        dz = load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dSr += tl.dot(r, tl.trans(dS), input_precision=PREC32)
        SdZ += tl.dot(dz, tl.trans(S), input_precision=PREC32)
        s_dot += tl.sum(S * dS, axis=1)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, L_last = residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    dxs = (tl.exp(L_last - L) * eta)[:, None] * dSr - tl.exp(Lp)[:, None] * SdZ
    store_rows(dxs_ptr, dxs, i_n, i_h, t, T, H, K, rk)
    xf = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    NH = tl.num_programs(2)
    tl.store(_part_row(part_ptr, i_k, 0, NH, i_nh, T_pad) + t, tl.sum(xf * dSr, axis=1))
    tl.store(_part_row(part_ptr, i_k, 1, NH, i_nh, T_pad) + t, tl.sum(xf * SdZ, axis=1))
    tl.store(_part_row(part_ptr, i_k, 2, NH, i_nh, T_pad) + t, tl.sum(s_dot, axis=0) + tl.zeros([BT], tl.float32),
             mask=tl.arange(0, BT) == 0)  # one number per chunk, in its first row (the only one read)


@triton.jit
def _part_row(part_ptr, i_k, j, NH, i_nh, T_pad):
    """Row (i_k, j, i_nh) of the [nK, 3, N * H, T_pad] buffer of `delta_grad_state_kernel`'s parts."""
    return part_ptr + ((i_k * 3 + j) * NH + i_nh).to(tl.int64) * T_pad


@autotuned(["K", "V", "BT", "READ_AFTER", "SLOTS", "N_PARTS"])
@triton.jit(do_not_specialize=SIZES)
def delta_grad_kernel(q_ptr, x_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, dz_ptr, qdq_ptr, dxs_ptr, part_ptr,
                      dx_ptr, deta_ptr, dlg_ptr, dy_ptr, T, T_pad, n_chunks, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      READ_AFTER: tl.constexpr, SLOTS: tl.constexpr, N_PARTS: tl.constexpr,
                      STORE_DY: tl.constexpr, PREC32: tl.constexpr):
    """(B2's dA, B5-B7) dx, d eta and d log_gamma of one chunk, from the residuals r, dZ, q_t . dq_t
    (`delta_grad_q_kernel`) and the state terms that `delta_grad_state_kernel` wrote (dxs, and its N_PARTS column
    blocks' parts of x_s . (dS' r_s), x_s^T S dZ_s and <dS', S>). BK: the column block of K (N_PARTS of them
    cover K), as the state kernel's. STORE_DY: dy = dZ (B2) stored in dy's dtype as it is read (16-bit inputs;
    float32 ones take the float32 dZ itself). Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    dOr = tl.zeros([BT, BT], dtype=tl.float32)                                              # dO_t . r_s
    dZr = tl.zeros([BT, BT], dtype=tl.float32)                                              # dZ_s . r_s'
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                    # [BT, BV]
        r = load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        dz = load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                   # fp32
        if STORE_DY:
            store_rows(dy_ptr, dz, i_n, i_h, t, T, H, V, rv)
        dOr += tl.dot(do, tl.trans(r), input_precision=PREC32)
        dZr += tl.dot(dz, tl.trans(r), input_precision=PREC32)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    _, Lp, _ = residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    out_decay = tl.exp(L_last - L)                                                          # [BT]
    start = tl.exp(Lp)
    earlier = earlier_steps(BT, SLOTS)                                                     # st(s') < st(s)
    decay = tl.exp(tl.where(earlier, Lp[:, None] - L[None, :], float("-inf")))
    dA_decay = -dZr * decay                                                                 # B2's dA exp(Lp_s - L_s')
    # The Gram matrix x_s . x_s' first (one pass over K), and the terms of B6 / B7 that read it, so that the pass
    # over K for dx below holds two [BT, BT] tiles (G and dGr + dGr^T) beside its accumulators, not four.
    gram = tl.zeros([BT, BT], dtype=tl.float32)                                             # x_s . x_s'
    for i_k in tl.static_range(N_PARTS):
        rk = i_k * BK + tl.arange(0, BK)
        xf = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                    # [BT, BK]
        gram += tl.dot(xf, tl.trans(xf), input_precision=PREC32)
    deta_gram = tl.sum(dA_decay * gram, axis=0)                                             # (B6)'s F1 term
    dGr = dA_decay * eta[None, :]
    E = dGr * gram                                                                          # dA * A
    E_rows, E_cols = tl.sum(E, axis=1), tl.sum(E, axis=0)
    dGr_sym = dGr + tl.trans(dGr)
    G = dOr * causal_decay(L, Lr, BT, READ_AFTER)                                          # [BT(t), BT(s)]
    # Over column blocks of K (BK = delta_grad_state_kernel's, whose parts are summed here): dx of rule 1A's part
    # of B5 (eta_s dxt_s, dxt_s = sum_t G[t, s] q_t + exp(L_last - L_s) dS' r_s, the second term in dxs) plus its
    # F1 term; the sum over K of x_s . dxt_s.
    x_dxt = tl.zeros([BT], dtype=tl.float32)                                                # x_s . sum_t G q_t
    x_dSr = tl.zeros([BT], dtype=tl.float32)                                                # x_s . (dS' r_s)
    x_SdZ = tl.zeros([BT], dtype=tl.float32)                                                # x_s^T S dZ_s
    s_dot = 0.0                                                                             # <dS', S>
    NH = tl.num_programs(1)
    for i_k in tl.static_range(N_PARTS):
        x_dSr += tl.load(_part_row(part_ptr, i_k, 0, NH, i_nh, T_pad) + t)
        x_SdZ += tl.load(_part_row(part_ptr, i_k, 1, NH, i_nh, T_pad) + t)
        s_dot += tl.load(_part_row(part_ptr, i_k, 2, NH, i_nh, T_pad) + i_c * BT)
        rk = i_k * BK + tl.arange(0, BK)
        xf = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                    # [BT, BK]
        qf = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
        dxt_attn = tl.dot(tl.trans(G), qf, input_precision=PREC32)                          # sum_t G[t, s] q_t
        x_dxt += tl.sum(xf * dxt_attn, axis=1)
        dx = load_rows(dxs_ptr, i_n, i_h, t, T, H, K, rk) + dxt_attn * eta[:, None] \
            + tl.dot(dGr_sym, xf, input_precision=PREC32)
        store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
    deta = x_dxt + out_decay * x_dSr                                                        # x_s . dxt_s
    x_dx = eta * deta                                                                       # x_s . (eta_s dxt_s)
    exit_term = tl.exp(L_last) * s_dot + tl.sum(out_decay * eta * x_dSr, axis=0)           # <dS', S_{c+1}>
    deta += deta_gram                                                                       # (B6)
    # B7.
    q_dq = load_steps(qdq_ptr, i_n, i_h, t, T, H)
    dL = -x_dx - E_cols
    dLp = E_rows - start * x_SdZ
    if READ_AFTER:
        dL += q_dq
    if SLOTS == 1:  # Lp_t = L_{t-1} = Lr_t (before): one reverse cumulative sum
        if not READ_AFTER:
            dLp += q_dq
        dlg = tl.cumsum(dL + dLp, axis=0, reverse=True) - dLp + exit_term
    else:  # sum_{t: st(t) > st(r)} dL/dLp_t: column r of `earlier` marks the events t of the later steps
        dlg = tl.cumsum(dL, axis=0, reverse=True) + tl.sum(tl.where(earlier, dLp[:, None], 0.0), axis=0) \
            + exit_term
        if not READ_AFTER:  # Lr_t = L_{t-1}
            dlg += tl.cumsum(q_dq, axis=0, reverse=True) - q_dq
    scalar_offs = (i_n.to(tl.int64) * T + t) * H + i_h
    tl.store(deta_ptr + scalar_offs, deta.to(deta_ptr.dtype.element_ty), mask=t < T)
    tl.store(dlg_ptr + scalar_offs, dlg.to(dlg_ptr.dtype.element_ty), mask=t < T)


@triton.jit
def _delta2_step(x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, PREC: tl.constexpr,
                 PREC32: tl.constexpr):
    """(F1-F4) One chunk: record the entry state S, the residuals r (stored), return S_{c+1}."""
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)                                     # [BT, BT] fp32
    xf = x.to(tl.float32)
    y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                          # [BT, BV]
    eta = load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    L, Lp, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    tinv = tinv_columns(gram, eta, L, Lp, BT)                                                    # [BT, BT, BV]
    z = y - tl.exp(Lp) * tl.dot(xf, S, input_precision=PREC32)
    r = tl.sum(tinv * z[None, :, :], axis=1)                                                # [BT, BV]
    store_rows(r_ptr, r, i_n, i_h, t, T, H, V, rv)
    coef = tl.exp(L_last[None, :] - L) * eta
    return tl.exp(L_last)[None, :] * S + tl.dot(tl.trans(xf), coef * r, input_precision=PREC32)


@triton.jit(do_not_specialize=SIZES)
def delta2_pass_kernel(x_ptr, y_ptr, eta_ptr, L_ptr, init_ptr, h_ptr, r_ptr, final_ptr, T, T_pad, n_chunks, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_INIT: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """The forward's sequential pass for one [K, BV] column block of the state (BK covers all of K): entry states
    into h, residuals into r, the final state into final. Grid (nV, N * H). INTERPRET: a while loop (Triton's
    interpreter cannot `range` over a runtime int with numpy >= 2.4)."""
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    # One key block covers all of K, so program 0's index is the value block's.
    S, rk, rv, offs0, mask = carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
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
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(dh_ptr + offs, dS, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    P = tl.dot(q, tl.trans(x), input_precision=PREC)                                        # q_t . x_s
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)
    qf, xf = q.to(tl.float32), x.to(tl.float32)
    eta = load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    _, Lp, _ = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    du = tl.sum(P[:, :, None] * causal_decay_columns(L, Lr, BT, READ_AFTER) * do[:, None, :], axis=0)  # [BT(s), BV]
    b0 = tl.exp(L_last[None, :] - L)
    dr = eta * (du + b0 * tl.dot(xf, dS, input_precision=PREC32))                           # (B1)
    tinv = tinv_columns(gram, eta, L, Lp, BT)
    dz = tl.sum(tinv * dr[:, None, :], axis=0)                                              # (B2) Tinv^T dr
    store_rows(dz_ptr, dz, i_n, i_h, t, T, H, V, rv)
    return tl.exp(L_last)[None, :] * dS + tl.dot(tl.trans(qf), do * tl.exp(Lr), input_precision=PREC32) \
        - tl.dot(tl.trans(xf), dz * tl.exp(Lp), input_precision=PREC32)                     # (B3)


@triton.jit(do_not_specialize=SIZES)
def delta2_grad_pass_kernel(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, init_ptr, dh_ptr, dz_ptr, final_ptr, T, T_pad,
                            n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, READ_AFTER: tl.constexpr, HAS_INIT: tl.constexpr,
                            INTERPRET: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """The backward's reverse pass for one [K, BV] column block of dS (BK covers all of K): dh[c] = dL/dS_{c+1},
    dz = dZ (= dL/dy), final = dL/dS_0; init: dL/dS_final (HAS_INIT) or zeros. Grid (nV, N * H)."""
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    # One key block covers all of K, so program 0's index is the value block's.
    dS, rk, rv, offs0, mask = carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
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


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
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
        q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        P += tl.dot(q, tl.trans(x), input_precision=PREC)
        gram += tl.dot(x, tl.trans(x), input_precision=PREC)
        qS += tl.dot(q.to(tl.float32), S, input_precision=PREC32)
        xdS += tl.dot(x.to(tl.float32), dS, input_precision=PREC32)
        s_dot += tl.sum(S * dS, axis=0)
    L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    _, Lp, _ = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
    y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    r = load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                         # fp32
    eta = load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    dz = load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                       # fp32
    u = eta * r
    PD = P[:, :, None] * causal_decay_columns(L, Lr, BT, READ_AFTER)                            # [BT(t), BT(s), BV]
    du = tl.sum(PD * do[:, None, :], axis=0)                                                # [BT(s), BV]
    o = tl.exp(Lr) * qS + tl.sum(PD * u[None, :, :], axis=1)                                # (F5) recomputed
    GA = gram[:, :, None] * causal_decay_columns(L, Lp, BT, False)                              # G Ad
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
    store_rows(dy_ptr, dz, i_n, i_h, t, T, H, V, rv)
    store_rows(deta_ptr, deta, i_n, i_h, t, T, H, V, rv)
    store_rows(dlg_ptr, dlg, i_n, i_h, t, T, H, V, rv)


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
def grad_qx_2_kernel(q_ptr, x_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr, dz_ptr, dq_ptr, dx_ptr,
                     T, T_pad, n_chunks, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     READ_AFTER: tl.constexpr, PREC32: tl.constexpr):
    """(B4, B5) dq and dx for a [BT, BK] block, summing over all value tiles. Grid (nK, n_chunks, N * H)."""
    i_k, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = i_k * BK + tl.arange(0, BK)
    qf = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    xf = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dG = tl.zeros([BT, BT], dtype=tl.float32)                                               # dL/dG (strictly lower)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dx = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
        _, Lp, _ = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, False)
        r = load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        eta = load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
        do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
        dz = load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                   # fp32
        u = eta * r
        dP += tl.sum(causal_decay_columns(L, Lr, BT, READ_AFTER) * u[None, :, :] * do[:, None, :], axis=2)
        dG -= tl.sum(causal_decay_columns(L, Lp, BT, False) * dz[:, None, :] * u[None, :, :], axis=2)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dq += tl.dot(do * tl.exp(Lr), tl.trans(S), input_precision=PREC32)
        dx += tl.dot(u * tl.exp(L_last[None, :] - L), tl.trans(dS), input_precision=PREC32) \
            - tl.dot(dz * tl.exp(Lp), tl.trans(S), input_precision=PREC32)
    dq += tl.dot(dP, xf, input_precision=PREC32)
    dx += tl.dot(tl.trans(dP), qf, input_precision=PREC32) + tl.dot(dG + tl.trans(dG), xf, input_precision=PREC32)
    store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
