"""Registers and spills of rule 1's Triton kernels (WY factors, passes, per-chunk gradients) for sm_90, on any
machine with triton (no GPU).

    python benchmarks/ptxas_spills.py                      # K = V = 128, chunk 64, bf16
    python benchmarks/ptxas_spills.py --K 64 --V 64

Compiles each kernel to PTX with Triton for sm_90 at several (warps, pipeline stages) launch configurations and runs
the `ptxas -v` that Triton uses for sm_90 on it: registers per thread and the bytes of spill stores / loads per
thread. A spill is a round trip through local memory inside a latency-bound sequential walk over the chunks, so this
is the cheap first look before a GPU timing (which decides). `*` marks a configuration `regression.py` launches
(the passes: `regression.NARROW_PASSES` and `WIDE_PASSES`, each at its value block).
Also the shared memory per program and how many programs an SM holds at once by registers and shared memory
(65,536 registers and 228 KB per H100 / H200 SM): the two passes run V / BV x rows x heads programs in waves of
132 SMs x that many. `--pass-block-v 32 64` compiles the passes at each value block (default: both launches').
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybridlm.ops.fast_weight.triton import regression_kernels, wy
from hybridlm.ops.fast_weight.triton.regression import pass_launches
from hybridlm.ops.triton_utils import block


def sm90_ptxas() -> str:
    """The ptxas that Triton itself runs for sm_90: its PTX version must match (Triton 3.9 emits PTX 9.4 for sm_90 and
    runs its bundled CUDA 13 `ptxas-blackwell` on it; the plain bundled `ptxas` of CUDA 12.9 refuses that PTX)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # a Triton without the per-architecture lookup bundles one ptxas
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return get_ptxas(90).path


PTXAS = sm90_ptxas()
BF16_POINTERS = ("x_ptr", "q_ptr", "y_ptr", "do_ptr", "dx_ptr", "dq_ptr", "dy_ptr")
SM_REGISTERS, SM_SHARED_BYTES = 65536, 228 * 1024  # per SM on sm_90


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs (thread blocks) one sm_90 SM holds at once, by registers (allocated per warp in units of 256) and
    shared memory (1 KB reserved per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED_BYTES // (shared + 1024)
    return min(by_registers, by_shared)


def launched(name: str, block_v: int, warps: int, stages: int, K: int, V: int) -> bool:
    """Whether `regression.py` launches pass kernel `name` with value block `block_v` at (warps, stages) for K, V
    (the narrow launch for one row x head, the wide one for many; the per-chunk gradient kernels are autotuned over
    4 / 8 warps x 1 / 2 stages: no fixed one)."""
    return any(block_v == block(V, launch.block_v) and launch.kwargs(reverse=name == "delta_grad_pass_kernel")
               == {"num_warps": warps, "num_stages": stages} for launch in pass_launches(K, V))


def ptxas_stats(kernel, constexprs: dict, *, warps: int, stages: int,
                bf16_pointers: tuple[str, ...] = BF16_POINTERS) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread and shared memory bytes per program of `kernel`
    compiled for sm_90 (bf16 inputs)."""
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # under the autotuner
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in constexprs else "*bf16" if name in bf16_pointers
                 else "*fp32" if name.endswith("_ptr") else "i32" for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        result = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"], capture_output=True,
                                text=True, check=True)
    report = result.stdout + result.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas output:\n{report}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2)), int(compiled.metadata.shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--configs", nargs="+", default=["4x2", "4x3", "8x2", "8x3"],
                        help="WARPSxSTAGES launch configs")
    parser.add_argument("--pass-block-v", type=int, nargs="+", default=None,
                        help="value blocks of the two passes (default: the narrow and the wide launch's)")
    args = parser.parse_args()
    block_k = max(16, triton.next_power_of_2(args.K))
    launched_blocks = {block(args.V, launch.block_v) for launch in pass_launches(args.K, args.V)}
    pass_blocks = args.pass_block_v or sorted(launched_blocks)
    grad_blocks = block(args.K, 64), block(args.V, 64)  # regression's gradient blocks
    sizes = {"K": args.K, "V": args.V, "BT": args.chunk, "BK": block_k, "PREC": "tf32", "PREC32": "tf32",
             "SLOTS": 1, "READ_AFTER": True, "HAS_INIT": True, "INTERPRET": False, "N_PARTS": -(-block_k // 64),
             "STORE_DY": True}
    kernels = ((wy, "tinv_kernel", {"BK": grad_blocks[0]}), (wy, "wu_kernel", {"BD": max(grad_blocks)}),
               *((regression_kernels, name, {"BV": bv}) for name in ("delta_pass_kernel", "delta_grad_pass_kernel")
                 for bv in pass_blocks),
               (regression_kernels, "delta_grad_state_kernel", {"BK": grad_blocks[0], "BV": grad_blocks[1]}),
               (regression_kernels, "delta_grad_kernel", {"BK": grad_blocks[0], "BV": grad_blocks[1]}))
    print(f"# {time.strftime('%Y-%m-%d')} | ptxas sm_90a (triton {triton.__version__}) | K={args.K} V={args.V} "
          f"chunk={args.chunk} bf16")
    print("| kernel | blocks | warps x stages | registers | spill stores (B) | spill loads (B) | shared (KB) "
          "| programs per SM |")
    print("|---|---|---|---|---|---|---|---|")
    for module, name, blocks in kernels:
        for config in args.configs:
            warps, stages = (int(part) for part in config.split("x"))
            registers, stores, loads, shared = ptxas_stats(getattr(module, name), dict(sizes, **blocks),
                                                           warps=warps, stages=stages)
            is_pass = name in ("delta_pass_kernel", "delta_grad_pass_kernel")
            mark = " *" if is_pass and launched(name, blocks["BV"], warps, stages, args.K, args.V) else ""
            shown = " ".join(f"{block}={size}" for block, size in blocks.items())
            print(f"| {name} | {shown} | {warps} x {stages}{mark} | {registers} | {stores} | {loads} | "
                  f"{shared / 1024:.0f} | {programs_per_sm(registers, shared, warps)} |", flush=True)


if __name__ == "__main__":
    main()
