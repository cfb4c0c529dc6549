"""Triton kernels of rule 1 (regression / delta rule, scalar decay, window 1), and of rule 3 (sliding-window
regression) as rule 1 over its write events: the WY factors, the sequential residual/state pass, and the backward's
reverse pass and per-chunk gradients. The outputs (and the chunk-local part of dr) reuse rule 1A's kernels
(`kernels.output_kernel`, `kernels.grad_y_kernel`) with the residuals r in place of y.

Imported only by `chunk_1.py` (lazily; this file needs triton at import time). The rows are write events, SLOTS per
step (a power of two, a constexpr): rule 1 has one (SLOTS = 1); rule 3 lays each step's window out in time as
(s, slot 0), ..., (s, slot SLOTS - 1), padded with zero-weight events (`frontend.py`), the step's decay on slot 0.
The two differ only in which state a residual reads: rule 3's events of one step do not see each other's writes,
and all of them read S_{s-1}, before the step's decay (README.md of the parent folder, "Write events"). Chunks hold
whole steps (BT is a multiple of SLOTS), so a chunk's entry state never holds part of a step.

Per (n, h) and chunk c of BT events, with chunk-local L_t = sum_{r<=t} log gamma_r, st(t) = t // SLOTS the step of
event t, Lp_t = L_{SLOTS st(t) - 1} the log decay of the state its residual reads (0 in the chunk's first step;
L_{t-1} for SLOTS = 1), Lr_t = L_t (read after) or L_{t-1} (read before, 0 at t = 0), M[t, s] = [s <= t] (after) or
[s < t] (before), b_s = exp(L_last - L_s) eta_s, S = S_c the entry state:

    A[s, s'] = [st(s') < st(s)] exp(Lp_s - L_s') eta_s' (x_s . x_s')         (strictly lower, [BT, BT])  (F1)
    Tinv = (I + A)^-1 (blocked: `_unit_lower_inverse`)    U = Tinv Y    W = Tinv diag(exp Lp) X            (F2)
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

Stages: `delta_grad_pass_kernel` runs B1 (its dS' term; the chunk-local term comes from `kernels.grad_y_kernel`),
B2's dZ and B3, sequentially from the last chunk; then, for all chunks in parallel, `delta_grad_q_kernel` runs B4
(and q_t . dq_t), `delta_grad_state_kernel` the terms of B5-B7 that read S and dS' (over 64-column blocks of the
states: dS' r_s, S dZ_s and their dot products with x_s), and `delta_grad_kernel` the rest of B5-B7 with B2's dA,
walking K in 64-column blocks. Neither of these two holds a [BT, K] accumulator beside [BT, BT] ones: together they
spilled (RESULTS.md).
Buffers: U [N * H, T_pad, V], W [N * H, T_pad, K] (float32, or bfloat16 with BF16: the opt-in
`chunk_1.BF16_PASSES`, faster but less exact, chunk_1.py) and Tinv [N * H, T_pad, BT] float32; residuals r, dr and
dZ [N, T, H, V] float32 (the layout of y); the state terms of dx [N, T, H, K] float32 and their column blocks' parts
[nK, 3, N * H, T_pad] float32; per-chunk states [N * H, n_chunks, K, V] float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.kernels import (
    _SIZES,
    _autotune,
    _causal_decay,
    _decays,
    _load_rows,
    _load_steps,
    _state_offsets,
    _store_rows,
)
from hybridlm.ops.triton_autotune import autotune


@triton.jit
def _buffer_offsets(i_nh, t, T_pad, D: tl.constexpr, cols):
    """Offsets and mask of rows t, columns cols of one head of a [N * H, T_pad, D] buffer."""
    offs = (i_nh.to(tl.int64) * T_pad + t[:, None]) * D + cols[None, :]
    return offs, (t[:, None] < T_pad) & (cols[None, :] < D)


@triton.jit
def _residual_decays(L_ptr, i_nh, i_c, T_pad, BT: tl.constexpr, SLOTS: tl.constexpr):
    """The chunk's L_t, Lp_t = L_{SLOTS st(t) - 1} (the state each residual reads; 0 in the chunk's first step) [BT]
    and L_last. SLOTS = 1: Lp_t = L_{t-1}, `kernels._decays(..., READ_AFTER=False)`."""
    base = L_ptr + i_nh.to(tl.int64) * T_pad + i_c * BT
    i = tl.arange(0, BT)
    first = (i // SLOTS) * SLOTS                                                            # slot 0 of t's step
    L = tl.load(base + i)
    Lp = tl.load(base + first - 1, mask=first > 0, other=0.0)
    L_last = tl.load(base + BT - 1)
    return L, Lp, L_last


@triton.jit
def _earlier_steps(BT: tl.constexpr, SLOTS: tl.constexpr):
    """[BT, BT] st(s') < st(s) (rows s, columns s'): the pairs of events that F1 couples (s' < s for SLOTS = 1)."""
    i = tl.arange(0, BT)
    return (i[:, None] // SLOTS) > (i[None, :] // SLOTS)


@triton.jit
def _mm(a, b, BF16: tl.constexpr, INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """a @ b accumulated in fp32: from fp32 factors at PREC32, or with BF16 from both rounded to bfloat16 (tensor
    cores at their bf16 rate, flash-linear-attention's precision). The interpreter multiplies the rounded values in
    fp32 (numpy has no bfloat16 product): the same products, summed in another order."""
    if BF16:
        a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
        if INTERPRET:
            a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC32)


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, SLOTS: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower triangular fp32 [BT, BT] A (BT a power of two in [16, 128]), blocked as
    flash-linear-attention's `solve_tril`: the 16 x 16 diagonal blocks by forward substitution (15 steps, all blocks
    at once on a [BT / 16, 16, 16] tensor, exact fp32), then the off-diagonal blocks by products, doubling the block
    size: with Inv_s the inverse of the s x s diagonal blocks of M = I + A (zeros elsewhere) and Off_s the entries of
    M inside the 2s x 2s diagonal blocks but outside the s x s ones (their lower-left quadrants),

        Inv_2s = Inv_s - Inv_s Off_s Inv_s

    (a 2s block [[P, 0], [Q, R]] has the inverse [[P^-1, 0], [-R^-1 Q P^-1, R^-1]]; Inv_s Off_s Inv_s is zero outside
    the quadrants, so the entries already found stay as they are). Each level is two [BT, BT] products at precision
    PREC. They are full tiles because register tensors cannot be sliced into blocks: their zero blocks cost
    tensor-core work (at BT = 64, four 64^3 products where explicit 16 x 16 blocks would need ~16 16^3 ones), but no
    per-block register tensors, no round trip through a global scratch with barriers, and every product is one
    M = BT tile. With fp32 inputs ("ieee", no tensor cores) that waste made the WY kernel ~5% slower than the
    sequential substitution it replaced (H200, README.md). Blocks inside one step of SLOTS events are zero in A
    (`_earlier_steps`), so the substitution (SLOTS >= 16) and the doublings within a step (2s <= SLOTS) are skipped."""
    tl.static_assert(BT >= 16 and BT <= 128)
    NB: tl.constexpr = BT // 16
    i = tl.arange(0, BT)
    inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)                                    # Inv_1 = I  [BT, BT]
    if SLOTS < 16:
        blk = tl.arange(0, NB)
        same = blk[:, None, None, None] == blk[None, None, :, None]                        # [NB, 1, NB, 1]
        b = -tl.sum(tl.where(same, tl.reshape(A, [NB, 16, NB, 16]), 0.0), axis=2)         # -A_bb  [NB, 16, 16]
        r = tl.arange(0, 16)[None, :, None]                                                 # [1, 16, 1]
        # Forward substitution in every block at once: row s of (I + A_bb)^-1 - I is -A_bb[s] - sum_{s' < s}
        # A_bb[s, s'] ((I + A_bb)^-1 - I)[s']; after step s the rows <= s of b hold (I + A_bb)^-1 - I.
        for s in range(1, 16):
            row = tl.sum(tl.where(r == s, b, 0.0), axis=1)                                  # -A_bb[s, :]  [NB, 16]
            row = row + tl.sum(row[:, :, None] * b, axis=1)
            b = tl.where(r == s, row[:, None, :], b)                                        # [NB, 16, 16]
        inv += tl.reshape(tl.where(same, b[:, :, None, :], 0.0), [BT, BT])                # Inv_16
    for level in tl.static_range(3):  # Inv_16 -> Inv_32 -> Inv_64 -> Inv_128, as far as BT
        if (32 << level) <= BT and SLOTS < (32 << level):
            inv = _double_blocks(inv, A, BT, 16 << level, PREC)
    return inv


@triton.jit
def _double_blocks(inv, A, BT: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr):
    """Inv_2S = Inv_S - Inv_S Off_S Inv_S (`_unit_lower_inverse`) for inv = Inv_S [BT, BT]."""
    i = tl.arange(0, BT)
    quadrant = (i[:, None] // (2 * S) == i[None, :] // (2 * S)) & (i[:, None] // S != i[None, :] // S)
    off = tl.where(quadrant, A, 0.0)                                                        # Off_S  [BT, BT]
    return inv - tl.dot(inv, tl.dot(off, inv, input_precision=PREC), input_precision=PREC)


@autotune(["K", "BT", "SLOTS"], fixed_warps=4)
@triton.jit(do_not_specialize=_SIZES)
def tinv_kernel(x_ptr, eta_ptr, L_ptr, tinv_ptr, T, T_pad, n_chunks, H, K: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, SLOTS: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """(F1, F2's inverse) (I + A)^-1 of one chunk (`_unit_lower_inverse`), float32 into tinv; the Gram matrix summed
    over BK-column blocks of x. A couples only events of earlier steps (SLOTS events per step; its same-step entries
    are zeros). Grid (n_chunks, N * H). Apart from `wu_kernel` so that this latency-bound program is small (4 warps
    by default: several per SM) and the products with X and Y, which are bandwidth-bound, spread over column
    blocks."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    gram = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        rk = i_k * BK + tl.arange(0, BK)
        x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)                                     # [BT, BK]
        gram += tl.dot(x, tl.trans(x), input_precision=PREC)                                # [BT, BT] fp32
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, _ = _residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    decay = tl.exp(tl.where(_earlier_steps(BT, SLOTS), Lp[:, None] - L[None, :], float("-inf")))
    tinv = _unit_lower_inverse(decay * eta[None, :] * gram, BT, SLOTS, PREC32)
    offs, mask = _buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tl.store(tinv_ptr + offs, tinv, mask=mask)


@_autotune(["K", "V", "BT", "SLOTS"])
@triton.jit(do_not_specialize=_SIZES)
def wu_kernel(x_ptr, y_ptr, L_ptr, tinv_ptr, u_ptr, w_ptr, T, T_pad, n_chunks, H, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SLOTS: tl.constexpr, PREC32: tl.constexpr):
    """(F2) One [BT, BD] column block of W = (I + A)^-1 diag(exp Lp) X (the first cdiv(K, BD) programs of axis 0) or
    of U = (I + A)^-1 Y (the rest), computed in float32 from `tinv_kernel`'s inverse and stored in the buffers'
    dtype (float32, or bfloat16 for `delta_pass_kernel`'s BF16). Grid (nK + nV, n_chunks, N * H)."""
    i_b, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    tinv_offs, tinv_mask = _buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tinv = tl.load(tinv_ptr + tinv_offs, mask=tinv_mask, other=0.0)                         # [BT, BT] fp32
    n_k = tl.cdiv(K, BD)
    if i_b < n_k:
        rk = i_b * BD + tl.arange(0, BD)
        _, Lp, _ = _residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
        xs = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32) * tl.exp(Lp)[:, None]
        w = tl.dot(tinv, xs, input_precision=PREC32)                                        # [BT, BD]
        offs, mask = _buffer_offsets(i_nh, t, T_pad, K, rk)
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)
    else:
        rv = (i_b - n_k) * BD + tl.arange(0, BD)
        y = _load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                     # [BT, BD]
        u = tl.dot(tinv, y, input_precision=PREC32)
        offs, mask = _buffer_offsets(i_nh, t, T_pad, V, rv)
        tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad, n_chunks, H,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, rk, rv, BF16: tl.constexpr,
                INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """(F3, F4) One chunk: record the entry state S, r = U - W S (stored), return exp(L_last) S + X^T (coef r)."""
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    tl.store(h_ptr + offs, S, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    w_offs, w_mask = _buffer_offsets(i_nh, t, T_pad, K, rk)
    u_offs, u_mask = _buffer_offsets(i_nh, t, T_pad, V, rv)
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)                                     # [BT, BK]
    u = tl.load(u_ptr + u_offs, mask=u_mask, other=0.0).to(tl.float32)                      # [BT, BV]
    r = u - _mm(w, S, BF16, INTERPRET, PREC32)
    _store_rows(r_ptr, r, i_n, i_h, t, T, H, V, rv)
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                         # [BT, BK]
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, _, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, True)
    coef = tl.exp(L_last - L) * eta
    return tl.exp(L_last) * S + _mm(tl.trans(x * coef[:, None]), r, BF16, INTERPRET, PREC32)


