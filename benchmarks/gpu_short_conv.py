"""GPU timing of the short causal conv: the library's shifted-sum form vs `F.conv1d` (its former form), in one run.

    python benchmarks/gpu_short_conv.py                      # the addition models' shape and a 125M model's at 4K
    python benchmarks/gpu_short_conv.py --shapes 256x101x1536

Times (median of `triton.testing.do_bench`) forward and forward + backward of `causal_conv1d` (K = 4, SiLU, bias,
bf16 activations, float32 weights under bf16 autocast, as in training) against the same conv through `F.conv1d` on a
[B, C, T] view (torch's depthwise conv kernels), eager and under `torch.compile`
(inductor; the shifted sum fuses with the SiLU, conv1d stays a library kernel). Prints a markdown table with the
ratio conv1d / shifted sum.

`--packed TxCxN ...` times instead one packed row of T tokens, C channels and N equal documents (`cu_seqlens`, as a
model runs packed rows), eager, forward and forward + backward: the form training takes (no state in or out: the
taps masked at the documents' starts on the row itself) against the gapped form (each document behind K - 1 slots of
its own history, then a depthwise conv over the whole row; what a call with initial states runs, zeros here).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gpu_ops import bench  # benchmarks/ is on the path when this script runs

from hybridlm.modules import causal_conv1d

SHAPES = ("256x101x1536", "8x4096x2304")  # bench addition's fw mixers (q, k, v of 512); a 125M model's at 4K


def conv1d_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The former implementation: left-pad K-1 zeros, depthwise `F.conv1d` on [B, C, T], SiLU."""
    extended = F.pad(x, (0, 0, weight.shape[1] - 1, 0))
    out = F.conv1d(extended.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2).to(x.dtype))


def shifted_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return causal_conv1d(x, weight, bias, activation="silu")[0]


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
    print("| B x T x C | pass | mode | conv1d (ms) | shifted sum (ms) | conv1d / shifted |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        B, T, C = (int(n) for n in shape.split("x"))
        x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(C, args.kernel, device="cuda", requires_grad=True)
        bias = torch.randn(C, device="cuda", requires_grad=True)
        inputs = (x, weight, bias)
        for mode in ("eager", "compiled"):
            forms = {"conv1d": conv1d_form, "shifted": shifted_form}
            if mode == "compiled":
                forms = {name: torch.compile(fn) for name, fn in forms.items()}
            for backward in (False, True):
                ms = {}
                for name, fn in forms.items():
                    def run(fn=fn):
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            return fn(x, weight, bias)
                    ms[name] = bench(run, backward=backward, inputs=inputs)
                print(f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | {mode} | {ms['conv1d']:.3f} | "
                      f"{ms['shifted']:.3f} | {ms['conv1d'] / ms['shifted']:.2f}x |", flush=True)
        torch.cuda.empty_cache()



def time_packed(shapes, kernel: int) -> None:
    """Table rows: one packed row per shape, the in-place form against the gapped form (checked equal first)."""
    print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"K={kernel}, SiLU, bf16 activations, float32 weights, bf16 autocast, eager")
    print("| T x C x documents | pass | in place (ms) | gapped (ms) | gapped / in place |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        T, C, N = (int(n) for n in shape.split("x"))
        x = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(C, kernel, device="cuda", requires_grad=True)
        bias = torch.randn(C, device="cuda", requires_grad=True)
        cu_seqlens = torch.arange(N + 1) * T // N
        zeros = torch.zeros(N, kernel - 1, C, device="cuda", dtype=torch.bfloat16)
        forms = {"in place": {}, "gapped": {"initial_state": zeros}}

        def run(form):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu_seqlens, **forms[form])[0]

        error = ((run("in place").float() - run("gapped").float()).norm() / run("gapped").float().norm()).item()
        if not error < 1e-2:
            raise SystemExit(f"{shape}: the in-place and gapped forms disagree (rel err {error:.1e}); not timing")
        for backward in (False, True):
            ms = {form: bench(lambda form=form: run(form), backward=backward, inputs=(x, weight, bias))
                  for form in forms}
            print(f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | {ms['in place']:.2f} | {ms['gapped']:.2f} | "
                  f"{ms['gapped'] / ms['in place']:.2f}x |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
