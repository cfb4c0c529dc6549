"""Triton helpers shared by the kernels of `hybridlm.ops` (the fast-weight rules and the SSD scan): addressing of
rows, steps and per-chunk states, the power-of-two blocks the launchers pick, and the autotuner every kernel tunes
through. Imported only by kernel and launcher modules, which load where triton is installed.

Layouts: a `[N, T, H, D]` tensor is read per (row n, head h) program as rows t and columns `cols`; a per-step
`[N, T, H]` tensor as steps t; per-chunk states `[N * H, n_chunks, R, C]` as a block (rows, cols) of chunk c (with
n_chunks = 1 and c = 0: one `[N * H, R, C]` state). Offsets are int64 (past 2^31 elements); everything outside the
sizes is masked (zeros on load).

Autotuning: every kernel tunes over (4, 8) warps x (1, 2) pipeline stages for each new value of its `key` arguments
(and the tensors' dtypes). Whether it tunes is decided at each launch (`autotuning()`): under Triton's CPU
interpreter, or with HYBRIDLM_TRITON_AUTOTUNE=0 (repeatable launches for A/B timing), it launches one fixed
configuration (the kernel's `fixed_warps` warps, 2 stages) instead. Tuning results are cached on disk
(`cache_results=True`, in Triton's cache directory, `TRITON_CACHE_DIR`, by default `~/.triton/cache`), keyed by
Triton's version, the compiler target (ptxas and compute capability: an H100 and an H200 share entries), the kernel's
source, the configurations and the tuning key: a second process on the same machine and software skips the search,
which otherwise times every configuration of every kernel before a new process's first step. The key holds no
sequence length or batch: the first shape to reach a key (a short evaluation, a test) picks the launch for every
later process too. The cache holds timings, never results: a stale entry can only pick a slower launch, never a
wrong output. To tune afresh, delete the `*.autotune.json` files there.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from hybridlm.ops.utils import MAX_GRID_YZ, cdiv, next_power_of_2, triton_interpreting

TUNED_STAGES = (1, 2)  # the pipeline stages that autotuning tries (with 4 and 8 warps) unless a kernel names others


def block(dim: int, cap: int) -> int:
    """A power-of-two block (>= 16, the smallest tl.dot size) covering dim, at most cap."""
    return min(max(16, next_power_of_2(dim)), cap)


SPREAD_PROGRAMS = 256  # programs a row kernel keeps before one program walks several row blocks (~2 per SM)


def row_steps(rows: int, block_rows: int, most: int) -> int:
    """Row blocks each program walks: one while the rows' blocks give fewer than ~2 x SPREAD_PROGRAMS programs, more
    (a power of two, at most `most`) only as the rows grow past that. A decoding step's rows then spread over the SMs
    (64 rows of a [64, 768] norm: 32 programs of one block, not 4 programs walking 8 blocks each, one reduction after
    another), while a training batch's thousands of rows still share a program's set-up over `most` blocks. Powers
    of two keep the compiled variants few."""
    blocks = cdiv(max(rows, 1), block_rows)
    steps = 1
    while steps < most and blocks >= 2 * steps * SPREAD_PROGRAMS:
        steps *= 2
    return steps


def autotuning() -> bool:
    """Whether a launch tunes its configuration now: not under Triton's interpreter, nor with
    HYBRIDLM_TRITON_AUTOTUNE=0. Read at each launch, so that the switch holds whenever it is set."""
    return not triton_interpreting() and os.environ.get("HYBRIDLM_TRITON_AUTOTUNE") != "0"


class CallTimeAutotuner(Autotuner):
    """`triton.autotune` over 4 and 8 warps x `tuned_stages` (timings cached on disk) when `autotuning()` holds at the
    launch, else one launch of `fixed_config` (no timing, nothing cached).

    A launch whose key is tuned already goes straight to the kernel with the tuned configuration: the generic
    `Autotuner.run` builds dictionaries of every argument to find it (~10 us of host time per launch, dozens of
    launches per training layer). `tuning_key` computes the generic key's tuple itself, so both read one cache."""

    def __init__(self, fn, key: list[str], *, fixed_warps: int, fixed_stages: int = 2,
                 tuned_stages: tuple[int, ...] = TUNED_STAGES):
        configs = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in tuned_stages]
        super().__init__(fn, fn.arg_names, configs, key, None, None, cache_results=True)
        self.fixed_config = triton.Config({}, num_warps=fixed_warps, num_stages=fixed_stages)
        self._positions = {name: i for i, name in enumerate(self.arg_names)}

    def tuning_key(self, args: tuple, kwargs: dict) -> tuple:
        """`Autotuner.run`'s cache key: the `key` arguments' values, then the dtype (as a string) of every argument
        that has one, positional arguments first, then keyword arguments in call order (the kernel's own names)."""
        n = len(args)
        key = []
        for name in self.keys:
            i = self._positions.get(name)
            if i is not None and i < n:
                key.append(args[i])
            elif name in kwargs and name in self._positions:
                key.append(kwargs[name])
        for value in args[:len(self.arg_names)]:
            if hasattr(value, "dtype"):
                key.append(str(value.dtype))
        for name, value in kwargs.items():
            if name in self._positions and hasattr(value, "dtype"):
                key.append(str(value.dtype))
        return tuple(key)

    def run(self, *args, **kwargs):
        if not autotuning():
            self.best_config = self.fixed_config
            return self.fn.run(*args, **kwargs, **self.fixed_config.all_kwargs())
        config = self.cache.get(self.tuning_key(args, kwargs)) if len(self.configs) > 1 else None
        if config is None or config.pre_hook is not None:
            return super().run(*args, **kwargs)
        self.best_config = config
        return self.fn.run(*args, **kwargs, **config.all_kwargs())


