"""The regression family on prepared writes (rules 1, 3 and 2): the launchers of its kernels, forward and backward,
the implementations of the custom ops `hybridlm::fast_weight_{1,3,2}_fwd` / `_bwd` (`custom_ops.py`).

    rule 1: S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T
    rule 2: S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * (y_t - S_{t-1}^T x_t))^T    (per value column)
    o_t = S_t^T q_t (read after) or S_{t-1}^T q_t

Rule 3 (`slots` > 1) is rule 1 over write events, `slots` per step: an event's residual reads the state before its
step's first event, y_t - S_{before step}^T x_t, so the events of one step do not see each other's writes
(`regression_kernels.py`, constexpr SLOTS). Rule 1 is slots = 1.

Rules 1 and 3, forward: chunk-local cumulative decays (`decays.py`) -> the WY factors of every chunk, (I + A)^-1,
then U = (I + A)^-1 Y and W = (I + A)^-1 diag(exp Lp_s) X (`wy.py`), all chunks in parallel -> the sequential pass
r_c = U_c - W_c S_c, S_{c+1} = exp(L_last) S_c + X_c^T diag(exp(L_last - L_s) eta_s) r_c (`delta_pass_kernel`) ->
the outputs, rule 1A's with y replaced by the residuals r (`chunk_output.output_kernel`). Backward: the forward's
first three stages again (the entry states, residuals and (I + A)^-1 of every chunk) -> sum_t exp(Lr_t) q_t dO_t^T
per chunk (`chunk_state.chunk_outer_kernel`) and the chunk-local part of dL/dr (`chunk_output.grad_y_kernel`), all
chunks in parallel -> the reverse sequential pass for dL/dS at every chunk exit, dZ = dL/dy and dL/dS_0
(`delta_grad_pass_kernel`) -> dq, then dx, d eta and d log_gamma, of all chunks in parallel.

Rule 2, forward: chunk-local cumulative decays per column -> the sequential pass (per-column triangular systems,
residuals, entry states, final state; `delta2_pass_kernel`) -> the outputs (the per-column output kernel on the
residuals). Backward recomputes the forward pass, runs the reverse pass (dS' of every chunk, dZ = dL/dy, dS_0),
then one kernel for dy, d eta, d log_gamma (per value tile) and one for dq, dx (per key tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridlm.ops.fast_weight.triton import chunk_output, chunk_state, regression_kernels, wy
from hybridlm.ops.fast_weight.triton.chunking import ChunkPlan
from hybridlm.ops.fast_weight.triton.decays import chunk_cumsum, chunk_cumsum_columns
from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import triton_interpreting


@dataclass(frozen=True)
class PassLaunch:
    """How rules 1 and 3's two sequential passes launch where they hold all of K > 64: value columns per program
    (each program carries a [K, block_v] float32 state block through every chunk, so the grid is V / block_v x rows x
    heads programs) and (warps, stages) of the forward pass and of the reverse pass. At K <= 64 the value block is
    64 and the launch the narrow one's."""

    block_v: int
    forward: tuple[int, int]
    reverse: tuple[int, int]

    def kwargs(self, reverse: bool = False) -> dict:
        warps, stages = self.reverse if reverse else self.forward
        return {"num_warps": warps, "num_stages": stages}


# The passes are latency-bound walks over the chunks, so their time is the walk's time x the waves of programs.
# Narrow: 32 value columns at 8 warps, the fewest spills (ptxas at K = V = 128: all 255 registers, one program per
# SM); many programs, so the most SMs share a small batch. Wide: 64 columns at 4 warps, two programs per SM despite
# the spills; half the programs, each walk longer, ahead once its programs about cover the SMs of an H200 (132), so
# that the narrow launch would run in two waves or more. benchmarks/RESULTS.md times both and the launches between
# them at several batch x head counts.
NARROW_PASSES = PassLaunch(block_v=32, forward=(8, 2), reverse=(8, 3))
WIDE_PASSES = PassLaunch(block_v=64, forward=(4, 1), reverse=(4, 1))
WIDE_PASS_MIN_PROGRAMS = 128


