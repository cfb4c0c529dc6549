"""Triton (GPU) kernels of the Falcon fast-weight rules. Importing this package never needs triton
(`chunk_1a.py`, `chunk_1.py`, `chunk_2a.py`, `chunk_2.py`, `prepare.py` and the kernel files, which do, are
imported on the first call).

- `fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, *, read_after, chunk_size)`: rule 1A on the prepared
  quantities of chunk.py's pipeline (write pairs, step sizes and log decays), forward and backward in Triton.
- `fast_weight_1_triton(...)`: rule 1 (regression, window 1) on the same prepared quantities, forward and backward
  in Triton.
- `fast_weight_3_triton(..., slots)`: rule 3 (sliding-window regression) as rule 1 over its write events, `slots`
  per step, on rule 1's kernels (the events of one step do not see each other's writes).
- `fast_weight_2a_triton(...)`: rule 2A (inner product, eta and log_gamma per value column, `[N, T, H, V]`) on the
  same prepared quantities, forward and backward in Triton.
- `fast_weight_2_triton(...)`: rule 2 (regression, eta and log_gamma per value column, `[N, T, H, V]`) on the
  same prepared quantities, forward and backward in Triton (not yet run on a GPU).
- All run as `torch.library` custom ops (`hybridlm::fast_weight_{1a,1,3,2a,2}_{fwd,bwd}`, `custom_ops.py`, registered
  on the first call), so `torch.compile` traces them; so does the fused write preparation of rules 1A and 1
  (`hybridlm::fast_weight_prepare_{fwd,bwd}`, `prepare.py`), which `fast_weight_triton` runs in place of chunk.py's
  `prepare_writes` for those rules.
- `fast_weight_triton(...)`: the same contract as `chunk.fast_weight_chunk` for the supported rules/options
  (`supports(...)`: rules 1A, 3A, 3 (window <= 64), and 1, 2A and 2 with window 1), i.e. what
  `fast_weight_attention(..., backend="triton")` runs.
- `is_available()`: triton importable and a CUDA device present.

The kernels also run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before triton is
imported): that is how the tests check them without a GPU (`HYBRIDLM_TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import importlib.util

import torch

# 3A runs on 1A's kernels over delayed writes plus a band kernel (frontend.py), 3 as 1 over its write
# events (a step's events do not see each other's writes); 1, 2A and 2: window 1 (2A, 2: decays per value column)
SUPPORTED_RULES = ("1A", "3A", "1", "2A", "3", "2")
# The rules `backend="auto"` sends to these kernels on CUDA: those whose compiled kernels have been checked and timed
# on a GPU (benchmarks/RESULTS.md: rule 1's forward + backward is 3.3x-13x faster than the chunk path). Rule 2A
# passes the GPU tests but has not been timed: it runs when asked for (`backend="triton"`); so does rule 3, which has
# not yet run on a GPU, and rule 2, which has not yet run on a GPU either.
AUTO_RULES = ("1A", "3A", "1")
MAX_HEAD_DIM = 128  # K and V
# Rules 1 and 3 take chunks of at most 64: at 128 rule 1's gradient kernels ask for more shared memory than an H200
# block has (227 KiB; ptxas for sm_90, bf16: `delta_grad_pass_kernel` 330 KB at K = V = 64, 265 KB at 32, 232.5 KB at
# 16), while chunks of 64 need at most 114 KB (the split gradient kernels of session 15: 82-99 KB at chunk 64,
# 164 KB at 128).
MAX_DELTA_CHUNK = 64
# Rule 3 lays each step out on the next power of two >= window slots; a chunk holds whole steps.
MAX_RULE_3_WINDOW = MAX_DELTA_CHUNK
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of q, k, v (float64 stays on the torch backends)


_TRITON_FOUND = importlib.util.find_spec("triton") is not None  # looked up once: torch.compile cannot trace it


def is_available() -> bool:
    """True when the Triton kernels can run here: triton is importable and a CUDA device is present."""
    return _TRITON_FOUND and torch.cuda.is_available()


def fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1A on prepared writes; see `custom_ops.fast_weight_1a_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_1a_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_1_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1 (window 1) on prepared writes; see `custom_ops.fast_weight_1_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_1_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_3_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64, slots: int):
    """Rule 3 as rule 1 over write events, `slots` per step; see `custom_ops.fast_weight_3_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_3_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size, slots=slots)


def fast_weight_2a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2A (eta, log_gamma per value column) on prepared writes; see `custom_ops.fast_weight_2a_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_2a_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_2_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2 (regression, eta and log_gamma per value column) on prepared writes; see
    `custom_ops.fast_weight_2_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_2_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def supports(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether `fast_weight_triton` handles this call (else use the chunk backend)."""
    windowed = window == 1 or rule == "3A" or (rule == "3" and window <= MAX_RULE_3_WINDOW)
    return rule in SUPPORTED_RULES and windowed and K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM and dtype in DTYPES


def fast_weight_triton(q, k, v, beta, lam, **options):
    """The op's backend contract (as `chunk.fast_weight_chunk`) on the Triton kernels; see `frontend.py`."""
    from hybridlm.ops.fast_weight.triton.frontend import fast_weight_triton as run

    return run(q, k, v, beta, lam, **options)


__all__ = ["AUTO_RULES", "DTYPES", "MAX_DELTA_CHUNK", "MAX_HEAD_DIM", "MAX_RULE_3_WINDOW", "SUPPORTED_RULES",
           "fast_weight_1_triton",
           "fast_weight_1a_triton", "fast_weight_2_triton", "fast_weight_2a_triton", "fast_weight_3_triton",
           "fast_weight_triton", "is_available", "supports"]
