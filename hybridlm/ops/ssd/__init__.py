"""Mamba-2 SSD (state-space duality) op: the front door `ssd` and its backends.

Backends: "naive" (loop over time steps, the specification, `naive.py`), "chunk" (the chunked SSD algorithm in
plain torch, `chunk.py`) and "triton" (the chunked algorithm in Triton kernels, `triton/`). "auto" picks "triton"
for bf16/fp16 CUDA tensors it supports when triton is installed, "chunk" otherwise: for float32 (its kernels spill
registers and are not the timed path) and with `seq_idx` (only the torch backends take it: the compiled blocks'
packed path, which keeps the mixer inside the graphs). benchmarks/RESULTS.md times the Triton kernels against the
chunk path. Where "auto" leaves 16-bit CUDA inputs without `seq_idx` on the chunk path (heads over 128, a state over
256, triton missing) it warns once per reason and process (`SlowPathWarning`); float32, float64 and `seq_idx` are its
choices and do not warn. A single step (T = 1: decoding) "auto" runs as the naive step, or on CUDA, where no gradient
is recorded, as one Triton kernel (`triton/step.py`). The math: README.md in this folder.
"""

from __future__ import annotations

import torch

from hybridlm.ops.ssd.chunk import chunk_ssd
from hybridlm.ops.ssd.naive import naive_ssd
from hybridlm.ops.ssd.triton import auto_takes as triton_auto_takes
from hybridlm.ops.ssd.triton import is_available as triton_is_available
from hybridlm.ops.ssd.triton import slow_path_reason as triton_slow_path_reason
from hybridlm.ops.ssd.triton import ssd_triton
from hybridlm.ops.ssd.triton import supports as triton_supports
from hybridlm.ops.utils import (
    check_cu_seqlens,
    compute_dtype,
    call_in_row_groups,
    needs_grad,
    resolve_backend,
    seq_idx_segments,
    triton_runs_on,
    warn_slow_path,
)

__all__ = ["ssd", "naive_ssd", "chunk_ssd", "runs_triton", "ssd_decoding_step", "ssd_step_fuses"]

