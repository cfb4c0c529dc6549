"""The output stage of the chunked scans and its value gradient: every step's read of the state entering its chunk
plus the chunk-local masked attention over the chunk's writes.

Per (n, h) and chunk c (t, s steps inside the chunk; L, Lr, L_last as in `decays.py`; M[t, s] = [s <= t] (read after)
or [s < t] (read before); S_c the state entering the chunk, dS_out = dL/dS_{c+1}):

    o_t  = exp(Lr_t) S_c^T q_t + sum_s M exp(Lr_t - L_s) eta_s (q_t . x_s) y_s                                  (3)
    dy_s = sum_t M exp(Lr_t - L_s) eta_s (q_t . x_s) dO_t + exp(L_last - L_s) eta_s dS_out^T x_s               (3'')

The regression rules read the same outputs with y replaced by their residuals r (`regression.py`). Per value column
(rules 2A, 2; u = eta * y, P[t, s] = q_t . x_s, D[t, s, j] = M exp(Lr[t, j] - L[s, j])):

    o[t, j] = exp(Lr[t, j]) (S_c^T q_t)[j] + sum_s P[t, s] D[t, s, j] u[s, j]

computed as a [BT, BT, BV] tensor per value tile (every exponent <= 0). Matmuls take the inputs' dtype (bf16/fp16
tensor cores, or fp32 with `PREC = "ieee"`) and accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunking import KEY, SIZES, XY_SIZES, ChunkPlan, autotuned
from hybridlm.ops.fast_weight.triton.decays import causal_decay, causal_decay_columns, chunk_decays, column_decays
from hybridlm.ops.triton_utils import block, load_rows, load_steps, row_views, state_offsets, store_rows


@triton.jit
def scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, rv, PREC: tl.constexpr):
    """The output kernels' pass over K for chunk i_c and value block rv: the scores q_t . x_s [BT, BT] and the
    inter-chunk read q_t^T S_c [BT, BV] (S_c = h[c]), both accumulated in fp32. Rule 1A's gradient kernel passes x
    for q and the exit states' gradients for h (`inner_product_kernels.grad_qxy_kernel`)."""
    qx = tl.zeros([BT, BT], dtype=tl.float32)
    o_inter = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                     # [BT, BK]
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV]
        qx += tl.dot(q, tl.trans(x), input_precision=PREC)
        o_inter += tl.dot(q, S.to(q.dtype), input_precision=PREC)
    return qx, o_inter


@autotuned(KEY)
@triton.jit(do_not_specialize=XY_SIZES)
def output_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, o_ptr, T, T_xy, T_pad, n_chunks, H,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(3) o_t = exp(Lr_t) S_c^T q_t + sum_s M exp(Lr_t - L_s) eta_s (q_t . x_s) y_s for a [BT, BV] block; x and y
    have T_xy >= T rows, of which the first T are read. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    x_ptr, y_ptr = row_views(x_ptr, y_ptr, i_n, T, T_xy, H, K, V)
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    qx, o_inter = scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K, V, BT, BK, BV, rv,
                                  PREC)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, _ = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    A = qx * causal_decay(L, Lr, BT, READ_AFTER) * eta[None, :]                            # [BT, BT]
    y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv)
    o = o_inter * tl.exp(Lr)[:, None] + tl.dot(A.to(y.dtype), y, input_precision=PREC)
    store_rows(o_ptr, o, i_n, i_h, t, T, H, V, rv)


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
def grad_y_kernel(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, dh_ptr, dy_ptr, T, T_pad, n_chunks, H,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  READ_AFTER: tl.constexpr, HAS_DH: tl.constexpr, PREC: tl.constexpr):
    """(3'') dy_s = sum_t M exp(Lr_t - L_s) eta_s (q_t . x_s) dO_t + exp(L_last - L_s) eta_s dS_out^T x_s,
    a [BT, BV] block. Without HAS_DH only the first (chunk-local) term: the regression rules' backward adds the
    second in its sequential pass, where dS_out is known. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    qx = tl.zeros([BT, BT], dtype=tl.float32)
    dy_out = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        qx += tl.dot(q, tl.trans(x), input_precision=PREC)
        if HAS_DH:
            offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
            dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)                               # [BK, BV]
            dy_out += tl.dot(x, dS.to(x.dtype), input_precision=PREC)
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    A = qx * causal_decay(L, Lr, BT, READ_AFTER) * eta[None, :]                            # [BT(t), BT(s)]
    do = load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)
    dy = tl.dot(tl.trans(A).to(do.dtype), do, input_precision=PREC)
    if HAS_DH:
        dy += dy_out * (tl.exp(L_last - L) * eta)[:, None]
    store_rows(dy_ptr, dy, i_n, i_h, t, T, H, V, rv)


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
def output_columns_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, o_ptr, T, T_pad, n_chunks, H,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(3) per value column: o[t, j] = exp(Lr[t, j]) (S_c^T q_t)[j] + sum_s P[t, s] D[t, s, j] u[s, j], a [BT, BV]
    block. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    P, o_inter = scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K, V, BT, BK, BV, rv,
                                 PREC)
    L, Lr, _ = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    u = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32) \
        * load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    D = causal_decay_columns(L, Lr, BT, READ_AFTER)                                         # [BT, BT, BV]
    o = o_inter * tl.exp(Lr) + tl.sum(P[:, :, None] * D * u[None, :, :], axis=1)
    store_rows(o_ptr, o, i_n, i_h, t, T, H, V, rv)


def output(plan: ChunkPlan, q, x, y, eta, L, states) -> torch.Tensor:
    """(3): o [N, T, H, V] in q's dtype from the chunk-local decays L [N * H, T_pad] and the entry states; y is the
    values (rule 1A) or the residuals (the regression rules). x and y may have more than T rows (their first T are
    read)."""
    o = torch.empty(plan.N, plan.T, plan.H, plan.V, dtype=q.dtype, device=plan.device)
    BK, BV = block(plan.K, 64), block(plan.V, 64)
    output_kernel[(-(-plan.V // BV), plan.n_chunks, plan.NH)](
        q, x, y, eta, L, states, o, plan.T, plan.T_xy, plan.T_pad, plan.n_chunks, plan.H, **plan.sizes, BK=BK, BV=BV,
        READ_AFTER=plan.read_after, PREC=plan.prec)
    return o


def output_columns(plan: ChunkPlan, q, x, y, eta, L, states) -> torch.Tensor:
    """(3) per value column: o [N, T, H, V] in q's dtype from L [N * H, T_pad, V] and the entry states; y is the
    values (rule 2A) or the residuals (rule 2)."""
    o = torch.empty(plan.N, plan.T, plan.H, plan.V, dtype=q.dtype, device=plan.device)
    BV = plan.column_tile()
    output_columns_kernel[(-(-plan.V // BV), plan.n_chunks, plan.NH)](
        q, x, y, eta, L, states, o, plan.T, plan.T_pad, plan.n_chunks, plan.H, **plan.sizes, BK=block(plan.K, 64),
        BV=BV, READ_AFTER=plan.read_after, PREC=plan.prec)
    return o
