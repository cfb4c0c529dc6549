"""Chunked SSD on the Triton kernels: the launchers of `kernels.py`, forward and backward (the implementations of
the custom ops `hybridlm::ssd_fwd` / `hybridlm::ssd_bwd`, `custom_ops.py`).

Forward: chunk-local cumulative log decays (F1) -> what every chunk writes (F2) -> the sequential pass giving
every chunk's entry state and the final state (F3) -> the outputs (F4). Backward recomputes the entry states, runs
the same two state stages on the gradients in reverse (B1, B2: dL/dh_out of every chunk and dL/dh0), then one kernel
for dx, ddt and the decay gradients (B3-B5) and one for dB, dC (B6). README.md has the derivation.
"""

from __future__ import annotations

import torch

from hybridlm.ops.ssd.triton import kernels
from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import MAX_GRID_YZ, cdiv, triton_interpreting


def forward(x, dt, A, B, C, D, h0, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y `[b, T, H, P]` (x's dtype) and the final state `[b, H, P, N]` float32 on contiguous, checked inputs
    (checked by `custom_ops.py`); D None for no skip, h0 None for zeros."""
    plan = _Plan(x, B, chunk_size)
    cum = plan.cumsum(dt, A)
    states, final = plan.states(x, B, dt, cum, h0)
    return plan.outputs(x, B, C, dt, D, cum, states), final


def backward(dy, dh_final, x, dt, A, B, C, D, h0, chunk_size: int):
    """dx (x's dtype), ddt, dA (float32), dB, dC (B's dtype), dD [H] and dh0 [b, H, P, N] (float32) for dL/dy (x's
    dtype) and dL/dh_final (float32 or None). The entry states are recomputed."""
    plan = _Plan(x, B, chunk_size)
    cum = plan.cumsum(dt, A)
    states, _ = plan.states(x, B, dt, cum, h0)                   # recomputed: h_in of every chunk
    dstates, dh0 = plan.state_grads(dy, C, dt, cum, dh_final)    # dL/dh_out of every chunk, and dL/dh0
    dx, ddt, dl, dD = plan.grad_x(x, B, C, dt, A, D, cum, states, dstates, dy)
    dB, dC = plan.grad_bc(x, B, C, dt, cum, states, dstates, dy)
    dA = (dl * dt).sum(dim=(0, 1))                               # l = dt A: dL/dA = sum_t dt_t dL/dl_t
    return dx, ddt, dA, dB, dC, dD, dh0


class _Plan:
    """Sizes, block shapes and launch grids of one call; each method launches one stage."""

    def __init__(self, x: torch.Tensor, B: torch.Tensor, chunk_size: int):
        self.b, self.T, self.H, self.P = x.shape
        self.G, self.N = B.shape[2:]
        self.BT = chunk_size
        self.n_chunks = -(-self.T // self.BT)
        if self.n_chunks > MAX_GRID_YZ or self.b * self.H > MAX_GRID_YZ:
            raise ValueError(f"the Triton launch grids put the chunks ({self.n_chunks}) and the rows x heads "
                             f"({self.b * self.H}) on axes limited to {MAX_GRID_YZ}: call ssd (it splits the batch) "
                             "or use a longer chunk")
        self.T_pad = self.n_chunks * self.BT
        self.BP_full = block(self.P, 128)  # the backward kernels hold all of P (their per-step sums run over it)
        self.BP, self.BN = block(self.P, 64), block(self.N, 64)
        self.prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact products (no TF32)
        self.device = x.device

    def _sizes(self):
        return {"P": self.P, "N": self.N, "BT": self.BT}

    def _state_buffer(self) -> torch.Tensor:
        return torch.empty(self.b * self.H, self.n_chunks, self.P, self.N, dtype=torch.float32, device=self.device)

    def _n_state_blocks(self) -> int:
        return cdiv(self.P, self.BP) * cdiv(self.N, self.BN)

    def cumsum(self, dt, A):
        """(F1) c [b * H, T_pad] float32."""
        cum = torch.empty(self.b * self.H, self.T_pad, dtype=torch.float32, device=self.device)
        kernels.chunk_cumsum_kernel[(self.n_chunks, self.b * self.H)](dt, A, cum, self.T, self.T_pad, self.H,
                                                                       BT=self.BT)
        return cum

    def _chunk_terms(self, a, w, dt, cum, out, *, grad: bool) -> None:
        kernels.chunk_state_kernel[(self._n_state_blocks(), self.n_chunks, self.b * self.H)](
            a, w, dt, cum, out, self.T, self.T_pad, self.n_chunks, self.H, self.G, **self._sizes(), BP=self.BP,
            BN=self.BN, GRAD=grad, PREC=self.prec)

    def _pass(self, h, init, final, cum, *, reverse: bool) -> None:
        # [16, 32] blocks: the pass is a walk over the chunks in every program, so more, smaller programs finish
        # sooner (benchmarks/RESULTS.md times [16, 16] to [64, 32] at two model widths).
        BP, BN = block(self.P, 16), block(self.N, 32)
        kernels.state_pass_kernel[(cdiv(self.P, BP) * cdiv(self.N, BN), self.b * self.H)](
            h, h if init is None else init, final, cum, self.T_pad, self.n_chunks, **self._sizes(), BP=BP, BN=BN,
            HAS_INIT=init is not None, REVERSE=reverse, INTERPRET=triton_interpreting(), num_warps=4)

    def states(self, x, B, dt, cum, h0):
        """(F2) + (F3): h_in of every chunk [b * H, n_chunks, P, N] and the final state [b, H, P, N]."""
        h = self._state_buffer()
        self._chunk_terms(x, B, dt, cum, h, grad=False)
        final = torch.empty(self.b, self.H, self.P, self.N, dtype=torch.float32, device=self.device)
        self._pass(h, h0, final, cum, reverse=False)
        return h, final

    def outputs(self, x, B, C, dt, D, cum, states):
        """(F4) y [b, T, H, P] in x's dtype."""
        y = torch.empty_like(x)
        kernels.output_kernel[(cdiv(self.P, self.BP), self.n_chunks, self.b * self.H)](
            x, B, C, dt, cum if D is None else D, cum, states, y, self.T, self.T_pad, self.n_chunks, self.H, self.G,
            **self._sizes(), BP=self.BP, BN=self.BN, HAS_D=D is not None, PREC=self.prec)
        return y

    def state_grads(self, dy, C, dt, cum, dh_final):
        """(B1) + (B2): dL/dh_out of every chunk [b * H, n_chunks, P, N] and dL/dh0 [b, H, P, N]."""
        g = self._state_buffer()
        self._chunk_terms(dy, C, dt, cum, g, grad=True)
        dh0 = torch.empty(self.b, self.H, self.P, self.N, dtype=torch.float32, device=self.device)
        self._pass(g, dh_final, dh0, cum, reverse=True)
        return g, dh0

    def grad_x(self, x, B, C, dt, A, D, cum, states, dstates, dy):
        """(B3)-(B5): dx (x's dtype), ddt, dl [b, T, H] (float32) and dD [H] (float32)."""
        dx = torch.empty_like(x)
        ddt = torch.empty(self.b, self.T, self.H, dtype=torch.float32, device=self.device)
        dl = torch.empty_like(ddt)
        dD_chunks = torch.empty(self.b, self.H, self.n_chunks, dtype=torch.float32, device=self.device)
        kernels.grad_x_kernel[(self.n_chunks, self.b * self.H)](
            x, B, C, dt, A, A if D is None else D, cum, states, dstates, dy, dx, ddt, dl, dD_chunks, self.T,
            self.T_pad, self.n_chunks, self.H, self.G, **self._sizes(), BP=self.BP_full, BN=self.BN,
            HAS_D=D is not None, PREC=self.prec)
        return dx, ddt, dl, dD_chunks.sum(dim=(0, 2))

    def grad_bc(self, x, B, C, dt, cum, states, dstates, dy):
        """(B6): dB, dC [b, T, G, N] in B's dtype (summed over the heads of each group inside the kernel)."""
        dB, dC = torch.empty_like(B), torch.empty_like(C)
        kernels.grad_bc_kernel[(cdiv(self.N, self.BN), self.n_chunks, self.b * self.G)](
            x, B, C, dt, cum, states, dstates, dy, dB, dC, self.T, self.T_pad, self.n_chunks, self.H, self.G,
            **self._sizes(), BP=self.BP_full, BN=self.BN, R=self.H // self.G, PREC=self.prec)
        return dB, dC