_BACKENDS = ("naive", "chunk", "triton")
_NO_TRITON = ("triton is not installed: backend='auto' runs the Mamba-2 SSD on CUDA through the torch chunk path "
              "(slower, more memory); install triton for its Triton kernels")


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    chunk_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2 SSD: per head, `h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T` and `y_t = h_t C_t + D x_t`.

    Args:
        x: `[b, T, H, P]` inputs per head.
        dt: `[b, T, H]` step sizes, already softplus-ed and limited (>= 0).
        A: `[H]` negative reals (the log decay per unit dt).
        B, C: `[b, T, G, N]` write and read vectors; head h uses group h // (H // G).
        D: optional `[H]` skip, `y += D[h] * x`.
        chunk_size: chunk length of the "chunk" backend.
        initial_state: `[b, H, P, N]` (`[N_seq, H, P, N]` with `cu_seqlens`); zeros if None.
        output_final_state: also return the state after the last step.
        cu_seqlens: `[N_seq + 1]` int offsets of packed sequences (b == 1); each sequence starts from its
            own row of `initial_state` and none sees another.
        seq_idx: `[b, T]` integer document index of every step: the state restarts from zero wherever it changes
            from one step to the next (the first step continues `initial_state`); the final state is the last
            document's. The alternative to `cu_seqlens` for compiled training on packed documents: the shapes stay
            the rows' (no padding per document, nothing read on the host). Backends "naive" and "chunk" ("auto"
            takes "chunk").
        backend: "auto", "naive", "chunk" or "triton" (CUDA tensors and triton installed; x, B, C in float32,
            bfloat16 or float16, P <= 128, N <= 256; "auto" takes it for bf16/fp16 ones, else "chunk", and warns
            once per reason where bf16/fp16 CUDA inputs without seq_idx miss it). For T == 1 "auto" takes "naive",
            or on CUDA, without a gradient to record and without cu_seqlens, the Triton step kernel.

    Returns:
        `(y, final_state)`: y `[b, T, H, P]` in x's dtype; final_state `[b or N_seq, H, P, N]` in float32
        (float64 for float64 inputs) when `output_final_state`, else None. The recurrence runs in that
        dtype too, whatever the input dtype.
    """
    _check_shapes(x, dt, A, B, C, D, initial_state, chunk_size)
    b, T, H, P = x.shape
    N = B.shape[-1]
    inference = not needs_grad(x, dt, A, B, C, D, initial_state)
    backend = _backend(x, B, C, seq_idx=seq_idx, backend=backend, inference=inference and cu_seqlens is None)
    segments = None
    if seq_idx is not None:
        segments = _segments(seq_idx, x.shape[:2], cu_seqlens=cu_seqlens, backend=backend)
    offsets = None
    n_states = b
    if cu_seqlens is not None:
        offsets = check_cu_seqlens(cu_seqlens, batch_size=b, total_len=T)
        n_states = len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_states, H, P, N):
        rows = "N_seq" if cu_seqlens is not None else "b"
        raise ValueError(
            f"initial_state must be [{rows}, H, P, N] = {[n_states, H, P, N]}, got {list(initial_state.shape)}"
        )

    if backend == "triton":  # x, B, C keep their dtype (bf16/fp16 matmuls); dt, A, D and the state run in float32
        with torch.autocast(x.device.type, enabled=False):
            y, final_state = _triton_in_row_groups(x, dt, A, B, C, D=D, chunk_size=chunk_size,
                                                   initial_state=initial_state, offsets=offsets)
        return y, (final_state if output_final_state else None)

    promoted = x.dtype
    for t in (dt, A, B, C):
        promoted = torch.promote_types(promoted, t.dtype)
    dtype = compute_dtype(promoted)
    if initial_state is None:
        initial_state = x.new_zeros(n_states, H, P, N, dtype=dtype)
    args = [t.to(dtype) for t in (x, dt, A, B, C)]
    kwargs = dict(D=None if D is None else D.to(dtype), initial_state=initial_state.to(device=x.device, dtype=dtype),
                  offsets=offsets, segments=segments)
    # The recurrence stays in `dtype` under a caller's bf16 autocast (its einsums would otherwise run in bf16).
    with torch.autocast(x.device.type, enabled=False):
        if backend == "naive":
            y, final_state = naive_ssd(*args, **kwargs)
        else:
            y, final_state = chunk_ssd(*args, chunk_size=chunk_size, **kwargs)
    return y.to(x.dtype), (final_state if output_final_state else None)


def _triton_in_row_groups(x, dt, A, B, C, *, D, chunk_size, initial_state, offsets):
    """`ssd_triton` once per group of sequences that keeps its launches within CUDA's grid: one call for the usual
    shapes; more for sequences x heads > 65535, whose outputs and final states are joined in order
    (`call_in_row_groups`)."""

    def call(steps, rows, group_offsets):
        group_x, group_dt, group_B, group_C = steps
        return ssd_triton(group_x, group_dt, A, group_B, group_C, D=D, chunk_size=chunk_size, initial_state=rows[0],
                          offsets=group_offsets)

    return call_in_row_groups(call, [x, dt, B, C], [initial_state], heads=x.shape[2], offsets=offsets,
                              join_rows=torch.cat)


def ssd_step_fuses(x: torch.Tensor, B: torch.Tensor, *, backend: str = "auto") -> bool:
    """Whether a decoding step of x [b, 1, H, P] and B, C [b, 1, G, N] (one dtype) without a gradient to record runs
    the step kernel (as `ssd` would), so that the Mamba-2 mixer can hand the kernel its discretization as well
    (`ssd_decoding_step`). Metadata only."""
    return (x.dim() == 4 and x.shape[1] == 1 and triton_supports(P=x.shape[-1], N=B.shape[-1], dtype=x.dtype)
            and B.dtype == x.dtype and _backend(x, B, B, seq_idx=None, backend=backend, inference=True) == "triton"
            and triton_runs_on(x))


def ssd_decoding_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    gate: tuple[torch.Tensor, float] | None = None,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the Mamba-2 mixer from its raw discretization inputs, in one kernel (where
    `ssd_step_fuses`): the same values as `ssd` on dt = clamp(softplus(dt + dt_bias), *dt_limit) and
    A = -exp(A_log), both in float32.

    Args:
        x: `[b, 1, H, P]`, B, C: `[b, 1, G, N]` (one dtype; row slices are read in place). dt: `[b, 1, H]` the raw
            step sizes (any float dtype). A_log, dt_bias, D: `[H]`. initial_state: `[b, H, P, N]` (None: zeros).
        gate: None, or `(z [b, 1, d_ssm], m_z)`: y comes out as the mixer's output gate without a norm gives it,
            `silu_gate(y, m_z z)` (y and m_z z rounded to their dtype first); z in x's dtype (row slices read in
            place).
        state_in_place: write the state after the step over `initial_state` and return it (a fixed-address cache
            that a replayed CUDA graph reads, `hybridlm.layers.cache.LayerCache.states_in_place`); only where it is
            float32 and contiguous, else the state comes back in a new tensor.

    Returns:
        `(y [b, 1, H, P] in x's dtype (gated, with `gate`), the state after the step [b, H, P, N] float32)`.
    """
    from hybridlm.ops.ssd.triton import ssd_step_triton

    if x.dim() != 4 or x.shape[1] != 1:
        raise ValueError(f"ssd_decoding_step takes one step, x [b, 1, H, P]; got {list(x.shape)}")
    b, _, H, P = x.shape
    h0 = (x.new_zeros(b, H, P, B.shape[-1], dtype=torch.float32) if initial_state is None
          else initial_state.to(torch.float32))
    in_place = state_in_place and h0 is initial_state and h0.is_contiguous()
    with torch.autocast(x.device.type, enabled=False):
        y, final = ssd_step_triton(x[:, 0], dt[:, 0], A_log, B[:, 0], C[:, 0], D, h0,
                                   discretize=(dt_bias, dt_limit),
                                   gate=None if gate is None else (gate[0][:, 0], gate[1]), in_place=in_place)
    return y[:, None], final


