"""Shared helpers of the ops: argument checks, packed <-> padded layouts, backend choice (Triton's availability and
its interpreter, the warning when "auto" cannot take the kernels), dtypes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

_TRITON_FOUND = importlib.util.find_spec("triton") is not None  # looked up once: torch.compile cannot trace it
# The activations every Triton kernel of hybridlm.ops takes (float32 math inside); float64 stays on the torch paths.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SLOW_PATHS_WARNED: set[str] = set()  # the SlowPathWarning messages this process has issued


class SlowPathWarning(UserWarning):
    """`backend="auto"` ran an op on CUDA tensors through its torch path where it takes the Triton kernels for other
    shapes, dtypes or settings (slower, more memory). Silence it with
    `warnings.filterwarnings("ignore", category=SlowPathWarning)`."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: `triton.cdiv`'s value as plain integer arithmetic. Triton's host helpers are
    constexpr-function objects costing ~1.5 us a call, and a training layer computes dozens of grids and blocks."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0): `triton.next_power_of_2`'s value as plain integer arithmetic."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype recurrent math runs in: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on `tensors` (grad mode on and one of them requiring a gradient): the
    inference-only kernels (decoding steps) run only where it does not."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dim is unit-strided (what the kernels that take row strides read in place: a row
    slice of a wider projection output), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where each of its rows (t[i]) is contiguous, whatever the stride between rows (a row slice of a wider
    projection output), else a contiguous copy."""
    return t if t.dim() <= 1 or t.shape[0] == 0 or t[0].is_contiguous() else t.contiguous()


def on_tensor_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make `tensor`'s GPU the current one while kernels launch: Triton launches on the current device's stream,
    so a model on cuda:1 called from a process whose current device is cuda:0 would hand the kernels pointers of
    another device. A no-op on the CPU (the interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (packed offsets, gather indices) on `device`, without waiting for the device. A blocking
    host-to-device copy synchronizes the stream: the host waits for every queued kernel, once per layer and per
    packed batch. From pageable memory an asynchronous copy is staged at once, so the source may go right after."""
    return tensor.to(device, non_blocking=True)


# CUDA caps a launch grid's second and third dimensions at 65535 blocks. The Triton kernels of both ops launch one
# program per (sequence, head) on one of them, so a call with more sequences x heads runs in groups of sequences.
MAX_GRID_YZ = 65535
# The row-wise kernels (RMS norm, SiLU gate) index rows in int32, up to a program's last block of rows.
MAX_KERNEL_ROWS = 2**31 - 2**16


