"""Accuracy of rule 1's Triton kernels and of fla's `chunk_delta_rule` on the same 16-bit inputs, each against a
float64 recurrence of exactly what it was given: the error each side's own arithmetic adds.

    pip install --no-deps einops fla-core==0.6.0 flash-linear-attention==0.6.0   # pure-Python wheels
    python benchmarks/gpu_fla_accuracy.py                 # B=1, H=2, D=128, bf16, T in 640 4096

Rule 1 without decay on prepared writes (`fast_weight_1_triton` with log gamma = 0) is fla's delta rule with key x_t
and beta_t = eta_t:

    S_t = S_{t-1} + eta_t x_t (v_t - S_{t-1}^T x_t)^T,    o_t = S_t^T q_t    (S_0 = 0)

Both sides get the same 16-bit q, x, v; ours takes eta in float32, fla in q's dtype (as its kernels take beta), and
each side's reference uses the eta it got. The reference runs the recurrence step by step in float64, with autograd
for the gradients of L = <o, W_o> + <S_T, W_S> (fixed random W). Two key scales: the layer's RMS-normalised keys
(|x|^2 = D, eta ~ beta / D, as `fast_weight_attention` prepares them) and unit keys (fla's usual
`use_qk_l2norm_in_kernel` inputs, eta = beta). Printed: relative Frobenius errors of o, S_T, dq, dx, dv, d eta, and
the largest. The tests hold our kernels to 5e-3 on such a row (`tests/ops/test_triton_rule3.py`,
`test_long_16bit_rows_match_float64`).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gpu_ops import rel_err  # benchmarks/ is on the path when this script runs

NAMES = ("o", "S", "dq", "dx", "dv", "deta")


def make_writes(B: int, T: int, H: int, D: int, *, unit_keys: bool, seed: int = 0,
                device: str = "cuda") -> list[torch.Tensor]:
    """q, x, v [B, T, H, D] and eta [B, T, H] in float64 (beta in (0.05, 0.95) per step)."""
    g = torch.Generator(device=device).manual_seed(seed)
    f64 = {"device": device, "dtype": torch.float64}
    q = F.normalize(torch.randn(B, T, H, D, generator=g, **f64), dim=-1) * D**0.5
    x = F.normalize(torch.randn(B, T, H, D, generator=g, **f64), dim=-1) * (1.0 if unit_keys else D**0.5)
    v = torch.randn(B, T, H, D, generator=g, **f64)
    beta = 0.05 + 0.9 * torch.rand(B, T, H, generator=g, **f64)
    eta = beta / x.pow(2).sum(-1)
    return [q, x, v, eta]


def reference(q, x, v, eta) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, H, D] and S_T [B, H, D, D] of the delta rule, step by step (float64)."""
    B, T, H, D = q.shape
    S = q.new_zeros(B, H, D, v.shape[-1])
    outs = []
    for t in range(T):
        xt, vt = x[:, t], v[:, t]                                                           # [B, H, D]
        r = vt - torch.einsum("bhkv,bhk->bhv", S, xt)
        S = S + eta[:, t, :, None, None] * xt[..., :, None] * r[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def errors(run, q, x, v, eta, dtype: torch.dtype, eta_dtype: torch.dtype) -> dict[str, float]:
    """Relative errors of `run(q, x, v, eta) -> (o, S_T)` on the inputs rounded to dtype (eta to eta_dtype), against
    the float64 reference on the same rounded values."""
    seen = [t.to(dtype) for t in (q, x, v)] + [eta.to(eta_dtype)]
    ref = [t.double().requires_grad_(True) for t in seen]
    o_ref, S_ref = reference(*ref)
    g = torch.Generator(device=q.device).manual_seed(7)
    w_o = torch.randn(o_ref.shape, device=q.device, generator=g, dtype=torch.float64)
    w_S = torch.randn(S_ref.shape, device=q.device, generator=g, dtype=torch.float64)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), ref)
    leaves = [t.clone().requires_grad_(True) for t in seen]
    o, S = run(*leaves)
    grads = torch.autograd.grad((o.double() * w_o).sum() + (S.double() * w_S).sum(), leaves)
    out = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}
    out.update({n: rel_err(a, b) for n, a, b in zip(NAMES[2:], grads, grads_ref)})
    return out


def ours(q, x, v, eta):
    from hybridlm.ops.fast_weight.triton import fast_weight_1_triton

    return fast_weight_1_triton(q, x, v, eta, torch.zeros_like(eta), None, read_after=True)


def fla(q, x, v, eta):
    from fla.ops.delta_rule import chunk_delta_rule

    return chunk_delta_rule(q, x, v, beta=eta, scale=1.0, output_final_state=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[640, 4096])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=2)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · B={args.B} H={args.H} D={args.D} "
          f"{args.dtype} · relative errors against float64")
    print("| keys | T | side | " + " | ".join(NAMES) + " | largest |")
    print("|---|---|---|" + "---|" * (len(NAMES) + 1))
    for unit_keys in (False, True):
        for T in args.T:
            writes = make_writes(args.B, T, args.H, args.D, unit_keys=unit_keys)
            for side, run, eta_dtype in (("ours (rule 1)", ours, torch.float32), ("fla delta", fla, dtype)):
                e = errors(run, *writes, dtype, eta_dtype)
                cells = " | ".join(f"{e[n]:.1e}" for n in NAMES)
                keys = "unit" if unit_keys else "|x|^2 = D"
                print(f"| {keys} | {T} | {side} | {cells} | {max(e.values()):.1e} |", flush=True)


if __name__ == "__main__":
    main()
