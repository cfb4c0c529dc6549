"""Our Triton fast-weight kernels against flash-linear-attention (fla) on a GPU: agreement, then timing.

    pip install --no-deps einops fla-core==0.6.0 flash-linear-attention==0.6.0   # pure-Python wheels
    python benchmarks/gpu_fla_compare.py                       # B=8 H=16 D=128 bf16, T in 2048 4096 16384
    python benchmarks/gpu_fla_compare.py --T 4096 --passes fwd+bwd --no-agreement   # one row, less autotuning
    python benchmarks/gpu_fla_compare.py --T 4096 16384 --passes fwd+bwd --no-agreement --only "fla delta" "ours 1"

Both sides compute the same function: our op as the model runs it (shifted pairing, NLMS steps, ridge as decay,
read after), and fla fed through these exact correspondences, computed inside fla's timed call from the same
raw q, k, v, beta, lam (so fla pays for its input mapping as ours pays for its write preparation, and gradients
reach the same leaves). With x_t = k_{t-1} (x_1 = 0), eta_t = beta_t / (|x_t|^2 + lam_t + eps) (0 at t = 1, where
nothing is written), gamma_t = 1 - min(eta_t lam_t, 1 - eps_gamma):
   - rule 1A is `chunk_simple_gla` with key eta_t x_t, g_t = log gamma_t, scale 1;
   - rule 1 is `chunk_gated_delta_rule` with key x_t, value gamma_t v_t, g_t = log gamma_t, beta = eta_t / gamma_t,
     scale 1, no in-kernel l2 norm.
(Checked in float64 against our chunk backend: 4e-16 relative.)

1. Agreement in float32 at the timed configuration (B=2, T=300, H=4, the timed D): outputs, and the q, k, v
   gradients where fla runs its backward.
2. Timing (median of `triton.testing.do_bench`), forward and forward+backward, bf16: SDPA (causal), ours 1A and
   rule 1, fla simple GLA and gated delta rule on the mapped inputs, and fla's ungated `chunk_delta_rule` (raw
   shifted keys, no decay: less work than rule 1, reported as the closest peer whose backward runs). The
   "kernels" columns time rule 1A's kernels alone on writes mapped before the timed call, ours
   (`fast_weight_1a_triton` on x, eta, log gamma) and fla's (`chunk_simple_gla` on eta x and log gamma), so that
   neither side's input mapping counts. fla 0.6
   refuses its gated backward kernels on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue #640: wrong results
   there), so on an H200 with Triton 3.6 the forward + backward rows of simple GLA and the gated delta rule print
   "refused". Each timing is printed as soon as it is measured: fla autotunes every kernel again for each dtype and
   shape (minutes per row on an H200), so a run stopped by a time limit still reports what it measured; `--only`
   times the named columns alone, in the order given (the others print "-").
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from gpu_ops import (  # benchmarks/ is on the path when this script runs
    add_timing_args,
    bench,
    causal_sdpa,
    set_timing,
)

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


EPS, EPS_GAMMA = 1e-6, 1e-6  # the op's defaults


def _shift(k: torch.Tensor) -> torch.Tensor:
    """x_t = k_{t-1}, x_1 = 0 ([B, T, H, D])."""
    return torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)


def _steps(x: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """eta, gamma [B, T, H] float32 of the shifted keys x (module docstring)."""
    eta = beta / (x.float().pow(2).sum(-1) + lam + EPS)
    eta = torch.cat([torch.zeros_like(eta[:, :1]), eta[:, 1:]], dim=1)
    return eta, 1.0 - torch.clamp(eta * lam, max=1.0 - EPS_GAMMA)


def _gla_writes(x, eta, gamma, dtype):
    """fla's simple GLA inputs for rule 1A's writes: the key eta_t x_t (in dtype) and g_t = log gamma_t."""
    return (eta[..., None] * x).to(dtype), gamma.log()


def fla_1a(q, k, v, beta, lam):
    """Our rule 1A through fla's simple GLA (the mapping included)."""
    from fla.ops.simple_gla import chunk_simple_gla

    x = _shift(k)
    key, g = _gla_writes(x, *_steps(x, beta, lam), q.dtype)
    return chunk_simple_gla(q, key, v, g=g, scale=1.0)[0]


