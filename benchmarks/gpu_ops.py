"""GPU timing of the fast-weight rules against causal SDPA at the same shape, side by side in one run.

    python benchmarks/gpu_ops.py                                  # B=8 H=16 D=128 bf16, T in 2048 4096
    python benchmarks/gpu_ops.py --T 2048 4096 16384 --rules 1 1A 3A

Times (median of `triton.testing.do_bench`) the torch chunk backend forward and forward+backward per rule,
and causal SDPA (cuDNN or flash backend, `causal_sdpa`) on the same q, k, v; prints time and the ratio
chunk / SDPA. `gpu_fast_weight_triton.py` times the Triton backend.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybridlm.ops import fast_weight_attention

RULES = ("1", "2", "3", "1A", "2A", "3A")


# Profiler event names of a kernel launch from the host: the runtime API (torch's kernels), the driver API
# (Triton 3.6 launches through cuLaunchKernelEx) and a whole CUDA graph.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def kernel_launches(events) -> int:
    """Host-side launches (kernels and CUDA graphs) among `torch.profiler` key averages."""
    return sum(e.count for e in events if e.key in LAUNCH_EVENTS)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of [B, T, H, D] tensors on cuDNN's or flash's kernel (either, by priority), never on a slower
    fallback that a torch release might pick instead: the baseline of every "x SDPA" ratio. [B, H, T, D] out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)


def rel_err(a, b) -> float:
    """|a - b| / |b| over the whole tensors, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# How `bench` times: eager launches (the default: what a user's eager loop sees, host launch time included where the
# GPU waits on it) or the same steps replayed from one CUDA graph (the GPU's time alone). Set by `set_timing`.
TIMING = {"cuda_graph": False}


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time each step replayed from a CUDA graph (GPU time, host launch time removed)")


def set_timing(args: argparse.Namespace) -> str:
    """Applies `--cuda-graph`; returns the words for the table's header."""
    TIMING["cuda_graph"] = bool(getattr(args, "cuda_graph", False))
    return "CUDA-graph replay" if TIMING["cuda_graph"] else "eager launches"


def bench(fn, *, backward: bool, inputs) -> float:
    """Median ms of `fn` (and its backward with the inputs' gradients cleared), over at least ~10 calls; replayed
    from a CUDA graph when `TIMING["cuda_graph"]` (falls back to eager launches, saying so, if `fn` cannot be
    captured)."""
    import triton.testing

    def step():
        out = fn()
        if backward:
            out.backward(grad)
            for t in inputs:
                t.grad = None

    out = fn()
    grad = torch.randn_like(out)
    del out  # its autograd graph would stay alive (and in memory) through the timing
    step()  # compiles what the first call has not (the backward's kernels) before the length of a call is estimated
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    # Both repeat rep / (their estimate) times: at rep=100 a call over 50 ms would be one sample, not a median
    rep = max(100.0, 10 * start.elapsed_time(end))
    if TIMING["cuda_graph"]:
        try:
            return triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median")
        except RuntimeError as error:  # a host synchronization inside fn cannot be captured
            print(f"# CUDA graph capture failed ({str(error).splitlines()[0]}); timed with eager launches")
            torch.cuda.synchronize()
    return triton.testing.do_bench(step, warmup=25, rep=rep, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    add_timing_args(parser)
    args = parser.parse_args()
    timing = set_timing(args)
    dev, dtype = "cuda", torch.bfloat16
    print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"B={args.B} H={args.H} D={args.D} bf16 chunk={args.chunk_size} | {timing}")
    print("| rule | T | pass | SDPA (ms) | chunk (ms) | chunk / SDPA |")
    print("|---|---|---|---|---|---|")
    for T in args.T:
        shape = (args.B, T, args.H, args.D)
        q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        k_unit = F.normalize(k.detach().float(), dim=-1).to(dtype).requires_grad_(True)
        sdpa = {}
        for backward in (False, True):
            sdpa[backward] = bench(
                lambda: causal_sdpa(q, k, v), backward=backward, inputs=(q, k, v))
        for rule in args.rules:
            window = 3 if rule in ("3", "3A") else 1
            beta_shape = shape if rule in ("2", "2A") else shape[:3]
            beta = torch.rand(beta_shape, device=dev, dtype=dtype).mul(1.9).requires_grad_(True)
            lam = torch.rand(shape[:3], device=dev, dtype=dtype).mul(0.1).requires_grad_(True)
            inputs = (q, k_unit, v, beta, lam)
            for backward in (False, True):
                try:
                    ms = bench(lambda: fast_weight_attention(*inputs, rule=rule, window=window, backend="chunk",
                                                             chunk_size=args.chunk_size)[0],
                               backward=backward, inputs=inputs)
                    cell = f"{ms:.2f} | {ms / sdpa[backward]:.1f}x"
                except torch.OutOfMemoryError:
                    cell = "out of memory | -"
                    torch.cuda.empty_cache()
                name = "fwd+bwd" if backward else "fwd"
                print(f"| {rule} | {T} | {name} | {sdpa[backward]:.2f} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
