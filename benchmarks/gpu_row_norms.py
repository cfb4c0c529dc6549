"""GPU timing of the row kernels at decoding sizes: the RMS normalization, the gated RMSNorm and the SiLU gate with the
row blocks per program that `row_steps` picks, against every program walking the fixed maximum (STEPS), in one run.

    python benchmarks/gpu_row_norms.py                      # rows 1, 16, 64 at the 125m shape's widths
    python benchmarks/gpu_row_norms.py --rows 1 4 --calls 400

A decoding step at batch B normalizes B rows per block norm and B x heads rows per QK norm: a program built for
thousands of rows walks STEPS blocks of which all but the first are masked. Each kernel is timed as a CUDA graph
replays it (`calls` launches captured in one graph, the replay's time over `calls`), the way a graphed decoding step
runs it; outputs are checked equal between the two launch shapes first. Prints a markdown table, maximum / chosen.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager

import torch

from hybridlm.ops.gated_norm import gated_norm_triton
from hybridlm.ops.gated_norm import kernels as gated_norm_kernels
from hybridlm.ops.rms_norm import kernels as rms_norm_kernels
from hybridlm.ops.rms_norm.kernels import rms_normalize_triton
from hybridlm.ops.silu_gate import kernels as silu_gate_kernels
from hybridlm.ops.silu_gate import silu_gate_triton

MODULES = (rms_norm_kernels, gated_norm_kernels, silu_gate_kernels)


@contextmanager
def fixed_steps(enabled: bool):
    """Every launcher's `row_steps` returning its maximum (the launch shape before `row_steps`), while enabled."""
    saved = [m.row_steps for m in MODULES]
    if enabled:
        for m in MODULES:
            m.row_steps = lambda rows, block_rows, most: most
    try:
        yield
    finally:
        for m, fn in zip(MODULES, saved):
            m.row_steps = fn


def graph_us(fn, calls: int, repeats: int = 7) -> float:
    """Median microseconds per call of `calls` calls of fn replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def cases(rows: int, hidden: int, heads: int, head_dim: int, device) -> dict:
    """name -> a no-argument call of each kernel at `rows` decoding rows (bf16, as under autocast)."""
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    qk = torch.randn(rows, 1, heads, head_dim, device=device, dtype=torch.bfloat16)
    width = heads * head_dim
    o, z = (torch.randn(rows, width, device=device, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.ones(width, device=device)
    return {
        f"block norm [{rows}, {hidden}]": lambda: rms_normalize_triton(x, 1e-6),
        f"QK norm [{rows}, 1, {heads}, {head_dim}]": lambda: rms_normalize_triton(qk, 1e-6),
        f"gated norm [{rows}, {width}], {heads} groups": lambda: gated_norm_triton(o, weight, z, groups=heads,
                                                                                    eps=1e-6, norm_before_gate=True),
        f"SiLU gate [{rows}, {width}]": lambda: silu_gate_triton(o, z),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200, help="launches captured in one graph")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · bf16 · {args.calls} launches per graph\n")
    print("| kernel | steps chosen | us per call, chosen | us per call, maximum | maximum / chosen |\n|---|---|---|---|---|")
    for rows in args.rows:
        for name, fn in cases(rows, args.hidden, args.heads, args.head_dim, device).items():
            with fixed_steps(True):
                want = fn()
            got = fn()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            chosen = graph_us(fn, args.calls)
            with fixed_steps(True):
                fixed = graph_us(fn, args.calls)
            print(f"| {name} | {_steps(name, rows, args)} | {chosen:.2f} | {fixed:.2f} | {fixed / chosen:.2f}x |",
                  flush=True)


def _steps(name: str, rows: int, args) -> int:
    """The row blocks per program `row_steps` picks for the case `name`."""
    import triton

    if name.startswith("SiLU"):
        return silu_gate_kernels.row_steps(rows, silu_gate_kernels.BM, silu_gate_kernels.STEPS)
    if name.startswith("gated"):
        width = triton.next_power_of_2(args.head_dim)
        return gated_norm_kernels.row_steps(rows, max(1, gated_norm_kernels.ROW_ELEMENTS // width),
                                            gated_norm_kernels.STEPS)
    total, width = (rows * args.heads, args.head_dim) if name.startswith("QK") else (rows, args.hidden)
    return rms_norm_kernels.row_steps(total, max(1, rms_norm_kernels.ROW_ELEMENTS // triton.next_power_of_2(width)),
                                      rms_norm_kernels.STEPS)


if __name__ == "__main__":
    main()
