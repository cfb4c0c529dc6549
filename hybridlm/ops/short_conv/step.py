"""One decoding step of the short causal conv in one kernel, with its state: inference only (no backward).

On the torch forms a step with a carried state is a concatenation, the depthwise conv (with casts around it), the
SiLU and the new state's slice (which a CUDA-graphed step then copies into its buffer): several small kernels per
layer, and a graphed step's time is its kernel count. Here one program per (row b, block of channels) reads the
state's K-1 inputs and the new one as a [KP, BC] tile (KP = K rounded up to a power of two), and writes

    y[b, c] = act(bias[c] + sum_k w[c, k] e_k[c])        e = (state[b, 0], ..., state[b, K-2], x[b])
    state'[b, j] = e_{j+1}                                j = 0 .. K-2 (oldest first)

with float32 accumulation, y and state' in x's dtype (the torch forms keep the state in x's dtype too).

`in_place=True` writes state' over the state it read (a fixed-address cache that a replayed CUDA graph reads: no copy
of the new state into it afterwards). Each program owns its channels, so only its own threads read what it
overwrites: a barrier between its loads and its store of state' orders them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.utils import cdiv, next_power_of_2, on_tensor_device, unit_last_stride

BC = 128  # channels per program
NUM_WARPS = 4


@triton.jit
def conv_step_columns(x, state_ptr, ss_k, w_ptr, b_ptr, c, mc, K: tl.constexpr, KP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The step on the channels c (mask mc) of one row: x [BC] the new input as loaded, the carried inputs at
    state_ptr + j ss_k + c (j = 0 .. K-2, oldest first) -> y [BC] float32 and state' [KP, BC] in x's dtype (rows past
    K-2 for the caller's store to mask: `store_conv_state`). Also the fast-weight mixer's whole step's conv
    (`hybridlm/ops/fast_weight/triton/mixer_step.py`)."""
    k = tl.arange(0, KP)
    # e_k: the state's rows k < K-1, then x at k = K-1; [KP, BC], zeros past K
    carried = tl.load(state_ptr + k[:, None] * ss_k + c[None, :], mask=(k[:, None] < K - 1) & mc[None, :], other=0.0)
    e = tl.where(k[:, None] == K - 1, x[None, :], carried).to(tl.float32)
    w = tl.load(w_ptr + c[None, :] * K + k[:, None], mask=(k[:, None] < K) & mc[None, :], other=0.0).to(tl.float32)
    y = tl.sum(w * e, axis=0)                                                               # [BC]
    if HAS_BIAS:
        y += tl.load(b_ptr + c, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    # state'_j = e_{j+1}: the state's rows 1 .. K-2, then x
    shifted = tl.load(state_ptr + (k[:, None] + 1) * ss_k + c[None, :], mask=(k[:, None] < K - 2) & mc[None, :],
                      other=0.0)
    return y, tl.where(k[:, None] == K - 2, x[None, :], shifted)


@triton.jit
def store_conv_state(out_ptr, so_k, c, mc, new, K: tl.constexpr, KP: tl.constexpr):
    """state' [KP, BC] from `conv_step_columns` at out_ptr + j so_k + c, rows j = 0 .. K-2."""
    k = tl.arange(0, KP)
    tl.store(out_ptr + k[:, None] * so_k + c[None, :], new.to(out_ptr.dtype.element_ty),
             mask=(k[:, None] < K - 1) & mc[None, :])


@triton.jit
def step_kernel(x_ptr, state_ptr, w_ptr, b_ptr, y_ptr, state_out_ptr, C, sx_b, ss_b, ss_k, so_b, so_k,
                K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                IN_PLACE: tl.constexpr):
    # x and the state are read at their strides (unit stride along the channels): a row slice of the input
    # projection, a prefill's state sliced from its extended input; y is contiguous, state' at its own strides.
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    b = i_b.to(tl.int64)
    c = i_c * BC + tl.arange(0, BC)
    mc = c < C
    x = tl.load(x_ptr + b * sx_b + c, mask=mc, other=0.0)
    y, new = conv_step_columns(x, state_ptr + b * ss_b, ss_k, w_ptr, b_ptr, c, mc, K, KP, HAS_BIAS, SILU)
    tl.store(y_ptr + b * C + c, y.to(y_ptr.dtype.element_ty), mask=mc)
    if IN_PLACE:
        tl.debug_barrier()  # every thread's reads of the state done before any row of it is overwritten
    store_conv_state(state_out_ptr + b * so_b, so_k, c, mc, new, K, KP)


def short_conv_step_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           *, silu: bool, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C], state [B, K-1, C] (x's dtype; both at any strides but a unit one along the channels), weight [C, K]
    (K >= 2), bias [C] or None -> y [B, C] and the new state [B, K-1, C], both in x's dtype: `state` itself, updated,
    with `in_place`, else a new contiguous tensor. CUDA tensors, or CPU tensors under Triton's interpreter; checked by
    the caller (`hybridlm.modules.causal_conv1d`)."""
    B, C = x.shape
    K = weight.shape[1]
    if in_place and state.stride(-1) != 1:
        raise ValueError("short_conv_step_triton: a state updated in place needs a unit stride along the channels")
    x, state = unit_last_stride(x), unit_last_stride(state)
    weight = weight.contiguous()
    y = x.new_empty(B, C)
    state_out = state if in_place else state.new_empty(state.shape)
    with on_tensor_device(x):
        step_kernel[(B, cdiv(C, BC))](
            x, state, weight, bias.contiguous() if bias is not None else weight, y, state_out, C, x.stride(0),
            state.stride(0), state.stride(1), state_out.stride(0), state_out.stride(1), K=K, KP=next_power_of_2(K),
            BC=BC, HAS_BIAS=bias is not None, SILU=silu, IN_PLACE=in_place, num_warps=NUM_WARPS)
    return y, state_out
