"""Rule 2A on prepared writes: launchers of the Triton chunk kernels, forward and backward (the implementations of
the custom ops `hybridlm::fast_weight_2a_fwd` / `_bwd`, `custom_ops.py`).

    S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * y_t)^T      o_t = S_t^T q_t (read after) or S_{t-1}^T q_t

with eta_t, log_gamma_t per value column ([N, T, H, V]). Forward: chunk-local cumulative decays per column ->
(F1) each chunk's contribution to the state -> (F2) the sequential pass (entry states, final state) -> (F3) the
outputs. Backward recomputes the entry states, runs F1/F2 on the gradients in reverse (dS' of every chunk exit, and
dS_0), then one kernel for dy, d eta, d log_gamma (per value tile) and one for dq, dx (per key tile).
`kernels_2a.py` derives the formulas.
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.triton import kernels_2a
from hybridlm.ops.fast_weight.triton.chunk_1a import ChunkPlan, _block
from hybridlm.ops.fast_weight.triton.custom_ops import _interpreting

# Elements of the [BT, BT, BV] decay tensor of the intra-chunk kernels (the value tile shrinks as the chunk grows).
_TILE_3D = 8192


def forward(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked inputs
    (`custom_ops._check`); S0 None for zeros."""
    p = _Plan(q, y, chunk_size, read_after)
    L = p.cumsum(log_gamma)
    states, final = p.states(x, y, eta, L, S0)
    o = torch.empty(p.N, p.T, p.H, p.V, dtype=q.dtype, device=p.device)
    kernels_2a.output_2a_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](
        q, x, y, eta, L, states, o, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK, BV=p.BV3,
        READ_AFTER=read_after, PREC=p.prec)
    return o, final


def backward(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's dtype) and
    dL/dS_final (float32 or None). The entry states are recomputed."""
    p = _Plan(q, y, chunk_size, read_after)
    L = p.cumsum(log_gamma)
    states, _ = p.states(x, y, eta, L, S0)                                 # entry state of every chunk
    dstates = p.state_buffer()                                             # (B1): dS' of every chunk, and dS_0
    p.outer(q, do, L, L, dstates, grad=True)                               # (eta unused)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    p.run_pass(dstates, init, dS0, L, reverse=True)
    dy = torch.empty_like(y)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    kernels_2a.grad_v_2a_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](      # (B2), (B4)
        q, x, y, eta, L, do, states, dstates, dy, deta, dlg, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK,
        BV=p.BV3, READ_AFTER=read_after, PREC=p.prec)
    dq, dx = torch.empty_like(q), torch.empty_like(x)
    kernels_2a.grad_qx_2a_kernel[(-(-p.K // p.BK), p.n_chunks, p.NH)](      # (B3)
        q, x, y, eta, L, do, states, dstates, dq, dx, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK, BV=p.BV3,
        READ_AFTER=read_after, PREC=p.prec)
    return dq, dx, dy, deta, dlg, dS0


class _Plan(ChunkPlan):
    """Rule 2A's block shapes and launch grids; the stages shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK, self.BV = _block(self.K, 64), _block(self.V, 64)
        self.BV3 = _block(self.V, max(16, _TILE_3D // (self.BT * self.BT)))  # value tile of the [BT, BT, BV] kernels

    def cumsum(self, log_gamma):
        """L [N * H, T_pad, V] float32, chunk-local cumulative log decays per value column."""
        L = torch.empty(self.NH, self.T_pad, self.V, dtype=torch.float32, device=self.device)
        kernels_2a.cumsum_2a_kernel[(-(-self.V // self.BV), self.n_chunks, self.NH)](
            log_gamma, L, self.T, self.T_pad, self.H, V=self.V, BT=self.BT, BV=self.BV)
        return L

    def states(self, x, y, eta, L, S0):
        """(F1) + (F2): the entry state of every chunk [N * H, n_chunks, K, V] and the final state [N, H, K, V]."""
        h = self.state_buffer()
        self.outer(x, y, eta, L, h, grad=False)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        self.run_pass(h, S0, final, L, reverse=False)
        return h, final

    def outer(self, a, b, eta, L, out, *, grad: bool) -> None:
        grid = (-(-self.K // self.BK) * -(-self.V // self.BV), self.n_chunks, self.NH)
        kernels_2a.outer_2a_kernel[grid](
            a, b, eta, L, out, self.T, self.T_pad, self.n_chunks, self.H, **self.sizes, BK=self.BK, BV=self.BV,
            READ_AFTER=self.read_after, GRAD=grad, PREC=self.prec)

    def run_pass(self, h, init, final, L, *, reverse: bool) -> None:
        BK, BV = self.BK, _block(self.V, 32)  # smaller blocks: more programs for the sequential pass
        kernels_2a.pass_2a_kernel[(-(-self.K // BK) * -(-self.V // BV), self.NH)](
            h, h if init is None else init, final, L, self.T_pad, self.n_chunks, **self.sizes, BK=BK, BV=BV,
            HAS_INIT=init is not None, REVERSE=reverse, INTERPRET=_interpreting(), num_warps=4)
