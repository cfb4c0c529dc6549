"""The state stages of the chunked inner-product scans: what every chunk writes into the state, and the sequential
pass over chunks that gives each chunk's entry state (and, on the gradients in reverse, dL/dS at each chunk's exit).

Per (n, h) and chunk c (t, s steps inside the chunk; L, Lr, L_last as in `decays.py`; S_c the state entering chunk c,
`[K, V]`), forward and on the gradients (dO, dS_out = dL/dS_{c+1}):

    contrib_c = sum_s exp(L_last - L_s) eta_s x_s y_s^T          (1)    dcontrib_c = sum_t exp(Lr_t) q_t dO_t^T     (1')
    S_{c+1}   = exp(L_last) S_c + contrib_c                      (2)    dS_c = exp(L_last) dS_{c+1} + dcontrib_c    (2')

With a decay and a step size per value column (rules 2A, 2) the same holds column by column: contrib_c[:, j] =
X^T (exp(L_last[j] - L[:, j]) eta[:, j] y[:, j]), S_{c+1}[:, j] = exp(L_last[j]) S_c[:, j] + contrib_c[:, j].

Scalar decays run (1) + (2) as one kernel (`state_scan_kernel`: each program keeps one block of the state in
registers while it walks the chunks, the layout of flash-linear-attention's state kernels); `chunk_outer_kernel` is
(1) / (1') alone, which rule 1's backward needs. Per value column, (1) and (2) are two kernels
(`chunk_outer_columns_kernel`, `state_pass_columns_kernel`, the pass in place over the contributions). Per-chunk
states are float32, or in the inputs' dtype where every product that reads them takes that dtype (rule 1A's,
`inner_product.py`; rule 1's forward, `regression.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunking import KEY, SIZES, XY_SIZES, autotuned
from hybridlm.ops.fast_weight.triton.decays import chunk_decays, column_decays
from hybridlm.ops.triton_utils import load_rows, load_steps, row_views, state_offsets


@triton.jit
def _contribution(a_ptr, b_ptr, eta_ptr, L_ptr, i_nh, i_c, T, T_pad, H, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, rk, rv, READ_AFTER: tl.constexpr, GRAD: tl.constexpr, PREC: tl.constexpr):
    """sum_t coef_t a_t b_t^T over chunk i_c, the [BK, BV] block (rk, rv), in fp32, and the chunk's L_last.
    (1) a = x, b = y, coef_t = exp(L_last - L_t) eta_t: the chunk's contribution to its exit state.
    (1') GRAD: a = q, b = dO, coef_t = exp(Lr_t): the chunk's outputs' contribution to dL/dS_c."""
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    a = load_rows(a_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    b = load_rows(b_ptr, i_n, i_h, t, T, H, V, rv)                                         # [BT, BV]
    L, Lr, L_last = chunk_decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    if GRAD:
        coef = tl.exp(Lr)
    else:
        coef = tl.exp(L_last - L) * load_steps(eta_ptr, i_n, i_h, t, T, H)                 # [BT]
    return tl.dot(tl.trans((a * coef[:, None]).to(a.dtype)), b, input_precision=PREC), L_last


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
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
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, h, mask=mask)


@triton.jit
def carried_block(init_ptr, i_kv, i_nh, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_INIT: tl.constexpr):
    """The sequential stages' start: program i_kv's [BK, BV] block of row nh's carried state (init, or zeros), its
    rows and columns, and the offsets and mask of that block in a [N * H, K, V] tensor."""
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    rk, rv = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = state_offsets(i_nh, 0, 1, K, V, rk, rv)                                  # [K, V] of row nh
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
    offs, _ = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S.to(h_ptr.dtype.element_ty), mask=mask)
    contrib, L_last = _contribution(a_ptr, b_ptr, eta_ptr, L_ptr, i_nh, i_c, T, T_pad, H, K, V, BT, rk, rv,
                                    READ_AFTER, GRAD, PREC)
    return tl.exp(L_last) * S + contrib