def fla_1(q, k, v, beta, lam):
    """Our rule 1 through fla's gated delta rule (the mapping included)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    x = _shift(k)
    eta, gamma = _steps(x, beta, lam)
    return chunk_gated_delta_rule(q, x, (gamma[..., None] * v).to(v.dtype), g=gamma.log(),
                                  beta=(eta / gamma).to(q.dtype), scale=1.0, use_qk_l2norm_in_kernel=False)[0]


def ours(rule: str):
    return lambda q, k, v, beta, lam: fast_weight_attention(q, k, v, beta, lam, rule=rule, backend="triton")[0]


def agreement(B: int, T: int, H: int, D: int) -> dict[str, float]:
    """Relative differences ours vs fla (outputs, and q/k/v gradients where fla's backward runs: NaN where refused)."""
    x = inputs(B, T, H, D, torch.float32, seed=1)
    out = {}
    for name, mine, theirs in (("1A", ours("1A"), fla_1a), ("1", ours("1"), fla_1)):
        results = []
        for fn in (mine, theirs):
            leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
            o = fn(*leaves, x["beta"], x["lam"])
            try:
                grads = torch.autograd.grad(o, leaves, torch.ones_like(o))
            except RuntimeError:  # fla's refused gated backward (module docstring)
                grads = None
            results.append((o.detach(), grads))
        (o_ours, g_ours), (o_fla, g_fla) = results
        out[f"{name} o"] = rel(o_ours, o_fla)
        for n, i in (("dq", 0), ("dk", 1), ("dv", 2)):
            out[f"{name} {n}"] = math.nan if g_fla is None else rel(g_ours[i], g_fla[i])
    from fla.ops.simple_gla import chunk_simple_gla

    from hybridlm.ops.fast_weight.triton import fast_weight_1a_triton

    (xs, eta, log_gamma), (eta_x, g) = mapped_1a(x["k"], x["beta"], x["lam"], requires_grad=False)
    out["1A kernels o"] = rel(fast_weight_1a_triton(x["q"], xs, x["v"], eta, log_gamma, None, read_after=True)[0],
                              chunk_simple_gla(x["q"], eta_x, x["v"], g=g, scale=1.0)[0])
    return out


COLUMNS = ["SDPA", "ours 1A", "ours 1", "fla simple GLA", "fla gated delta", "fla delta", "ours 1A kernels",
           "fla simple GLA kernels"]
RATIOS = {"ours 1A / fla GLA": ("ours 1A", "fla simple GLA"), "ours 1 / fla GDN": ("ours 1", "fla gated delta"),
          "ours 1 / fla delta": ("ours 1", "fla delta"),
          "ours 1A / fla GLA, kernels": ("ours 1A kernels", "fla simple GLA kernels")}


def mapped_1a(k: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor, *, requires_grad: bool):
    """Rule 1A's writes mapped once, outside any timed call: x, eta, log gamma for our kernels, and the key eta x
    that fla's simple GLA takes in their place (as leaves, so that a backward reaches them)."""
    with torch.no_grad():
        x = _shift(k)
        eta, gamma = _steps(x, beta, lam)
        ours_writes = (x, eta, gamma.log())
        fla_writes = _gla_writes(x, eta, gamma, k.dtype)
    return ([t.clone().requires_grad_(requires_grad) for t in ours_writes],
            [t.clone().requires_grad_(requires_grad) for t in fla_writes])


def timings(B: int, T: int, H: int, D: int, *, backward: bool, only: list[str]) -> dict[str, float]:
    """Median ms per call of the columns in `only`, in that order; NaN where fla refuses the call (a RuntimeError
    raised before any kernel runs)."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    from hybridlm.ops.fast_weight.triton import fast_weight_1a_triton

    x = inputs(B, T, H, D, torch.bfloat16)
    leaves = [x["q"], x["k"], x["v"]]
    for t in leaves:
        t.requires_grad_(backward)
    q, k, v, beta, lam = x["q"], x["k"], x["v"], x["beta"], x["lam"]
    (xs, eta, log_gamma), (eta_x, g) = mapped_1a(k, beta, lam, requires_grad=backward)
    kernel_leaves = {"ours 1A kernels": [q, xs, v, eta, log_gamma], "fla simple GLA kernels": [q, eta_x, v, g]}
    calls = {
        "SDPA": lambda: causal_sdpa(q, k, v),
        "ours 1A": lambda: ours("1A")(q, k, v, beta, lam),
        "ours 1": lambda: ours("1")(q, k, v, beta, lam),
        "fla simple GLA": lambda: fla_1a(q, k, v, beta, lam),
        "fla gated delta": lambda: fla_1(q, k, v, beta, lam),
        "fla delta": lambda: chunk_delta_rule(q, _shift(k), v, beta=beta.to(q.dtype), scale=1.0)[0],
        "ours 1A kernels": lambda: fast_weight_1a_triton(q, xs, v, eta, log_gamma, None, read_after=True)[0],
        "fla simple GLA kernels": lambda: chunk_simple_gla(q, eta_x, v, g=g, scale=1.0)[0],
    }
    if {"ours 1A kernels", "fla simple GLA kernels"} <= set(only):
        with torch.no_grad():
            diff = rel(calls["ours 1A kernels"](), calls["fla simple GLA kernels"]())
        print(f"  T={T}: rule 1A's kernels, ours vs fla's on the same writes (bf16): {diff:.1e} relative", flush=True)
    out = {}
    for name in only:
        fn = calls[name]
        try:
            out[name] = bench(fn, backward=backward, inputs=kernel_leaves.get(name, leaves))
            print(f"  measured T={T} {'fwd+bwd' if backward else 'fwd'} {name}: {out[name]:.3f} ms", flush=True)
        except RuntimeError as error:
            if not name.startswith("fla"):
                raise
            print(f"  {name} refused at T={T}: {str(error).splitlines()[0][:100]}", flush=True)
            out[name] = math.nan
    return out


def cell(value: float | None, digits: int = 2, suffix: str = "") -> str:
    """A table cell: "-" for a column not timed, "refused" for a call fla refused."""
    if value is None:
        return "-"
    return "refused" if math.isnan(value) else f"{value:.{digits}f}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    parser.add_argument("--only", nargs="+", choices=COLUMNS, default=COLUMNS, metavar="COLUMN",
                        help=f"time only these columns, in this order (of: {', '.join(COLUMNS)})")
    parser.add_argument("--no-agreement", action="store_true",
                        help="skip the float32 agreement check (it autotunes fla's float32 kernels: minutes)")
    add_timing_args(parser)
    args = parser.parse_args()
    timing = set_timing(args)
    if not args.no_agreement:
        errors = agreement(2, 300, 4, args.D)
        print("agreement with fla (float32, relative; nan: fla's backward refused):",
              {k: f"{v:.1e}" for k, v in errors.items()}, flush=True)
        # fla's float32 tl.dot runs in TF32 (10-bit mantissa): ~1e-3 relative is its rounding; a wrong
        # correspondence (a missing shift, gamma or eta) shows as errors of order one.
        if max((e for e in errors.values() if not math.isnan(e)), default=0.0) > 1e-2:
            raise SystemExit("ours and fla disagree: fix that before timing anything")
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · B={args.B} H={args.H} D={args.D} bf16, ms "
          f"· {timing}")
    names = COLUMNS
    print("| T | pass | " + " | ".join([*names, *RATIOS]) + " |")
    print("|---|---|" + "---|" * (len(names) + len(RATIOS)))
    for T in args.T:
        for backward in [p == "fwd+bwd" for p in args.passes]:
            ms = timings(args.B, T, args.H, args.D, backward=backward, only=args.only)
            row = " | ".join(cell(ms.get(n)) for n in names)
            ratio_cells = " | ".join(cell(ms[a] / ms[b] if a in ms and b in ms else None, suffix="x")
                                     for a, b in RATIOS.values())
            print(f"| {T} | {'fwd+bwd' if backward else 'fwd'} | {row} | {ratio_cells} |", flush=True)


if __name__ == "__main__":
    main()
