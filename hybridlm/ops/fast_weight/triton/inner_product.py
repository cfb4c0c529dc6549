"""The inner-product family on prepared writes (rules 1A and 2A; rule 3A runs on 1A's ops): the launchers of its
kernels, forward and backward, the implementations of the custom ops `hybridlm::fast_weight_1a_fwd` / `_bwd` and
`hybridlm::fast_weight_2a_fwd` / `_bwd` (`custom_ops.py`).

    rule 1A: S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t y_t^T
    rule 2A: S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * y_t)^T      (eta_t, log_gamma_t per value column)
    o_t = S_t^T q_t  (read after)  or  S_{t-1}^T q_t  (read before)

Forward: chunk-local cumulative decays (`decays.py`) -> each chunk's contribution to the state and the sequential
pass giving every chunk's entry state and the final state (`chunk_state.py`) -> the outputs (`chunk_output.py`).
Backward recomputes the entry states, runs the same state stages on the gradients in reverse (dS of every chunk
exit, and dS_0), then the per-chunk gradients (`inner_product_kernels.py`).
Rule 1A's forward with 16-bit inputs and enough rows x heads (`walk_warps`) instead walks the chunks with the
whole state per program (`whole_state.py`), and no per-chunk state reaches memory.
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.triton import chunk_output, chunk_state, inner_product_kernels, whole_state
from hybridlm.ops.fast_weight.triton.chunking import ChunkPlan
from hybridlm.ops.fast_weight.triton.decays import chunk_cumsum, chunk_cumsum_columns
from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import triton_interpreting

# The state scan's programs each walk all the chunks of one state block, so the scan takes one walk's time however
# many programs run beside it. With few rows x heads (a model's training row: 1 x 10 heads gives 20 programs of
# [64, 32] blocks) most of the GPU idles and each program moves its block's keys and values alone. Below
# SCAN_MIN_PROGRAMS programs the blocks shrink (to 16 x 16 at least) so that more SMs share the walk: 264, two
# waves of an H200's 132 SMs (benchmarks/RESULTS.md compares the fixed and the narrowed blocks). 0: the fixed
# [64, 32] blocks.
SCAN_MIN_PROGRAMS = 264
# Rule 1A's forward walk (`walk_warps`): one program per row x head holds the whole [K, V] state in registers and
# walks the chunks; it needs K, V <= WALK_MAX_DIM and, to occupy about one program per SM of an H100 / H200 (132),
# WALK_MIN_PROGRAMS rows x heads.
WALK_MAX_DIM = 128
WALK_MIN_PROGRAMS = 128
WALK_WARPS = 8


def forward_1a(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 1A: o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked
    inputs (checked by `custom_ops.py`; x and y may have more than T rows, of which the first T are the writes); S0
    None for zeros."""
    plan = ScalarPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum(plan, log_gamma)
    warps = walk_warps(plan.K, plan.V, plan.NH, q.dtype)
    if warps is not None:
        return plan.output_walk(q, x, y, eta, L, S0, warps)
    states, S_final = plan.states(x, y, eta, L, S0)
    return chunk_output.output(plan, q, x, y, eta, L, states), S_final


