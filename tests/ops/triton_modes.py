"""Where the Triton tests run: on a GPU, or under Triton's CPU interpreter with HYBRIDLM_TRITON_INTERPRET=1.

Imported before anything imports triton's kernels (tests/ops/conftest.py imports it first): it sets
TRITON_INTERPRET for the interpreter mode, and one launch configuration (HYBRIDLM_TRITON_AUTOTUNE=0) instead of
autotuning, since the many test shapes would each tune (compile time) over configurations that differ only in
warps/stages. Under the interpreter every kernel's memory accesses are also checked against its arguments
(`check_interpreted_bounds`). Also the harness that compiles kernels for sm_90 without a GPU (`compile_for_sm90`).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
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


def check_interpreted_bounds() -> None:
    """Make Triton's interpreter fail every load and store that a kernel makes (its mask's active lanes) outside the
    storages of the tensors it was launched with. On a GPU such an access faults (an illegal memory access, surfacing
    at some later call) or silently reads another tensor; the interpreter reads or writes host memory without a word,
    so without this check a kernel's out-of-bounds access passes every interpreted test. Patches the interpreter's
    launch (to record the arguments' storages) and its masked load and store; a Triton whose interpreter lacks them
    fails here, naming what is missing."""
    import numpy as np
    from triton.runtime import interpreter

    missing = [name for owner, name in ((interpreter.GridExecutor, "_init_args_hst"),
                                        (interpreter.InterpreterBuilder, "create_masked_load"),
                                        (interpreter.InterpreterBuilder, "create_masked_store"))
               if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(f"check_interpreted_bounds: this Triton's interpreter has no {missing}; update the check")
    ranges: list[tuple[int, int]] = []
    kernel = [""]
    init_args = interpreter.GridExecutor._init_args_hst
    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def recording_init(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges.clear()
        for arg in (*args_hst, *kwargs_hst.values()):
            if isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        kernel[0] = getattr(self.fn, "__name__", "?")
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        addresses, active = np.broadcast_arrays(ptrs.data.astype(np.uint64), mask.data.astype(bool))
        addresses = addresses[active]
        if addresses.size == 0:
            return
        end = addresses + np.uint64(np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        inside = np.zeros(addresses.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (addresses >= lo) & (end <= hi)
        if not inside.all():
            raise AssertionError(f"{kernel[0]}: {int((~inside).sum())} of {addresses.size} active {what} lanes fall "
                                 "outside every tensor the kernel was launched with")

    def checked_load(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interpreter.GridExecutor._init_args_hst = recording_init
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store


if INTERPRET and HAS_TRITON:
    check_interpreted_bounds()


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
    names them. Every pointer is 16-byte aligned, as a launch on tensors that torch allocated specializes it. Prints
    the shared memory it asks for, and every read of a uniform register that its SASS never set before."""
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # under the autotuner
    consts = {name: value for name, value in consts.items() if name in fn.arg_names}
    types = types or {}
    sig = {n: "constexpr" if n in consts else types.get(n) or (io if n in io_names else "*fp32" if n.endswith("_ptr")
                                                                else "i32")
           for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    print("built", fn.__name__, compiled.metadata.shared)
    for line in uniform_reads_before_writes(sass_of(compiled)):
        print("unset", fn.__name__, consts, line)
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


def sass_of(compiled) -> str:
    """The SASS of a kernel that `triton.compile` built for a CUDA target, from the cuobjdump that triton ships."""
    import os
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([cuobjdump, "--dump-sass", path], capture_output=True, text=True, check=True).stdout


def uniform_reads_before_writes(sass: str) -> list[str]:
    """The instructions of a kernel's SASS (`cuobjdump --dump-sass`) that read a uniform register (URn) which no
    instruction before them in program order writes, and the wgmma descriptor groups (`gdesc[URn]`, URn..URn+3) that
    no instruction of the kernel writes. Such a read takes whatever the register last held: ptxas 12.8 (the one
    triton 3.6 ships) builds some wgmma descriptors from a register it never sets, at some block shapes, and the
    kernel then reads shared memory at an address that changes from run to run, faulting or reading garbage. A
    straight-line scan: a loop that sets a register at its bottom before reading it at its top on the next iteration
    would be flagged too (ptxas sets loop-carried uniform registers before the loop)."""
    written, unset, descriptors = set(), [], []
    for line in sass.splitlines():
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][\w.]*)\s+([^;]*);", line)
        if found is None:
            continue
        pc, op, operands = found.groups()
        if op.startswith("HGMMA"):
            descriptors += [(pc, op, int(n)) for n in re.findall(r"gdesc\[UR(\d+)\]", operands)]
            continue
        if re.match(r"U?LOP3", op) and re.match(r"\s*U?P(\d|T)", operands):
            operands = operands.split(",", 1)[1]  # LOP3 with a predicate result: the register result comes next
        first, _, rest = operands.partition(",")
        target = re.fullmatch(r"\s*UR(\d+)\s*", first)
        sources = rest if target else operands  # a store's or compare's first operand is read
        unset += [f"{pc} {op} {operands.strip()}" for n in re.findall(r"\bUR(\d+)\b", sources)
                  if int(n) not in written][:1]
        if target:
            n = int(target.group(1))
            written.update((n, n + 1) if ".64" in op or ".WIDE" in op else (n,))
    unset += [f"{pc} {op} gdesc[UR{n}]" for pc, op, n in descriptors if not written & {n, n + 1, n + 2, n + 3}]
    return unset


def compile_for_sm90(script: str, *, modules: tuple[str, ...], timeout: int = 600) -> dict:
    """Run `script` (calls of `build(kernel, consts, io=..., io_names=..., warps=...)`) in a subprocess without
    TRITON_INTERPRET, after the definition of `build`. Returns {"built": {kernel: largest shared memory in bytes over
    its builds}, "defined": the names of the `*_kernel` Triton functions of `modules`} for the caller's assertions;
    a build that does not compile, or whose SASS reads a uniform register that it never set
    (`uniform_reads_before_writes`), fails here, with its error output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    checker = "import re\n" + inspect.getsource(sass_of) + inspect.getsource(uniform_reads_before_writes)
    code = checker + _SM90_BUILD + script + f"\nMODULES = {list(modules)!r}\n" + _SM90_DEFINED
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    built, defined, unset = {}, set(), []
    for line in result.stdout.splitlines():
        what, name, *rest = line.split()
        if what == "built":
            built[name] = max(built.get(name, 0), int(rest[0]))
        elif what == "defined":
            defined.add(name)
        elif what == "unset":
            unset.append(line)
    assert not unset, ("ptxas built kernels that read uniform registers they never set (garbage descriptors or "
                       "addresses at run time; pick other block shapes for these sizes):\n" + "\n".join(unset[:20]))
    return {"built": built, "defined": defined}