def launch_row_groups(n_rows: int, heads: int, *, max_programs: int = MAX_GRID_YZ) -> list[tuple[int, int]] | None:
    """None when one launch takes all `n_rows` sequences (batch rows, or packed sequences) x `heads` programs on a
    grid axis (at most `max_programs`): the usual case, decided without building a list, so that a compiled caller
    guards on the bound instead of specializing on the batch size. Otherwise [start, stop) ranges of as even sizes
    as fit, each an independent call (the sequences share nothing)."""
    if n_rows * heads <= max_programs:
        return None
    per_group = max(1, max_programs // heads)
    n_groups = -(-n_rows // per_group)
    size = -(-n_rows // n_groups)
    return [(start, min(start + size, n_rows)) for start in range(0, n_rows, size)]


def packed_group(offsets: torch.Tensor, start: int, stop: int) -> tuple[slice, torch.Tensor]:
    """The packed token range of sequences start..stop-1 and their offsets rebased to 0 (offsets: CPU int64)."""
    first, last = int(offsets[start]), int(offsets[stop])
    return slice(first, last), offsets[start:stop + 1] - first


def call_in_row_groups(call, steps: list, rows: list, *, heads: int, offsets: torch.Tensor | None, join_rows):
    """`call(steps, rows, offsets) -> (out, per_row)` once per group of sequences of `launch_row_groups` (once, as
    given, for the usual shapes), for the Triton front doors. `steps`: tensors laid out [B, T, ...] (or [1, total,
    ...] packed by `offsets`; None entries pass through), cut by rows or by packed token ranges; `rows`: one entry
    per sequence (a tensor or state sliced by `[start:stop]`, or None). The outputs `out` are joined along the rows
    (dim 0) or the packed tokens (dim 1), the per-sequence results by `join_rows(list)`."""
    n_rows = steps[0].shape[0] if offsets is None else len(offsets) - 1
    groups = launch_row_groups(n_rows, heads)
    if groups is None:
        return call(steps, rows, offsets)
    outputs, per_row = [], []
    for start, stop in groups:
        if offsets is None:
            cut, group_offsets = slice(start, stop), None
            group_steps = [None if t is None else t[cut] for t in steps]
        else:
            tokens, group_offsets = packed_group(offsets, start, stop)
            group_steps = [None if t is None else t[:, tokens] for t in steps]
        out, result = call(group_steps, [None if r is None else r[start:stop] for r in rows], group_offsets)
        outputs.append(out)
        per_row.append(result)
    return torch.cat(outputs, dim=0 if offsets is None else 1), join_rows(per_row)


def check_cu_seqlens(cu_seqlens: torch.Tensor, *, batch_size: int, total_len: int) -> torch.Tensor:
    """Validate packed-sequence offsets `[N + 1]` and return them as a CPU int64 tensor.

    Packed batches put every sequence end to end in one row, so `batch_size` must be 1; offsets start
    at 0, end at `total_len` and strictly increase (every sequence has at least one token).
    """
    if batch_size != 1:
        raise ValueError(
            f"cu_seqlens needs a packed batch with B == 1, got B = {batch_size}; "
            "concatenate the sequences along time into one row"
        )
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {type(cu_seqlens).__name__}; "
                         "wrap the offsets in torch.tensor(...)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    offsets = cu_seqlens.detach().to("cpu", torch.int64, copy=True)  # ours: the caller may reuse its (pinned) buffer
    if offsets[0].item() != 0 or offsets[-1].item() != total_len:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the packed length {total_len}, "
            f"got {offsets[0].item()} .. {offsets[-1].item()}"
        )
    if not bool((offsets[1:] > offsets[:-1]).all()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequences), got {offsets.tolist()}")
    return offsets


def seq_idx_segments(seq_idx: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A document index per step, seq_idx [b, T] (any integers), -> segments [b, T] int64 numbered from 0 in each
    row, +1 at every step whose id differs from the step before (an id that comes back after another document
    starts a new segment). Checks the shape and dtype only: nothing is read back from the device."""
    if tuple(seq_idx.shape) != tuple(shape) or seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be an integer tensor [b, T] = {list(shape)}, got {seq_idx.dtype} "
                         f"{list(seq_idx.shape)}")
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int64)  # [b, T - 1] (empty for T = 0)
    return torch.cat([changes.new_zeros(changes.shape[0], 1), changes.cumsum(dim=1)], dim=1)[:, : seq_idx.shape[1]]


def packed_to_padded(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`[1, total, ...]` packed along time -> `[N, max_len, ...]`, right-padded with zeros."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    max_len = max(lengths)
    out = x.new_zeros((len(lengths), max_len) + tuple(x.shape[2:]))
    index, rows = _scatter_index(offsets, x.device)
    out = out.index_put((rows, index), x[0])
    return out


def padded_to_packed(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`[N, max_len, ...]` right-padded -> `[1, total, ...]` packed along time (inverse of `packed_to_padded`)."""
    index, rows = _scatter_index(offsets, x.device)
    return x[rows, index].unsqueeze(0)


def _scatter_index(offsets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Built on the device from the host offsets (N + 1 numbers copied): copying [total] indices from pageable host
    # memory may wait for the stream while it is staged.
    total = int(offsets[-1])
    offsets = host_to_device(offsets, device)
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
    index = torch.arange(total, device=device) - offsets[:-1][rows]
    return index, rows


def triton_interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (`TRITON_INTERPRET=1`, Triton's own switch, read at each
    call): the kernels then take CPU tensors, and the sequential kernels loop with `while` (the interpreter cannot
    `range` over a runtime int with numpy >= 2.4)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """True when the Triton kernels can run here: triton is importable and a CUDA device is present."""
    return _TRITON_FOUND and torch.cuda.is_available()


KERNEL_BACKENDS = ("auto", "torch", "triton")  # the modules' kernel switch: "auto" chooses, the others force


def check_backend(caller: str, backend: str) -> None:
    """A ValueError naming `caller` for a backend other than KERNEL_BACKENDS."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"{caller}: unknown backend {backend!r}; choose one of {KERNEL_BACKENDS}")


def runs_kernels(caller: str, backend: str, tensor: torch.Tensor, auto) -> bool:
    """Whether `caller` runs its Triton kernels on `tensor` for `backend`: "triton" always (a ValueError where they
    cannot run on it), "torch" never, "auto" when `auto()` holds."""
    check_backend(caller, backend)
    if backend == "triton":
        if not triton_runs_on(tensor):
            raise ValueError(f"{caller}: backend='triton' needs triton and a CUDA tensor, got a {tensor.device.type} "
                             "tensor; use backend='auto'")
        return True
    return backend == "auto" and auto()


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can take `tensor`: triton installed and the tensor on a CUDA device, or any tensor
    under Triton's interpreter."""
    return (_TRITON_FOUND and tensor.is_cuda) or triton_interpreting()


def triton_chunk_size(chunk_size: int, *, cap: int) -> int:
    """The Triton kernels' chunk for a requested chunk length: the nearest power of two >= chunk_size, clamped to
    [16, cap] (tl.dot needs >= 16 rows). The chunk length changes the cost only, never the result."""
    return min(cap, max(16, 1 << (max(chunk_size, 1) - 1).bit_length()))


def warn_slow_path(message: str) -> None:
    """Issue `message` as a `SlowPathWarning` the first time this process meets it: once per reason, not once per
    layer and call. Reads no tensor (no host sync). Under torch.compile the warning is issued while dynamo traces
    the call (its `comptime` hook), so the graph neither breaks nor carries it."""
    if torch.compiler.is_compiling():  # dynamo is loaded then; eager calls never import it
        from torch._dynamo.comptime import comptime

        comptime(_warn_slow_path_traced)
        return
    _warn_slow_path_once(message)


def _warn_slow_path_traced(ctx) -> None:
    """Run by dynamo inside `warn_slow_path` while tracing it, where `message` is a constant."""
    _warn_slow_path_once(ctx.get_local("message").as_python_constant())


def _warn_slow_path_once(message: str) -> None:
    if message not in _SLOW_PATHS_WARNED:
        _SLOW_PATHS_WARNED.add(message)
        warnings.warn(message, SlowPathWarning, stacklevel=3)


def resolve_backend(backend: str, *, available: tuple[str, ...], default: str) -> str:
    """Map `backend` ("auto" or a name) to an implemented backend, with a clear error for unknown names."""
    if backend == "auto":
        return default
    if backend not in available:
        raise ValueError(f"unknown backend {backend!r}; choose one of {('auto',) + available}")
    return backend


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The local shard of a sharded DTensor parameter (the layers' per-head parameters under tensor
    parallelism), else the tensor itself. Duck-typed (`to_local`) so that the layers need no
    torch.distributed import."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param
