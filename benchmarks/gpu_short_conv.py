"""GPU timing of the short causal conv: the library's torch forms and Triton kernels vs `F.conv1d`, in one run.

    python benchmarks/gpu_short_conv.py                      # the addition models' shape and a 125M model's at 4K
    python benchmarks/gpu_short_conv.py --shapes 256x101x1536

Times (median of `triton.testing.do_bench`) forward and forward + backward of `causal_conv1d(backend="torch")`
(the shifted sum; K = 4, SiLU, bias,
bf16 activations, float32 weights under bf16 autocast, as in training) against the same conv through `F.conv1d` on a
[B, C, T] view (torch's depthwise conv kernels), eager and under `torch.compile`
(inductor; the shifted sum fuses with the SiLU, conv1d stays a library kernel), and in eager mode the Triton kernels
of `hybridlm.ops.short_conv` (checked against conv1d first). Prints a markdown table with the ratios conv1d / shifted
sum and conv1d / Triton.

`--packed TxCxN ...` times instead one packed row of T tokens, C channels and N equal documents (`cu_seqlens`, as a
model runs packed rows), eager, forward and forward + backward: the torch forms in place (the
taps masked at the documents' starts on the row itself) and gapped (each document behind K - 1 slots of
its own history, then a depthwise conv over the whole row; what a call with initial states runs, zeros here), and
the Triton kernels on the same documents (what training takes on a GPU).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gpu_ops import bench, rel_err  # benchmarks/ is on the path when this script runs

from hybridlm.modules import causal_conv1d
from hybridlm.modules.boundaries import sequence_ids
from hybridlm.ops.short_conv import short_conv_triton

SHAPES = ("256x101x1536", "8x4096x2304")  # bench addition's fw mixers (q, k, v of 512); a 125M model's at 4K


def conv1d_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The former implementation: left-pad K-1 zeros, depthwise `F.conv1d` on [B, C, T], SiLU."""
    extended = F.pad(x, (0, 0, weight.shape[1] - 1, 0))
    out = F.conv1d(extended.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2).to(x.dtype))


def shifted_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return causal_conv1d(x, weight, bias, activation="silu", backend="torch")[0]


def triton_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seq_idx=None) -> torch.Tensor:
    return short_conv_triton(x, weight, bias, seq_idx=seq_idx, activation="silu")


def check_agree(shape: str, baseline, other, inputs) -> None:
    """Stop unless `other`'s output and gradients agree with `baseline`'s on `inputs` (bf16 autocast)."""
    results = []
    for fn in (baseline, other):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(*inputs)
        results.append([y.float(), *(g.float() for g in torch.autograd.grad(y.float().square().sum(), inputs))])
    error = max(rel_err(a, b) for a, b in zip(*results))
    if not error < 2e-2:
        raise SystemExit(f"{shape}: {other.__name__} disagrees with {baseline.__name__} (rel err {error:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BxTxC")
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--packed", nargs="+", default=None, help="TxCxN: packed rows of N documents instead")
    args = parser.parse_args()
    if args.packed:
        time_packed(args.packed, args.kernel)
        return
    print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"K={args.kernel}, SiLU, bf16 activations, float32 weights, bf16 autocast")
    print("| B x T x C | pass | mode | conv1d (ms) | shifted sum (ms) | Triton (ms) | conv1d / shifted "
          "| conv1d / Triton |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        B, T, C = (int(n) for n in shape.split("x"))
        x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(C, args.kernel, device="cuda", requires_grad=True)
        bias = torch.randn(C, device="cuda", requires_grad=True)
        inputs = (x, weight, bias)
        check_agree(shape, conv1d_form, triton_form, inputs)
        for mode in ("eager", "compiled"):
            forms = {"conv1d": conv1d_form, "shifted": shifted_form, "triton": triton_form}
            if mode == "compiled":
                del forms["triton"]
                forms = {name: torch.compile(fn) for name, fn in forms.items()}
            for backward in (False, True):
                ms = {}
                for name, fn in forms.items():
                    def run(fn=fn):
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            return fn(x, weight, bias)
                    ms[name] = bench(run, backward=backward, inputs=inputs)
                triton_ms, triton_ratio = ((f"{ms['triton']:.3f}", f"{ms['conv1d'] / ms['triton']:.2f}x")
                                           if "triton" in ms else ("-", "-"))
                print(f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | {mode} | {ms['conv1d']:.3f} | "
                      f"{ms['shifted']:.3f} | {triton_ms} | {ms['conv1d'] / ms['shifted']:.2f}x | {triton_ratio} |",
                      flush=True)
        torch.cuda.empty_cache()



def time_packed(shapes, kernel: int) -> None:
    """Table rows: one packed row per shape, the in-place form, the gapped form and the Triton kernels (checked to
    agree first)."""
    print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"K={kernel}, SiLU, bf16 activations, float32 weights, bf16 autocast, eager")
    print("| T x C x documents | pass | in place (ms) | gapped (ms) | Triton (ms) | gapped / in place "
          "| in place / Triton |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        T, C, N = (int(n) for n in shape.split("x"))
        x = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(C, kernel, device="cuda", requires_grad=True)
        bias = torch.randn(C, device="cuda", requires_grad=True)
        cu_seqlens = torch.arange(N + 1) * T // N
        seq_idx = sequence_ids(cu_seqlens.cuda(), T)[None]
        zeros = torch.zeros(N, kernel - 1, C, device="cuda", dtype=torch.bfloat16)

        def in_place(x, weight, bias):
            return causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx, backend="torch")[0]

        def gapped(x, weight, bias):
            return causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu_seqlens, initial_state=zeros,
                                 backend="torch")[0]

        def triton(x, weight, bias):
            return triton_form(x, weight, bias, seq_idx=seq_idx)

        inputs = (x, weight, bias)
        check_agree(shape, in_place, gapped, inputs)
        check_agree(shape, in_place, triton, inputs)
        for backward in (False, True):
            ms = {}
            for fn in (in_place, gapped, triton):
                def run(fn=fn):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        return fn(*inputs)
                ms[fn.__name__] = bench(run, backward=backward, inputs=inputs)
            print(f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | {ms['in_place']:.2f} | {ms['gapped']:.2f} | "
                  f"{ms['triton']:.2f} | {ms['gapped'] / ms['in_place']:.2f}x | {ms['in_place'] / ms['triton']:.2f}x |",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
