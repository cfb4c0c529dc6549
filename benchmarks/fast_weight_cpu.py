"""CPU timing of the fast-weight op: the chunk-parallel backend against the naive step loop, side by side.

    python benchmarks/fast_weight_cpu.py                       # B=1 H=4 K=V=64, T in 256 1024 4096
    python benchmarks/fast_weight_cpu.py --T 256 1024 --repeats 3
    python benchmarks/fast_weight_cpu.py --decode --B 1 8 64      # one decoding step: naive / recurrent / chunk

Prints median wall times and the naive/chunk ratio per rule, forward and forward+backward, all measured in
this one process (float32, chunk 64, window 3 for rules 3/3A). `--decode` times a single step (T = 1, no
gradients, a carried state with full tails) of the naive spec, the row-vectorized "recurrent" backend ("auto"'s
choice for decoding) and the chunk path, per batch size.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hybridlm.ops import fast_weight_attention

RULES = ("1", "2", "3", "1A", "2A", "3A")


def make_inputs(rule: str, *, T: int, B: int, H: int, D: int, requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    k = k / k.pow(2).mean(-1, keepdim=True).sqrt()
    v = torch.randn(B, T, H, D, generator=g)
    beta = 1.9 * torch.rand((B, T, H, D) if rule in ("2", "2A") else (B, T, H), generator=g)
    lam = 0.1 * torch.rand(B, T, H, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, beta, lam)]


def time_call(rule: str, backend: str, *, T: int, backward: bool, repeats: int, B: int, H: int, D: int) -> float:
    inputs = make_inputs(rule, T=T, B=B, H=H, D=D, requires_grad=backward)
    window = 3 if rule in ("3", "3A") else 1
    fast_weight_attention(*inputs, rule=rule, window=window, backend=backend, chunk_size=64)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        o, _ = fast_weight_attention(*inputs, rule=rule, window=window, backend=backend, chunk_size=64)
        if backward:
            o.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_decode(rule: str, backend: str, *, B: int, H: int, D: int, repeats: int) -> float:
    inputs = make_inputs(rule, T=1, B=B, H=H, D=D, requires_grad=False)
    window = 3 if rule in ("3", "3A") else 1
    _, state = fast_weight_attention(*make_inputs(rule, T=4, B=B, H=H, D=D, requires_grad=False), rule=rule,
                                     window=window, output_final_state=True)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            fast_weight_attention(*inputs, rule=rule, window=window, backend=backend, initial_state=state,
                                  output_final_state=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def decode_table(args: argparse.Namespace) -> None:
    print("| rule | B | naive (ms) | recurrent (ms) | chunk (ms) | naive / recurrent | chunk / recurrent |")
    print("|---|---|---|---|---|---|---|")
    for rule in args.rules:
        for B in args.B:
            ms = {name: 1e3 * time_decode(rule, name, B=B, H=args.H, D=args.D, repeats=args.repeats)
                  for name in ("naive", "recurrent", "chunk")}
            print(f"| {rule} | {B} | {ms['naive']:.2f} | {ms['recurrent']:.2f} | {ms['chunk']:.2f} | "
                  f"{ms['naive'] / ms['recurrent']:.1f}x | {ms['chunk'] / ms['recurrent']:.1f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--B", type=int, nargs="+", default=[1], help="batch sizes (the sequence table uses the first)")
    parser.add_argument("--decode", action="store_true", help="time one decoding step instead of sequences")
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64, help="K = V")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | torch {torch.__version__} "
          f"| {args.threads} threads | B={args.B} H={args.H} K=V={args.D} float32 chunk=64")
    if args.decode:
        decode_table(args)
        return
    args.B = args.B[0]
    print("| rule | T | pass | naive (s) | chunk (s) | naive / chunk |")
    print("|---|---|---|---|---|---|")
    for rule in args.rules:
        for T in args.T:
            for backward in (False, True):
                shape = dict(T=T, backward=backward, repeats=args.repeats, B=args.B, H=args.H, D=args.D)
                chunk = time_call(rule, "chunk", **shape)
                naive = time_call(rule, "naive", **shape)
                name = "fwd+bwd" if backward else "fwd"
                print(f"| {rule} | {T} | {name} | {naive:.3f} | {chunk:.4f} | {naive / chunk:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