@triton.jit(do_not_specialize=_SIZES)
def delta_pass_kernel(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, init_ptr, h_ptr, r_ptr, final_ptr, T, T_pad, n_chunks,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
                      PREC32: tl.constexpr):
    """The sequential pass over chunks for one [K, BV] column block of the state (BK covers all of K, since
    r = U - W S needs every row of S): entry states into h, residuals into r, the final state into final.
    Grid (nV, N * H); states and residuals float32, the products' factors float32 or with BF16 bfloat16 (`_mm`).
    INTERPRET: a while loop (see `kernels.state_scan_kernel`)."""
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
                            n_chunks, H, K, V, BT, rk, rv, BF16, INTERPRET, PREC32)
            i_c += 1
    else:
        for i_c in range(n_chunks):
            S = _delta_step(x_ptr, eta_ptr, L_ptr, u_ptr, w_ptr, h_ptr, r_ptr, S, i_c, i_n, i_h, i_nh, T, T_pad,
                            n_chunks, H, K, V, BT, rk, rv, BF16, INTERPRET, PREC32)
    tl.store(final_ptr + offs0, S, mask=mask)


@triton.jit
def _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T, T_pad,
                     n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SLOTS: tl.constexpr, rk, rv,
                     BF16: tl.constexpr, INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """One chunk of the reverse pass, dS = dS' = dL/dS_{c+1} on entry: swap h[c] (sum_t exp(Lr_t) q_t dO_t^T) for
    dS', finish dr (B1), store dZ = Tinv^T dr (B2) and return dS_c (B3)."""
    i_c = n_chunks - 1 - i
    offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
    dcontrib = tl.load(dh_ptr + offs, mask=mask, other=0.0)
    tl.store(dh_ptr + offs, dS, mask=mask)
    t = i_c * BT + tl.arange(0, BT)
    x = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                         # [BT, BK]
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, L_last = _residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    dr = _load_rows(dr_ptr, i_n, i_h, t, T, H, V, rv) \
        + (tl.exp(L_last - L) * eta)[:, None] * _mm(x, dS, BF16, INTERPRET, PREC32)         # (B1) [BT, BV]
    tinv_offs, tinv_mask = _buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tinv = tl.load(tinv_ptr + tinv_offs, mask=tinv_mask, other=0.0)                         # [BT, BT]
    dz = _mm(tl.trans(tinv), dr, BF16, INTERPRET, PREC32)                                   # (B2)
    _store_rows(dz_ptr, dz, i_n, i_h, t, T, H, V, rv)
    xs = x * tl.exp(Lp)[:, None]
    return tl.exp(L_last) * dS + dcontrib - _mm(tl.trans(xs), dz, BF16, INTERPRET, PREC32)  # (B3)


