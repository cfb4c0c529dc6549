"""Rule 1A on prepared writes: launchers of the Triton chunk kernels and their autograd Function.

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t y_t^T          o_t = S_t^T q_t  (read after)  or  S_{t-1}^T q_t

Forward: chunk-local cumulative decays -> (1) each chunk's contribution to the state -> (2) the sequential pass
giving every chunk's entry state and the final state -> (3) the outputs. Backward recomputes the entry states,
runs the same two state stages on the gradients in reverse (dS of every chunk exit, and dS_0), then one kernel for
dq, dx, d eta, d log_gamma and one for dy. `kernels.py` has the formulas.
"""

from __future__ import annotations

import os

import torch
import triton

from hybridlm.ops.fast_weight.triton import DTYPES, MAX_HEAD_DIM, kernels


def fast_weight_1a_triton(
    q: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    eta: torch.Tensor,
    log_gamma: torch.Tensor,
    S0: torch.Tensor | None,
    *,
    read_after: bool,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 1A on prepared quantities (chunk.py's pipeline after its step 3), differentiable in every input.

    Args:
        q: `[N, T, H, K]` queries. x: `[N, T, H, K]` write features (already shifted and masked).
        y: `[N, T, H, V]` values (same dtype as q and x: float32, bfloat16 or float16).
        eta: `[N, T, H]` step sizes (0 where nothing is written). log_gamma: `[N, T, H]` log decays (<= 0).
        S0: `[N, H, K, V]` the entry state (float32), or None for zeros.
        read_after: o_t reads S_t (True) or S_{t-1} (False).
        chunk_size: a power of two in [16, 128].

    Returns:
        o `[N, T, H, V]` in q's dtype and the final state `[N, H, K, V]` float32.
    """
    _check(q, x, y, eta, log_gamma, S0, chunk_size)
    return _FastWeight1A.apply(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


def _check(q, x, y, eta, log_gamma, S0, chunk_size) -> None:
    if q.dim() != 4 or x.shape != q.shape or y.dim() != 4 or y.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, x must be [N, T, H, K] and y [N, T, H, V]; got q {tuple(q.shape)}, "
                         f"x {tuple(x.shape)}, y {tuple(y.shape)}")
    N, T, H, K = q.shape
    V = y.shape[-1]
    if T < 1:
        raise ValueError("the sequence is empty (T = 0)")
    for name, t in (("eta", eta), ("log_gamma", log_gamma)):
        if tuple(t.shape) != (N, T, H) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point [N, T, H] = {[N, T, H]}; "
                             f"got {list(t.shape)} {t.dtype}")
    if q.dtype not in DTYPES or x.dtype != q.dtype or y.dtype != q.dtype:
        raise ValueError(f"q, x, y must share one dtype among {DTYPES}; got {q.dtype}, {x.dtype}, {y.dtype}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K, V <= {MAX_HEAD_DIM}; got K = {K}, V = {V} "
                         "(use the chunk backend)")
    if not (isinstance(chunk_size, int) and 16 <= chunk_size <= 128 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a power of two in [16, 128] for the Triton kernels; got {chunk_size}")
    if S0 is not None and (tuple(S0.shape) != (N, H, K, V) or S0.dtype != torch.float32):
        raise ValueError(f"S0 must be float32 [N, H, K, V] = {[N, H, K, V]}; got {list(S0.shape)} {S0.dtype}")
    devices = {t.device for t in (q, x, y, eta, log_gamma, S0) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {q.device}; on a CPU set TRITON_INTERPRET=1 "
                         "before triton is imported to run them under the interpreter)")


class _FastWeight1A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, y, eta, log_gamma, S0, read_after, chunk_size):
        q, x, y, eta, log_gamma = (t.contiguous() for t in (q, x, y, eta, log_gamma))
        S0 = None if S0 is None else S0.contiguous()
        plan = _Plan(q, y, chunk_size, read_after)
        L = plan.cumsum(log_gamma)
        states, S_final = plan.states(x, y, eta, L, S0)
        o = plan.outputs(q, x, y, eta, L, states)
        ctx.save_for_backward(q, x, y, eta, S0, L)
        ctx.plan = plan
        ctx.lg_dtype = log_gamma.dtype
        ctx.set_materialize_grads(False)
        return o, S_final

    @staticmethod
    def backward(ctx, do, dS_final):
        q, x, y, eta, S0, L = ctx.saved_tensors
        plan = ctx.plan
        do = torch.zeros_like(y) if do is None else do.to(q.dtype).contiguous()
        states, _ = plan.states(x, y, eta, L, S0)                     # recomputed: entry state of every chunk
        dstates, dS0 = plan.state_grads(q, do, L, dS_final)          # dL/dS at every chunk exit, and dS_0
        dq, dx, deta, dlg = plan.grad_qx(q, x, y, eta, L, do, states, dstates, ctx.lg_dtype)
        dy = plan.grad_y(q, x, eta, L, do, dstates)
        return dq, dx, dy, deta, dlg, (dS0 if S0 is not None and ctx.needs_input_grad[5] else None), None, None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block(dim: int, cap: int) -> int:
    """A power-of-two block (>= 16, the smallest tl.dot size) covering dim, at most cap."""
    return min(max(16, triton.next_power_of_2(dim)), cap)


class _Plan:
    """Sizes, block shapes and launch grids of one call; each method launches one stage."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        self.N, self.T, self.H, self.K = q.shape
        self.V = y.shape[-1]
        self.BT = chunk_size
        self.n_chunks = -(-self.T // self.BT)
        self.T_pad = self.n_chunks * self.BT
        self.BK, self.BV = _block(self.K, 64), _block(self.V, 64)
        self.BK_full = _block(self.K, 128)  # the dq/dx kernel holds all of K
        self.BV_qx = _block(self.V, 64 if self.BK_full <= 64 else 32)
        self.read_after = read_after
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: exact products (no TF32)
        self.device = q.device

    def _sizes(self):
        return {"K": self.K, "V": self.V, "BT": self.BT}

    def _state_buffer(self) -> torch.Tensor:
        return torch.empty(self.N * self.H, self.n_chunks, self.K, self.V, dtype=torch.float32, device=self.device)

    def _n_state_blocks(self) -> int:
        return -(-self.K // self.BK) * -(-self.V // self.BV)

    def cumsum(self, log_gamma):
        L = torch.empty(self.N * self.H, self.T_pad, dtype=torch.float32, device=self.device)
        kernels.chunk_cumsum_kernel[(self.n_chunks, self.N * self.H)](log_gamma, L, self.T, self.T_pad, self.H,
                                                                      BT=self.BT)
        return L

    def states(self, x, y, eta, L, S0):
        """(1) + (2): the entry state of every chunk [N * H, n_chunks, K, V] and the final state [N, H, K, V]."""
        h = self._state_buffer()
        self._outer(x, y, eta, L, h, grad=False)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        self._pass(h, S0, final, L, reverse=False)
        return h, final

    def _outer(self, a, b, eta, L, out, *, grad: bool) -> None:
        kernels.chunk_outer_kernel[(self._n_state_blocks(), self.n_chunks, self.N * self.H)](
            a, b, eta, L, out, self.T, self.T_pad, self.n_chunks, self.H, **self._sizes(), BK=self.BK, BV=self.BV,
            READ_AFTER=self.read_after, GRAD=grad, PREC=self.prec)

    def _pass(self, h, init, final, L, *, reverse: bool) -> None:
        BK, BV = self.BK, _block(self.V, 32)  # smaller blocks: more programs for the sequential pass
        kernels.state_pass_kernel[(-(-self.K // BK) * -(-self.V // BV), self.N * self.H)](
            h, h if init is None else init, final, L, self.T_pad, self.n_chunks, **self._sizes(), BK=BK, BV=BV,
            HAS_INIT=init is not None, REVERSE=reverse, INTERPRET=_interpreting(), num_warps=4)

    def outputs(self, q, x, y, eta, L, states):
        o = torch.empty(self.N, self.T, self.H, self.V, dtype=q.dtype, device=self.device)
        kernels.output_kernel[(-(-self.V // self.BV), self.n_chunks, self.N * self.H)](
            q, x, y, eta, L, states, o, self.T, self.T_pad, self.n_chunks, self.H, **self._sizes(), BK=self.BK,
            BV=self.BV, READ_AFTER=self.read_after, PREC=self.prec)
        return o

    def state_grads(self, q, do, L, dS_final):
        """(1') + (2'): dL/dS at every chunk's exit [N * H, n_chunks, K, V] and dL/dS_0 [N, H, K, V]."""
        g = self._state_buffer()
        self._outer(q, do, L, L, g, grad=True)  # (eta is unused)
        dS0 = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
        self._pass(g, init, dS0, L, reverse=True)
        return g, dS0

    def grad_qx(self, q, x, y, eta, L, do, states, dstates, lg_dtype):
        dq, dx = torch.empty_like(q), torch.empty_like(x)
        deta = torch.empty_like(eta)
        dlg = torch.empty(eta.shape, dtype=lg_dtype, device=self.device)
        kernels.grad_qx_kernel[(self.n_chunks, self.N * self.H)](
            q, x, y, eta, L, do, states, dstates, dq, dx, deta, dlg, self.T, self.T_pad, self.n_chunks, self.H,
            **self._sizes(), BK=self.BK_full, BV=self.BV_qx, READ_AFTER=self.read_after, PREC=self.prec)
        return dq, dx, deta, dlg

    def grad_y(self, q, x, eta, L, do, dstates):
        dy = torch.empty(self.N, self.T, self.H, self.V, dtype=q.dtype, device=self.device)
        kernels.grad_y_kernel[(-(-self.V // self.BV), self.n_chunks, self.N * self.H)](
            q, x, eta, L, do, dstates, dy, self.T, self.T_pad, self.n_chunks, self.H, **self._sizes(), BK=self.BK,
            BV=self.BV, READ_AFTER=self.read_after, PREC=self.prec)
        return dy