def runs_triton(x, B, *, seq_idx=None, backend="auto") -> bool:
    """Whether `ssd(x, dt, A, B, C, ...)` runs the Triton kernels, C like B (metadata only)."""
    return _backend(x, B, B, seq_idx=seq_idx, backend=backend) == "triton"


def _backend(x, B, C, *, seq_idx, backend, inference=False) -> str:
    """The backend a call runs: the Triton kernels for 16-bit CUDA inputs they take without seq_idx, else the chunk
    path; a single step (T = 1) the naive step, or on CUDA the step kernel where it takes the call (`inference`: no
    gradient to record and no packed sequences; x, B, C in any of the kernels' dtypes). "auto" on such inputs that
    the kernels would take but for their head or state size or a missing triton warns (once per reason) that it runs
    the chunk path."""
    P, N = x.shape[-1], B.shape[-1]
    dtype = torch.promote_types(torch.promote_types(x.dtype, B.dtype), C.dtype)  # of the kernels' matmul operands
    takes = triton_auto_takes(P=P, N=N, dtype=dtype)
    if x.shape[1] == 1 and seq_idx is None:
        step_kernel = inference and x.is_cuda and triton_supports(P=P, N=N, dtype=dtype) and triton_is_available()
        return resolve_backend(backend, available=_BACKENDS, default="triton" if step_kernel else "naive")
    on_gpu = x.is_cuda and seq_idx is None and takes and triton_is_available()
    if backend == "auto" and x.is_cuda and seq_idx is None and not on_gpu:  # metadata only: no host sync
        reason = _NO_TRITON if takes else triton_slow_path_reason(P=P, N=N, dtype=dtype)
        if reason is not None:
            warn_slow_path(reason)
    return resolve_backend(backend, available=_BACKENDS, default="triton" if on_gpu else "chunk")


def _segments(seq_idx: torch.Tensor, shape: torch.Size, *, cu_seqlens, backend: str) -> torch.Tensor:
    if cu_seqlens is not None:
        raise ValueError("pass either cu_seqlens (packed offsets) or seq_idx (a document index per step), not both")
    if backend == "triton":
        raise ValueError("the Triton backend takes cu_seqlens, not seq_idx; use backend='chunk' (or 'auto')")
    return seq_idx_segments(seq_idx, shape)


def _check_shapes(x, dt, A, B, C, D, initial_state, chunk_size) -> None:
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("initial_state", initial_state)):
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: put every input on one device")
    if x.dim() != 4:
        raise ValueError(f"x must be [b, T, H, P], got shape {list(x.shape)}")
    b, T, H, P = x.shape
    if tuple(dt.shape) != (b, T, H):
        raise ValueError(f"dt must be [b, T, H] = {[b, T, H]} (matching x), got {list(dt.shape)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"A must be [H] = [{H}], got {list(A.shape)}")
    if D is not None and tuple(D.shape) != (H,):
        raise ValueError(f"D must be None or [H] = [{H}], got {list(D.shape)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, T):
        raise ValueError(f"B must be [b, T, G, N] with b, T = {b}, {T} (matching x), got {list(B.shape)}")
    if tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"C must have B's shape [b, T, G, N] = {list(B.shape)}, got {list(C.shape)}")
    G = B.shape[2]
    if G == 0 or H % G != 0:
        raise ValueError(f"the number of heads H = {H} must be a multiple of the number of groups G = {G}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if initial_state is not None and initial_state.dim() != 4:
        raise ValueError(f"initial_state must be [b, H, P, N], got shape {list(initial_state.shape)}")
