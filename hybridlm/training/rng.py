"""Capture and restore every global random-number generator a training loop draws from.

Covered: torch's CPU generator, every CUDA device's generator (when CUDA is available), numpy's legacy
global RandomState (`np.random.*`; `np.random.default_rng()` generators are objects the caller owns), and
Python's `random`. The state is a nested dict of tensors and JSON values (`hybridlm.training.tensor_tree`
stores it without pickle); restoring it makes every later draw identical to the run that saved it.
"""

from __future__ import annotations

import random
import warnings
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
