"""GPU timing of the SSD's sequential state pass (`state_pass_kernel`, (F3) forward and (B2) reverse): the kernel as it
is (each chunk's term and decay loaded two chunks ahead) at several blocks per program, against the same walk that
loads each chunk's term in the step that adds it, in one run.

    python benchmarks/gpu_ssd_pass.py                         # the 125m and falcon-h1-0.5b Mamba-2 shapes, 4K and 16K
    python benchmarks/gpu_ssd_pass.py --shapes 13x64x128 --T 16384
    python benchmarks/gpu_ssd_pass.py --cpu --shapes 2x16x32 --T 64 --chunk 16   # smoke run under the interpreter

A shape is heads x P x N of one row (the pass's grid is (P / BP) x (N / BN) x heads programs). Every launch is
checked bit for bit against the load-in-step walk first (the same arithmetic in the same order), then timed with
`triton.testing.do_bench` (median us). Prints a markdown table, each row's time over the load-in-step walk at
[32, 32] blocks of the same direction and shape.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--cpu" in sys.argv:  # before triton is imported: the interpreter runs the kernels on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridlm.ops.ssd.triton import kernels  # noqa: E402
from hybridlm.ops.triton_utils import state_offsets  # noqa: E402
from hybridlm.ops.utils import triton_interpreting  # noqa: E402

SIZES = ["T_pad", "n_chunks"]
LAUNCHES = ((32, 32, 4), (16, 16, 4), (16, 32, 4), (64, 32, 4), (32, 32, 2))  # BP, BN, warps


@triton.jit
def _load_in_step(h_ptr, cum_ptr, S, k, i_bh, T_pad, n_chunks, P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
                  rp, rn, mask, REVERSE: tl.constexpr):
    if REVERSE:
        i_c = n_chunks - 1 - k
    else:
        i_c = k
    offs, _ = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
    term = tl.load(h_ptr + offs, mask=mask, other=0.0)
    tl.store(h_ptr + offs, S, mask=mask)
    decay = tl.exp(tl.load(cum_ptr + i_bh.to(tl.int64) * T_pad + i_c * BT + BT - 1))
    return decay * S + term


@triton.jit(do_not_specialize=SIZES)
def load_in_step_pass_kernel(h_ptr, init_ptr, final_ptr, cum_ptr, T_pad, n_chunks, P: tl.constexpr, N: tl.constexpr,
                             BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_INIT: tl.constexpr,
                             REVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """`kernels.state_pass_kernel`'s walk with each chunk's term loaded in the step that adds it."""
    i_pn, i_bh = tl.program_id(0), tl.program_id(1)
    i_p, i_n = i_pn // tl.cdiv(N, BN), i_pn % tl.cdiv(N, BN)
    rp, rn = i_p * BP + tl.arange(0, BP), i_n * BN + tl.arange(0, BN)
    offs0, mask = state_offsets(i_bh, 0, 1, P, N, rp, rn)
    if HAS_INIT:
        S = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BP, BN], dtype=tl.float32)
    if INTERPRET:
        k = 0
        while k < n_chunks:
            S = _load_in_step(h_ptr, cum_ptr, S, k, i_bh, T_pad, n_chunks, P, N, BT, rp, rn, mask, REVERSE)
            k += 1
    else:
        for k in range(n_chunks):
            S = _load_in_step(h_ptr, cum_ptr, S, k, i_bh, T_pad, n_chunks, P, N, BT, rp, rn, mask, REVERSE)
    tl.store(final_ptr + offs0, S, mask=mask)


def measure(heads: int, P: int, N: int, T: int, chunk: int, device: torch.device) -> list[tuple[str, float, bool]]:
    """(label, us, equal to the load-in-step walk) for both directions and every launch at one shape."""
    n_chunks = T // chunk
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(heads, n_chunks, P, N, generator=g).to(device)                     # [H, n_chunks, P, N]
    init = torch.randn(heads, P, N, generator=g).to(device)
    cum = (-torch.rand(heads, T, generator=g).cumsum(-1) * 0.01).to(device)                # chunk-local: any <= 0
    work, final = terms.clone(), torch.empty_like(init)

    def launch(kernel, h, out, BP, BN, warps, reverse):
        kernel[(triton.cdiv(P, BP) * triton.cdiv(N, BN), heads)](
            h, init, out, cum, T, n_chunks, P=P, N=N, BT=chunk, BP=BP, BN=BN, HAS_INIT=True, REVERSE=reverse,
            INTERPRET=triton_interpreting(), num_warps=warps)

    rows = []
    for reverse in (False, True):
        direction = "reverse" if reverse else "forward"
        expected, expected_final = terms.clone(), torch.empty_like(init)
        launch(load_in_step_pass_kernel, expected, expected_final, 32, 32, 4, reverse)
        candidates = [("load in step", load_in_step_pass_kernel, 32, 32, 4)]
        candidates += [("two ahead", kernels.state_pass_kernel, *launch_) for launch_ in LAUNCHES]
        for name, kernel, BP, BN, warps in candidates:
            h, out = terms.clone(), torch.empty_like(init)
            launch(kernel, h, out, BP, BN, warps, reverse)
            equal = torch.equal(h, expected) and torch.equal(out, expected_final)
            if device.type == "cuda":
                us = 1e3 * triton.testing.do_bench(lambda: launch(kernel, work, final, BP, BN, warps, reverse),
                                                   warmup=25, rep=100)
            else:
                us = float("nan")
            rows.append((f"{direction} | {name} | [{BP}, {BN}] x {warps} warps", us, equal))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["10x64x64", "13x64x128"],
                        help="heads x P x N (the 125m and falcon-h1-0.5b shapes' Mamba-2 heads by default)")
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--chunk", type=int, default=128, help="the SSD's chunk length (steps per chunk)")
    parser.add_argument("--cpu", action="store_true", help="run under Triton's interpreter (no timing: a smoke run)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    name = "CPU (interpreter)" if args.cpu else torch.cuda.get_device_name()
    print(f"{name} · torch {torch.__version__} · triton {triton.__version__} · chunk {args.chunk}")
    print("\n| heads x P x N | T | direction | walk | blocks | us | / load in step [32, 32] | outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        heads, P, N = (int(v) for v in shape.split("x"))
        for T in args.T:
            rows = measure(heads, P, N, T, args.chunk, device)
            base = {label.split(" | ")[0]: us for label, us, _ in rows if "load in step" in label}
            for label, us, equal in rows:
                timed = f"{us:.1f} | {us / base[label.split(' | ')[0]]:.2f}x" if device.type == "cuda" else "- | -"
                print(f"| {shape} | {T} | {label} | {timed} | {'equal' if equal else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
