"""Rule 1A on prepared writes: launchers of the Triton chunk kernels, forward and backward (the implementations of
the custom ops `hybridlm::fast_weight_1a_fwd` / `_bwd`, `custom_ops.py`).

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t y_t^T          o_t = S_t^T q_t  (read after)  or  S_{t-1}^T q_t

Forward: chunk-local cumulative decays -> (1) each chunk's contribution to the state -> (2) the sequential pass
giving every chunk's entry state and the final state -> (3) the outputs. Backward recomputes the entry states,
runs the same two state stages on the gradients in reverse (dS of every chunk exit, and dS_0), then one kernel for
dq, dx, d eta, d log_gamma and one for dy. `kernels.py` has the formulas.

The state stages (1) + (2), and (1') + (2'), run as one kernel (`kernels.state_scan_kernel`: the state block
stays in registers while a program walks the chunks), the layout of flash-linear-attention's state kernels.
"""

from __future__ import annotations

import torch
import triton

from hybridlm.ops.fast_weight.triton import kernels
from hybridlm.ops.fast_weight.triton.custom_ops import _interpreting

_MAX_GRID_YZ = 65535  # CUDA's limit on launch grid axes 1 and 2
# The state scan's programs each walk all the chunks of one state block, so the scan takes one walk's time however
# many programs run beside it. With few rows x heads (a model's training row: 1 x 10 heads gives 20 programs of
# [64, 32] blocks) most of the GPU idles and each program moves its block's keys and values alone. Below
# SCAN_MIN_PROGRAMS programs the blocks shrink (to 16 x 16 at least) so that more SMs share the walk: 264, two
# waves of an H200's 132 SMs. Timed on an H200 (2026-11-30, bf16, B=1 H=10 D=64, fixed -> narrowed blocks;
# benchmarks/gpu_fast_weight_triton.py, column "fixed scan blocks"): 3A forward + backward 5.94 -> 5.32 ms at
# T=16K and 4.77 -> 4.58 ms at T=4K, the rest within one run's noise (+-15%; 1A's forward at 16K read 1.06 -> 0.51
# ms, but below its 4K time, so not counted); at B=8 H=16 D=128 nothing narrows (1024 programs). 0: the fixed
# [64, 32] blocks.
SCAN_MIN_PROGRAMS = 264


