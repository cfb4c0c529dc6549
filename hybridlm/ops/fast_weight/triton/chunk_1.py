"""Rule 1 (regression / delta rule, scalar decay, window 1) on prepared writes, and rule 3 as rule 1 over its write
events: launchers of the Triton kernels, forward and backward (the implementations of the custom ops
`hybridlm::fast_weight_1_fwd` / `_bwd` and `hybridlm::fast_weight_3_fwd` / `_bwd`, `custom_ops.py`).

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T     o_t = S_t^T q_t (read after) or S_{t-1}^T q_t

Rule 3 (`slots` > 1): the rows are events, `slots` per step; an event's residual reads the state before its step's
first event, y_t - S_{before step}^T x_t, so the events of one step do not see each other's writes
(`kernels_delta.py`, constexpr SLOTS). Rule 1 is slots = 1.

Forward: chunk-local cumulative decays (`kernels.chunk_cumsum_kernel`) -> the WY factors of every chunk,
(I + A)^-1 (`kernels_delta.tinv_kernel`), then U = (I + A)^-1 Y and W = (I + A)^-1 diag(exp Lp_s) X (Lp_s = L_{s-1};
for rule 3 the end of the step before; `kernels_delta.wu_kernel`), all chunks in parallel ->
the sequential pass r_c = U_c - W_c S_c, S_{c+1} = exp(L_last) S_c + X_c^T diag(exp(L_last - L_s) eta_s) r_c
(`kernels_delta.delta_pass_kernel`) -> the outputs, which are rule 1A's with y replaced by the residuals r
(`kernels.output_kernel`).

Backward (`kernels_delta.py` derives it): the forward's first three stages again (the entry states, residuals and
(I + A)^-1 of every chunk) -> sum_t exp(Lr_t) q_t dO_t^T per chunk (`kernels.chunk_outer_kernel`) and the
chunk-local part of dL/dr (`kernels.grad_y_kernel`), all chunks in parallel -> the reverse sequential pass for
dL/dS at every chunk exit, dZ = dL/dy and dL/dS_0 (`kernels_delta.delta_grad_pass_kernel`) -> dq, then dx, d eta and
d log_gamma, of all chunks in parallel (`kernels_delta.delta_grad_q_kernel`; the terms that read the states,
`kernels_delta.delta_grad_state_kernel`; the rest, `kernels_delta.delta_grad_kernel`).
"""

from __future__ import annotations

import os

import torch

from hybridlm.ops.fast_weight.triton import kernels, kernels_delta
from hybridlm.ops.fast_weight.triton.chunk_1a import ChunkPlan, _block
from hybridlm.ops.fast_weight.triton.custom_ops import _interpreting

# Precision of the two sequential passes' products (r = U - W S, the state update, and their gradients). Default:
# float32 factors (TF32 products for 16-bit inputs, "ieee" for float32). Opt-in for 16-bit inputs
# (HYBRIDLM_TRITON_BF16_PASSES=1 or `BF16_PASSES = True`): bfloat16-rounded factors and W, U stored in bfloat16,
# flash-linear-attention's precision. It is faster (H200, B=8 H=16 D=128: rule 1 fwd+bwd 0.80x the default's time
# at T = 4K and 16K with its launch below), but not exact enough for the 16-bit tolerance (2e-2): r is a small
# difference of two large terms, so rounding U and W S to 8 bits costs up to 2.4e-2 in a gradient at T = 640 with
# the layer's RMS-normalised keys, against 5e-4 with float32 factors (fast_weight/triton/README.md, "Precision").
BF16_PASSES = os.environ.get("HYBRIDLM_TRITON_BF16_PASSES", "0") == "1"
# Launches (warps, stages) of the passes, keyed by bfloat16 factors. Those of bfloat16 factors were timed on an H200
# (4 warps: 0.89x the time of 8 at B=8 H=16 D=128, though ptxas counts more spills; the README's launch table); those
# of float32 factors come from ptxas spill counts (8 warps: 168 / 588 B per thread against 4524 / 2052 at 4).
PASS_LAUNCH = {True: {"num_warps": 4, "num_stages": 3}, False: {"num_warps": 8, "num_stages": 2}}
GRAD_PASS_LAUNCH = {True: {"num_warps": 4, "num_stages": 2}, False: {"num_warps": 8, "num_stages": 3}}


