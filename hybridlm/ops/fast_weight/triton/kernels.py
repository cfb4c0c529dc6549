"""Triton kernels of the rule-1A chunk scan (gated linear attention with a scalar log decay per step).

Imported only by `chunk_1a.py`, which is itself imported lazily (this file needs triton at import time).
The math, per (n, h) and per chunk c of BT steps (README.md of the parent folder, "Chunk-parallel form";
t, s are steps inside the chunk, L_t = sum_{r<=t} log gamma_r chunk-local, Lr_t = L_t (read after) or
L_{t-1} with L_{-1} = 0 (read before), M[t, s] = [s <= t] (after) or [s < t] (before)):

    forward                                                        backward (dO, dS_out = dL/dS_{c+1})
    contrib_c = sum_s exp(L_last - L_s) eta_s x_s y_s^T  (1)      dcontrib_c = sum_t exp(Lr_t) q_t dO_t^T     (1')
    S_{c+1} = exp(L_last) S_c + contrib_c                (2)      dS_c = exp(L_last) dS_{c+1} + dcontrib_c    (2')
    o_t = exp(Lr_t) S_c^T q_t                            (3)      dq, dx, eta, dlog_gamma per chunk           (3')
        + sum_s M exp(Lr_t - L_s) eta_s (q_t . x_s) y_s           dy per chunk                                (3'')

Tensors are contiguous: q, x [N, T, H, K]; y, o [N, T, H, V]; eta, log_gamma [N, T, H]; the chunk-local
cumulative decays L [N * H, T_pad] (float32, T_pad = n_chunks * BT; padded steps repeat the last value);
per-chunk states [N * H, n_chunks, K, V] (float32, or rule 1A's in the inputs' dtype: `chunk_1a.py`; they are
converted to the inputs' dtype for every matmul that reads them). Steps t >= T are masked on load (zeros: no write,
no decay).
Matmuls take the inputs' dtype (bf16/fp16 tensor cores, or fp32 with `PREC = "ieee"`) and accumulate in fp32;
masked decay entries are set to -inf before the exponential, never exponentiated.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from hybridlm.ops.triton_autotune import autotune

# With HYBRIDLM_TRITON_AUTOTUNE=0 the fast-weight kernels launch with 8 warps: the fixed launch of the A/B timings in
# benchmarks/RESULTS.md.
_autotune = functools.partial(autotune, fixed_warps=8)


_KEY = ["K", "V", "BT", "READ_AFTER"]
_SIZES = ["T", "T_pad", "n_chunks"]  # runtime sizes: no recompilation per sequence length


@triton.jit(do_not_specialize=_SIZES)
def chunk_cumsum_kernel(lg_ptr, L_ptr, T, T_pad, H, BT: tl.constexpr):
    """L[nh, c * BT + i] = sum_{r <= i} log_gamma[n, c * BT + r, h]. Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    lg = tl.load(lg_ptr + (i_n.to(tl.int64) * T + t) * H + i_h, mask=t < T, other=0.0).to(tl.float32)
    tl.store(L_ptr + i_nh.to(tl.int64) * T_pad + t, tl.cumsum(lg, axis=0))


@triton.jit
def _load_rows(ptr, i_n, i_h, t, T, H, D: tl.constexpr, cols):
    """Rows t (< T) and columns `cols` (< D) of one head of a [N, T, H, D] tensor -> [len(t), len(cols)],
    zeros outside."""
    offs = ((i_n.to(tl.int64) * T + t[:, None]) * H + i_h) * D + cols[None, :]
    return tl.load(ptr + offs, mask=(t[:, None] < T) & (cols[None, :] < D), other=0.0)


@triton.jit
def _store_rows(ptr, value, i_n, i_h, t, T, H, D: tl.constexpr, cols):
    offs = ((i_n.to(tl.int64) * T + t[:, None]) * H + i_h) * D + cols[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=(t[:, None] < T) & (cols[None, :] < D))


@triton.jit
def _load_steps(ptr, i_n, i_h, t, T, H):
    """Steps t (< T) of one head of a [N, T, H] tensor, in float32 (zeros outside)."""
    return tl.load(ptr + (i_n.to(tl.int64) * T + t) * H + i_h, mask=t < T, other=0.0).to(tl.float32)


