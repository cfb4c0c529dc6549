"""Where the Triton tests run: on a GPU, or under Triton's CPU interpreter with HYBRIDLM_TRITON_INTERPRET=1.

Imported before anything imports triton's kernels (tests/ops/conftest.py imports it first): it sets
TRITON_INTERPRET for the interpreter mode, and one launch configuration (HYBRIDLM_TRITON_AUTOTUNE=0) instead of
autotuning, since the many test shapes would each tune (compile time) over configurations that differ only in
warps/stages. Also the harness that compiles kernels for sm_90 without a GPU (`compile_for_sm90`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

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

# Elementwise and row-wise kernels (norms, gates, short conv) against their float64 references, by input dtype.
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def skip_bfloat16_interpreted(dtype: torch.dtype) -> None:
    """The interpreter computes in numpy, which has no bfloat16: float16 covers the 16-bit path there, bfloat16 runs
    on the GPU."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("bfloat16 is checked on the GPU; float16 covers the 16-bit path under the interpreter")


# Compiling kernels to PTX for sm_90 without a GPU: the interpreter never runs the compiled path (its typing of
# 3-D tensors, reductions, register allocation), so each kernel file has a test that builds every kernel.
needs_cuda_backend = pytest.mark.skipif(
    not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs triton with its CUDA backend (no GPU needed)")

_SM90_BUILD = '''
import functools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(kernel, consts, *, io="*fp32", io_names=(), warps=4, stages=3, types=None):
    """Compile `kernel` for sm_90 with `warps` warps and `stages` pipeline stages: the constexprs in `consts` that it
    takes, pointers named in io_names of type io, the other pointers *fp32, the other arguments i32 unless `types`
    names them."""
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # under the autotuner
    consts = {name: value for name, value in consts.items() if name in fn.arg_names}
    types = types or {}
    sig = {n: "constexpr" if n in consts else types.get(n) or (io if n in io_names else "*fp32" if n.endswith("_ptr")
                                                                else "i32")
           for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    print("built", fn.__name__, compiled.metadata.shared)
'''

_SM90_DEFINED = '''
import importlib
for name in MODULES:
    for attr, value in vars(importlib.import_module(name)).items():
        if isinstance(value, (triton.runtime.JITFunction, triton.runtime.Autotuner)) and attr.endswith("_kernel"):
            print("defined", attr)
'''

# An H200 block has 227 KiB of shared memory: a kernel that asks for more compiles, and fails at launch.
H200_SHARED_BYTES = 232448


def compile_for_sm90(script: str, *, modules: tuple[str, ...], timeout: int = 600) -> dict:
    """Run `script` (calls of `build(kernel, consts, io=..., io_names=..., warps=...)`) in a subprocess without
    TRITON_INTERPRET, after the definition of `build`. Returns {"built": {kernel: largest shared memory in bytes over
    its builds}, "defined": the names of the `*_kernel` Triton functions of `modules`} for the caller's assertions;
    a build that does not compile fails here, with its error output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _SM90_BUILD + script + f"\nMODULES = {list(modules)!r}\n" + _SM90_DEFINED
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    built, defined = {}, set()
    for line in result.stdout.splitlines():
        what, name, *rest = line.split()
        if what == "built":
            built[name] = max(built.get(name, 0), int(rest[0]))
        elif what == "defined":
            defined.add(name)
    return {"built": built, "defined": defined}
