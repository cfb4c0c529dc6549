"""GPU timing of the Mamba-2 SSD op: the Triton kernels vs the torch chunk path vs causal SDPA vs fla, in one run.

    python benchmarks/gpu_ssd.py                                     # B=8 H=16 P=64 N=128 G=1 bf16, T 2048 4096 16384
    python benchmarks/gpu_ssd.py --T 4096 --compiled-chunk           # also the chunk path under torch.compile
    python benchmarks/gpu_ssd.py --cpu --B 1 --H 2 --P 16 --N 16 --T 64   # smoke run: naive vs chunk on the CPU

`ssd(..., backend="auto")` runs the Triton kernels on CUDA because this script shows them faster
(benchmarks/RESULTS.md).
First checks the Triton backend against the chunk backend at one shape (float32 and bf16: y, the final
state and every gradient) and stops if they disagree; with flash-linear-attention installed, also that fla's
`chunk_simple_gla` computes the same function:

    SSD:         y_t = sum_{s <= t} exp(dt_{s+1} A + ... + dt_t A) dt_s (C_t . B_s) x_s
    simple GLA:  o_t = sum_{s <= t} exp(g_{s+1} + ... + g_t) (q_t . k_s) v_s,  q = C, k = dt B, v = x, g = dt A

(B and C broadcast from their G groups to the H heads; no D skip; scale 1). Then times (median of
`triton.testing.do_bench`) forward and forward + backward of causal SDPA on [B, T, H, P] (the same heads and head
dim; cuDNN or flash, `gpu_ops.causal_sdpa`), `ssd` through "chunk" (and, with `--compiled-chunk`, the same under
torch.compile) and "triton", and fla's simple GLA on the same math, its input mapping (B, C broadcast to the heads,
dt B, dt A) inside the timed call and its gradients reaching the same leaves as ours (its gated backward is refused
on Hopper with Triton >= 3.4 and < 3.7.1, fla issue #640: "refused"). Prints a markdown table with the ratios
triton / SDPA, chunk / triton and triton / fla.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gpu_ops import causal_sdpa, rel_err  # benchmarks/ is on the path when this script runs

from hybridlm.ops.ssd import ssd


def make_inputs(B, T, H, P, N, G, dtype, *, device, seed=0):
    """x [B, T, H, P], dt [B, T, H] (softplus range, >= 0), A [H] (< 0), B, C [B, T, G, N]; leaves with grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = F.softplus(torch.randn(B, T, H, generator=g) - 2.0)
    A = -torch.rand(H, generator=g) * 2 - 0.5
    Bm = torch.randn(B, T, G, N, generator=g) / N ** 0.5
    Cm = torch.randn(B, T, G, N, generator=g) / N ** 0.5
    return [t.to(device=device, dtype=dtype if t.dim() == 4 else torch.float32).requires_grad_(True)
            for t in (x, dt, A, Bm, Cm)]


def run_ssd(x, dt, A, Bm, Cm, *, backend, chunk_size, initial_state=None):
    return ssd(x, dt, A, Bm, Cm, chunk_size=chunk_size, initial_state=initial_state, output_final_state=True,
               backend=backend)


def as_simple_gla(x, dt, A, Bm, Cm):
    """fla's simple GLA arguments of the same function: q, k [B, T, H, N], v [B, T, H, P], g [B, T, H]."""
    heads = x.shape[2] // Bm.shape[2]
    q = Cm.repeat_interleave(heads, dim=2)
    k = Bm.repeat_interleave(heads, dim=2) * dt[..., None].to(Bm.dtype)
    return q, k, x, dt * A


def check(*, device, chunk_size, B=2, T=1000, H=4, P=64, N=128, G=2, half=torch.bfloat16) -> list[str]:
    """Triton vs chunk (float32 < 1e-4, `half` < 2e-2 relative: y, final state, every gradient), and fla's simple
    GLA vs chunk on y and the state (float32). Raises on disagreement; returns the lines it measured. (Under Triton's
    interpreter, whose tl.dot is wrong for bfloat16, float16 stands in for `half`.)"""
    lines = []
    for dtype, tol in ((torch.float32, 1e-4), (half, 2e-2)):
        ins_t = make_inputs(B, T, H, P, N, G, dtype, device=device, seed=1)
        ins_c = [t.detach().clone().requires_grad_(True) for t in ins_t]
        h0 = torch.randn(B, H, P, N, device=device)
        (y_t, s_t), (y_c, s_c) = (run_ssd(*ins, backend=b, chunk_size=chunk_size, initial_state=h0)
                                  for ins, b in ((ins_t, "triton"), (ins_c, "chunk")))
        grad_y = torch.randn_like(y_c)
        (y_t.float() * grad_y).sum().add((s_t * s_c.detach()).sum()).backward()
        (y_c.float() * grad_y).sum().add((s_c * s_c.detach()).sum()).backward()
        errors = {"y": rel_err(y_t, y_c), "state": rel_err(s_t, s_c)}
        errors.update({f"d{name}": rel_err(a.grad, b.grad)
                       for name, a, b in zip(("x", "dt", "A", "B", "C"), ins_t, ins_c)})
        worst = max(errors, key=errors.get)
        lines.append(f"check {dtype}: triton vs chunk, worst {worst} {errors[worst]:.1e} (tolerance {tol:g})")
        if errors[worst] > tol:
            raise SystemExit(f"the Triton SSD disagrees with the chunk path in {dtype}: {errors}")
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return lines + ["check fla: not installed"]
    with torch.no_grad():
        ins = make_inputs(B, T, H, P, N, G, torch.float32, device=device, seed=2)
        y, state = run_ssd(*ins, backend="chunk", chunk_size=chunk_size)
        q, k, v, g = as_simple_gla(*ins)
        o, fla_state = chunk_simple_gla(q, k, v, g=g, scale=1.0, output_final_state=True)
        # fla's state is [B, H, K = N, V = P]; ours [B, H, P, N]
        errors = {"y": rel_err(o, y), "state": rel_err(fla_state.transpose(-1, -2), state)}
    lines.append(f"check fla simple GLA vs chunk (float32): y {errors['y']:.1e}, state {errors['state']:.1e}")
    # fla's kernels multiply float32 inputs in TF32 (10-bit mantissa): they agree with the chunk path to ~1e-3;
    # a different function would be off by O(1).
    if max(errors.values()) > 5e-3:
        raise SystemExit(f"fla's simple GLA is not the same function here: {errors}")
    return lines