@triton.jit
def _state_offsets(i_nh, i_c, n_chunks, K: tl.constexpr, V: tl.constexpr, rows, cols):
    """Offsets and mask of the block (rows, cols) of chunk i_c's [K, V] state in a [N * H, n_chunks, K, V] buffer."""
    offs = ((i_nh.to(tl.int64) * n_chunks + i_c) * K + rows[:, None]) * V + cols[None, :]
    return offs, (rows[:, None] < K) & (cols[None, :] < V)


@triton.jit
def _decays(L_ptr, i_nh, i_c, T_pad, BT: tl.constexpr, READ_AFTER: tl.constexpr):
    """The chunk's L_t, read decays Lr_t [BT] and its last cumulative decay L_last (a scalar)."""
    base = L_ptr + i_nh.to(tl.int64) * T_pad + i_c * BT
    i = tl.arange(0, BT)
    L = tl.load(base + i)
    if READ_AFTER:
        Lr = L
    else:
        Lr = tl.load(base + i - 1, mask=i > 0, other=0.0)
    L_last = tl.load(base + BT - 1)
    return L, Lr, L_last


@triton.jit
def _causal_decay(L, Lr, BT: tl.constexpr, READ_AFTER: tl.constexpr):
    """[BT, BT] exp(Lr_t - L_s) where s <= t (after) / s < t (before), else 0 (masked before the exp)."""
    i = tl.arange(0, BT)
    if READ_AFTER:
        seen = i[:, None] >= i[None, :]
    else:
        seen = i[:, None] > i[None, :]
    return tl.exp(tl.where(seen, Lr[:, None] - L[None, :], float("-inf")))


@triton.jit
def _contribution(a_ptr, b_ptr, eta_ptr, L_ptr, i_nh, i_c, T, T_pad, H, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, rk, rv, READ_AFTER: tl.constexpr, GRAD: tl.constexpr, PREC: tl.constexpr):
    """sum_t coef_t a_t b_t^T over chunk i_c, the [BK, BV] block (rk, rv), in fp32, and the chunk's L_last.
    (1) a = x, b = y, coef_t = exp(L_last - L_t) eta_t: the chunk's contribution to its exit state.
    (1') GRAD: a = q, b = dO, coef_t = exp(Lr_t): the chunk's outputs' contribution to dL/dS_c."""
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    a = _load_rows(a_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    b = _load_rows(b_ptr, i_n, i_h, t, T, H, V, rv)                                         # [BT, BV]
    L, Lr, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    if GRAD:
        coef = tl.exp(Lr)
    else:
        coef = tl.exp(L_last - L) * _load_steps(eta_ptr, i_n, i_h, t, T, H)                 # [BT]
    return tl.dot(tl.trans((a * coef[:, None]).to(a.dtype)), b, input_precision=PREC), L_last


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def chunk_outer_kernel(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, T, T_pad, n_chunks, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       READ_AFTER: tl.constexpr, GRAD: tl.constexpr, PREC: tl.constexpr):
    """h[nh, c] = sum_t coef_t a_t b_t^T (`_contribution`), one [BK, BV] block; a is [N, T, H, K], b [N, T, H, V].
    Grid (nK * nV, n_chunks, N * H)."""
    i_kv, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    rk, rv = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    h, _ = _contribution(a_ptr, b_ptr, eta_ptr, L_ptr, i_nh, i_c, T, T_pad, H, K, V, BT, rk, rv, READ_AFTER, GRAD,
                         PREC)
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, h, mask=mask)


@triton.jit
def _carried_block(init_ptr, i_kv, i_nh, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_INIT: tl.constexpr):
    """The sequential stages' start: program i_kv's [BK, BV] block of row nh's carried state (init, or zeros), its
    rows and columns, and the offsets and mask of that block in a [N * H, K, V] tensor."""
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    rk, rv = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = _state_offsets(i_nh, 0, 1, K, V, rk, rv)                                  # [K, V] of row nh
    if HAS_INIT:
        S = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S, rk, rv, offs0, mask


@triton.jit
def _scan_step(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, S, i, i_nh, T, T_pad, n_chunks, H, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, rk, rv, mask, READ_AFTER: tl.constexpr, GRAD: tl.constexpr,
               REVERSE: tl.constexpr, PREC: tl.constexpr):
    """One chunk of the fused scan: h[c] <- S (the state carried into chunk c), return exp(L_last_c) S + contrib_c
    (`_contribution`), kept in registers instead of a buffer."""
    if REVERSE:
        i_c = n_chunks - 1 - i
    else:
        i_c = i
    offs, _ = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S.to(h_ptr.dtype.element_ty), mask=mask)
    contrib, L_last = _contribution(a_ptr, b_ptr, eta_ptr, L_ptr, i_nh, i_c, T, T_pad, H, K, V, BT, rk, rv,
                                    READ_AFTER, GRAD, PREC)
    return tl.exp(L_last) * S + contrib


