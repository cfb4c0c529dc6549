"""Rule 1A as walks over the chunks in which one program per (row, head) carries the whole [K, V] state in
registers: the forward (outputs and final state) and the backward (dq on a forward walk, then dx, dy, d eta,
d log_gamma and dS_0 on a reverse walk). No per-chunk state reaches memory, where the chunk-parallel form
(`inner_product.py`: state scan -> outputs; recomputed states, reverse scan -> per-chunk gradients) writes every
chunk's [K, V] state and reads it back, and each chunk's scores q_t . x_s and loads of q, x are made once, not once
per value block. `inner_product.one_pass_launch` takes these walks where the rows x heads give about one program
per SM (benchmarks/RESULTS.md times them).

Per chunk c (t, s steps inside the chunk; L, Lr, L_last, M as in `chunk_output.py` and `decays.py`; S_c the state
entering the chunk, dS' = dL/dS_{c+1} the gradient of its exit state; A[t, s] = M exp(Lr_t - L_s) eta_s (q_t . x_s),
G[t, s] = M exp(Lr_t - L_s) (dO_t . y_s)):

    forward walk     o_t   = exp(Lr_t) S_c^T q_t + sum_s A[t, s] y_s                                           (3)
                     S_{c+1} = exp(L_last) S_c + sum_s exp(L_last - L_s) eta_s x_s y_s^T                     (1), (2)
    gradient walks   dq_t  = exp(Lr_t) S_c dO_t + sum_s G[t, s] eta_s x_s                          (forward order)
                     dxt_s = sum_t G[t, s] q_t + exp(L_last - L_s) dS' y_s,   dx_s = eta_s dxt_s,   deta_s = x_s . dxt_s
                     dy_s  = sum_t A[t, s] dO_t + exp(L_last - L_s) eta_s dS'^T x_s
                     dS_c  = exp(L_last) dS' + sum_t exp(Lr_t) q_t dO_t^T                          (reverse order)

The log decays take the whole row's identity instead of a per-chunk exit term: every term of o_t and of the final
state in which lg_r enters pairs a write s < r with a read t >= r (or the final state), so

    dlog_gamma_r = sum_{t >= r} (q_t . dq_t) [t > r when reading before] - sum_{t >= r} (x_t . dx_t) + <dS_T, S_T>

(S_0 counts as a write before every step; dS_T = dL/dS_final). The forward walk leaves q_t . dq_t per step and
<dS_T, S_T> per row; the reverse walk carries the sum over the chunks after its own and adds the chunk's reverse
cumulative sum.

Products take the inputs' dtype (the carried float32 state rounded to it, as the per-chunk states of the
chunk-parallel form are stored) and accumulate in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunk_state import carried_block
from hybridlm.ops.fast_weight.triton.chunking import SIZES
from hybridlm.ops.fast_weight.triton.decays import causal_decay, chunk_decays
from hybridlm.ops.triton_utils import load_rows, load_steps, store_rows


@triton.jit
def _chunk(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, i_c, i_n, i_h, i_nh, T, T_pad, H, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr):
    """Chunk i_c's steps t [BT], q, x [BT, BK], y [BT, BV], eta [BT] (float32), its decays L, Lr [BT], L_last and
    the causal decay mask M [BT(t), BT(s)]."""
    t = i_c * BT + tl.arange(0, BT)
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
    x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    return t, q, x, y, eta, L, Lr, L_last, causal_decay(L, Lr, BT, READ_AFTER)


@triton.jit
def _write(S, x, y, eta, L, L_last, PREC: tl.constexpr):
    """(1) + (2): the state after the chunk."""
    coef = tl.exp(L_last - L) * eta                                                         # [BT]
    return tl.exp(L_last) * S + tl.dot(tl.trans((x * coef[:, None]).to(x.dtype)), y, input_precision=PREC)


@triton.jit
def _output_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, o_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """Chunk i_c of the forward walk: (3) from the carried S_c, then (1) + (2); returns S_{c+1}."""
    t, q, x, y, eta, L, Lr, L_last, M = _chunk(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, i_c, i_n, i_h, i_nh, T, T_pad,
                                               H, K, V, BT, BK, BV, READ_AFTER)
    A = tl.dot(q, tl.trans(x), input_precision=PREC) * M * eta[None, :]                    # [BT(t), BT(s)]
    o = tl.dot(q, S.to(q.dtype), input_precision=PREC) * tl.exp(Lr)[:, None] \
        + tl.dot(A.to(y.dtype), y, input_precision=PREC)
    store_rows(o_ptr, o, i_n, i_h, t, T, H, V, tl.arange(0, BV))
    return _write(S, x, y, eta, L, L_last, PREC)


@triton.jit(do_not_specialize=SIZES)
def output_walk_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, o_ptr, init_ptr, final_ptr, T, T_pad, n_chunks, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_INIT: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """The forward walk: o [N, T, H, V] and the final state [N * H, K, V] (float32) from S_0 (init, or zeros).
    Grid (N * H,).

    INTERPRET: a while loop (Triton's CPU interpreter cannot `range` over a runtime int with numpy >= 2.4)."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    S, _, _, offs0, mask = carried_block(init_ptr, 0, i_nh, K, V, BK, BV, HAS_INIT)        # [BK, BV] fp32
    if INTERPRET:
        i_c = 0
        while i_c < n_chunks:
            S = _output_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, o_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, H, K, V,
                             BT, BK, BV, READ_AFTER, PREC)
            i_c += 1
    else:
        for i_c in range(n_chunks):
            S = _output_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, o_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, H, K, V,
                             BT, BK, BV, READ_AFTER, PREC)
    tl.store(final_ptr + offs0, S, mask=mask)