def timed_cpu(fn, *, backward: bool, inputs, repeats: int = 3) -> float:
    """Median ms of `fn` (and its backward) on the CPU (the smoke run; no triton)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        if backward:
            out.float().sum().backward()
            for t in inputs:
                t.grad = None
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def time_one(T, args, device) -> list[str]:
    """The table rows (fwd, fwd+bwd) at one sequence length."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ins = make_inputs(args.B, T, args.H, args.P, args.N, args.G, dtype, device=device)
    qkv = [torch.randn(args.B, T, args.H, args.P, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    sdpa = causal_sdpa if device.type == "cuda" else (  # the CPU smoke run has neither cuDNN nor flash
        lambda q, k, v: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True))
    calls = {"SDPA": (lambda: sdpa(*qkv), qkv),
             "chunk": (lambda: run_ssd(*ins, backend="chunk", chunk_size=args.chunk_size)[0], ins)}
    if device.type == "cuda":
        calls["triton"] = (lambda: run_ssd(*ins, backend="triton", chunk_size=args.chunk_size)[0], ins)
        if args.compiled_chunk:
            compiled = torch.compile(run_ssd, dynamic=False)
            calls["chunk compiled"] = (lambda: compiled(*ins, backend="chunk", chunk_size=args.chunk_size)[0], ins)
        try:
            from fla.ops.simple_gla import chunk_simple_gla

            def fla_ssd():  # the mapping inside the timed call, as our side's own preparation is: same leaves
                q, k, v, g = as_simple_gla(*ins)
                return chunk_simple_gla(q, k, v, g=g.float(), scale=1.0)[0]

            calls["fla"] = (fla_ssd, ins)
        except ImportError:
            pass
    else:
        calls["naive"] = (lambda: run_ssd(*ins, backend="naive", chunk_size=args.chunk_size)[0], ins)
    rows = []
    for backward in (False, True):
        ms = {}
        for name, (fn, leaves) in calls.items():
            try:
                if device.type == "cuda":
                    from gpu_ops import bench  # benchmarks/ is on the path when this script runs

                    ms[name] = bench(fn, backward=backward, inputs=leaves)
                else:
                    ms[name] = timed_cpu(fn, backward=backward, inputs=leaves)
            except RuntimeError as err:  # fla refusing its gated backward, or out of memory
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                ms[name] = float("nan")
                print(f"{name} at T={T} ({'fwd+bwd' if backward else 'fwd'}): {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:160]}", flush=True)
        cells = " | ".join("refused / failed" if ms[n] != ms[n] else f"{ms[n]:.2f}" for n in calls)
        fast = ms.get("triton", ms.get("chunk"))
        ratios = [f"{fast / ms['SDPA']:.2f}x", f"{ms['chunk'] / fast:.1f}x",
                  f"{fast / ms['fla']:.2f}x" if ms.get("fla") == ms.get("fla") and "fla" in ms else "-"]
        rows.append(f"| {T} | {'fwd+bwd' if backward else 'fwd'} | {cells} | {' | '.join(ratios)} |")
    ours = "triton" if "triton" in calls else "chunk"  # the backend "auto" takes on this device
    return ["| T | pass | " + " | ".join(f"{n} (ms)" for n in calls) + f" | {ours} / SDPA | chunk / {ours} "
            f"| {ours} / fla |", "|" + "---|" * (len(calls) + 5)] + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--H", type=int, default=16, help="heads")
    parser.add_argument("--P", type=int, default=64, help="head dim")
    parser.add_argument("--N", type=int, default=128, help="state dim (d_state)")
    parser.add_argument("--G", type=int, default=1, help="groups of B and C")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--compiled-chunk", action="store_true", help="also time the chunk path under torch.compile")
    parser.add_argument("--cpu", action="store_true", help="smoke run on the CPU: naive vs chunk, no triton")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# {time.strftime('%Y-%m-%d')} | {name} | torch {torch.__version__} | B={args.B} H={args.H} P={args.P} "
          f"N={args.N} G={args.G} chunk={args.chunk_size} | {'bf16' if device.type == 'cuda' else 'float32'}")
    if device.type == "cuda":
        for line in check(device=device, chunk_size=args.chunk_size):
            print(line, flush=True)
    for T in args.T:
        lines = time_one(T, args, device)
        print("\n".join(lines if T == args.T[0] else lines[2:]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
