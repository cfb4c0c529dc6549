"""Rule 1A's forward as one walk over the chunks in which one program per (row, head) carries the whole [K, V]
state in registers and writes each chunk's outputs from it. No per-chunk state reaches memory, where the
chunk-parallel forward (`inner_product.py`: the state scan, then the outputs) writes every chunk's [K, V] state and
reads it back, and each chunk's scores q_t . x_s and loads of q, x are made once, not once per value block. The
backward stays chunk-parallel (it recomputes the states). `inner_product.walk_warps` takes the walk for 16-bit
inputs where the rows x heads give about one program per SM (benchmarks/RESULTS.md times it).

Per chunk c (t, s steps inside the chunk; L, Lr, L_last, M as in `chunk_output.py` and `decays.py`; S_c the state
entering the chunk; A[t, s] = M exp(Lr_t - L_s) eta_s (q_t . x_s)):

    o_t     = exp(Lr_t) S_c^T q_t + sum_s A[t, s] y_s                                                          (3)
    S_{c+1} = exp(L_last) S_c + sum_s exp(L_last - L_s) eta_s x_s y_s^T                                    (1), (2)

Products take the inputs' dtype (the carried float32 state rounded to it, as the chunk-parallel form stores its
per-chunk states) and accumulate in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunk_state import carried_block
from hybridlm.ops.fast_weight.triton.chunking import XY_SIZES
from hybridlm.ops.fast_weight.triton.decays import causal_decay, chunk_decays
from hybridlm.ops.triton_utils import load_rows, load_steps, row_views, store_rows


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


@triton.jit(do_not_specialize=XY_SIZES)
def output_walk_kernel(q_ptr, x_ptr, y_ptr, eta_ptr, L_ptr, o_ptr, init_ptr, final_ptr, T, T_xy, T_pad, n_chunks, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_INIT: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """The forward walk: o [N, T, H, V] and the final state [N * H, K, V] (float32) from S_0 (init, or zeros); x and
    y have T_xy >= T rows, of which the first T are read. Grid (N * H,).

    INTERPRET: a while loop (Triton's CPU interpreter cannot `range` over a runtime int with numpy >= 2.4)."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    x_ptr, y_ptr = row_views(x_ptr, y_ptr, i_n, T, T_xy, H, K, V)
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