@triton.jit
def _grad_q_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, dq_ptr, qdq_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """Chunk i_c of the forward gradient walk: dq and q . dq from the carried S_c; returns S_{c+1}."""
    t, q, x, y, eta, L, Lr, L_last, M = _chunk(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, i_c, i_n, i_h, i_nh, T, T_pad,
                                               H, K, V, BT, BK, BV, READ_AFTER)
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, tl.arange(0, BV))                        # [BT, BV]
    G = tl.dot(do, tl.trans(y), input_precision=PREC) * M * eta[None, :]                   # G eta_s [BT(t), BT(s)]
    dq = tl.dot(do, tl.trans(S).to(do.dtype), input_precision=PREC) * tl.exp(Lr)[:, None] \
        + tl.dot(G.to(x.dtype), x, input_precision=PREC)                                    # [BT, BK]
    store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, tl.arange(0, BK))
    tl.store(qdq_ptr + (i_n.to(tl.int64) * T + t) * H + i_h, tl.sum(q.to(tl.float32) * dq, axis=1), mask=t < T)
    return _write(S, x, y, eta, L, L_last, PREC)


@triton.jit(do_not_specialize=SIZES)
def grad_q_walk_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, init_ptr, dS_final_ptr, dq_ptr, qdq_ptr,
                       exit_ptr, T, T_pad, n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DSF: tl.constexpr,
                       READ_AFTER: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """The forward gradient walk: dq [N, T, H, K], q_t . dq_t [N, T, H] (float32) and <dS_T, S_T> per row x head
    [N * H] (float32; 0 without dS_final). Grid (N * H,)."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    S, _, _, offs0, mask = carried_block(init_ptr, 0, i_nh, K, V, BK, BV, HAS_INIT)        # [BK, BV] fp32
    if INTERPRET:
        i_c = 0
        while i_c < n_chunks:
            S = _grad_q_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, dq_ptr, qdq_ptr, S, i_c, i_n, i_h, i_nh,
                             T, T_pad, H, K, V, BT, BK, BV, READ_AFTER, PREC)
            i_c += 1
    else:
        for i_c in range(n_chunks):
            S = _grad_q_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, dq_ptr, qdq_ptr, S, i_c, i_n, i_h, i_nh,
                             T, T_pad, H, K, V, BT, BK, BV, READ_AFTER, PREC)
    if HAS_DSF:
        dS_T = tl.load(dS_final_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
        tl.store(exit_ptr + i_nh, tl.sum(tl.sum(S * dS_T, axis=1), axis=0))
    else:
        tl.store(exit_ptr + i_nh, 0.0)


@triton.jit
def _grad_xy_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, qdq_ptr, dx_ptr, dy_ptr, deta_ptr, dlg_ptr, dS,
                  later, exit_term, i, n_chunks, i_n, i_h, i_nh, T, T_pad, H, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr,
                  PREC: tl.constexpr):
    """The i-th chunk from the end in the reverse gradient walk, with the carried dS' (its exit state's gradient)
    and `later`, the sum of q . dq - x . dx over the chunks after it: dx, dy, d eta, d log_gamma; returns dS_c and
    `later` with this chunk added."""
    i_c = n_chunks - 1 - i
    t, q, x, y, eta, L, Lr, L_last, M = _chunk(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, i_c, i_n, i_h, i_nh, T, T_pad,
                                               H, K, V, BT, BK, BV, READ_AFTER)
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)                                       # [BT, BV]
    out_coef = tl.exp(L_last - L)                                                           # [BT(s)]
    Gt = tl.trans(tl.dot(do, tl.trans(y), input_precision=PREC) * M)                       # G^T [BT(s), BT(t)]
    dxt = tl.dot(Gt.to(q.dtype), q, input_precision=PREC) \
        + tl.dot(y, tl.trans(dS).to(y.dtype), input_precision=PREC) * out_coef[:, None]    # [BT, BK]
    dx = dxt * eta[:, None]
    store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
    At = tl.trans(tl.dot(q, tl.trans(x), input_precision=PREC) * M * eta[None, :])         # A^T [BT(s), BT(t)]
    dy = tl.dot(At.to(do.dtype), do, input_precision=PREC) \
        + tl.dot(x, dS.to(x.dtype), input_precision=PREC) * (out_coef * eta)[:, None]      # [BT, BV]
    store_rows(dy_ptr, dy, i_n, i_h, t, T, H, V, rv)
    xf = x.to(tl.float32)
    steps = (i_n.to(tl.int64) * T + t) * H + i_h
    q_dq = tl.load(qdq_ptr + steps, mask=t < T, other=0.0)
    here = q_dq - tl.sum(xf * dx, axis=1)                                                   # [BT]
    dlg = tl.cumsum(here, axis=0, reverse=True) + later + exit_term
    if not READ_AFTER:
        dlg -= q_dq
    tl.store(deta_ptr + steps, tl.sum(xf * dxt, axis=1).to(deta_ptr.dtype.element_ty), mask=t < T)
    tl.store(dlg_ptr + steps, dlg.to(dlg_ptr.dtype.element_ty), mask=t < T)
    dS = tl.exp(L_last) * dS + tl.dot(tl.trans((q * tl.exp(Lr)[:, None]).to(q.dtype)), do, input_precision=PREC)
    return dS, later + tl.sum(here, axis=0)


@triton.jit(do_not_specialize=SIZES)
def grad_xy_walk_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, qdq_ptr, exit_ptr, dS_final_ptr, dx_ptr,
                        dy_ptr, deta_ptr, dlg_ptr, dS0_ptr, T, T_pad, n_chunks, H, K: tl.constexpr,
                        V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        HAS_DSF: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """The reverse gradient walk, after `grad_q_walk_kernel` (its q . dq and <dS_T, S_T>): dx, dy, d eta,
    d log_gamma and dS_0 [N * H, K, V] (float32), from dS_T (dS_final, or zeros). Grid (N * H,)."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    dS, _, _, offs0, mask = carried_block(dS_final_ptr, 0, i_nh, K, V, BK, BV, HAS_DSF)   # [BK, BV] fp32
    exit_term = tl.load(exit_ptr + i_nh)
    later = 0.0
    if INTERPRET:
        i = 0
        while i < n_chunks:
            dS, later = _grad_xy_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, qdq_ptr, dx_ptr, dy_ptr, deta_ptr,
                                      dlg_ptr, dS, later, exit_term, i, n_chunks, i_n, i_h, i_nh, T, T_pad, H, K,
                                      V, BT, BK, BV, READ_AFTER, PREC)
            i += 1
    else:
        for i in range(n_chunks):
            dS, later = _grad_xy_step(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, qdq_ptr, dx_ptr, dy_ptr, deta_ptr,
                                      dlg_ptr, dS, later, exit_term, i, n_chunks, i_n, i_h, i_nh, T, T_pad, H, K,
                                      V, BT, BK, BV, READ_AFTER, PREC)
    tl.store(dS0_ptr + offs0, dS, mask=mask)
