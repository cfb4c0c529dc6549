"""Where the Triton tests run: on a GPU, or under Triton's CPU interpreter with HYBRIDLM_TRITON_INTERPRET=1.

Import this module before anything imports triton's kernels: it sets TRITON_INTERPRET for the interpreter
mode, and one launch configuration (HYBRIDLM_TRITON_AUTOTUNE=0) instead of autotuning, since the many test
shapes would each tune (compile time) over configurations that differ only in warps/stages.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("HYBRIDLM_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HYBRIDLM_TRITON_AUTOTUNE", "0")

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = not INTERPRET and HAS_TRITON and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# Runs on the GPU, and on the CPU under the interpreter.
interpret = pytest.mark.skipif(not (ON_GPU or (INTERPRET and HAS_TRITON)),
                               reason="needs CUDA + triton, or HYBRIDLM_TRITON_INTERPRET=1 with triton installed")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA + triton (too slow or unsupported in the interpreter)")