def backward_1a(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """Rule 1A: dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's
    dtype) and dL/dS_final (float32 or None). The entry states are recomputed. dx and dy have x's and y's rows (zeros
    after the first T)."""
    plan = ScalarPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum(plan, log_gamma)
    states, _ = plan.states(x, y, eta, L, S0)                     # recomputed: entry state of every chunk
    dstates, dS0 = plan.state_grads(q, do, L, dS_final)          # dL/dS at every chunk exit, and dS_0
    dq, dx, dy, deta, dlg = plan.grad_qxy(q, x, y, eta, L, do, states, dstates, log_gamma.dtype)
    return dq, dx, dy, deta, dlg, dS0


def walk_warps(K: int, V: int, NH: int, dtype: torch.dtype) -> int | None:
    """The warps of rule 1A's forward walk (`whole_state.py`), or None for the chunk-parallel forward. The walk runs
    one program per row x head, so it needs K, V <= WALK_MAX_DIM and WALK_MIN_PROGRAMS rows x heads (with fewer,
    the chunk-parallel form spreads the work over more programs), and 16-bit inputs (float32 tiles of q and x
    would not fit its registers: ptxas spills tens of KB per thread, and its pipelined loads exceed an SM's shared
    memory at chunk 64). Timed at B = 8, H = 16, K = V = 128, bf16 (benchmarks/RESULTS.md): 0.69-0.84x the
    chunk-parallel forward's time; value blocks of 64 per program 1.0x, of 32 or 16 1.3-2.7x (the scores and the
    loads of q, x made once per block). A backward walking the chunks the same way (dq forward; dx, dy in reverse)
    measured 1.2-1.4x the chunk-parallel backward: its tiles spill more."""
    if max(K, V) > WALK_MAX_DIM or NH < WALK_MIN_PROGRAMS or dtype not in (torch.float16, torch.bfloat16):
        return None
    return WALK_WARPS


def scan_blocks(K: int, V: int, NH: int, min_programs: int | None = None) -> tuple[int, int]:
    """The state scan's [BK, BV] blocks: [64, 32] (narrower than the other stages': more programs for the sequential
    walk), halved (the larger side first, down to 16) while fewer than `min_programs` (default `SCAN_MIN_PROGRAMS`,
    264) programs would cover the N * H states; `min_programs=0` keeps [64, 32]."""
    min_programs = SCAN_MIN_PROGRAMS if min_programs is None else min_programs
    BK, BV = block(K, 64), block(V, 32)
    while -(-K // BK) * -(-V // BV) * NH < min_programs and max(BK, BV) > 16:
        if BK >= BV:
            BK //= 2
        else:
            BV //= 2
    return BK, BV


def grad_qxy_blocks(K: int, V: int) -> tuple[int, int]:
    """`grad_qxy_kernel`'s key and value blocks, up to 64 each. Never (32, 16): at chunks of 64, ptxas 12.8 (the one
    triton 3.6 ships) has built the kernel with a wgmma descriptor taken from a uniform register that it never sets,
    and the launch then reads shared memory at an address that changes from run to run
    (`tests/ops/triton_modes.uniform_reads_before_writes` finds such builds), so V <= 16 takes a value block of 32
    there."""
    BK, BV = block(K, 64), block(V, 64)
    return (BK, 32) if (BK, BV) == (32, 16) else (BK, BV)


class ScalarPlan(ChunkPlan):
    """Rule 1A's block shapes; each method launches one stage."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK, self.BV = block(self.K, 64), block(self.V, 64)
        self.BK_qxy, self.BV_qxy = grad_qxy_blocks(self.K, self.V)
        self.walk_sizes = {**self.sizes, "BK": block(self.K, WALK_MAX_DIM), "BV": block(self.V, WALK_MAX_DIM)}
        # The per-chunk states (and their gradients) are stored in the inputs' dtype: every matmul that reads them
        # takes that dtype anyway, so only the exit term of dlog_gamma (<dS_out, S_c>, summed in fp32) sees the
        # rounding, and half the bytes of the buffers, the op's largest, move (flash-linear-attention's choice too).
        # The carried state, S_0 and the final state stay float32; float32 inputs keep float32 states.
        self.state_dtype = q.dtype

    def states(self, x, y, eta, L, S0):
        """(1) + (2): the entry state of every chunk [N * H, n_chunks, K, V] and the final state [N, H, K, V]."""
        h = self.state_buffer()
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        self._scan(x, y, eta, L, h, S0, final, grad=False)
        return h, final

    def output_walk(self, q, x, y, eta, L, S0, warps: int):
        """The forward walk: o [N, T, H, V] (q's dtype) and the final state [N, H, K, V] float32."""
        o = torch.empty(self.N, self.T, self.H, self.V, dtype=q.dtype, device=self.device)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        whole_state.output_walk_kernel[(self.NH,)](
            q, x, y, eta, L, o, final if S0 is None else S0, final, self.T, self.T_xy, self.T_pad, self.n_chunks,
            self.H, **self.walk_sizes, HAS_INIT=S0 is not None, READ_AFTER=self.read_after, PREC=self.prec,
            INTERPRET=triton_interpreting(), num_warps=warps)
        return o, final

    def _scan(self, a, b, eta, L, h, init, final, *, grad: bool) -> None:
        """(1) + (2) (or with grad, (1') + (2') in reverse) as one kernel."""
        BK, BV = scan_blocks(self.K, self.V, self.NH)
        chunk_state.state_scan_kernel[(-(-self.K // BK) * -(-self.V // BV), self.N * self.H)](
            a, b, eta, L, h, h if init is None else init, final, self.T, a.shape[1], self.T_pad, self.n_chunks, self.H,
            **self.sizes, BK=BK, BV=BV, HAS_INIT=init is not None, READ_AFTER=self.read_after, GRAD=grad,
            REVERSE=grad, PREC=self.prec, INTERPRET=triton_interpreting(), num_warps=4)

    def state_grads(self, q, do, L, dS_final):
        """(1') + (2'): dL/dS at every chunk's exit [N * H, n_chunks, K, V] and dL/dS_0 [N, H, K, V]."""
        g = self.state_buffer()
        dS0 = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
        self._scan(q, do, L, L, g, init, dS0, grad=True)  # (eta is unused)
        return g, dS0

    def grad_qxy(self, q, x, y, eta, L, do, states, dstates, lg_dtype):
        """dq, dx, dy, d eta, d log_gamma of every chunk in one kernel (`grad_qxy_kernel`); d eta and d log_gamma
        are sums of one share per key block, summed here where there are several."""
        dq, dx, dy = torch.empty_like(q), torch.empty_like(x), torch.empty_like(y)
        if self.T_xy > self.T:  # rows that are not writes (rule 3A's band rows)
            dx[:, self.T:], dy[:, self.T:] = 0, 0
        BK, BV = self.BK_qxy, self.BV_qxy
        n_k, n_v = -(-self.K // BK), -(-self.V // BV)
        if n_k == 1:
            deta, dlg = torch.empty_like(eta), torch.empty(eta.shape, dtype=lg_dtype, device=self.device)
        else:
            deta, dlg = torch.empty(2, n_k, *eta.shape, dtype=torch.float32, device=self.device)
        inner_product_kernels.grad_qxy_kernel[(max(n_k, n_v), self.n_chunks, self.N * self.H)](
            q, x, y, eta, L, do, states, dstates, dq, dx, dy, deta, dlg, self.T, self.T_xy, self.T_pad,
            self.n_chunks, self.H, eta.numel(), **self.sizes, BK=BK, BV=BV, READ_AFTER=self.read_after,
            PREC=self.prec)
        if n_k > 1:
            deta, dlg = deta.sum(0).to(eta.dtype), dlg.sum(0).to(lg_dtype)
        return dq, dx, dy, deta, dlg


def forward_2a(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 2A: o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked
    inputs (checked by `custom_ops.py`); S0 None for zeros."""
    p = ColumnPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum_columns(p, log_gamma)
    states, final = p.states(x, y, eta, L, S0)
    return chunk_output.output_columns(p, q, x, y, eta, L, states), final


def backward_2a(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """Rule 2A: dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's
    dtype) and dL/dS_final (float32 or None). The entry states are recomputed."""
    p = ColumnPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum_columns(p, log_gamma)
    states, _ = p.states(x, y, eta, L, S0)                                 # entry state of every chunk
    dstates = p.state_buffer()                                             # (1') + (2'): dS' of every chunk, dS_0
    p.outer(q, do, L, L, dstates, grad=True)                               # (eta unused)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    p.run_pass(dstates, init, dS0, L, reverse=True)
    dy = torch.empty_like(y)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    inner_product_kernels.grad_v_2a_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](      # (B2), (B4)
        q, x, y, eta, L, do, states, dstates, dy, deta, dlg, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK,
        BV=p.BV3, READ_AFTER=read_after, PREC=p.prec)
    dq, dx = torch.empty_like(q), torch.empty_like(x)
    inner_product_kernels.grad_qx_2a_kernel[(-(-p.K // p.BK), p.n_chunks, p.NH)](      # (B3)
        q, x, y, eta, L, do, states, dstates, dq, dx, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK, BV=p.BV3,
        READ_AFTER=read_after, PREC=p.prec)
    return dq, dx, dy, deta, dlg, dS0


class ColumnPlan(ChunkPlan):
    """Rule 2A's block shapes and launch grids; the stages shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK, self.BV = block(self.K, 64), block(self.V, 64)
        self.BV3 = self.column_tile()  # value tile of the [BT, BT, BV] kernels

    def states(self, x, y, eta, L, S0):
        """(1) + (2): the entry state of every chunk [N * H, n_chunks, K, V] and the final state [N, H, K, V]."""
        h = self.state_buffer()
        self.outer(x, y, eta, L, h, grad=False)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        self.run_pass(h, S0, final, L, reverse=False)
        return h, final

    def outer(self, a, b, eta, L, out, *, grad: bool) -> None:
        grid = (-(-self.K // self.BK) * -(-self.V // self.BV), self.n_chunks, self.NH)
        chunk_state.chunk_outer_columns_kernel[grid](
            a, b, eta, L, out, self.T, self.T_pad, self.n_chunks, self.H, **self.sizes, BK=self.BK, BV=self.BV,
            READ_AFTER=self.read_after, GRAD=grad, PREC=self.prec)

    def run_pass(self, h, init, final, L, *, reverse: bool) -> None:
        BK, BV = self.BK, block(self.V, 32)  # smaller blocks: more programs for the sequential pass
        chunk_state.state_pass_columns_kernel[(-(-self.K // BK) * -(-self.V // BV), self.NH)](
            h, h if init is None else init, final, L, self.T_pad, self.n_chunks, **self.sizes, BK=BK, BV=BV,
            HAS_INIT=init is not None, REVERSE=reverse, INTERPRET=triton_interpreting(), num_warps=4)