@triton.jit(do_not_specialize=_SIZES)
def delta_grad_pass_kernel(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, init_ptr, dh_ptr, dz_ptr, final_ptr, T, T_pad,
                           n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, SLOTS: tl.constexpr, HAS_INIT: tl.constexpr, BF16: tl.constexpr,
                           INTERPRET: tl.constexpr, PREC32: tl.constexpr):
    """The reverse pass over chunks for one [K, BV] column block of dS (B3 acts on the rows of dS, so column blocks
    are independent; BK covers all of K). On entry dh[c] = sum_t exp(Lr_t) q_t dO_t^T and dr holds the chunk-local
    part of B1; on exit dh[c] = dL/dS_{c+1}, dz = dZ (B2), final = dL/dS_0. init: dL/dS_final (HAS_INIT) or zeros.
    Grid (nV, N * H); float32 buffers, the products' factors float32 or with BF16 bfloat16 (`_mm`). INTERPRET: a
    while loop (see `kernels.state_scan_kernel`)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    offs0, mask = _state_offsets(i_nh, 0, 1, K, V, rk, rv)
    if HAS_INIT:
        dS = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    if INTERPRET:
        i = 0
        while i < n_chunks:
            dS = _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                  T_pad, n_chunks, H, K, V, BT, SLOTS, rk, rv, BF16, INTERPRET, PREC32)
            i += 1
    else:
        for i in range(n_chunks):
            dS = _delta_grad_step(x_ptr, eta_ptr, L_ptr, tinv_ptr, dr_ptr, dh_ptr, dz_ptr, dS, i, i_n, i_h, i_nh, T,
                                  T_pad, n_chunks, H, K, V, BT, SLOTS, rk, rv, BF16, INTERPRET, PREC32)
    tl.store(final_ptr + offs0, dS, mask=mask)


@_autotune(["K", "V", "BT", "READ_AFTER"])
@triton.jit(do_not_specialize=_SIZES)
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
        do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                    # [BT, BV]
        r = _load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dOr += tl.dot(do, tl.trans(r), input_precision=PREC32)
        dq += tl.dot(do, tl.trans(S), input_precision=PREC32)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, _ = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    G = dOr * _causal_decay(L, Lr, BT, READ_AFTER)                                          # [BT(t), BT(s)]
    xf = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    dq = dq * tl.exp(Lr)[:, None] + tl.dot(G * eta[None, :], xf, input_precision=PREC32)
    qf = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
    _store_rows(dq_ptr, dq, i_n, i_h, t, T, H, K, rk)
    tl.store(qdq_ptr + (i_n.to(tl.int64) * T + t) * H + i_h, tl.sum(qf * dq, axis=1), mask=t < T)


@_autotune(["K", "V", "BT", "SLOTS"])
@triton.jit(do_not_specialize=_SIZES)
def delta_grad_state_kernel(x_ptr, r_ptr, eta_ptr, L_ptr, h_ptr, dh_ptr, dz_ptr, dxs_ptr, part_ptr, T, T_pad,
                            n_chunks, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, SLOTS: tl.constexpr, PREC32: tl.constexpr):
    """The terms of B5-B7 that read the chunk's states, for one [BT, BK] column block of dx: with S = h[c] (entry
    state) and dS' = dh[c],

        dxs_s = exp(L_last - L_s) eta_s dS' r_s - exp(Lp_s) S dZ_s                    (B5's F4 and F3 terms)

    into dxs (float32, the layout of x), and the block's parts of the sums over K that B6/B7 need: x_s . (dS' r_s),
    x_s^T S dZ_s [BT] and <dS', S> (one number per chunk, in the chunk's first row), into part
    [nK, 3, N * H, T_pad]. Grid (nK, n_chunks, N * H): the states' rows are split over programs, so that no program
    holds a [BT, K] accumulator beside the [BT, BT] ones of `delta_grad_kernel` (spills, RESULTS.md)."""
    i_k, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rk = i_k * BK + tl.arange(0, BK)
    dSr = tl.zeros([BT, BK], dtype=tl.float32)                                              # dS' r_s  (rows s)
    SdZ = tl.zeros([BT, BK], dtype=tl.float32)                                              # S dZ_s
    s_dot = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        r = _load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # [BT, BV] fp32
        dz = _load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)
        offs, mask = _state_offsets(i_nh, i_c, n_chunks, K, V, rk, rv)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BK, BV] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        dSr += tl.dot(r, tl.trans(dS), input_precision=PREC32)
        SdZ += tl.dot(dz, tl.trans(S), input_precision=PREC32)
        s_dot += tl.sum(S * dS, axis=1)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, L_last = _residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    dxs = (tl.exp(L_last - L) * eta)[:, None] * dSr - tl.exp(Lp)[:, None] * SdZ
    _store_rows(dxs_ptr, dxs, i_n, i_h, t, T, H, K, rk)
    xf = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                        # [BT, BK]
    NH = tl.num_programs(2)
    tl.store(_part_row(part_ptr, i_k, 0, NH, i_nh, T_pad) + t, tl.sum(xf * dSr, axis=1))
    tl.store(_part_row(part_ptr, i_k, 1, NH, i_nh, T_pad) + t, tl.sum(xf * SdZ, axis=1))
    tl.store(_part_row(part_ptr, i_k, 2, NH, i_nh, T_pad) + t, tl.sum(s_dot, axis=0) + tl.zeros([BT], tl.float32),
             mask=tl.arange(0, BT) == 0)  # one number per chunk, in its first row (the only one read)


@triton.jit
def _part_row(part_ptr, i_k, j, NH, i_nh, T_pad):
    """Row (i_k, j, i_nh) of the [nK, 3, N * H, T_pad] buffer of `delta_grad_state_kernel`'s parts."""
    return part_ptr + ((i_k * 3 + j) * NH + i_nh).to(tl.int64) * T_pad


