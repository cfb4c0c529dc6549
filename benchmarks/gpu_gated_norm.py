"""GPU timing of the mixers' gated RMSNorm: the torch form (`gated_rms_norm(backend="torch")`) vs the Triton kernels
(`hybridlm.ops.gated_norm`), in one run.

    python benchmarks/gpu_gated_norm.py                            # the fast-weight and Mamba-2 mixers' shapes
    python benchmarks/gpu_gated_norm.py --shapes 16384x2048x16 --gate-first

Times (median of `triton.testing.do_bench`) forward and forward + backward on rows x D channels in G groups: bf16
activations and gate, the float32 weight, bf16 autocast, as in training; the kernels are checked against the torch
form first. Prints a markdown table with the ratio torch / Triton.
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_ops import bench, rel_err  # benchmarks/ is on the path when this script runs

from hybridlm.modules.gated_norm import gated_rms_norm
from hybridlm.ops.gated_norm import gated_norm_triton

# rows x channels x groups: a 144M h1 fw-1A's fast-weight norm at 16K (16 heads of 64), a Mamba-2 mixer's (2 groups of
# 512), and the packed addition batch's fast-weight norm (8 heads of 64)
SHAPES = ("16384x1024x16", "16384x1024x2", "491520x512x8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="ROWSxDxGROUPS")
    parser.add_argument("--gate-first", action="store_true", help="the gate before the norm (norm_before_gate=False)")
    args = parser.parse_args()
    before = not args.gate_first
    print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 x and "
          f"gate, float32 weight, bf16 autocast, norm_before_gate={before}")
    print("| rows x D x groups | pass | torch (ms) | Triton (ms) | torch / Triton |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        rows, D, groups = (int(n) for n in shape.split("x"))
        x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gate = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = (1 + torch.randn(D, device="cuda") / 4).requires_grad_(True)
        inputs = (x, weight, gate)
        forms = {
            "torch": lambda: gated_rms_norm(x, weight, gate, groups=groups, norm_before_gate=before, backend="torch"),
            "triton": lambda: gated_norm_triton(x, weight, gate, groups=groups, norm_before_gate=before),
        }
        results = []
        for fn in forms.values():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn()
            results.append([y.float(), *(g.float() for g in torch.autograd.grad(y.float().square().sum(), inputs))])
        error = max(rel_err(a, b) for a, b in zip(*results))
        if not error < 2e-2:
            raise SystemExit(f"{shape}: the kernels disagree with the torch form (rel err {error:.1e})")
        for backward in (False, True):
            ms = {}
            for name, fn in forms.items():
                def run(fn=fn):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        return fn()
                ms[name] = bench(run, backward=backward, inputs=inputs)
            print(f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | {ms['torch']:.3f} | {ms['triton']:.3f} | "
                  f"{ms['torch'] / ms['triton']:.2f}x |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