@triton.jit(do_not_specialize=_SIZES)
def state_scan_kernel(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, init_ptr, final_ptr, T, T_pad, n_chunks, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, READ_AFTER: tl.constexpr, GRAD: tl.constexpr, REVERSE: tl.constexpr,
                      PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """(1) + (2) in one kernel (or (1') + (2') with GRAD and REVERSE): each program keeps one [BK, BV] block of the
    carried state in registers and walks the chunks, writing the state carried into every chunk to h and the last
    one to final. The per-chunk contributions never reach memory: a form with (1) as its own kernel
    (`chunk_outer_kernel`) and (2) as a pass over the buffer it wrote took 1.2x-1.6x longer on an H200
    (benchmarks/RESULTS.md, 2026-11-30), for two more passes over the [N * H, n_chunks, K, V] float32 buffer.
    Grid (nK * nV, N * H).

    INTERPRET: a while loop (Triton 3.6's CPU interpreter cannot `range` over a runtime int with numpy >= 2.4);
    compiled kernels use the for loop, which Triton can software-pipeline."""
    i_nh = tl.program_id(1)
    S, rk, rv, offs0, mask = _carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
    if INTERPRET:
        i = 0
        while i < n_chunks:
            S = _scan_step(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, S, i, i_nh, T, T_pad, n_chunks, H, K, V, BT, rk, rv,
                           mask, READ_AFTER, GRAD, REVERSE, PREC)
            i += 1
    else:
        for i in range(n_chunks):
            S = _scan_step(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, S, i, i_nh, T, T_pad, n_chunks, H, K, V, BT, rk, rv,
                           mask, READ_AFTER, GRAD, REVERSE, PREC)
    tl.store(final_ptr + offs0, S, mask=mask)


@triton.jit
def _scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, rv, PREC: tl.constexpr):
    """The output kernels' pass over K for chunk i_c and value block rv: the scores q_t . x_s [BT, BT] and the
    inter-chunk read q_t^T S_c [BT, BV] (S_c = h[c]), both accumulated in fp32."""
    qx = tl.zeros([BT, BT], dtype=tl.float32)
    o_inter = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                     # [BT, BK]
        x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV]
        qx += tl.dot(q, tl.trans(x), input_precision=PREC)
        o_inter += tl.dot(q, S.to(q.dtype), input_precision=PREC)
    return qx, o_inter


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def output_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, h_ptr, o_ptr, T, T_pad, n_chunks, H,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(3) o_t = exp(Lr_t) S_c^T q_t + sum_s M exp(Lr_t - L_s) eta_s (q_t . x_s) y_s for a [BT, BV] block.
    Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    qx, o_inter = _scores_and_read(q_ptr, x_ptr, h_ptr, i_n, i_h, i_nh, i_c, t, T, n_chunks, H, K, V, BT, BK, BV, rv,
                                   PREC)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, _ = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    A = qx * _causal_decay(L, Lr, BT, READ_AFTER) * eta[None, :]                            # [BT, BT]
    y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv)
    o = o_inter * tl.exp(Lr)[:, None] + tl.dot(A.to(y.dtype), y, input_precision=PREC)
    _store_rows(o_ptr, o, i_n, i_h, t, T, H, V, rv)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_qx_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, do_ptr, h_ptr, dh_ptr,
                   dq_ptr, dx_ptr, deta_ptr, dlg_ptr, T, T_pad, n_chunks, H,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   READ_AFTER: tl.constexpr, PREC: tl.constexpr):
    """(3') Per chunk, with S_c = h[c] (entry state) and dS_out = dh[c] (gradient of the chunk's exit state):

        dq_t   = exp(Lr_t) S_c dO_t + sum_s G[t, s] eta_s x_s          G[t, s] = M exp(Lr_t - L_s) (dO_t . y_s)
        dxt_s  = sum_t G[t, s] q_t + exp(L_last - L_s) dS_out y_s      dx_s = eta_s dxt_s,  deta_s = x_s . dxt_s
        dlog_gamma_r = sum_{t >= r} (q_t . dq_t) [t > r when reading before] - sum_{t >= r} (x_t . dx_t)
                       + <dS_out, S_{c+1}>

    (every term of o_t carries exp(Lr_t) and is linear in q_t; every term that x_s enters carries exp(-L_s);
    the exit state carries exp(L_last), and <dS_out, S_{c+1}> = exp(L_last) <dS_out, S_c> + sum_s x_s . dx_s^out).
    BK covers all of K. Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
    dA = tl.zeros([BT, BT], dtype=tl.float32)                                               # dO_t . y_s
    dq_inter = tl.zeros([BT, BK], dtype=tl.float32)                                         # S_c dO_t
    dx_out = tl.zeros([BT, BK], dtype=tl.float32)                                           # dS_out y_s
    s_dot = 0.0                                                                             # <dS_out, S_c>
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)                                   # [BT, BV]
        y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)                      # [BK, BV]
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dA += tl.dot(do, tl.trans(y), input_precision=PREC)
        dq_inter += tl.dot(do, tl.trans(S).to(do.dtype), input_precision=PREC)
        dx_out += tl.dot(y, tl.trans(dS).to(y.dtype), input_precision=PREC)
        s_dot += tl.sum(tl.sum(S * dS, axis=1), axis=0)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    G = dA * _causal_decay(L, Lr, BT, READ_AFTER)                                           # [BT, BT]
    dq = dq_inter * tl.exp(Lr)[:, None] + tl.dot((G * eta[None, :]).to(x.dtype), x, input_precision=PREC)
    out_coef = tl.exp(L_last - L)                                                           # [BT]
    dxt = tl.dot(tl.trans(G).to(q.dtype), q, input_precision=PREC) + dx_out * out_coef[:, None]
    dx = dxt * eta[:, None]
    qf, xf = q.to(tl.float32), x.to(tl.float32)
    deta = tl.sum(xf * dxt, axis=1)
    q_dq = tl.sum(qf * dq, axis=1)
    x_dx = tl.sum(xf * dx, axis=1)
    exit_term = tl.exp(L_last) * s_dot \
        + tl.sum(tl.sum(xf * dx_out, axis=1) * out_coef * eta, axis=0)                      # <dS_out, S_{c+1}>
    if READ_AFTER:
        dlg = tl.cumsum(q_dq - x_dx, axis=0, reverse=True) + exit_term
    else:
        dlg = tl.cumsum(q_dq - x_dx, axis=0, reverse=True) - q_dq + exit_term
    _store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    _store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
    scalar_offs = (i_n.to(tl.int64) * T + t) * H + i_h
    tl.store(deta_ptr + scalar_offs, deta.to(deta_ptr.dtype.element_ty), mask=t < T)
    tl.store(dlg_ptr + scalar_offs, dlg.to(dlg_ptr.dtype.element_ty), mask=t < T)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_y_kernel(q_ptr, x_ptr, eta_ptr, L_ptr, do_ptr, dh_ptr, dy_ptr, T, T_pad, n_chunks, H,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  READ_AFTER: tl.constexpr, HAS_DH: tl.constexpr, PREC: tl.constexpr):
    """(3'') dy_s = sum_t M exp(Lr_t - L_s) eta_s (q_t . x_s) dO_t + exp(L_last - L_s) eta_s dS_out^T x_s,
    a [BT, BV] block. Without HAS_DH only the first (chunk-local) term: rule 1's backward adds the second in its
    sequential pass, where dS_out is known. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    qx = tl.zeros([BT, BT], dtype=tl.float32)
    dy_out = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        q = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk)
        x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)
        qx += tl.dot(q, tl.trans(x), input_precision=PREC)
        if HAS_DH:
            offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
            dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)                               # [BK, BV]
            dy_out += tl.dot(x, dS.to(x.dtype), input_precision=PREC)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    A = qx * _causal_decay(L, Lr, BT, READ_AFTER) * eta[None, :]                            # [BT(t), BT(s)]
    do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv)
    dy = tl.dot(tl.trans(A).to(do.dtype), do, input_precision=PREC)
    if HAS_DH:
        dy += dy_out * (tl.exp(L_last - L) * eta)[:, None]
    _store_rows(dy_ptr, dy, i_n, i_h, t, T, H, V, rv)