def pass_launch(K: int, V: int, NH: int) -> PassLaunch:
    """The passes' launch for K key and V value dimensions over NH rows x heads: `WIDE_PASSES` where its programs
    (ceil(V / 64) x NH) reach `WIDE_PASS_MIN_PROGRAMS`, else `NARROW_PASSES`; at K <= 64 value blocks of 64 at the
    narrow launch's warps."""
    if block(K, 128) <= 64:
        return PassLaunch(64, NARROW_PASSES.forward, NARROW_PASSES.reverse)
    if -(-V // WIDE_PASSES.block_v) * NH >= WIDE_PASS_MIN_PROGRAMS:
        return WIDE_PASSES
    return NARROW_PASSES


def pass_launches(K: int, V: int) -> list[PassLaunch]:
    """Every launch `pass_launch` takes for K and V over some number of rows x heads (fewest rows x heads first)."""
    few, many = pass_launch(K, V, 1), pass_launch(K, V, WIDE_PASS_MIN_PROGRAMS)
    return [few] if many == few else [few, many]


def forward_1(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int,
              slots: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rules 1 and 3: o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked
    inputs (checked by `custom_ops.py`); S0 None for zeros. slots: events per step (rule 3; a power of two
    dividing chunk_size)."""
    p = EventPlan(q, y, chunk_size, read_after, slots)
    L = chunk_cumsum(p, log_gamma)
    # The entry states stored in q's dtype: the output kernel's product rounds them to it anyway, so the outputs are
    # the same and half the bytes of the op's largest buffer move. The backward recomputes them in float32 for its
    # TF32 products (stored in 16 bits, they would put several times the error into dq, dx and d log_gamma).
    states, R, final, _ = p.scan(x, y, eta, L, S0, states_dtype=q.dtype)
    return chunk_output.output(p, q, x, R, eta, L, states), final  # rule 1A's outputs, the residuals for y


def backward_1(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int, slots: int = 1):
    """Rules 1 and 3: dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do
    (q's dtype) and dL/dS_final (float32 or None). The entry states, residuals and (I + A)^-1 are recomputed."""
    p = EventPlan(q, y, chunk_size, read_after, slots)
    L = chunk_cumsum(p, log_gamma)
    states, R, _, tinv = p.scan(x, y, eta, L, S0)
    BK, BV = block(p.K, 64), block(p.V, 64)
    sizes = {"K": p.K, "V": p.V, "BT": p.BT}

    # sum_t exp(Lr_t) q_t dO_t^T of every chunk (B3's second term), into the buffer that the pass fills with dS'.
    dh = torch.empty(p.NH, p.n_chunks, p.K, p.V, dtype=torch.float32, device=p.device)
    chunk_state.chunk_outer_kernel[(-(-p.K // BK) * -(-p.V // BV), p.n_chunks, p.NH)](
        q, do, L, L, dh, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK, BV=BV, READ_AFTER=read_after, GRAD=True,
        PREC=p.prec)
    # The chunk-local part of dL/dr (B1's first term): rule 1A's dy without its dS' term.
    dr = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    chunk_output.grad_y_kernel[(-(-p.V // BV), p.n_chunks, p.NH)](
        q, x, eta, L, do, dh, dr, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK, BV=BV, READ_AFTER=read_after,
        HAS_DH=False, PREC=p.prec)
    # The reverse pass: dh[c] <- dL/dS_{c+1}, dZ (= dL/dy), dL/dS_0.
    dz = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    regression_kernels.delta_grad_pass_kernel[(-(-p.V // p.BV_pass), p.NH)](
        x, eta, L, tinv, dr, dS0 if init is None else init, dh, dz, dS0, p.T, p.T_pad, p.n_chunks, p.H, **sizes,
        BK=p.BK_full, BV=p.BV_pass, SLOTS=p.slots, HAS_INIT=init is not None, INTERPRET=triton_interpreting(),
        PREC32=p.prec, **p.passes.kwargs(reverse=True))
    # dq (and q_t . dq_t), per chunk (ptxas, sm_90, K = V = 128, C = 64, bf16, 8 warps: no spill at BV = 32).
    BV_q = block(p.V, 32) if p.BK_full > 64 else block(p.V, 64)
    dq = torch.empty_like(q)
    qdq = torch.empty(p.N, p.T, p.H, dtype=torch.float32, device=p.device)
    regression_kernels.delta_grad_q_kernel[(p.n_chunks, p.NH)](
        q, x, R, eta, L, do, states, dq, qdq, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=p.BK_full, BV=BV_q,
        READ_AFTER=read_after, PREC32=p.prec)
    # The state terms of dx, d eta and d log_gamma, over column blocks of the states; then the rest, per chunk.
    BK_s, BV_s = block(p.K, 64), block(p.V, 64)
    n_parts = -(-p.K // BK_s)
    dxs = torch.empty(p.N, p.T, p.H, p.K, dtype=torch.float32, device=p.device)
    parts = torch.empty(n_parts, 3, p.NH, p.T_pad, dtype=torch.float32, device=p.device)
    regression_kernels.delta_grad_state_kernel[(n_parts, p.n_chunks, p.NH)](
        x, R, eta, L, states, dh, dz, dxs, parts, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK_s, BV=BV_s,
        SLOTS=p.slots, PREC32=p.prec)
    dx = torch.empty_like(x)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    store_dy = y.dtype != dz.dtype
    dy = torch.empty_like(y) if store_dy else dz  # dy = dZ (B2), cast where the kernel reads it
    regression_kernels.delta_grad_kernel[(p.n_chunks, p.NH)](
        q, x, R, eta, L, do, dz, qdq, dxs, parts, dx, deta, dlg, dy, p.T, p.T_pad, p.n_chunks, p.H, **sizes,
        BK=BK_s, BV=BV_s, READ_AFTER=read_after, SLOTS=p.slots, N_PARTS=n_parts, STORE_DY=store_dy, PREC32=p.prec)
    return dq, dx, dy, deta, dlg, dS0


class EventPlan(ChunkPlan):
    """Rules 1 and 3's block shapes (write events, `slots` per step); the stages shared by the forward and the
    backward. Products of float32 factors (states, residuals, gradients) take the inputs' precision."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool, slots: int):
        super().__init__(q, y, chunk_size, read_after)
        if slots < 1 or slots & (slots - 1) or chunk_size % slots or self.T % slots:
            raise ValueError(f"slots must be a power of two dividing chunk_size ({chunk_size}) and T ({self.T}); "
                             f"got {slots}")
        self.slots = slots
        self.BK_full = block(self.K, 128)  # the pass and dq kernels hold all of K
        self.passes = pass_launch(self.K, self.V, self.NH)
        self.BV_pass = block(self.V, self.passes.block_v)

    def scan(self, x, y, eta, L, S0, states_dtype: torch.dtype = torch.float32):
        """The WY factors and the sequential pass: every chunk's entry state [N * H, n_chunks, K, V] (stored in
        `states_dtype`; the pass carries its state in float32), the residuals r [N, T, H, V], the final state
        [N, H, K, V] and (I + A)^-1 of every chunk [N * H, T_pad, BT] (float32)."""
        N, T, H, K, V, NH, BT = self.N, self.T, self.H, self.K, self.V, self.NH, self.BT
        f32 = {"dtype": torch.float32, "device": self.device}
        tinv = torch.empty(NH, self.T_pad, BT, **f32)
        wy.tinv_kernel[(self.n_chunks, NH)](
            x, eta, L, tinv, T, self.T_pad, self.n_chunks, H, K=K, BT=BT, BK=block(K, 64), SLOTS=self.slots,
            PREC=self.prec, PREC32=self.prec)
        U = torch.empty(NH, self.T_pad, V, **f32)
        W = torch.empty(NH, self.T_pad, K, **f32)
        BD = block(max(K, V), 64)
        wy.wu_kernel[(-(-K // BD) + -(-V // BD), self.n_chunks, NH)](
            x, y, L, tinv, U, W, T, self.T_pad, self.n_chunks, H, K=K, V=V, BT=BT, BD=BD, SLOTS=self.slots,
            PREC32=self.prec)
        states = self.state_buffer(states_dtype)
        R = torch.empty(N, T, H, V, **f32)
        final = torch.empty(N, H, K, V, **f32)
        regression_kernels.delta_pass_kernel[(-(-V // self.BV_pass), NH)](
            x, eta, L, U, W, final if S0 is None else S0, states, R, final, T, self.T_pad, self.n_chunks, H, K=K,
            V=V, BT=BT, BK=self.BK_full, BV=self.BV_pass, HAS_INIT=S0 is not None, INTERPRET=triton_interpreting(),
            PREC32=self.prec, **self.passes.kwargs())
        return states, R, final, tinv


def forward_2(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 2: o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked inputs
    (checked by `custom_ops.py`); S0 None for zeros."""
    p = ColumnEventPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum_columns(p, log_gamma)
    states, R, final = p.scan(x, y, eta, L, S0)
    return chunk_output.output_columns(p, q, x, R, eta, L, states), final  # rule 2A's outputs, the residuals for y


def backward_2(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int):
    """Rule 2: dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's
    dtype) and dL/dS_final (float32 or None). The entry states and residuals are recomputed."""
    p = ColumnEventPlan(q, y, chunk_size, read_after)
    L = chunk_cumsum_columns(p, log_gamma)
    states, R, _ = p.scan(x, y, eta, L, S0)
    dstates = p.state_buffer()
    dz = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    regression_kernels.delta2_grad_pass_kernel[(-(-p.V // p.BV_pass), p.NH)](
        q, x, eta, L, do, dS0 if init is None else init, dstates, dz, dS0, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes,
        BK=p.BK_full, BV=p.BV_pass, READ_AFTER=read_after, HAS_INIT=init is not None, INTERPRET=triton_interpreting(),
        PREC=p.prec, PREC32=p.prec, num_warps=8)  # (ptxas, sm_90, K = V = 128, bf16: 4 warps spill 72 B, 8 none)
    dy = torch.empty_like(y)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    regression_kernels.grad_v_2_kernel[(-(-p.V // p.BV3), p.n_chunks, p.NH)](
        q, x, y, R, eta, L, do, states, dstates, dz, dy, deta, dlg, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes,
        BK=p.BK, BV=p.BV3, READ_AFTER=read_after, PREC=p.prec, PREC32=p.prec)
    dq, dx = torch.empty_like(q), torch.empty_like(x)
    regression_kernels.grad_qx_2_kernel[(-(-p.K // p.BK), p.n_chunks, p.NH)](
        q, x, R, eta, L, do, states, dstates, dz, dq, dx, p.T, p.T_pad, p.n_chunks, p.H, **p.sizes, BK=p.BK,
        BV=p.BV3, READ_AFTER=read_after, PREC32=p.prec)
    return dq, dx, dy, deta, dlg, dS0


class ColumnEventPlan(ChunkPlan):
    """Rule 2's block shapes; the stages shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        super().__init__(q, y, chunk_size, read_after)
        self.BK = block(self.K, 64)
        self.BK_full = block(self.K, 128)  # the sequential passes hold all of K (r = (I + A)^-1 (Y - X S))
        self.BV3 = self.column_tile()  # value tile of the [BT, BT, BV] work
        self.BV_pass = min(self.BV3, block(self.V, 32 if self.BK_full <= 64 else 16))

    def scan(self, x, y, eta, L, S0):
        """The sequential pass: entry states [N * H, n_chunks, K, V], residuals r [N, T, H, V] and the final state
        [N, H, K, V] (all float32)."""
        states = self.state_buffer()
        R = torch.empty(self.N, self.T, self.H, self.V, dtype=torch.float32, device=self.device)
        final = torch.empty(self.N, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        regression_kernels.delta2_pass_kernel[(-(-self.V // self.BV_pass), self.NH)](
            x, y, eta, L, final if S0 is None else S0, states, R, final, self.T, self.T_pad, self.n_chunks, self.H,
            **self.sizes, BK=self.BK_full, BV=self.BV_pass, HAS_INIT=S0 is not None, INTERPRET=triton_interpreting(),
            PREC=self.prec, PREC32=self.prec, num_warps=4)
        return states, R, final
