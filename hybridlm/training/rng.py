"""Capture and restore every global random-number generator a training loop draws from.

Covered: torch's CPU generator, every CUDA device's generator (when CUDA is available), numpy's legacy
global RandomState (`np.random.*`; `np.random.default_rng()` generators are objects the caller owns), and
Python's `random`. The state is a nested dict of tensors and JSON values (`hybridlm.training.tensor_tree`
stores it without pickle); restoring it makes every later draw identical to the run that saved it.

Equal draws are not enough on a GPU: kernels whose order of summation changes from call to call (atomic adds,
cuBLAS workspaces shared by streams) round differently each time, so two runs with one seed can part after a few
updates (benchmarks/RESULTS.md records such a same-seed rerun).
`deterministic_kernels()` makes torch pick deterministic kernels for the code inside it (`train.deterministic`,
`bench ... --deterministic`); an op that has none raises torch's RuntimeError naming it. It costs speed and is
for runs that must repeat bit for bit on the same hardware and software, not for every run.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The current state of all global generators (copies; later draws do not change it)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),  # uint32 values, stored as int64
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": int(version), "internal": [int(v) for v in internal], "gauss_next": gauss_next},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set all global generators from `capture_rng_state()` output.

    CUDA states are restored device by device; if the saved run had a different number of CUDA devices
    (or this one has none) the devices in common are restored and a warning says so.
    """
    torch.set_rng_state(state["torch_cpu"].to(torch.uint8))
    cuda_states = list(state.get("torch_cuda", []))
    if cuda_states:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available != len(cuda_states):
            warnings.warn(
                f"the checkpoint holds RNG states of {len(cuda_states)} CUDA device(s) but {available} are "
                f"available; restoring the first {min(available, len(cuda_states))}, so GPU random draws "
                "will differ from the saved run",
                stacklevel=2,
            )
        for index in range(min(available, len(cuda_states))):
            torch.cuda.set_rng_state(cuda_states[index].to(torch.uint8), device=index)
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))


# cuBLAS needs a fixed workspace per stream to be deterministic (CUDA's docs; torch raises without it in
# deterministic mode); kept if the user set one.
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(enabled: bool = True) -> Iterator[None]:
    """Inside: `torch.use_deterministic_algorithms(True)`, cuDNN deterministic without autotuning, and the cuBLAS
    workspace it needs; on leaving, the previous settings (so a test or a library caller is left as it was).
    `enabled=False` changes nothing, for callers that pass a config flag."""
    if not enabled:
        yield
        return
    cudnn = torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              cudnn.deterministic, cudnn.benchmark, os.environ.get(CUBLAS_WORKSPACE_VARIABLE))
    os.environ.setdefault(CUBLAS_WORKSPACE_VARIABLE, CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        mode, warn_only, cudnn.deterministic, cudnn.benchmark, workspace = before
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE_VARIABLE, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VARIABLE] = workspace
