"""The WY representation of the regression rules' chunks: the unit lower triangular inverse (I + A)^-1 and the
factors U, W built from it (paper Algorithms 1 and 8; flash-linear-attention's `solve_tril` and `wy_fast`).

Per (n, h) and chunk c of BT write events (st(t) = t // SLOTS the step of event t; L, Lp as in `decays.py`;
S = S_c the state entering the chunk):

    A[s, s'] = [st(s') < st(s)] exp(Lp_s - L_s') eta_s' (x_s . x_s')         (strictly lower, [BT, BT])   (F1)
    Tinv = (I + A)^-1        U = Tinv Y        W = Tinv diag(exp Lp) X                                       (F2)

so that the chunk's residuals are r = U - W S (`regression_kernels.py`). The inverse is blocked: 16 x 16 diagonal
blocks by forward substitution, then doublings by products. Buffers: Tinv [N * H, T_pad, BT], U [N * H, T_pad, V],
W [N * H, T_pad, K], all float32 (the residual r is a small difference of two large terms: rounding U and W S to
16 bits costs more than the 16-bit tolerance; README.md, "Precision").

Per value column (rule 2) every column j has its own A^j (decays and step sizes per column, the Gram X X^T shared):
`tinv_columns` inverts them all at once by forward substitution on a [BT, BT, BV] tensor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunking import SIZES, autotuned
from hybridlm.ops.fast_weight.triton.decays import causal_decay_columns, earlier_steps, residual_decays
from hybridlm.ops.triton_utils import autotune, load_rows, load_steps


@triton.jit
def buffer_offsets(i_nh, t, T_pad, D: tl.constexpr, cols):
    """Offsets and mask of rows t, columns cols of one head of a [N * H, T_pad, D] buffer."""
    offs = (i_nh.to(tl.int64) * T_pad + t[:, None]) * D + cols[None, :]
    return offs, (t[:, None] < T_pad) & (cols[None, :] < D)


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
    M = BT tile (with fp32 inputs, "ieee", the zero blocks cost plain fp32 work: README.md, "The WY inverse").
    Blocks inside one step of SLOTS events are zero in A
    (`earlier_steps`), so the substitution (SLOTS >= 16) and the doublings within a step (2s <= SLOTS) are skipped."""
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
@triton.jit(do_not_specialize=SIZES)
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
        x = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk)                                     # [BT, BK]
        gram += tl.dot(x, tl.trans(x), input_precision=PREC)                                # [BT, BT] fp32
    eta = load_steps(eta_ptr, i_n, i_h, t, T, H)
    L, Lp, _ = residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
    decay = tl.exp(tl.where(earlier_steps(BT, SLOTS), Lp[:, None] - L[None, :], float("-inf")))
    tinv = _unit_lower_inverse(decay * eta[None, :] * gram, BT, SLOTS, PREC32)
    offs, mask = buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tl.store(tinv_ptr + offs, tinv, mask=mask)


@autotuned(["K", "V", "BT", "SLOTS"])
@triton.jit(do_not_specialize=SIZES)
def wu_kernel(x_ptr, y_ptr, L_ptr, tinv_ptr, u_ptr, w_ptr, T, T_pad, n_chunks, H, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SLOTS: tl.constexpr, PREC32: tl.constexpr):
    """(F2) One [BT, BD] column block of W = (I + A)^-1 diag(exp Lp) X (the first cdiv(K, BD) programs of axis 0) or
    of U = (I + A)^-1 Y (the rest), computed in float32 from `tinv_kernel`'s inverse and stored in the buffers'
    dtype (float32). Grid (nK + nV, n_chunks, N * H)."""
    i_b, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    tinv_offs, tinv_mask = buffer_offsets(i_nh, t, T_pad, BT, tl.arange(0, BT))
    tinv = tl.load(tinv_ptr + tinv_offs, mask=tinv_mask, other=0.0)                         # [BT, BT] fp32
    n_k = tl.cdiv(K, BD)
    if i_b < n_k:
        rk = i_b * BD + tl.arange(0, BD)
        _, Lp, _ = residual_decays(L_ptr, i_nh, i_c, T_pad, BT, SLOTS)
        xs = load_rows(x_ptr, i_n, i_h, t, T, H, K, rk).to(tl.float32) * tl.exp(Lp)[:, None]
        w = tl.dot(tinv, xs, input_precision=PREC32)                                        # [BT, BD]
        offs, mask = buffer_offsets(i_nh, t, T_pad, K, rk)
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)
    else:
        rv = (i_b - n_k) * BD + tl.arange(0, BD)
        y = load_rows(y_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                     # [BT, BD]
        u = tl.dot(tinv, y, input_precision=PREC32)
        offs, mask = buffer_offsets(i_nh, t, T_pad, V, rv)
        tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tinv_columns(gram, eta, L, Lp, BT: tl.constexpr):
    """Per value column (rule 2): (I + A^j)^-1 of every value column j of the tile, [BT(t), BT(s), BV], by forward
    substitution: after step s the rows <= s hold (I + A)^-1 - I, the rows below still -A."""
    i = tl.arange(0, BT)
    b = -(causal_decay_columns(L, Lp, BT, False) * eta[None, :, :] * gram[:, :, None])    # -A
    for s in range(1, BT):
        here = (i == s)[:, None, None]
        row = tl.sum(tl.where(here, b, 0.0), axis=0)                                        # -A[s, :, :] [BT, BV]
        row = row + tl.sum(row[:, None, :] * b, axis=0)
        b = tl.where(here, row[None, :, :], b)
    eye = (i[:, None] == i[None, :])[:, :, None]
    return b + tl.where(eye, 1.0, 0.0)