def forward(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked inputs
    (`custom_ops._check`); S0 None for zeros."""
    plan = _Plan(q, y, chunk_size, read_after)
    L = plan.cumsum(log_gamma)
    states, S_final = plan.states(x, y, eta, L, S0)
    return plan.outputs(q, x, y, eta, L, states), S_final


def backward(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's dtype) and
    dL/dS_final (float32 or None). The entry states are recomputed."""
    plan = _Plan(q, y, chunk_size, read_after)
    L = plan.cumsum(log_gamma)
    states, _ = plan.states(x, y, eta, L, S0)                     # recomputed: entry state of every chunk
    dstates, dS0 = plan.state_grads(q, do, L, dS_final)          # dL/dS at every chunk exit, and dS_0
    dq, dx, deta, dlg = plan.grad_qx(q, x, y, eta, L, do, states, dstates, log_gamma.dtype)
    dy = plan.grad_y(q, x, eta, L, do, dstates)
    return dq, dx, dy, deta, dlg, dS0


def _block(dim: int, cap: int) -> int:
    """A power-of-two block (>= 16, the smallest tl.dot size) covering dim, at most cap."""
    return min(max(16, triton.next_power_of_2(dim)), cap)


def scan_blocks(K: int, V: int, NH: int, min_programs: int | None = None) -> tuple[int, int]:
    """The state scan's [BK, BV] blocks: [64, 32] (narrower than the other stages': more programs for the sequential
    walk), halved (the larger side first, down to 16) while fewer than `min_programs` (default `SCAN_MIN_PROGRAMS`,
    264) programs would cover the N * H states; `min_programs=0` keeps [64, 32]."""
    min_programs = SCAN_MIN_PROGRAMS if min_programs is None else min_programs
    BK, BV = _block(K, 64), _block(V, 32)
    while -(-K // BK) * -(-V // BV) * NH < min_programs and max(BK, BV) > 16:
        if BK >= BV:
            BK //= 2
        else:
            BV //= 2
    return BK, BV


class ChunkPlan:
    """What every chunked launcher derives from one call: sizes, the chunk grid, the matmul precision, and the
    buffer of per-chunk states (float32 unless a rule's plan says otherwise). The rules' plans add their block shapes
    and stages."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        self.N, self.T, self.H, self.K = q.shape
        self.V = y.shape[-1]
        self.NH = self.N * self.H
        self.BT = chunk_size
        self.n_chunks = -(-self.T // self.BT)
        self.T_pad = self.n_chunks * self.BT
        self.read_after = read_after
        if self.n_chunks > _MAX_GRID_YZ or self.NH > _MAX_GRID_YZ:
            raise ValueError(f"the Triton launch grids put the chunks ({self.n_chunks}) and the rows x heads "
                             f"({self.NH}) on axes limited to {_MAX_GRID_YZ}: split the batch or use a longer chunk")
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: exact products (no TF32)
        self.device = q.device
        self.sizes = {"K": self.K, "V": self.V, "BT": self.BT}

    def state_buffer(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N * H, n_chunks, K, V]: one state per chunk (float32 unless a rule's plan asks otherwise)."""
        return torch.empty(self.NH, self.n_chunks, self.K, self.V, dtype=dtype, device=self.device)


class _Plan(ChunkPlan):
    """Rule 1A's block shapes; each method launches one stage."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK, self.BV = _block(self.K, 64), _block(self.V, 64)
        self.BK_full = _block(self.K, 128)  # the dq/dx kernel holds all of K
        self.BV_qx = _block(self.V, 64 if self.BK_full <= 64 else 32)
        # The per-chunk states (and their gradients) are stored in the inputs' dtype: every matmul that reads them
        # takes that dtype anyway (kernels.py), so only the exit term of dlog_gamma (<dS_out, S_c>, summed in fp32)
        # sees the rounding, and half the bytes of the buffers, the op's largest, move (flash-linear-attention's
        # choice too; 14% off forward + backward on an H200, benchmarks/RESULTS.md). The carried state, S_0 and the
        # final state stay float32; float32 inputs keep float32 states.
        self.state_dtype = q.dtype

    def state_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return super().state_buffer(self.state_dtype if dtype is None else dtype)

    def cumsum(self, log_gamma):
        L = torch.empty(self.N * self.H, self.T_pad, dtype=torch.float32, device=self.device)
        kernels.chunk_cumsum_kernel[(self.n_chunks, self.N * self.H)](log_gamma, L, self.T, self.T_pad, self.H,
                                                                      BT=self.BT)
        return L

    def states(self, x, y, eta, L, S0):
        """(1) + (2): the entry state of every chunk [N * H, n_chunks, K, V] and the final state [N, H, K, V]."""
        h = self.state_buffer()
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        self._scan(x, y, eta, L, h, S0, final, grad=False)
        return h, final

    def _scan(self, a, b, eta, L, h, init, final, *, grad: bool) -> None:
        """(1) + (2) (or with grad, (1') + (2') in reverse) as one kernel."""
        BK, BV = scan_blocks(self.K, self.V, self.NH)
        kernels.state_scan_kernel[(-(-self.K // BK) * -(-self.V // BV), self.N * self.H)](
            a, b, eta, L, h, h if init is None else init, final, self.T, self.T_pad, self.n_chunks, self.H,
            **self.sizes, BK=BK, BV=BV, HAS_INIT=init is not None, READ_AFTER=self.read_after, GRAD=grad,
            REVERSE=grad, PREC=self.prec, INTERPRET=_interpreting(), num_warps=4)

    def outputs(self, q, x, y, eta, L, states):
        o = torch.empty(self.N, self.T, self.H, self.V, dtype=q.dtype, device=self.device)
        kernels.output_kernel[(-(-self.V // self.BV), self.n_chunks, self.N * self.H)](
            q, x, y, eta, L, states, o, self.T, self.T_pad, self.n_chunks, self.H, **self.sizes, BK=self.BK,
            BV=self.BV, READ_AFTER=self.read_after, PREC=self.prec)
        return o

    def state_grads(self, q, do, L, dS_final):
        """(1') + (2'): dL/dS at every chunk's exit [N * H, n_chunks, K, V] and dL/dS_0 [N, H, K, V]."""
        g = self.state_buffer()
        dS0 = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
        self._scan(q, do, L, L, g, init, dS0, grad=True)  # (eta is unused)
        return g, dS0

    def grad_qx(self, q, x, y, eta, L, do, states, dstates, lg_dtype):
        dq, dx = torch.empty_like(q), torch.empty_like(x)
        deta = torch.empty_like(eta)
        dlg = torch.empty(eta.shape, dtype=lg_dtype, device=self.device)
        kernels.grad_qx_kernel[(self.n_chunks, self.N * self.H)](
            q, x, y, eta, L, do, states, dstates, dq, dx, deta, dlg, self.T, self.T_pad, self.n_chunks, self.H,
            **self.sizes, BK=self.BK_full, BV=self.BV_qx, READ_AFTER=self.read_after, PREC=self.prec)
        return dq, dx, deta, dlg

    def grad_y(self, q, x, eta, L, do, dstates):
        dy = torch.empty(self.N, self.T, self.H, self.V, dtype=q.dtype, device=self.device)
        kernels.grad_y_kernel[(-(-self.V // self.BV), self.n_chunks, self.N * self.H)](
            q, x, eta, L, do, dstates, dy, self.T, self.T_pad, self.n_chunks, self.H, **self.sizes, BK=self.BK,
            BV=self.BV, READ_AFTER=self.read_after, HAS_DH=True, PREC=self.prec)
        return dy
