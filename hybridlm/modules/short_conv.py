"""Depthwise short causal conv1d with an explicit state, for any mixer (Mamba-2, fast-weight, ...).

    y_t[c] = bias[c] + sum_{k=0}^{K-1} w[c, k] * x_{t-K+1+k}[c]        (then an optional SiLU)

The state is the last K-1 inputs, time-major like the activations: `[B, K-1, C]` (oldest first).
Running `[0:T]` equals running `[0:t]` then `[t:T]` from the carried state. A fresh sequence starts
from zeros. With `cu_seqlens` (packed batch, B == 1) every document runs on its own: it never sees
the tail of the previous one, it starts from its own row of `initial_state` (`[N, K-1, C]`), and the
final state has one row per document.

Training calls (no state in or out) on a GPU in eager mode run the Triton kernels of `hybridlm.ops.short_conv`: one
launch forward and two backward, documents restarting inside the row, where the torch forms launch several kernels
and copy the activations (benchmarks/gpu_short_conv.py). A decoding step (one token per row, a state in and out, no
gradient to record) on a GPU in eager mode runs one kernel (`short_conv_step_triton`). Other carried states,
torch.compile (whose inductor fuses the shifted sum with its neighbours) and the CPU take the torch forms below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.modules.boundaries import sequence_ids
from hybridlm.ops.short_conv import short_conv_step_triton, short_conv_triton
from hybridlm.ops.utils import (
    TRITON_DTYPES,
    check_backend,
    check_cu_seqlens,
    host_to_device,
    needs_grad,
    seq_idx_segments,
    triton_available,
    triton_runs_on,
    warn_slow_path,
)

_ACTIVATIONS = (None, "silu")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    backend: str = "auto",
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, T, C], weight [C, K], bias [C] -> (y [B, T, C], final_state [B or N, K-1, C] or None).

    seq_idx [B, T] (a document index per step, instead of cu_seqlens): no tap reaches across a change of
    document; the carried state belongs to the row's first document, and the final state holds only the last
    document's inputs (zeros before its start). The shapes stay the rows': for compiled training on packed rows.

    backend: "torch" (the forms below), "triton" (`hybridlm.ops.short_conv`'s kernels: a 32- or 16-bit tensor, no
    state in or out, or a decoding step) or "auto" (the kernels for a 32- or 16-bit CUDA tensor outside
    torch.compile with no state in or out, where triton is installed; else the torch forms, with a
    `SlowPathWarning` once where only triton is missing). A decoding step, T == 1 with a state in and out (K >= 2),
    no packed rows and no gradient to record, runs one step kernel under "triton", and under "auto" on such a CUDA
    tensor outside torch.compile. With `state_in_place` that kernel writes the new state over `initial_state` (in
    x's dtype, unit stride along the channels) and returns it: a fixed-address cache that a replayed CUDA graph reads
    (`hybridlm.layers.cache.LayerCache.states_in_place`). Every other path returns a new state."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}; choose one of {_ACTIVATIONS}")
    check_backend("causal_conv1d", backend)
    batch, length, channels = x.shape
    if weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight has {weight.shape[0]} channels, x has {channels}")
    width = weight.shape[1] - 1  # K - 1: how far back each output looks
    rows = batch
    if cu_seqlens is not None:
        offsets = host_to_device(check_cu_seqlens(cu_seqlens, batch_size=batch, total_len=length), x.device)
        rows = len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (rows, width, channels):
        raise ValueError(
            f"causal_conv1d: initial_state must be [{rows}, {width}, {channels}] (one row per sequence, last K-1 "
            f"inputs), got {tuple(initial_state.shape)}"
        )
    if seq_idx is not None and cu_seqlens is not None:
        raise ValueError("causal_conv1d: pass either cu_seqlens or seq_idx, not both")
    if (length == 1 and width > 0 and initial_state is not None and output_final_state and cu_seqlens is None
            and seq_idx is None and _takes_step_kernel(backend, x, weight, bias, initial_state)):
        in_place = state_in_place and initial_state.dtype == x.dtype and initial_state.stride(-1) == 1
        y, final = short_conv_step_triton(x[:, 0], initial_state.to(x.dtype), weight, bias, silu=activation == "silu",
                                          in_place=in_place)
        return y[:, None], final
    stateless = initial_state is None and not output_final_state
    kernels = _takes_kernels(backend, x, stateless)
    if cu_seqlens is not None and stateless and (kernels or packed_in_place(x, rows)):
        # Packed documents with no state in or out (training): the taps masked at the documents' starts on the
        # packed row itself, as for seq_idx, instead of the gapped row below.
        seq_idx, cu_seqlens = sequence_ids(offsets, length)[None], None  # [1, T]
    if kernels:
        return short_conv_triton(x, weight, bias, seq_idx=seq_idx, activation=activation), None
    if seq_idx is not None:
        segments = seq_idx_segments(seq_idx, (batch, length))  # [B, T]
        state = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(batch, width, channels)
        extended = torch.cat([state, x], dim=1)  # [B, K-1+T, C]
        # The carried state counts as the first segment's; tap k of output t reads extended[t + k].
        extended_segments = torch.cat([segments[:, :1].expand(batch, width), segments], dim=1)  # [B, K-1+T]
        keep = [(extended_segments[:, k : k + length] == segments)[..., None] for k in range(width + 1)]
        y = _shifted_sum(extended, weight, bias, keep=keep)  # [B, T, C]
        final = None
        if output_final_state:
            tail = extended_segments[:, extended.shape[1] - width :] == segments[:, -1:]  # [B, K-1]
            final = extended[:, extended.shape[1] - width :] * tail[..., None]
    elif cu_seqlens is None:
        # 1. Extended input: the carried K-1 inputs, then the new ones.  [B, K-1+T, C]
        state = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(batch, width, channels)
        extended = torch.cat([state, x], dim=1)
        y = _depthwise(extended, weight, bias)  # [B, T, C]
        final = extended[:, extended.shape[1] - width :] if output_final_state else None
    else:
        # 1. Extended packed row: every document gets its own K-1 slots of history in front of it.
        #    Token t of document n sits at t + (n + 1)(K - 1); the slots of document n start at
        #    offsets[n] + n(K - 1).                                               [1, T + N(K-1), C]
        seq = sequence_ids(offsets, length)  # [T]
        where = torch.arange(length, device=x.device) + (seq + 1) * width  # [T]
        extended = x.new_zeros(1, length + rows * width, channels)
        extended[0, where] = x[0]
        slots = torch.arange(width, device=x.device)
        docs = torch.arange(rows, device=x.device)
        if initial_state is not None:
            history = (offsets[:-1] + docs * width)[:, None] + slots  # [N, K-1]
            extended[0, history] = initial_state.to(x.dtype)
        # 2. Conv over the whole extended row; the output for a token at p is window [p-K+1, p].
        y_all = _depthwise(extended, weight, bias)  # [1, T + (N-1)(K-1), C]; output o covers extended[o : o+K]
        y = y_all[:, where - width]
        final = None
        if output_final_state:
            tail = (offsets[1:] + (docs + 1) * width - width)[:, None] + slots  # [N, K-1]
            final = extended[0, tail]
    if activation == "silu":
        y = F.silu(y)
    return y, final


def _takes_kernels(backend: str, x: torch.Tensor, stateless: bool) -> bool:
    """Whether `causal_conv1d` runs the Triton kernels (see its `backend`)."""
    if backend == "triton":
        if not stateless:
            raise ValueError("causal_conv1d: backend='triton' takes no initial_state and no output_final_state, "
                             "except in a decoding step (one token, both, no gradient); other carried states run on "
                             "backend='torch' or 'auto'")
        if not triton_runs_on(x):
            raise ValueError(f"causal_conv1d: backend='triton' needs triton and a CUDA tensor, got a {x.device.type} "
                             "tensor; use backend='auto'")
        if x.dtype not in TRITON_DTYPES:
            raise ValueError(f"causal_conv1d: backend='triton' takes float32, bfloat16 or float16, got {x.dtype}; "
                             "use backend='torch' or 'auto'")
        return True
    if backend != "auto" or not (stateless and x.is_cuda and x.dtype in TRITON_DTYPES):
        return False
    if torch.compiler.is_compiling():  # inductor fuses the torch form's shifted sum with its neighbours
        return False
    if not triton_available():
        warn_slow_path(NO_TRITON)
        return False
    return True


def _takes_step_kernel(backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       state: torch.Tensor) -> bool:
    """Whether a decoding step of `causal_conv1d` (checked by the caller) runs the step kernel."""
    if backend == "torch" or x.dtype not in TRITON_DTYPES or needs_grad(x, weight, bias, state):
        return False
    if backend == "triton":
        return triton_runs_on(x)
    return x.is_cuda and not torch.compiler.is_compiling() and triton_available()


NO_TRITON = ("causal_conv1d: triton is not installed, so the short convolutions' training calls on CUDA run the "
             "torch form (several kernels and float32 copies per call, where the Triton kernels take one forward and "
             "two backward): pip install triton")


# With the torch forms on a GPU in eager mode, packed rows whose documents average at most this many tokens run in
# place; longer ones on the gapped row, whose depthwise conv kernel is the faster for them
# (benchmarks/gpu_short_conv.py --packed).
IN_PLACE_MAX_MEAN_DOCUMENT = 1024


def packed_in_place(x: torch.Tensor, documents: int) -> bool:
    """Whether a packed row x [1, T, C] of `documents` documents, with no state in or out, runs in place (the taps
    masked at the documents' starts) rather than on the gapped row (K - 1 slots of history before each document):
    wherever `_depthwise` is the shifted sum anyway (CPU, torch.compile), where the gapped row only adds a scatter
    and a gather; else for documents of at most IN_PLACE_MAX_MEAN_DOCUMENT tokens on average."""
    if x.device.type == "cpu" or torch.compiler.is_compiling():
        return True
    return x.shape[1] <= documents * IN_PLACE_MAX_MEAN_DOCUMENT


def _depthwise(extended: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Valid depthwise conv along time: [B, L, C] -> [B, L-K+1, C].

    Two forms of one sum, each the faster where it is used (benchmarks/gpu_short_conv.py, benchmarks/RESULTS.md):
    under torch.compile K shifted multiply-adds, which inductor fuses with their neighbours; in eager mode on a GPU
    `F.conv1d`'s depthwise kernels, one kernel where the shifted form would launch K. On the CPU the shifted form:
    oneDNN's depthwise conv1d takes 0.2 to 30 ms for the small shapes of a decoding step (1 token x 384 channels),
    where the K multiply-adds take ~50 us."""
    if torch.compiler.is_compiling() or extended.device.type == "cpu":
        return _shifted_sum(extended, weight, bias)
    return _conv1d(extended, weight, bias)


def _conv1d(extended: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    channels = extended.shape[-1]
    out = F.conv1d(extended.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)
    return out.transpose(1, 2).to(extended.dtype)


def _shifted_sum(
    extended: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, keep: list | None = None
) -> torch.Tensor:
    """sum_k w[:, k] * extended[:, k : k + L-K+1] (+ bias) in float32 (float64 for float64 inputs); `keep[k]`
    ([B, L-K+1, 1] bool) drops tap k where it is False."""
    taps = weight.shape[1]
    length = extended.shape[1] - taps + 1
    dtype = torch.promote_types(torch.promote_types(extended.dtype, weight.dtype), torch.float32)
    w = weight.to(dtype)
    out = 0
    for k in range(taps):
        tap = extended[:, k : k + length].to(dtype) * w[:, k]
        out = out + (tap if keep is None else tap * keep[k])
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(extended.dtype)


class ShortConvolution(nn.Module):
    """`causal_conv1d` with its parameters: weight [C, K], optional bias [C], optional SiLU; `backend` as there."""

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True, activation: str | None = "silu") -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: kernel_size must be >= 1, got {kernel_size}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ShortConvolution: unknown activation {activation!r}; choose one of {_ACTIVATIONS}")
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.activation = activation
        self.backend = "auto"
        self.reset_parameters()

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[1]

    def reset_parameters(self) -> None:
        # torch's Conv1d default for a depthwise filter: U(-1/sqrt(K), 1/sqrt(K)) (fan_in = K).
        bound = self.kernel_size**-0.5
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        *,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        state_in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return causal_conv1d(
            x,
            self.weight,
            self.bias,
            activation=self.activation,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            seq_idx=seq_idx,
            backend=self.backend,
            state_in_place=state_in_place,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.weight.shape[0]}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
            f"activation={self.activation}, backend={self.backend}"
        )
