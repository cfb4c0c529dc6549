"""Chunk-local cumulative log decays: the first stage of every chunked rule, and the helpers with which the later
kernels read them.

Per (n, h) and chunk c of BT steps (t, s steps inside the chunk): L_t = sum_{r<=t} log gamma_r, chunk-local, so that
every decay between two steps of a chunk is exp(L_t - L_s) with an exponent <= 0 (nothing overflows however strong
the decay); Lr_t = L_t (read after) or L_{t-1} with L_{-1} = 0 (read before); L_last = L_{BT-1}. Padded steps
(t >= T) are loaded as log gamma = 0, so they repeat the last value. Masked decay entries are set to -inf before the
exponential, never exponentiated.

Per value column (rules 2A, 2) the same holds for L[t, j] = sum_{r<=t} log gamma[r, j], laid out [N * H, T_pad, V].

The regression rules' write events (`regression_kernels.py`) also read Lp_t = L_{SLOTS st(t) - 1}, the decay of the
state event t's residual reads (st(t) = t // SLOTS its step; 0 in the chunk's first step; L_{t-1} for SLOTS = 1), and
couple only events of earlier steps, st(s') < st(s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.chunking import SIZES, ChunkPlan
from hybridlm.ops.triton_utils import block, load_rows


@triton.jit(do_not_specialize=SIZES)
def chunk_cumsum_kernel(lg_ptr, L_ptr, T, T_pad, H, BT: tl.constexpr):
    """L[nh, c * BT + i] = sum_{r <= i} log_gamma[n, c * BT + r, h]. Grid (n_chunks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    lg = tl.load(lg_ptr + (i_n.to(tl.int64) * T + t) * H + i_h, mask=t < T, other=0.0).to(tl.float32)
    tl.store(L_ptr + i_nh.to(tl.int64) * T_pad + t, tl.cumsum(lg, axis=0))


@triton.jit
def chunk_decays(L_ptr, i_nh, i_c, T_pad, BT: tl.constexpr, READ_AFTER: tl.constexpr):
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
def causal_decay(L, Lr, BT: tl.constexpr, READ_AFTER: tl.constexpr):
    """[BT, BT] exp(Lr_t - L_s) where s <= t (after) / s < t (before), else 0 (masked before the exp)."""
    i = tl.arange(0, BT)
    if READ_AFTER:
        seen = i[:, None] >= i[None, :]
    else:
        seen = i[:, None] > i[None, :]
    return tl.exp(tl.where(seen, Lr[:, None] - L[None, :], float("-inf")))


@triton.jit
def residual_decays(L_ptr, i_nh, i_c, T_pad, BT: tl.constexpr, SLOTS: tl.constexpr):
    """The chunk's L_t, Lp_t = L_{SLOTS st(t) - 1} (the state each residual reads; 0 in the chunk's first step) [BT]
    and L_last. SLOTS = 1: Lp_t = L_{t-1}, `chunk_decays(..., READ_AFTER=False)`."""
    base = L_ptr + i_nh.to(tl.int64) * T_pad + i_c * BT
    i = tl.arange(0, BT)
    first = (i // SLOTS) * SLOTS                                                            # slot 0 of t's step
    L = tl.load(base + i)
    Lp = tl.load(base + first - 1, mask=first > 0, other=0.0)
    L_last = tl.load(base + BT - 1)
    return L, Lp, L_last


@triton.jit
def earlier_steps(BT: tl.constexpr, SLOTS: tl.constexpr):
    """[BT, BT] st(s') < st(s) (rows s, columns s'): the pairs of events that F1 couples (s' < s for SLOTS = 1)."""
    i = tl.arange(0, BT)
    return (i[:, None] // SLOTS) > (i[None, :] // SLOTS)


@triton.jit(do_not_specialize=SIZES)
def chunk_cumsum_columns_kernel(lg_ptr, L_ptr, T, T_pad, H, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """L[nh, c * BT + i, j] = sum_{r <= i} log_gamma[n, c * BT + r, h, j]. Grid (nV, n_chunks, N * H)."""
    i_v, i_c, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_c * BT + tl.arange(0, BT)
    rv = i_v * BV + tl.arange(0, BV)
    lg = load_rows(lg_ptr, i_n, i_h, t, T, H, V, rv).to(tl.float32)                      # [BT, BV]
    offs = (i_nh.to(tl.int64) * T_pad + t[:, None]) * V + rv[None, :]
    tl.store(L_ptr + offs, tl.cumsum(lg, axis=0), mask=rv[None, :] < V)


@triton.jit
def column_decays(L_ptr, i_nh, i_c, T_pad, V: tl.constexpr, BT: tl.constexpr, rv, READ_AFTER: tl.constexpr):
    """The chunk's L [BT, BV], read decays Lr [BT, BV] and last cumulative decay L_last [BV] of value columns rv."""
    base = L_ptr + (i_nh.to(tl.int64) * T_pad + i_c * BT) * V
    i = tl.arange(0, BT)
    vmask = rv < V
    L = tl.load(base + i[:, None] * V + rv[None, :], mask=vmask[None, :], other=0.0)
    if READ_AFTER:
        Lr = L
    else:
        Lr = tl.load(base + (i[:, None] - 1) * V + rv[None, :], mask=(i[:, None] > 0) & vmask[None, :], other=0.0)
    L_last = tl.load(base + (BT - 1) * V + rv, mask=vmask, other=0.0)
    return L, Lr, L_last


@triton.jit
def causal_decay_columns(L, Lr, BT: tl.constexpr, READ_AFTER: tl.constexpr):
    """D[t, s, j] = exp(Lr[t, j] - L[s, j]) where s <= t (after) / s < t (before), else 0: [BT, BT, BV], every
    exponent <= 0 (the masked ones are -inf before the exponential)."""
    i = tl.arange(0, BT)
    if READ_AFTER:
        seen = i[:, None] >= i[None, :]
    else:
        seen = i[:, None] > i[None, :]
    return tl.exp(tl.where(seen[:, :, None], Lr[:, None, :] - L[None, :, :], float("-inf")))


def chunk_cumsum(plan: ChunkPlan, log_gamma: torch.Tensor) -> torch.Tensor:
    """L [N * H, T_pad] float32, the chunk-local cumulative log decays of log_gamma [N, T, H]."""
    L = torch.empty(plan.NH, plan.T_pad, dtype=torch.float32, device=plan.device)
    chunk_cumsum_kernel[(plan.n_chunks, plan.NH)](log_gamma, L, plan.T, plan.T_pad, plan.H, BT=plan.BT)
    return L


def chunk_cumsum_columns(plan: ChunkPlan, log_gamma: torch.Tensor) -> torch.Tensor:
    """L [N * H, T_pad, V] float32, the chunk-local cumulative log decays of log_gamma [N, T, H, V] per column."""
    BV = block(plan.V, 64)
    L = torch.empty(plan.NH, plan.T_pad, plan.V, dtype=torch.float32, device=plan.device)
    chunk_cumsum_columns_kernel[(-(-plan.V // BV), plan.n_chunks, plan.NH)](
        log_gamma, L, plan.T, plan.T_pad, plan.H, V=plan.V, BT=plan.BT, BV=BV)
    return L
