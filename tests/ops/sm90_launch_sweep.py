"""Build, for sm_90, every Triton launch that interpreted op tests make, and check each build's SASS.

The sm_90 test builds (`triton_modes.compile_for_sm90`) cover each kernel at a model's sizes and a few odd ones. The
interpreted tests launch the kernels at many more block shapes, dtypes and flags, which on a GPU would each be a
build of their own. This tool records every such launch (the kernel, its constexprs, and the specialization that a
CUDA launch would derive from the same arguments: pointer dtypes and alignment, integers equal to 1 or divisible by
16, warps and stages; float16 launches also as bfloat16), builds each distinct one for sm_90 without a GPU, and reports the builds whose SASS reads a
uniform register that it never set (`triton_modes.uniform_reads_before_writes`: ptxas 12.8 miscompiles some block
shapes that way, and the kernel then faults or reads garbage on the GPU). It takes minutes per test file, so it is a
tool to run when kernels or their launch rules change, not part of the suite:

    HYBRIDLM_TRITON_INTERPRET=1 python -m tests.ops.sm90_launch_sweep tests/ops/test_triton_rule1.py -k 1A

Arguments are pytest's. Exits 1 if a build reads an unset register or fails to compile.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import subprocess
import sys
import tempfile

WORKERS = os.cpu_count() or 1


def _constexpr_params(fn) -> set[str]:
    return {name for name, annotation in getattr(fn, "__annotations__", {}).items()
            if "constexpr" in str(annotation)}


def _specialization(kernel, fn, args: tuple, kwargs: dict) -> dict:
    """The build a CUDA launch of `kernel` (an InterpretedFunction over `fn`) with these arguments would make."""
    import inspect

    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names = list(inspect.signature(fn).parameters)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    constexprs = _constexpr_params(fn)
    options = kernel.kwargs
    unspecialized = {names[p] if isinstance(p, int) else p for p in options.get("do_not_specialize") or ()}
    unaligned = {names[p] if isinstance(p, int) else p for p in options.get("do_not_specialize_on_alignment") or ()}
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = bound.get(name, inspect.signature(fn).parameters[name].default)
        if name in constexprs:  # INTERPRET: the interpreter's loop form, which a CUDA launch does not take
            signature[name], consts[name] = "constexpr", False if name == "INTERPRET" else value
            continue
        if isinstance(value, torch.Tensor):
            value = value.detach()
        kind, key = native_specialize_impl(BaseBackend, value, False, name not in unspecialized,
                                           name not in unaligned)
        if kind == "constexpr":
            signature[name], consts[name] = "constexpr", key
        else:
            signature[name] = kind
            if key and BaseBackend.parse_attr(key):
                attrs[str(i)] = BaseBackend.parse_attr(key)
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": consts,
            "attrs": attrs, "warps": kwargs.get("num_warps", 4), "stages": kwargs.get("num_stages", 3)}


def record(path: str, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter, writing one JSON line per distinct launch to `path`."""
    import pytest

    importlib.import_module("tests.ops.triton_modes")  # sets TRITON_INTERPRET before triton is imported
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        line = json.dumps(_specialization(self, self.fn, args, kwargs), sort_keys=True, default=str)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        return pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    finally:
        InterpretedFunction.run = run


def build(spec: dict) -> list[str]:
    """Build one recorded launch for sm_90; its unset-register reads (empty if none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.ops.triton_modes import sass_of, uniform_reads_before_writes

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    fn = kernel.fn if hasattr(kernel, "configs") else kernel
    attrs = {(int(i),): value for i, value in spec["attrs"].items()}
    compiled = triton.compile(ASTSource(fn, spec["signature"], constexprs=spec["constexprs"], attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": spec["warps"], "num_stages": spec["stages"]})
    return uniform_reads_before_writes(sass_of(compiled))


def _build_part(path: str, part: int, parts: int) -> None:
    """Worker: build every `parts`-th recorded launch from `part` on, printing one JSON result per line."""
    with open(path) as f:
        specs = [json.loads(line) for line in f]
    for spec in specs[part::parts]:
        try:
            result = {"unset": build(spec)}
        except Exception as e:  # noqa: BLE001  (a build that does not compile is a finding too)
            result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps({**result, "spec": spec}), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        _build_part(argv[1], int(argv[2]), int(argv[3]))
        return 0
    if os.environ.get("HYBRIDLM_TRITON_INTERPRET") != "1":
        print("run with HYBRIDLM_TRITON_INTERPRET=1 (the launches are recorded under Triton's interpreter)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.jsonl")
        open(path, "w").close()
        status = record(path, argv)
        with open(path) as f:
            specs = [json.loads(line) for line in f]
        # bfloat16, the dtype of training, is checked on GPUs only: build every float16 launch as bfloat16 as well
        specs += [json.loads(line.replace('"*fp16"', '"*bf16"')) for line in map(json.dumps, specs) if '"*fp16"' in line]
        with open(path, "w") as f:
            f.writelines(json.dumps(spec) + "\n" for spec in specs)
        n = len(specs)
        print(f"{n} distinct launches recorded (pytest exit {status}); building them for sm_90 on {WORKERS} workers")
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYBRIDLM_TRITON_INTERPRET")}
        command = [sys.executable, "-m", "tests.ops.sm90_launch_sweep", "--build", path]
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            outputs = list(pool.map(lambda i: subprocess.run([*command, str(i), str(WORKERS)], capture_output=True,
                                                             text=True, env=env, check=False), range(WORKERS)))
    results = [json.loads(line) for out in outputs for line in out.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in results if r.get("unset") or r.get("error")]
    for r in bad:
        spec = r["spec"]
        consts = {k: v for k, v in spec["constexprs"].items() if v is not None}
        print(f"{spec['kernel']} {consts} warps {spec['warps']} stages {spec['stages']}: "
              f"{r.get('error') or r['unset']}")
    crashed = [out.stderr[-2000:] for out in outputs if out.returncode]
    for err in crashed:
        print("a build worker failed:\n" + err)
    print(f"{len(results)} of {n} built; {len(bad)} with unset uniform registers or build errors")
    return 1 if bad or crashed or len(results) != n else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
