"""The fused write preparation of rules 1A and 1 (window 1): launchers of `kernels_prepare.py`, forward and backward
(the implementations of the custom ops `hybridlm::fast_weight_prepare_fwd` / `_bwd`, `custom_ops.py`).

One kernel computes chunk.py's `prepare_writes` steps 1-3 for window 1 and a scalar step per head (pairs, |x|^2,
NLMS or direct step sizes, ridge, clamped log decays; packed rows padded on the fly, or documents restarted in place
from a document index per step); one kernel its backward.
"""

from __future__ import annotations

import torch
import triton

from hybridlm.ops.fast_weight.triton import kernels_prepare

# Steps per program and warps: at K = V = 128 (bf16, sm_90, checked with ptxas) 16 steps on 8 warps compile without
# spills in every variant (the backward peaks at 172 registers); 32 steps, or 4 warps, spill in the backward.
BT, NUM_WARPS = 16, 8


def _launch(k, v, offsets, max_len):
    N = k.shape[0] if offsets is None else offsets.shape[0] - 1
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    sizes = {"K": K, "V": V, "BT": BT, "BK": max(16, triton.next_power_of_2(K)),
             "BV": max(16, triton.next_power_of_2(V))}
    return N, H, K, V, (triton.cdiv(max_len, BT), N * H), sizes


def _flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling):
    return {"SHIFTED": shifted, "HAS_LAST": shifted and last_k is not None, "PACKED": offsets is not None,
            "NLMS": nlms, "SCALED": ridge_scaling, "SEQ": seq_idx is not None}


def _pointers(k, last_k, offsets, seq_idx):
    """The optional inputs' pointers (k where absent: never read)."""
    return tuple(k if t is None else t for t in (last_k, offsets, seq_idx))


def forward(k, v, beta, lam, last_k, offsets, seq_idx, max_len: int, shifted: bool, nlms: bool, ridge_scaling: bool,
            eps: float, eps_gamma: float):
    """x [N, max_len, H, K] (k's dtype), y [N, max_len, H, V] (v's dtype), eta, log_gamma [N, max_len, H] float32 on
    contiguous inputs: k [B, T, H, K], v [B, T, H, V], beta, lam [B, T, H] float32, last_k [N, H, K] (k's dtype) or
    None, offsets [N + 1] int64 on k's device or None (then N = B and max_len = T), seq_idx [B, T] integers (a
    document index per step; without offsets) or None."""
    N, H, K, V, grid, sizes = _launch(k, v, offsets, max_len)
    x = k.new_empty(N, max_len, H, K)
    y = v.new_empty(N, max_len, H, V)
    eta = torch.empty(N, max_len, H, dtype=torch.float32, device=k.device)
    lg = torch.empty_like(eta)
    kernels_prepare.prepare_fwd_kernel[grid](
        k, v, beta, lam, *_pointers(k, last_k, offsets, seq_idx), x, y, eta, lg, max_len, H, eps, 1.0 - eps_gamma,
        **sizes, **_flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling), num_warps=NUM_WARPS)
    return x, y, eta, lg


def backward(dx, dy, deta, dlg, k, v, beta, lam, last_k, offsets, seq_idx, max_len: int, shifted: bool, nlms: bool,
             ridge_scaling: bool, eps: float, eps_gamma: float):
    """dk, dv (as k, v), d beta, d lam (float32) and d last_k ([N, H, K], zeros when last_k is None) for the
    gradients of the forward's four outputs (contiguous, their shapes)."""
    N, H, K, _, grid, sizes = _launch(k, v, offsets, max_len)
    # Every input row is some step's (t < its length), which writes its dv, d beta, d lam (zeros where no pair);
    # dk: a shifted row's last key feeds no write here (the final state's last_k is taken outside), so zeros first.
    dk = torch.zeros_like(k) if shifted else torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dlam = torch.empty_like(lam)
    dlast = k.new_zeros(N, H, K)
    kernels_prepare.prepare_bwd_kernel[grid](
        k, v, beta, lam, *_pointers(k, last_k, offsets, seq_idx), dx, dy, deta, dlg, dk, dv, dbeta, dlam, dlast,
        max_len, H, eps, 1.0 - eps_gamma, **sizes, **_flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling),
        num_warps=NUM_WARPS)
    return dk, dv, dbeta, dlam, dlast