@_autotune(["K", "V", "BT", "READ_AFTER", "SLOTS", "N_PARTS"])
@triton.jit(do_not_specialize=_SIZES)
def delta_grad_kernel(q_ptr, x_ptr, r_ptr, eta_ptr, L_ptr, do_ptr, dz_ptr, qdq_ptr, dxs_ptr, part_ptr,
                      dx_ptr, deta_ptr, dlg_ptr, T, T_pad, n_chunks, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      READ_AFTER: tl.constexpr, SLOTS: tl.constexpr, N_PARTS: tl.constexpr,
                      PREC32: tl.constexpr):
    """(B2's dA, B5-B7) dx, d eta and d log_gamma of one chunk, from the residuals r, dZ, q_t . dq_t
    (`delta_grad_q_kernel`) and the state terms that `delta_grad_state_kernel` wrote (dxs, and its N_PARTS column
    blocks' parts of x_s . (dS' r_s), x_s^T S dZ_s and <dS', S>). BK: the column block of K (N_PARTS of them
    cover K), as the state kernel's. Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    dOr = tl.zeros([BT, BT], dtype=tl.float32)                                              # dO_t . r_s
    dZr = tl.zeros([BT, BT], dtype=tl.float32)                                              # dZ_s . r_s'
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        do = _load_rows(do_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                    # [BT, BV]
        r = _load_rows(r_ptr, i_n, i_h, t, T, H, V, rv)                                     # fp32
        dz = _load_rows(dz_ptr, i_n, i_h, t, T, H, V, rv)                                   # fp32
        dOr += tl.dot(do, tl.trans(r), input_precision=PREC32)
        dZr += tl.dot(dz, tl.trans(r), input_precision=PREC32)
    eta = _load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lr, L_last = _decays(L_ptr, i_nh, i_c, T_pad, BT, READ_AFTER)
    _, Lp, _ = _residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    out_decay = tl.exp(L_last - L)                                                          # [BT]
    start = tl.exp(Lp)
    G = dOr * _causal_decay(L, Lr, BT, READ_AFTER)                                          # [BT(t), BT(s)]
    earlier = _earlier_steps(BT, SLOTS)                                                     # st(s') < st(s)
    decay = tl.exp(tl.where(earlier, Lp[:, None] - L[None, :], float("-inf")))
    dA_decay = -dZr * decay                                                                 # B2's dA exp(Lp_s - L_s')
    dGr = dA_decay * eta[None, :]
    dGr_sym = dGr + tl.trans(dGr)
    # Over column blocks of K (BK = delta_grad_state_kernel's, whose parts are summed here): dx of rule 1A's part
    # of B5 (eta_s dxt_s, dxt_s = sum_t G[t, s] q_t + exp(L_last - L_s) dS' r_s, the second term in dxs) plus its
    # F1 term; the sums over K of x_s . dxt_s and of the Gram matrix x_s . x_s'.
    x_dxt = tl.zeros([BT], dtype=tl.float32)                                                # x_s . sum_t G q_t
    x_dSr = tl.zeros([BT], dtype=tl.float32)                                                # x_s . (dS' r_s)
    x_SdZ = tl.zeros([BT], dtype=tl.float32)                                                # x_s^T S dZ_s
    s_dot = 0.0                                                                             # <dS', S>
    gram = tl.zeros([BT, BT], dtype=tl.float32)                                             # x_s . x_s'
    NH = tl.num_programs(1)
    for i_k in tl.static_range(N_PARTS):
        x_dSr += tl.load(_part_row(part_ptr, i_k, 0, NH, i_nh, T_pad) + t)
        x_SdZ += tl.load(_part_row(part_ptr, i_k, 1, NH, i_nh, T_pad) + t)
        s_dot += tl.load(_part_row(part_ptr, i_k, 2, NH, i_nh, T_pad) + i_c * BT)
        rk = i_k * BK + tl.arange(0, BK)
        xf = _load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)                    # [BT, BK]
        qf = _load_rows(q_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32)
        dxt_attn = tl.dot(tl.trans(G), qf, input_precision=PREC32)                          # sum_t G[t, s] q_t
        x_dxt += tl.sum(xf * dxt_attn, axis=1)
        gram += tl.dot(xf, tl.trans(xf), input_precision=PREC32)
        dx = _load_rows(dxs_ptr, i_n, i_h, t, T, H, K, rk) + dxt_attn * eta[:, None] \
            + tl.dot(dGr_sym, xf, input_precision=PREC32)
        _store_rows(dx_ptr, dx, i_n, i_h, t, T, H, K, rk)
    deta = x_dxt + out_decay * x_dSr                                                        # x_s . dxt_s
    x_dx = eta * deta                                                                       # x_s . (eta_s dxt_s)
    exit_term = tl.exp(L_last) * s_dot + tl.sum(out_decay * eta * x_dSr, axis=0)           # <dS', S_{c+1}>
    deta += tl.sum(dA_decay * gram, axis=0)                                                 # (B6)
    E = dGr * gram                                                                          # dA * A
    # B7.
    q_dq = _load_steps(qdq_ptr, i_n, i_h, t, T, H)
    dL = -x_dx - tl.sum(E, axis=0)
    dLp = tl.sum(E, axis=1) - start * x_SdZ
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