def forward(q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int,
            slots: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """o `[N, T, H, V]` (q's dtype) and the final state `[N, H, K, V]` float32 on contiguous, checked inputs
    (`custom_ops._check`); S0 None for zeros. slots: events per step (rule 3; a power of two dividing chunk_size)."""
    p = _Plan(q, y, chunk_size, read_after, slots)
    L = p.cumsum(log_gamma)
    states, R, final, _ = p.scan(x, y, eta, L, S0)
    # Outputs: rule 1A's output kernel with the (float32) residuals in place of y.
    o = torch.empty(p.N, p.T, p.H, p.V, dtype=q.dtype, device=p.device)
    BK, BV = _block(p.K, 64), _block(p.V, 64)
    kernels.output_kernel[(-(-p.V // BV), p.n_chunks, p.NH)](
        q, x, R, eta, L, states, o, p.T, p.T_pad, p.n_chunks, p.H, K=p.K, V=p.V, BT=p.BT, BK=BK, BV=BV,
        READ_AFTER=read_after, PREC=p.prec32)
    return o, final


def backward(do, dS_final, q, x, y, eta, log_gamma, S0, read_after: bool, chunk_size: int, slots: int = 1):
    """dq, dx, dy (inputs' dtype), d eta, d log_gamma (their dtypes) and dS_0 (float32) for dL/do (q's dtype) and
    dL/dS_final (float32 or None). The entry states, residuals and (I + A)^-1 are recomputed."""
    p = _Plan(q, y, chunk_size, read_after, slots)
    L = p.cumsum(log_gamma)
    states, R, _, tinv = p.scan(x, y, eta, L, S0)
    BK, BV = _block(p.K, 64), _block(p.V, 64)
    sizes = {"K": p.K, "V": p.V, "BT": p.BT}

    # sum_t exp(Lr_t) q_t dO_t^T of every chunk (B3's second term), into the buffer that the pass fills with dS'.
    dh = torch.empty(p.NH, p.n_chunks, p.K, p.V, dtype=torch.float32, device=p.device)
    kernels.chunk_outer_kernel[(-(-p.K // BK) * -(-p.V // BV), p.n_chunks, p.NH)](
        q, do, L, L, dh, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK, BV=BV, READ_AFTER=read_after, GRAD=True,
        PREC=p.prec)
    # The chunk-local part of dL/dr (B1's first term): rule 1A's dy without its dS' term.
    dr = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    kernels.grad_y_kernel[(-(-p.V // BV), p.n_chunks, p.NH)](
        q, x, eta, L, do, dh, dr, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK, BV=BV, READ_AFTER=read_after,
        HAS_DH=False, PREC=p.prec)
    # The reverse pass: dh[c] <- dL/dS_{c+1}, dZ (= dL/dy), dL/dS_0.
    dz = torch.empty(p.N, p.T, p.H, p.V, dtype=torch.float32, device=p.device)
    dS0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.device)
    init = None if dS_final is None else dS_final.to(torch.float32).contiguous()
    kernels_delta.delta_grad_pass_kernel[(-(-p.V // p.BV_pass), p.NH)](
        x, eta, L, tinv, dr, dS0 if init is None else init, dh, dz, dS0, p.T, p.T_pad, p.n_chunks, p.H, **sizes,
        BK=p.BK_full, BV=p.BV_pass, SLOTS=p.slots, HAS_INIT=init is not None, BF16=p.bf16,
        INTERPRET=_interpreting(), PREC32=p.prec32, **GRAD_PASS_LAUNCH[p.bf16])
    # dq (and q_t . dq_t), per chunk (ptxas, sm_90, K = V = 128, C = 64, bf16, 8 warps: no spill at BV = 32).
    BV_q = _block(p.V, 32) if p.BK_full > 64 else _block(p.V, 64)
    dq = torch.empty_like(q)
    qdq = torch.empty(p.N, p.T, p.H, dtype=torch.float32, device=p.device)
    kernels_delta.delta_grad_q_kernel[(p.n_chunks, p.NH)](
        q, x, R, eta, L, do, states, dq, qdq, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=p.BK_full, BV=BV_q,
        READ_AFTER=read_after, PREC32=p.prec32)
    # The state terms of dx, d eta and d log_gamma, over column blocks of the states; then the rest, per chunk.
    BK_s, BV_s = _block(p.K, 64), _block(p.V, 64)
    n_parts = -(-p.K // BK_s)
    dxs = torch.empty(p.N, p.T, p.H, p.K, dtype=torch.float32, device=p.device)
    parts = torch.empty(n_parts, 3, p.NH, p.T_pad, dtype=torch.float32, device=p.device)
    kernels_delta.delta_grad_state_kernel[(n_parts, p.n_chunks, p.NH)](
        x, R, eta, L, states, dh, dz, dxs, parts, p.T, p.T_pad, p.n_chunks, p.H, **sizes, BK=BK_s, BV=BV_s,
        SLOTS=p.slots, PREC32=p.prec32)
    dx = torch.empty_like(x)
    deta = torch.empty_like(eta)
    dlg = torch.empty_like(log_gamma)
    kernels_delta.delta_grad_kernel[(p.n_chunks, p.NH)](
        q, x, R, eta, L, do, dz, qdq, dxs, parts, dx, deta, dlg, p.T, p.T_pad, p.n_chunks, p.H, **sizes,
        BK=BK_s, BV=BV_s, READ_AFTER=read_after, SLOTS=p.slots, N_PARTS=n_parts, PREC32=p.prec32)
    return dq, dx, dz.to(y.dtype), deta, dlg, dS0


class _Plan(ChunkPlan):
    """Rule 1's block shapes; the stages shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool, slots: int):
        super().__init__(q, y, chunk_size, read_after)
        if slots < 1 or slots & (slots - 1) or chunk_size % slots or self.T % slots:
            raise ValueError(f"slots must be a power of two dividing chunk_size ({chunk_size}) and T ({self.T}); "
                             f"got {slots}")
        self.slots = slots
        self.prec32 = self.prec  # products of fp32 factors, states, gradients: as exact as the inputs' products
        self.bf16 = BF16_PASSES and q.dtype != torch.float32  # bfloat16 factors, W and U in bfloat16
        self.BK_full = _block(self.K, 128)  # the pass and dq kernels hold all of K
        self.BV_pass = _block(self.V, 32 if self.BK_full > 64 else 64)

    def cumsum(self, log_gamma):
        L = torch.empty(self.NH, self.T_pad, dtype=torch.float32, device=self.device)
        kernels.chunk_cumsum_kernel[(self.n_chunks, self.NH)](log_gamma, L, self.T, self.T_pad, self.H, BT=self.BT)
        return L

    def scan(self, x, y, eta, L, S0):
        """The WY factors and the sequential pass: every chunk's entry state [N * H, n_chunks, K, V], the residuals
        r [N, T, H, V], the final state [N, H, K, V] and (I + A)^-1 of every chunk [N * H, T_pad, BT] (all
        float32)."""
        N, T, H, K, V, NH, BT = self.N, self.T, self.H, self.K, self.V, self.NH, self.BT
        f32 = {"dtype": torch.float32, "device": self.device}
        wu = {"dtype": torch.bfloat16 if self.bf16 else torch.float32, "device": self.device}
        tinv = torch.empty(NH, self.T_pad, BT, **f32)
        kernels_delta.tinv_kernel[(self.n_chunks, NH)](
            x, eta, L, tinv, T, self.T_pad, self.n_chunks, H, K=K, BT=BT, BK=_block(K, 64), SLOTS=self.slots,
            PREC=self.prec, PREC32=self.prec32)
        U = torch.empty(NH, self.T_pad, V, **wu)
        W = torch.empty(NH, self.T_pad, K, **wu)
        BD = _block(max(K, V), 64)
        kernels_delta.wu_kernel[(-(-K // BD) + -(-V // BD), self.n_chunks, NH)](
            x, y, L, tinv, U, W, T, self.T_pad, self.n_chunks, H, K=K, V=V, BT=BT, BD=BD, SLOTS=self.slots,
            PREC32=self.prec32)
        states = self.state_buffer()
        R = torch.empty(N, T, H, V, **f32)
        final = torch.empty(N, H, K, V, **f32)
        kernels_delta.delta_pass_kernel[(-(-V // self.BV_pass), NH)](
            x, eta, L, U, W, final if S0 is None else S0, states, R, final, T, self.T_pad, self.n_chunks, H, K=K,
            V=V, BT=BT, BK=self.BK_full, BV=self.BV_pass, HAS_INIT=S0 is not None, BF16=self.bf16,
            INTERPRET=_interpreting(), PREC32=self.prec32, **PASS_LAUNCH[self.bf16])
        return states, R, final, tinv
