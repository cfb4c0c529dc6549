"""Our Triton fast-weight kernels against flash-linear-attention (fla) on a GPU: agreement, then timing.

    pip install --no-deps einops fla-core==0.6.0 flash-linear-attention==0.6.0   # pure-Python wheels
    python benchmarks/gpu_fla_compare.py                       # B=8 H=16 D=128 bf16, T in 2048 4096 16384

1. Agreement in float32 on one shape, two exact correspondences (ours through `backend="triton"`):
   - rule 1A, same-step pairing, direct step, read after, no ridge scaling:
         S_t = gamma_t S_{t-1} + beta_t k_t v_t^T,  gamma_t = 1 - min(beta_t lam_t, 1 - eps_gamma),  o_t = S_t^T q_t
     is fla's `chunk_simple_gla` with k_t -> beta_t k_t, g_t = log gamma_t and scale 1;
   - rule 1, same-step, direct, lam = 0 (gamma = 1): S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T is fla's
     `chunk_gated_delta_rule` with g = 0, the same beta, scale 1 and no in-kernel l2 norm (with a decay the two
     differ: the gated delta rule also decays the correction term, rule 1 does not).
   The shifted pairing (our default) writes (k_{t-1}, v_t), which fla has no option for; the timing uses it.
2. Timing (median of `triton.testing.do_bench`), forward and forward+backward, bf16: SDPA (causal), ours 1A and
   rule 1 (shifted pairing, NLMS steps: what the model runs), fla simple GLA, gated delta rule and (ungated)
   delta rule. fla 0.6 refuses its gated backward kernels on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue
   #640: wrong results there), so on an H200 with Triton 3.6 the forward + backward rows of simple GLA and the gated
   delta rule print "refused"; `chunk_delta_rule` (no decay) is then rule 1's forward + backward peer.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from gpu_ops import bench  # benchmarks/ is on the path when this script runs

from hybridlm.ops import fast_weight_attention


def inputs(B: int, T: int, H: int, D: int, dtype: torch.dtype, *, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D, device="cuda", generator=g)
    k = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=g), dim=-1)  # unit keys: |k|^2 = 1
    v = torch.randn(B, T, H, D, device="cuda", generator=g)
    beta = 0.9 * torch.rand(B, T, H, device="cuda", generator=g)
    lam = 0.05 * torch.rand(B, T, H, device="cuda", generator=g)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "beta": beta, "lam": lam}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def agreement(B: int, T: int, H: int, D: int) -> dict[str, float]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    x = inputs(B, T, H, D, torch.float32, seed=1)
    q, k, v, beta, lam = x["q"], x["k"], x["v"], x["beta"], x["lam"]
    common = dict(pairing="same_step", read="after", step_size="direct", ridge_scaling=False, backend="triton",
                  output_final_state=True)
    ours_1a, state_1a = fast_weight_attention(q, k, v, beta, lam, rule="1A", **common)
    eps_gamma = 1e-6  # the op's default
    log_gamma = torch.log1p(-torch.clamp(beta * lam, max=1.0 - eps_gamma))
    fla_1a, fla_state_1a = chunk_simple_gla(q, k * beta[..., None], v, g=log_gamma, scale=1.0, output_final_state=True)
    ours_1, state_1 = fast_weight_attention(q, k, v, beta, torch.zeros_like(lam), rule="1", **common)
    fla_1, fla_state_1 = chunk_gated_delta_rule(q, k, v, g=torch.zeros_like(beta), beta=beta, scale=1.0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=False)
    return {"1A o": rel(ours_1a, fla_1a), "1A S": rel(state_1a.S, fla_state_1a),
            "1 o": rel(ours_1, fla_1), "1 S": rel(state_1.S, fla_state_1)}


def timings(B: int, T: int, H: int, D: int, *, backward: bool) -> dict[str, float]:
    """Median ms per call; NaN where fla refuses the call (a RuntimeError raised before any kernel runs)."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    x = inputs(B, T, H, D, torch.bfloat16)
    leaves = [x["q"], x["k"], x["v"]]
    for t in leaves:
        t.requires_grad_(backward)
    q, k, v, beta, lam = x["q"], x["k"], x["v"], x["beta"], x["lam"]
    log_gamma = torch.log1p(-torch.clamp(beta * lam, max=0.999)).float()
    scale = 1.0 / math.sqrt(D)
    calls = {
        "SDPA": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True),
        "ours 1A": lambda: fast_weight_attention(q, k, v, beta, lam, rule="1A", backend="triton")[0],
        "ours 1": lambda: fast_weight_attention(q, k, v, beta, lam, rule="1", backend="triton")[0],
        "fla simple GLA": lambda: chunk_simple_gla(q, k, v, g=log_gamma, scale=scale)[0],
        "fla gated delta": lambda: chunk_gated_delta_rule(q, k, v, g=log_gamma, beta=beta.to(q.dtype), scale=scale)[0],
        "fla delta": lambda: chunk_delta_rule(q, k, v, beta=beta.to(q.dtype), scale=scale)[0],
    }
    out = {}
    for name, fn in calls.items():
        try:
            out[name] = bench(fn, backward=backward, inputs=leaves)
        except RuntimeError as error:
            if not name.startswith("fla"):
                raise
            print(f"  {name} refused at T={T}: {str(error).splitlines()[0][:100]}", flush=True)
            out[name] = math.nan
    return out


def cell(value: float, digits: int = 2, suffix: str = "") -> str:
    return "refused" if math.isnan(value) else f"{value:.{digits}f}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128)
    args = parser.parse_args()
    errors = agreement(2, 300, 4, 64)
    print("agreement with fla (float32, relative):", {k: f"{v:.1e}" for k, v in errors.items()}, flush=True)
    # fla's float32 tl.dot runs in TF32 (10-bit mantissa): ~1e-3 relative is its rounding; a wrong
    # correspondence (a missing shift, gamma or eta) shows as errors of order one.
    if max(errors.values()) > 1e-2:
        raise SystemExit("ours and fla disagree: fix that before timing anything")
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · B={args.B} H={args.H} D={args.D} bf16, ms")
    names = ["SDPA", "ours 1A", "ours 1", "fla simple GLA", "fla gated delta", "fla delta"]
    ratios = [("ours 1A", "fla simple GLA"), ("ours 1", "fla gated delta"), ("ours 1", "fla delta")]
    print("| T | pass | " + " | ".join(names) + " | ours 1A / fla GLA | ours 1 / fla GDN | ours 1 / fla delta |")
    print("|---|---|" + "---|" * (len(names) + len(ratios)))
    for T in args.T:
        for backward in (False, True):
            ms = timings(args.B, T, args.H, args.D, backward=backward)
            row = " | ".join(cell(ms[n]) for n in names)
            ratio_cells = " | ".join(cell(ms[a] / ms[b], suffix="x") for a, b in ratios)
            print(f"| {T} | {'fwd+bwd' if backward else 'fwd'} | {row} | {ratio_cells} |", flush=True)


if __name__ == "__main__":
    main()