@triton.jit(do_not_specialize=XY_SIZES)
def state_scan_kernel(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, init_ptr, final_ptr, T, T_xy, T_pad, n_chunks, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, READ_AFTER: tl.constexpr, GRAD: tl.constexpr, REVERSE: tl.constexpr,
                      PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """(1) + (2) in one kernel (or (1') + (2') with GRAD and REVERSE): each program keeps one [BK, BV] block of the
    carried state in registers and walks the chunks, writing the state carried into every chunk to h and the last
    one to final. The per-chunk contributions never reach memory, where a form with (1) as its own kernel
    (`chunk_outer_kernel`) and (2) as a pass over the buffer it wrote makes two more passes over the
    [N * H, n_chunks, K, V] buffer (benchmarks/RESULTS.md compares the two). a and b have T_xy >= T rows, of which
    the first T are read (T_xy = T but for rule 3A's delayed writes). Grid (nK * nV, N * H).

    INTERPRET: a while loop (Triton's CPU interpreter cannot `range` over a runtime int with numpy >= 2.4);
    compiled kernels use the for loop, which Triton can software-pipeline."""
    i_nh = tl.program_id(1)
    a_ptr, b_ptr = row_views(a_ptr, b_ptr, i_nh // H, T, T_xy, H, K, V)
    S, rk, rv, offs0, mask = carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
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


@autotuned(KEY)
@triton.jit(do_not_specialize=SIZES)
def chunk_outer_columns_kernel(a_ptr, b_ptr, eta_ptr, L_ptr, h_ptr, T, T_pad, n_chunks, H,
                               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                               BV: tl.constexpr, READ_AFTER: tl.constexpr, GRAD: tl.constexpr, PREC: tl.constexpr):
    """h[nh, c] = a^T (coef * b), one [BK, BV] block; a is [N, T, H, K], b and coef [BT, V] (per column).
    (1) a = x, b = y, coef = exp(L_last - L) * eta: the chunk's contribution to its exit state.
    (1') GRAD: a = q, b = dO, coef = exp(Lr): the chunk's outputs' contribution to dL/dS_c.
    Grid (nK * nV, n_chunks, N * H)."""
    i_kv, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk, rv = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    a = load_rows(a_ptr, i_n, i_h, t, T, H, K, rk)                                         # [BT, BK]
    b = load_rows(b_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                          # [BT, BV]
    L, Lr, L_last = column_decays(L_ptr, i_nh, i_c, T_pad, V, BT, rv, READ_AFTER)
    if GRAD:
        coef = tl.exp(Lr)
    else:
        coef = tl.exp(L_last[None, :] - L) * load_rows(eta_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)
    h = tl.dot(tl.trans(a), (b * coef).to(a.dtype), input_precision=PREC)                  # [BK, BV] fp32
    offs, mask = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, h, mask=mask)


@triton.jit
def _pass_chunk_columns(h_ptr, L_ptr, i, i_nh, T_pad, n_chunks, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        rk, rv, mask, REVERSE: tl.constexpr):
    """The i-th chunk of the pass (the last first when REVERSE): its offsets in h, its contribution h[c] and its
    decay exp(L_last_c) per value column; past the pass's end both are masked off (read by nothing)."""
    if REVERSE:
        i_c = n_chunks - 1 - i
    else:
        i_c = i
    live = i < n_chunks
    offs, _ = state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    contrib = tl.load(h_ptr + offs, mask=mask & live, other=0.0)
    L_last = tl.load(L_ptr + (i_nh.to(tl.int64) * T_pad + i_c * BT + BT - 1) * V + rv, mask=(rv < V) & live,
                     other=0.0)
    return offs, contrib, tl.exp(L_last)


@triton.jit
def _pass_step_columns(h_ptr, L_ptr, S, i, offs, contrib, decay, offs1, contrib1, decay1, i_nh, T_pad, n_chunks,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, mask, REVERSE: tl.constexpr):
    """Chunk i of the pass, chunks i and i + 1 loaded: load chunk i + 2, swap h[c] (the contribution) for S, return
    exp(L_last_c) S + contribution (the decay per value column) and the two loaded chunks moved up by one."""
    offs2, contrib2, decay2 = _pass_chunk_columns(h_ptr, L_ptr, i + 2, i_nh, T_pad, n_chunks, K, V, BT, rk, rv, mask,
                                                  REVERSE)
    tl.store(h_ptr + offs, S, mask=mask)
    return decay[None, :] * S + contrib, offs1, contrib1, decay1, offs2, contrib2, decay2


@triton.jit(do_not_specialize=SIZES)
def state_pass_columns_kernel(h_ptr, init_ptr, final_ptr, L_ptr, T_pad, n_chunks,
                              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """(2) / (2') The sequential pass over chunks, in place, with the decay per value column: h[c] holds chunk c's
    contribution on entry and the value carried into chunk c on exit (the entry states; REVERSE: dS' of every chunk).
    The last carried value goes to final [N * H, K, V]. Grid (nK * nV, N * H).

    Each chunk's contribution and decay are loaded two chunks ahead of the step that adds them, as in the SSD's
    `state_pass_kernel` (a step has no other work to hide a load behind; benchmarks/RESULTS.md times that pass)."""
    i_nh = tl.program_id(1)
    S, rk, rv, offs0, mask = carried_block(init_ptr, tl.program_id(0), i_nh, K, V, BK, BV, HAS_INIT)
    offs, contrib, decay = _pass_chunk_columns(h_ptr, L_ptr, 0, i_nh, T_pad, n_chunks, K, V, BT, rk, rv, mask,
                                               REVERSE)
    offs1, contrib1, decay1 = _pass_chunk_columns(h_ptr, L_ptr, 1, i_nh, T_pad, n_chunks, K, V, BT, rk, rv, mask,
                                                  REVERSE)
    if INTERPRET:  # Triton's interpreter cannot `range` over a runtime int with numpy >= 2.4
        i = 0
        while i < n_chunks:
            S, offs, contrib, decay, offs1, contrib1, decay1 = _pass_step_columns(
                h_ptr, L_ptr, S, i, offs, contrib, decay, offs1, contrib1, decay1, i_nh, T_pad, n_chunks, K, V, BT,
                rk, rv, mask, REVERSE)
            i += 1
    else:
        for i in range(n_chunks):
            S, offs, contrib, decay, offs1, contrib1, decay1 = _pass_step_columns(
                h_ptr, L_ptr, S, i, offs, contrib, decay, offs1, contrib1, decay1, i_nh, T_pad, n_chunks, K, V, BT,
                rk, rv, mask, REVERSE)
    tl.store(final_ptr + offs0, S, mask=mask)