def autotune(key: list[str], *, fixed_warps: int, fixed_stages: int = 2,
             tuned_stages: tuple[int, ...] = TUNED_STAGES):
    """Decorator: the jitted kernel under a `CallTimeAutotuner` for each new value of the `key` arguments."""
    return lambda fn: CallTimeAutotuner(fn, key, fixed_warps=fixed_warps, fixed_stages=fixed_stages,
                                        tuned_stages=tuned_stages)


@triton.jit
def load_rows(ptr, i_n, i_h, t, T, H, D: tl.constexpr, cols):
    """Rows t (< T) and columns `cols` (< D) of head i_h of a [N, T, H, D] tensor -> [len(t), len(cols)], zeros
    outside (a grouped tensor, as the SSD's B and C, is read with H = its groups and i_h = the group)."""
    offs = ((i_n.to(tl.int64) * T + t[:, None]) * H + i_h) * D + cols[None, :]
    return tl.load(ptr + offs, mask=(t[:, None] < T) & (cols[None, :] < D), other=0.0)


@triton.jit
def store_rows(ptr, value, i_n, i_h, t, T, H, D: tl.constexpr, cols):
    """`value` into rows t (< T), columns `cols` (< D) of head i_h of a [N, T, H, D] tensor, in its dtype."""
    offs = ((i_n.to(tl.int64) * T + t[:, None]) * H + i_h) * D + cols[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=(t[:, None] < T) & (cols[None, :] < D))


@triton.jit
def row_views(a_ptr, b_ptr, i_n, T, T_ab, H, A: tl.constexpr, B: tl.constexpr):
    """Pointers at which `load_rows` / `store_rows` with T rows reach row i_n's first T rows of an [N, T_ab, H, A]
    and an [N, T_ab, H, B] tensor (T_ab >= T): they offset row n by n T H D, the tensors hold n T_ab H D before it."""
    shift = i_n.to(tl.int64) * (T_ab - T) * H
    return a_ptr + shift * A, b_ptr + shift * B


@triton.jit
def load_steps(ptr, i_n, i_h, t, T, H):
    """Steps t (< T) of head i_h of a [N, T, H] tensor, in float32 (zeros outside)."""
    return tl.load(ptr + (i_n.to(tl.int64) * T + t) * H + i_h, mask=t < T, other=0.0).to(tl.float32)


@triton.jit
def state_offsets(i_nh, i_c, n_chunks, R: tl.constexpr, C: tl.constexpr, rows, cols):
    """Offsets and mask of the block (rows, cols) of chunk i_c's [R, C] state in a [N * H, n_chunks, R, C] buffer."""
    offs = ((i_nh.to(tl.int64) * n_chunks + i_c) * R + rows[:, None]) * C + cols[None, :]
    return offs, (rows[:, None] < R) & (cols[None, :] < C)
