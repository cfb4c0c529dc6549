"""The launch configurations every Triton kernel of `hybridlm.ops` tunes over, and the autotuner they share.

Imported only by the kernel modules, which load where triton is installed.

Tuning results are cached on disk (`cache_results=True`, in Triton's cache directory, `TRITON_CACHE_DIR`, by default
`~/.triton/cache`), keyed by Triton's version, the compiler target (ptxas and compute capability: an H100 and an
H200 share entries), the kernel's source, the configurations and the tuning key (the `key` arguments' values and
the tensors' dtypes): a second process on the same machine and software skips the search. Without the cache every
new process (each training run, each resume of a preempted job) times every configuration of every kernel again
before its first step: more than 150 s for rule 1's kernels alone on an H200 (benchmarks/RESULTS.md, session 15).
The key holds no sequence length or batch: the first shape to reach a key (a short evaluation, a test) picks the
launch for every later process too, as it did for the rest of one process before. The cache holds timings, never
results: a stale entry can only pick a slower launch, never a wrong output. To tune afresh, delete the
`*.autotune.json` files there.
"""

from __future__ import annotations

import os

import triton


def launch_configs(*, fixed_warps: int) -> list[triton.Config]:
    """(4, 8) warps x (1, 2) pipeline stages to tune over; one configuration (`fixed_warps` warps, 2 stages) under
    Triton's CPU interpreter, or with HYBRIDLM_TRITON_AUTOTUNE=0 (repeatable launches for A/B timing)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("HYBRIDLM_TRITON_AUTOTUNE") == "0":
        return [triton.Config({}, num_warps=fixed_warps, num_stages=2)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2)]


def autotune(key: list[str], *, fixed_warps: int):
    """`triton.autotune` over `launch_configs(fixed_warps=...)` for each new value of the `key` arguments (and the
    tensors' dtypes), its timings cached on disk (module docstring)."""
    return triton.autotune(configs=launch_configs(fixed_warps=fixed_warps), key=key, cache_results=True)
