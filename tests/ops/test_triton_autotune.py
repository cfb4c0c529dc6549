"""Every Triton kernel of hybridlm.ops tunes through `hybridlm.ops.triton_utils.autotune`: four launches (six for
`grad_qxy_kernel`) with results cached on disk, decided at each launch: one fixed launch instead with
HYBRIDLM_TRITON_AUTOTUNE=0 or under the interpreter, whenever the switch is set. Checked in fresh interpreters (no
GPU needed: the launches are recorded, not run), since the test session sets HYBRIDLM_TRITON_AUTOTUNE=0
(triton_modes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ops.triton_modes import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

MODULES = tuple(f"hybridlm.ops.fast_weight.triton.{name}" for name in (
    "decays", "chunk_state", "chunk_output", "inner_product_kernels", "wy", "regression_kernels", "band", "prepare",
)) + ("hybridlm.ops.ssd.triton.kernels", "hybridlm.ops.short_conv.kernels", "hybridlm.ops.gated_norm.kernels",
     "hybridlm.ops.rms_norm.kernels", "hybridlm.ops.silu_gate.kernels")

# Imports MODULES with the environment it is given, then prints, for every autotuned kernel, its configurations,
# whether it caches them, and the launch each of four call-time settings makes: the switch unset, set to 0, the
# interpreter on, and unset again. The jitted function's launch is recorded instead of run, and a tuning launch
# (the autotuner's own `run`) is recorded as "tuned".
_REPORT = """
import importlib, json, os, sys
from triton.runtime.autotuner import Autotuner
from hybridlm.ops.triton_utils import CallTimeAutotuner

launches = []
Autotuner.run = lambda self, *args, **kwargs: launches.append("tuned")
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for attr, value in vars(module).items():
        if isinstance(value, Autotuner):
            value.fn.run = lambda *args, **kwargs: launches.append(f"{kwargs['num_warps']}x{kwargs['num_stages']}")
            seen = []
            for setting in ({}, {"HYBRIDLM_TRITON_AUTOTUNE": "0"}, {"TRITON_INTERPRET": "1"}, {}):
                for key in ("HYBRIDLM_TRITON_AUTOTUNE", "TRITON_INTERPRET"):
                    os.environ.pop(key, None)
                os.environ.update(setting)
                launches.clear()
                value[(1,)]()
                seen += launches
            out[f"{name}.{attr}"] = {"configs": [f"{c.num_warps}x{c.num_stages}" for c in value.configs],
                                     "cached": value.cache_results, "call_time": isinstance(value, CallTimeAutotuner),
                                     "launches": seen}
