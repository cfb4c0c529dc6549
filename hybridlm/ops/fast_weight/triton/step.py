"""One decoding step of the window-1 rules (1A, 1, 2A, 2) in one kernel: the write, the decay and the read of
`recurrent.py`'s step, for every row and head at once. The implementation of the custom op
`hybridlm::fast_weight_step` (`custom_ops.py`); inference only (no backward).

A decoding step on the torch path is some twenty small kernels per layer (the input casts, |x|^2, the step size, the
clamped decay, the outer product, the read, the output cast), and a CUDA-graphed step's time is its kernel count. Here
one program per (row n, head h, block of value columns) computes, in float32 (the state's dtype):

    x = the carried last key (shifted pairing; no write when there is none) | k (same-step)      [K]
    E = |x|^2      ridge = lam * E (ridge scaling) | lam
    eta = beta / (E + ridge + eps) (NLMS) | beta          gamma = 1 - min(eta * ridge, 1 - eps_gamma)
    r = y - S^T x (regression rules 1, 2) | y (inner-product rules 1A, 2A)                            [BV]
    S' = gamma * S + eta * x r^T  (1A, 1: scalar eta, gamma)
    S' = S * gamma + x (eta * r)^T  (2A, 2: eta, gamma per value column)
    o = S'^T q (read after) | S^T q (read before)

and writes o in q's dtype, S' and k in float32 (the next step's carried key). beta is [N, H] (or [N, H, V] for 2A, 2).
Divisions are IEEE (`div_rn`), as torch's.

`in_place=True` writes S' over S and k over the carried key (a fixed-address cache that a replayed CUDA graph reads,
which then needs no copy of the new state into it). Each program owns its [K, BV] block of S, so only its own
threads read what it overwrites: a barrier between its loads and its stores orders them. The carried key is read by
every value block of its head but written by the first: over it only where one block covers V (else into a new
tensor, copied over it after the kernel).

A mixer's step can hand over its raw pieces instead, and the kernel prepares them where they are loaded (the fast-weight
mixer's QK normalization and gains: two kernels (rms) or four (l2) and eight more per layer on the unfused path):

    QK_NORM 1 (rms): q <- q / sqrt(mean q^2 + eps), rounded to q's dtype; 2 (l2): that with eps / K, times 1/sqrt(K),
        rounded again (the mixer's `_normalize` then its cast: the same roundings); likewise k
    GATES: beta = beta_scale sigmoid(b + beta_bias), lam = lam_scale sigmoid(l + lam_bias) from the logits b, l
        (any float dtype, rows at a stride) and float32 biases [H] ([H V] for beta of 2A, 2)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import cdiv

NUM_WARPS = 4
STATE_BLOCK = 4096  # float32 elements of S per program: BK x BV, 32 per thread at 4 warps


@triton.jit
def qk_normalize(u, K: tl.constexpr, eps, scale, L2: tl.constexpr, dtype: tl.constexpr):
    """u [BK] float32 (zeros past K) -> u / sqrt(mean u^2 + eps) rounded to `dtype` (`rms_normalize`'s arithmetic),
    then for L2 times `scale`, rounded again; back in float32."""
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(u * u, axis=0), K * 1.0) + eps))
    n = (u * rstd).to(dtype).to(tl.float32)
    if L2:
        n = (n * scale).to(dtype).to(tl.float32)
    return n


@triton.jit
def gain_from_logit(logit, bias, scale):
    """scale sigmoid(logit + bias) in float32 (the bias as loaded, in the parameters' dtype)."""
    return scale * tl.sigmoid(logit.to(tl.float32) + bias.to(tl.float32))


@triton.jit
def rule_step(S, q, x, y, beta, lam, eps, one_minus_eps_gamma, WRITES: tl.constexpr, REGRESSION: tl.constexpr,
              PER_COLUMN: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr, READ_AFTER: tl.constexpr):
    """The step of the module docstring on one [BK, BV] block: S float32, q and the written key x [BK], the value y
    [BV], beta (a scalar, or [BV] PER_COLUMN) and lam (gains taken) -> (S', o [BV]). Also the fast-weight mixer's whole
    step's (`mixer_step.py`)."""
    S_new = S
    if WRITES:
        E = tl.sum(x * x, axis=0)
        if SCALED:
            ridge = lam * E
        else:
            ridge = lam
        if NLMS:
            eta = tl.math.div_rn(beta, E + ridge + eps)
        else:
            eta = beta
        gamma = 1.0 - tl.minimum(eta * ridge, one_minus_eps_gamma, propagate_nan=tl.PropagateNan.ALL)  # NaN stays
        if REGRESSION:
            r = y - tl.sum(S * x[:, None], axis=0)                                          # y - S^T x  [BV]
        else:
            r = y
        if PER_COLUMN:
            S_new = S * gamma[None, :] + x[:, None] * (eta * r)[None, :]
        else:
            S_new = gamma * S + eta * (x[:, None] * r[None, :])
    if READ_AFTER:
        o = tl.sum(S_new * q[:, None], axis=0)
    else:
        o = tl.sum(S * q[:, None], axis=0)
    return S_new, o


@triton.jit
def step_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, lam_ptr, S_ptr, last_ptr, o_ptr, S_out_ptr, last_out_ptr,
                beta_bias_ptr, lam_bias_ptr, H, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sb_n, sl_n, eps,
                one_minus_eps_gamma, qk_eps, qk_scale, beta_scale, lam_scale, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, WRITES: tl.constexpr, SHIFTED: tl.constexpr,
                REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr,
                READ_AFTER: tl.constexpr, QK_NORM: tl.constexpr, GATES: tl.constexpr, IN_PLACE: tl.constexpr):
    # q, k, v are read at (row, head) strides, beta and lam (or their logits) at row strides (unit stride along the
    # rest): the mixers hand over row slices of their projection, which a contiguous copy would cost a kernel each;
    # everything else is contiguous.
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    nh = i_nh.to(tl.int64)
    i_n, i_h = nh // H, nh % H
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    q = tl.load(q_ptr + i_n * sq_n + i_h * sq_h + rk, mask=mk, other=0.0).to(tl.float32)   # [BK]
    k = tl.load(k_ptr + i_n * sk_n + i_h * sk_h + rk, mask=mk, other=0.0).to(tl.float32)   # [BK]
    if QK_NORM != 0:
        q = qk_normalize(q, K, qk_eps, qk_scale, QK_NORM == 2, q_ptr.dtype.element_ty)
        k = qk_normalize(k, K, qk_eps, qk_scale, QK_NORM == 2, q_ptr.dtype.element_ty)
    s_offs = (nh * K + rk[:, None]) * V + rv[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(S_ptr + s_offs, mask=s_mask, other=0.0)                                    # [BK, BV] S_{t-1}
    x, y, beta, lam = k, tl.zeros([BV], dtype=tl.float32), 0.0, 0.0  # read only where the step writes
    if WRITES:
        if SHIFTED:
            x = tl.load(last_ptr + nh * K + rk, mask=mk, other=0.0).to(tl.float32)         # k_{t-1}
        y = tl.load(v_ptr + i_n * sv_n + i_h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)   # [BV]
        lam = tl.load(lam_ptr + i_n * sl_n + i_h)
        if GATES:
            lam = gain_from_logit(lam, tl.load(lam_bias_ptr + i_h), lam_scale)
        if PER_COLUMN:
            beta = tl.load(beta_ptr + i_n * sb_n + i_h * V + rv, mask=mv, other=0.0)        # [BV]
            if GATES:
                beta = gain_from_logit(beta, tl.load(beta_bias_ptr + i_h * V + rv, mask=mv, other=0.0), beta_scale)
        else:
            beta = tl.load(beta_ptr + i_n * sb_n + i_h)
            if GATES:
                beta = gain_from_logit(beta, tl.load(beta_bias_ptr + i_h), beta_scale)
    S_new, o = rule_step(S, q, x, y, beta, lam, eps, one_minus_eps_gamma, WRITES, REGRESSION, PER_COLUMN, NLMS,
                         SCALED, READ_AFTER)
    tl.store(o_ptr + nh * V + rv, o.to(o_ptr.dtype.element_ty), mask=mv)                  # o, S', k: contiguous
    if IN_PLACE:
        tl.debug_barrier()  # every thread's reads of S and the carried key done before they are overwritten
    tl.store(S_out_ptr + s_offs, S_new, mask=s_mask)
    if i_v == 0:
        tl.store(last_out_ptr + nh * K + rk, k, mask=mk)


def forward(q, k, v, beta, lam, S, last_k, *, rule: str, shifted: bool, read_after: bool, nlms: bool,
            ridge_scaling: bool, eps: float, eps_gamma: float, beta_bias=None, lam_bias=None, beta_scale: float = 1.0,
            lam_scale: float = 1.0, qk_norm: int = 0, qk_eps: float = 0.0, qk_scale: float = 1.0,
            in_place: bool = False):
    """o [N, H, V] (q's dtype), S' [N, H, K, V] and the new last key [N, H, K] (k in float32, whatever the
    pairing: same-step rows carry none and drop it) from q, k [N, H, K], v [N, H, V] (one dtype; any row and head
    strides, the head dim unit-strided), beta [N, H] (2A, 2: [N, H, V]) and lam [N, H] float32 (any row stride, the
    rest contiguous), S [N, H, K, V] float32, last_k [N, H, K] float32 or None (a fresh shifted row: no write), all
    contiguous but q, k, v, beta, lam. With beta_bias and lam_bias (any float dtype, read as float32; contiguous),
    beta and lam are the gains' logits in any float dtype (GATES); qk_norm 1 / 2 normalizes q and k first
    (QK_NORM). `in_place`: S' is S and the new last key is last_k (when given), overwritten."""
    N, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(N, H, V)
    BK = block(K, 256)
    BV = min(block(V, 256), max(16, STATE_BLOCK // BK))
    S_out = S if in_place else torch.empty_like(S)
    key_in_place = in_place and last_k is not None and cdiv(V, BV) == 1  # the module docstring
    last_out = last_k if key_in_place else torch.empty(N, H, K, dtype=torch.float32, device=q.device)
    writes = last_k is not None or not shifted
    gates = beta_bias is not None
    step_kernel[(N * H, cdiv(V, BV))](
        q, k, v, beta, lam, S, last_k if last_k is not None else S, o, S_out, last_out,
        beta_bias if gates else S, lam_bias if gates else S, H, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), beta.stride(0), lam.stride(0), eps, 1.0 - eps_gamma, qk_eps, qk_scale, beta_scale,
        lam_scale, K=K, V=V, BK=BK, BV=BV, WRITES=writes, SHIFTED=shifted, REGRESSION=rule in ("1", "2"),
        PER_COLUMN=rule in ("2A", "2"), NLMS=nlms, SCALED=ridge_scaling, READ_AFTER=read_after, QK_NORM=qk_norm,
        GATES=gates, IN_PLACE=in_place, num_warps=NUM_WARPS)
    if in_place and last_k is not None and not key_in_place:
        last_k.copy_(last_out)
        last_out = last_k
    return o, S_out, last_out
