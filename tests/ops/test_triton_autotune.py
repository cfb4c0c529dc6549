"""Every Triton kernel of hybridlm.ops tunes through `hybridlm.ops.triton_autotune`: four launches with results
cached on disk by default, one fixed launch with HYBRIDLM_TRITON_AUTOTUNE=0 or under the interpreter. Checked in a
fresh interpreter, since the test session fixes HYBRIDLM_TRITON_AUTOTUNE=0 before the kernels load (triton_modes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ops.triton_modes import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

MODULES = ("hybridlm.ops.fast_weight.triton.kernels", "hybridlm.ops.fast_weight.triton.kernels_2",
           "hybridlm.ops.fast_weight.triton.kernels_2a", "hybridlm.ops.fast_weight.triton.kernels_delta",
           "hybridlm.ops.ssd.triton.kernels")

# Prints {kernel: [configs as "warps x stages", cache_results]} for every autotuned kernel of MODULES.
_REPORT = """
import importlib, json, sys
from triton.runtime.autotuner import Autotuner
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for attr, value in vars(module).items():
        if isinstance(value, Autotuner):
            out[f"{name}.{attr}"] = [[f"{c.num_warps}x{c.num_stages}" for c in value.configs], value.cache_results]
print(json.dumps(out))
"""


# The kernels whose fixed launch has 4 warps (the others': 8).
FOUR_WARPS = ("hybridlm.ops.ssd", "hybridlm.ops.fast_weight.triton.kernels_delta.tinv_kernel")


def autotuners(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("HYBRIDLM_TRITON_AUTOTUNE", "TRITON_INTERPRET")}
    result = subprocess.run([sys.executable, "-c", _REPORT, *MODULES], env={**clean, **env}, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout)


def test_kernels_tune_over_four_launches_with_cached_results():
    found = autotuners()
    assert len(found) == 19, sorted(found)  # 4 + 2 + 4 + 5 fast-weight kernels, 4 SSD kernels
    for kernel, (configs, cached) in found.items():
        assert sorted(configs) == ["4x1", "4x2", "8x1", "8x2"], kernel
        assert cached, kernel


@pytest.mark.parametrize("env", [{"HYBRIDLM_TRITON_AUTOTUNE": "0"}, {"TRITON_INTERPRET": "1"}],
                         ids=["fixed", "interpreter"])
def test_one_fixed_launch_without_tuning(env):
    for kernel, (configs, cached) in autotuners(**env).items():
        assert configs == ["4x2" if kernel.startswith(FOUR_WARPS) else "8x2"], kernel
        if "TRITON_INTERPRET" in env:
            assert not cached, kernel  # Triton never caches under its interpreter
