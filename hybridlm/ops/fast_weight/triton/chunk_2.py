"""Rule 2 on prepared writes: launchers of the Triton chunk kernels, forward and backward (the implementations of
the custom ops `hybridlm::fast_weight_2_fwd` / `_bwd`, `custom_ops.py`).

    S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * (y_t - S_{t-1}^T x_t))^T
    o_t = S_t^T q_t (read after) or S_{t-1}^T q_t

with eta_t, log_gamma_t per value column ([N, T, H, V]): every value column is a rule-1 recurrence of its own,
sharing the keys. Forward: chunk-local cumulative decays per column (`kernels_2a.cumsum_2a_kernel`) -> the
sequential pass (per-column triangular systems, residuals, entry states, final state;
`kernels_2.delta2_pass_kernel`) -> the outputs (rule 2A's output kernel on the residuals). Backward recomputes the
forward pass, runs the reverse pass (dS' of every chunk, dZ = dL/dy, dS_0), then one kernel for dy, d eta,
d log_gamma (per value tile) and one for dq, dx (per key tile). `kernels_2.py` derives the formulas.
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.triton import kernels_2, kernels_2a
from hybridlm.ops.fast_weight.triton.chunk_1a import ChunkPlan, _block
from hybridlm.ops.fast_weight.triton.custom_ops import _interpreting

# Elements of the [BT, BT, BV] tensors of the intra-chunk kernels (the value tile shrinks as the chunk grows).
_TILE_3D = 8192


def forward(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked inputs
    (`custom_ops._check`); S0 None for zeros."""
    p = _Plan(q, y, chunk_size, read_after)
    L = p.cumsum(log_gamma)
    states, R, final = p.scan(x, y, eta, L, S0)
    o = torch.empty(p.N, p.T, p.H, p.V, dtype=q.dtype, device=p.device)
    kernels_2a.output_2a_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](
        q, x, R, eta, L, states, o, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK, BV=p.BV3,
        READ_AFTER=read_after, PREC=p.prec)
    return o, final


def backward(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's dtype) and
    dL/dS_final (float32 or None). The entry states and residuals are recomputed."""
    p = _Plan(q, y, chunk_size, read_after)
    L = p.cumsum(log_gamma)
    states, R, _ = p.scan(x, y, eta, L, S0)
    dstates = p.state_buffer()
    dz = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    kernels_2.delta2_grad_pass_kernel[(-(-p.V // p.BV_pass), p.NH)](
        q, x, eta, L, do, dS0 if init is None else init, dstates, dz, dS0, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes,
        BK=p.BK_full, BV=p.BV_pass, READ_AFTER=read_after, HAS_INIT=init is not None, INTERPRET=_interpreting(),
        PREC=p.prec, PREC32=p.prec, num_warps=8)  # (ptxas, sm_90, K = V = 128, bf16: 4 warps spill 72 B, 8 none)
    dy = torch.empty_like(y)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    kernels_2.grad_v_2_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](
        q, x, y, R, eta, L, do, states, dstates, dz, dy, deta, dlg, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes,
        BK=p.BK, BV=p.BV3, READ_AFTER=read_after, PREC=p.prec, PREC32=p.prec)
    dq, dx = torch.empty_like(q), torch.empty_like(x)
    kernels_2.grad_qx_2_kernel[(-(-p.K // p.BK), p.n_chunks, p.NH)](
        q, x, R, eta, L, do, states, dstates, dz, dq, dx, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK,
        BV=p.BV3, READ_AFTER=read_after, PREC32=p.prec)
    return dq, dx, dy, deta, dlg, dS0


class _Plan(ChunkPlan):
    """Rule 2's block shapes; the stages shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK = _block(self.K, 64)
        self.BK_full = _block(self.K, 128)  # the sequential passes hold all of K (r = (I + A)^-1 (Y - X S))
        self.BV3 = _block(self.V, max(16, _TILE_3D // (self.BT * self.BT)))  # value tile of the [BT, BT, BV] work
        self.BV_pass = min(self.BV3, _block(self.V, 32 if self.BK_full <= 64 else 16))

    def cumsum(self, log_gamma):
        """L [N * H, T_pad, V] float32, chunk-local cumulative log decays per value column."""
        BV = _block(self.V, 64)
        L = torch.empty(self.NH, self.T_pad, self.V, dtype=torch.float32, device=self.device)
        kernels_2a.cumsum_2a_kernel[(-(-self.V // BV), self.n_chunks, self.NH)](
            log_gamma, L, self.T, self.T_pad, self.H, V=self.V, BT=self.BT, BV=BV)
        return L

    def scan(self, x, y, eta, L, S0):
        """The sequential pass: entry states [N * H, n_chunks, K, V], residuals r [N, T, H, V] and the final state
        [N, H, K, V] (all float32)."""
        states = self.state_buffer()
        R = torch.empty(self.N, self.T, self.H, self.V, dtype=torch.float32, device=self.device)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        kernels_2.delta2_pass_kernel[(-(-self.V // self.BV_pass), self.NH)](
            x, y, eta, L, final if S0 is None else S0, states, R, final, self.T, self.T_pad, self.n_chunks, self.H,
            **self.sizes, BK=self.BK_full, BV=self.BV_pass, HAS_INIT=S0 is not None, INTERPRET=_interpreting(),
            PREC=self.prec, PREC32=self.prec, num_warps=4)
        return states, R, final
