"""The inner-product family's gradient kernels (rules 1A and 2A; rule 3A runs on 1A's): dq, dx, d eta and
d log_gamma of every chunk, in parallel, once the state stages (`chunk_state.py`) have given each chunk's entry state
S_c = h[c] and the gradient of its exit state dS_out = dh[c]. Rule 1A's dy comes from the same kernel as its dq and dx
(`grad_qxy_kernel`; (3'') in `chunk_output.py`); rule 2A's from `grad_v_2a_kernel`.

Rule 1A (scalar decay; L, Lr, L_last, M as in `chunk_output.py`):

    dq_t   = exp(Lr_t) S_c dO_t + sum_s G[t, s] eta_s x_s          G[t, s] = M exp(Lr_t - L_s) (dO_t . y_s)
    dxt_s  = sum_t G[t, s] q_t + exp(L_last - L_s) dS_out y_s      dx_s = eta_s dxt_s,  deta_s = x_s . dxt_s
    dlog_gamma_r = sum_{t >= r} (q_t . dq_t) [t > r when reading before] - sum_{t >= r} (x_t . dx_t)
                   + <dS_out, S_{c+1}>                                                                         (3')

Rule 2A (S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * y_t)^T, eta and log_gamma per value column).
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
O(BT^2 BV) exponentials per (chunk, value tile), which is why the backend runs 2A with chunks of 16 (as the torch
chunk path's PER_COLUMN_MAX_CHUNK). The inter-chunk factors exp(Lr), exp(L_last - L), exp(L_last) are <= 1 as well.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunk_output import scores_and_read
from hybridlm.ops.fast_weight.triton.chunking import KEY, SIZES, XY_SIZES, autotuned
from hybridlm.ops.fast_weight.triton.decays import causal_decay, causal_decay_columns, chunk_decays, column_decays
from hybridlm.ops.triton_utils import autotune, load_rows, load_steps, row_views, state_offsets, store_rows


# 4 warps and 3 pipeline stages: two programs per SM by registers (8 warps fit one), and 3 stages overlap the walks'
# loads (K = V = 128, chunk 64: benchmarks/RESULTS.md).
@autotune(KEY, fixed_warps=4, fixed_stages=3, tuned_stages=(1, 2, 3))
@triton.jit(do_not_specialize=[*XY_SIZES, "NTH"])
def grad_qxy_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr,
                    dq_ptr, dx_ptr, dy_ptr, deta_ptr, dlg_ptr, T, T_xy, T_pad, n_chunks, H, NTH,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(3') and (3'') Per chunk, with S_c = h[c] (entry state) and dS_out = dh[c] (gradient of the chunk's exit
    state):

        dq_t   = exp(Lr_t) S_c dO_t + sum_s G[t, s] eta_s x_s          G[t, s] = M exp(Lr_t - L_s) (dO_t . y_s)
        dxt_s  = sum_t G[t, s] q_t + exp(L_last - L_s) dS_out y_s      dx_s = eta_s dxt_s,  deta_s = x_s . dxt_s
        dy_s   = sum_t A[t, s] dO_t + exp(L_last - L_s) eta_s dS_out^T x_s
                                                                       A[t, s] = M exp(Lr_t - L_s) eta_s (q_t . x_s)
        dlog_gamma_r = sum_{t >= r} (q_t . dq_t) [t > r when reading before] - sum_{t >= r} (x_t . dx_t)
                       + <dS_out, S_{c+1}>

    (every term of o_t carries exp(Lr_t) and is linear in q_t; every term that x_s enters carries exp(-L_s);
    the exit state carries exp(L_last), and <dS_out, S_{c+1}> = exp(L_last) <dS_out, S_c> + sum_s x_s . dx_s^out).
    Program p of a chunk takes key block p (BK columns of dq and dx, walking the value blocks) and value block p
    (BV columns of dy, walking the key blocks), as flash-linear-attention's chunked backward splits its dq / dk by
    key block: a program holds [BT, BK] float32 accumulators instead of [BT, K] ones, so that two programs of 4 warps
    fit an SM. The blocks that p's siblings also read (dO and y for dq and dx; q, x and dS_out for dy) are launched
    side by side and mostly read from L2. d eta and d log_gamma are sums over the key blocks: program
    p writes its block's share to row p of the [K / BK, N, T, H] buffers deta and dlg (dlog_gamma is linear in the
    row sums q_t . dq_t, x_t . dx_t and in the exit term), which the launcher sums. x, y, dx and dy have T_xy >= T
    rows, of which the first T are read and written; NTH = N T H. Grid (max(K / BK, V / BV), n_chunks, N * H)."""
    i_p, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    x_ptr, y_ptr = row_views(x_ptr, y_ptr, i_n, T, T_xy, H, K, V)
    dx_ptr, dy_ptr = row_views(dx_ptr, dy_ptr, i_n, T, T_xy, H, K, V)
    t = i_c * BT + tl.arange(0, BT)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    M = causal_decay(L, Lr, BT, READ_AFTER)                                                 # [BT(t), BT(s)]
    out_coef = tl.exp(L_last - L)                                                           # [BT]
    if i_p < tl.cdiv(K, BK):  # (3'): dq, dx and this key block's share of d eta, d log_gamma
        rk = i_p * BK + tl.arange(0, BK)
        q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                     # [BT, BK]
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        dA = tl.zeros([BT, BT], dtype=tl.float32)                                           # dO_t . y_s
        dq_inter = tl.zeros([BT, BK], dtype=tl.float32)                                     # S_c dO_t
        dx_out = tl.zeros([BT, BK], dtype=tl.float32)                                       # dS_out y_s
        s_dot = 0.0                                                                         # <dS_out, S_c> (block)
        for i_v in range(tl.cdiv(V, BV)):
            rv = i_v * BV + tl.arange(0, BV)
            do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)                               # [BT, BV]
            y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv)
            offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
            S = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)                  # [BK, BV]
            dS = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dA += tl.dot(do, tl.trans(y), input_precision=PREC)
            dq_inter += tl.dot(do, tl.trans(S).to(do.dtype), input_precision=PREC)
            dx_out += tl.dot(y, tl.trans(dS).to(y.dtype), input_precision=PREC)
            s_dot += tl.sum(tl.sum(S * dS, axis=1), axis=0)
        G = dA * M                                                                          # [BT, BT]
        qf, xf = q.to(tl.float32), x.to(tl.float32)
        dq = dq_inter * tl.exp(Lr)[:, None] + tl.dot((G * eta[None, :]).to(x.dtype), x, input_precision=PREC)
        q_dq = tl.sum(qf * dq, axis=1)
        store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
        x_out = tl.sum(xf * dx_out, axis=1)                                                 # x_s . dS_out y_s
        dxt = tl.dot(tl.trans(G).to(q.dtype), q, input_precision=PREC) + dx_out * out_coef[:, None]
        store_rows(dx_ptr, dxt * eta[:, None], i_n, i_h, t, T, H, K, rk)
        deta = tl.sum(xf * dxt, axis=1)
        x_dx = eta * deta                                                                   # x_s . dx_s
        exit_term = tl.exp(L_last) * s_dot + tl.sum(x_out * out_coef * eta, axis=0)         # <dS_out, S_{c+1}>
        dlg = tl.cumsum(q_dq - x_dx, axis=0, reverse=True) + exit_term
        if not READ_AFTER:
            dlg -= q_dq
        scalar_offs = i_p.to(tl.int64) * NTH + (i_n.to(tl.int64) * T + t) * H + i_h
        tl.store(deta_ptr + scalar_offs, deta.to(deta_ptr.dtype.element_ty), mask=t < T)
        tl.store(dlg_ptr + scalar_offs, dlg.to(dlg_ptr.dtype.element_ty), mask=t < T)
    if i_p < tl.cdiv(V, BV):  # (3''): dy of this value block
        rv = i_p * BV + tl.arange(0, BV)
        # x_s . q_t [BT(s), BT(t)] and dS_out^T x_s [BT, BV]: the output kernels' pass over K with x and q swapped
        xq, x_dS = scores_and_read(x_ptr, q_ptr, dh_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K, V, BT, BK, BV, rv,
                                   PREC)
        At = (xq * tl.trans(M) * eta[:, None]).to(q_ptr.dtype.element_ty)                   # A^T [BT(s), BT(t)]
        do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)                                   # [BT, BV]
        dy = tl.dot(At, do, input_precision=PREC) + x_dS * (out_coef * eta)[:, None]
        store_rows(dy_ptr, dy, i_n, i_h, t, T, H, V, rv)


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
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
        q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        P += tl.dot(q, tl.trans(x), input_precision=PREC)
        o_inter += tl.dot(q, S.to(q.dtype), input_precision=PREC)
        du_out += tl.dot(x, dS.to(x.dtype), input_precision=PREC)
        s_dot += tl.sum(S * dS, axis=0)
    L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    eta = load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    u = y * eta
    PD = P[:, :, None] * causal_decay_columns(L, Lr, BT, READ_AFTER)                            # [BT(t), BT(s), BV]
    o = o_inter * tl.exp(Lr) + tl.sum(PD * u[None, :, :], axis=1)                           # (F3) recomputed
    b = tl.exp(L_last[None, :] - L)                                                         # [BT(s), BV]
    du = tl.sum(PD * do[:, None, :], axis=0) + b * du_out                                   # (B2)
    ub_out = u * b * du_out
    dL_last = tl.exp(L_last) * s_dot + tl.sum(ub_out, axis=0)                               # <dS', S_{c+1}> per column
    do_o = do * o                                                                           # dL/dLr
    dlg = tl.cumsum(do_o - u * du, axis=0, reverse=True) + dL_last[None, :]                 # (B4)
    if not READ_AFTER:
        dlg -= do_o
    store_rows(dy_ptr, eta * du, i_n, i_h, t, T, H, V, rv)
    store_rows(deta_ptr, y * du, i_n, i_h, t, T, H, V, rv)
    store_rows(dlg_ptr, dlg, i_n, i_h, t, T, H, V, rv)


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
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
    q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dq_inter = tl.zeros([BT, BK], dtype=tl.float32)                                         # (exp(Lr) dO) S_c^T
    dx_out = tl.zeros([BT, BK], dtype=tl.float32)                                           # (b u) dS'^T
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
        u = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32) \
            * load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                  # [BT, BV]
        do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)
        D = causal_decay_columns(L, Lr, BT, READ_AFTER)
        dP += tl.sum(D * u[None, :, :] * do.to(tl.float32)[:, None, :], axis=2)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dq_inter += tl.dot((do.to(tl.float32) * tl.exp(Lr)).to(q.dtype), tl.trans(S).to(q.dtype),
                           input_precision=PREC)
        dx_out += tl.dot((u * tl.exp(L_last[None, :] - L)).to(x.dtype), tl.trans(dS).to(x.dtype),
                         input_precision=PREC)
    dq = dq_inter + tl.dot(dP.to(x.dtype), x, input_precision=PREC)
    dx = dx_out + tl.dot(tl.trans(dP).to(q.dtype), q, input_precision=PREC)
    store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