print(json.dumps(out))
"""

# The kernels whose fixed launch has 4 warps (the others': 8).
FOUR_WARPS = ("hybridlm.ops.ssd", "hybridlm.ops.gated_norm.kernels.gated_norm_fwd_kernel",
              "hybridlm.ops.short_conv.kernels.short_conv_fwd_kernel",
              "hybridlm.ops.short_conv.kernels.short_conv_bwd_input_kernel",
              "hybridlm.ops.fast_weight.triton.wy.tinv_kernel", "hybridlm.ops.rms_norm",
              "hybridlm.ops.silu_gate")
# Kernels whose launches differ from the rest: their fixed launch and the stages they tune over.
OWN_LAUNCHES = {"hybridlm.ops.fast_weight.triton.inner_product_kernels.grad_qxy_kernel": ("4x3", (1, 2, 3))}


def autotuners(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("HYBRIDLM_TRITON_AUTOTUNE", "TRITON_INTERPRET")}
    result = subprocess.run([sys.executable, "-c", _REPORT, *MODULES], env={**clean, **env}, capture_output=True,
                            text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_kernels_tune_over_warps_and_stages_with_cached_results():
    found = autotuners()
    assert len(found) == 29, sorted(found)  # 15 fast-weight, 4 SSD, 3 short conv, 3 RMS norm, 2 each gated norm, gate
    for kernel, report in found.items():
        stages = OWN_LAUNCHES.get(kernel, (None, (1, 2)))[1]
        assert sorted(report["configs"]) == sorted(f"{w}x{s}" for w in (4, 8) for s in stages), kernel
        assert report["cached"] and report["call_time"], kernel


@pytest.mark.parametrize("env", [{}, {"HYBRIDLM_TRITON_AUTOTUNE": "0"}], ids=["loaded-tuning", "loaded-fixed"])
def test_the_switch_is_read_at_each_launch(env):
    """Whatever the environment when the kernels load, each launch follows the switch as it is then: it tunes with the
    switch unset, launches the kernel's fixed configuration with HYBRIDLM_TRITON_AUTOTUNE=0 or under the
    interpreter, and tunes again once the switch is unset."""
    for kernel, report in autotuners(**env).items():
        fixed = OWN_LAUNCHES.get(kernel, ("4x2" if kernel.startswith(FOUR_WARPS) else "8x2",))[0]
        assert report["launches"] == ["tuned", fixed, fixed, "tuned"], kernel


def test_a_tuned_key_launches_without_the_generic_lookup(monkeypatch):
    """`CallTimeAutotuner.tuning_key` is the generic `Autotuner.run`'s cache key (positional and keyword arguments,
    their dtypes), so a launch whose key is tuned goes straight to the kernel with the tuned configuration; a new
    key (another `key` value, another dtype) takes the generic path and tunes. No GPU: the launches are recorded."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    from hybridlm.ops import triton_utils

    @triton.jit
    def probe_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)) * scale)

    tuner = triton_utils.CallTimeAutotuner(probe_kernel, ["n", "BLOCK"], fixed_warps=4)
    tuner.cache_results = False  # no disk cache in a test
    best = tuner.configs[2]
    tuner._bench = lambda *args, config, **meta: 1.0 if config is best else 2.0  # what tuning measures
    launched = []
    tuner.fn.run = lambda *args, **kwargs: launched.append((args, kwargs))
    monkeypatch.setattr(triton_utils, "autotuning", lambda: True)
    x, y = torch.zeros(64), torch.zeros(64)

    tuner[(1,)](x, y, 100, 2.0, BLOCK=64)  # tunes: the generic path fills the cache
    assert list(tuner.cache) == [tuner.tuning_key((x, y, 100, 2.0), {"grid": (1,), "warmup": False, "BLOCK": 64})]
    assert tuner.cache[tuner.tuning_key((x, y, 100, 2.0), {"BLOCK": 64})] is best

    def generic(self, *args, **kwargs):
        raise LookupError("the generic path")

    monkeypatch.setattr(Autotuner, "run", generic)
    launched.clear()
    tuner[(1,)](x, y, 100, 3.0, BLOCK=64)  # the same key (scale is no key argument)
    (args, kwargs), = launched
    assert args == (x, y, 100, 3.0) and kwargs["BLOCK"] == 64 and kwargs["grid"] == (1,)
    assert (kwargs["num_warps"], kwargs["num_stages"]) == (best.num_warps, best.num_stages)
    assert tuner.best_config is best
    # a config read back from the disk cache is an equal object, not the same one; keyword tensors count by dtype
    key = next(iter(tuner.cache))
    loaded = tuner.cache[key] = triton.Config({}, num_warps=best.num_warps, num_stages=best.num_stages)
    launched.clear()
    tuner[(1,)](x, y_ptr=y, n=100, scale=2.0, BLOCK=64)
    (args, kwargs), = launched
    assert args == (x,) and kwargs["y_ptr"] is y and tuner.best_config is loaded
    for args, kwargs in [((x, y, 101, 2.0), {"BLOCK": 64}), ((x, y, 100, 2.0), {"BLOCK": 32}),
                         ((x.half(), y, 100, 2.0), {"BLOCK": 64}), ((x, y.double(), 100, 2.0), {"BLOCK": 64}),
                         ((x,), {"y_ptr": y.double(), "n": 100, "scale": 2.0, "BLOCK": 64})]:
        with pytest.raises(LookupError, match="the generic path"):
            tuner[(1,)](*args, **kwargs)
