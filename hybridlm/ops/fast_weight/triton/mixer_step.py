"""The fast-weight mixer's whole decoding step between its two projections in one kernel: the short conv with its
state, the QK norm, the gains, the rule's step and the gated RMSNorm (`hybridlm.layers.fast_weight`'s steps 2-5 for
one token). The implementation of the custom ops `hybridlm::fast_weight_mixer_step` and `..._step_`
(`custom_ops.py`); inference only (no backward).

Run apart, that step is three kernels per layer (the conv's step, `step.py`'s, the gated norm's), and a CUDA-graphed
decoding step's time is its kernel count. Here one program per (row n, head h) reads the head's pieces of the input
projection's row, p = [q | k | v | z | beta logits | lam logits] (q, k [H K], v, z [H V]), and computes in float32:

    q, k, v = SiLU(conv(p's q, k, v channels of head h; the conv state)), rounded to p's dtype    (short_conv/step.py)
    q, k <- QK norm (rms / l2 / none), rounded to p's dtype; beta, lam from their logits and biases    (step.py)
    S', o = the rule's step on (q, the written key, v, beta, lam)                                      (step.py)
    y = RMSNorm(o rounded to p's dtype) * w * SiLU(z)      over the head's V channels (gated_norm/kernels.py)

and writes y [N, H V] in p's dtype, S', k (the next carried key) and the conv state's new rows: into new tensors, or
over the ones it read (`in_place`: a fixed-address cache that a replayed CUDA graph reads). Each rounding is the
unfused path's, so the outputs match it up to the compiler's contraction of float32 products.

The program walks the head's value columns in blocks of [K, BV] (`step.py`'s block, 4096 float32 elements: one block
at K = V = 64, four at 128), writing o to y as it goes (o rounded to p's dtype, what the norm reads), then normalizes
y in a second walk once the sum of squares is complete. A program owns its head's conv channels, S and carried key:
barriers between its loads and its stores order an update in place, and y's second walk after its first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.step import NUM_WARPS, STATE_BLOCK, gain_from_logit, qk_normalize, rule_step
from hybridlm.ops.short_conv.step import conv_step_columns, store_conv_state
from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import next_power_of_2


@triton.jit
def mixer_step_kernel(p_ptr, cw_ptr, cb_ptr, cs_ptr, cs_out_ptr, S_ptr, last_ptr, S_out_ptr, last_out_ptr,
                      beta_bias_ptr, lam_bias_ptr, nw_ptr, y_ptr, H, sp_n, scs_n, scs_k, sco_n, sco_k, eps,
                      one_minus_eps_gamma, qk_eps, qk_scale, beta_scale, lam_scale, norm_eps, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr,
                      CONV_BIAS: tl.constexpr, WRITES: tl.constexpr, SHIFTED: tl.constexpr,
                      REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr,
                      READ_AFTER: tl.constexpr, QK_NORM: tl.constexpr, IN_PLACE: tl.constexpr):
    # p and the conv state are read at their row strides (unit stride along the channels); y, S and the keys are
    # contiguous, the new conv state at its own strides.
    nh = tl.program_id(0).to(tl.int64)
    i_n, i_h = nh // H, nh % H
    dtype = p_ptr.dtype.element_ty
    rk = tl.arange(0, BK)
    mk = rk < K
    conv_channels = H * (2 * K + V)
    row = p_ptr + i_n * sp_n
    state = cs_ptr + i_n * scs_n
    out = cs_out_ptr + i_n * sco_n
    cq, ck = i_h * K + rk, H * K + i_h * K + rk  # the head's q and k conv channels
    q, q_state = conv_step_columns(tl.load(row + cq, mask=mk, other=0.0), state, scs_k, cw_ptr, cb_ptr, cq, mk, KC,
                                   KCP, CONV_BIAS, True)
    k, k_state = conv_step_columns(tl.load(row + ck, mask=mk, other=0.0), state, scs_k, cw_ptr, cb_ptr, ck, mk, KC,
                                   KCP, CONV_BIAS, True)
    q, k = q.to(dtype).to(tl.float32), k.to(dtype).to(tl.float32)  # the conv's output, in p's dtype
    if QK_NORM != 0:
        q = qk_normalize(q, K, qk_eps, qk_scale, QK_NORM == 2, dtype)
        k = qk_normalize(k, K, qk_eps, qk_scale, QK_NORM == 2, dtype)
    x, beta, lam = k, 0.0, 0.0  # read only where the step writes
    logits = row + conv_channels + H * V  # the gains' logits: beta [H] ([H V] per column), then lam [H]
    if WRITES:
        if SHIFTED:
            x = tl.load(last_ptr + nh * K + rk, mask=mk, other=0.0)                          # k_{t-1}
        if PER_COLUMN:
            lam = gain_from_logit(tl.load(logits + H * V + i_h), tl.load(lam_bias_ptr + i_h), lam_scale)
        else:
            lam = gain_from_logit(tl.load(logits + H + i_h), tl.load(lam_bias_ptr + i_h), lam_scale)
            beta = gain_from_logit(tl.load(logits + i_h), tl.load(beta_bias_ptr + i_h), beta_scale)
    # The value columns in blocks of BV: the conv, the step and o; o goes to y as it is handed to the norm (rounded to
    # p's dtype), and its squares are summed for the norm.
    squares = 0.0
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        cv = 2 * H * K + i_h * V + rv
        v, v_state = conv_step_columns(tl.load(row + cv, mask=mv, other=0.0), state, scs_k, cw_ptr, cb_ptr, cv, mv,
                                       KC, KCP, CONV_BIAS, True)
        v = v.to(dtype).to(tl.float32)
        if WRITES and PER_COLUMN:
            gain = gain_from_logit(tl.load(logits + i_h * V + rv, mask=mv, other=0.0),
                                   tl.load(beta_bias_ptr + i_h * V + rv, mask=mv, other=0.0), beta_scale)  # [BV]
        else:
            gain = beta
        s_offs = (nh * K + rk[:, None]) * V + rv[None, :]
        s_mask = mk[:, None] & mv[None, :]
        S = tl.load(S_ptr + s_offs, mask=s_mask, other=0.0)                                 # [BK, BV] S_{t-1}
        S_new, o = rule_step(S, q, x, v, gain, lam, eps, one_minus_eps_gamma, WRITES, REGRESSION, PER_COLUMN, NLMS,
                             SCALED, READ_AFTER)
        u = tl.where(mv, o.to(dtype).to(tl.float32), 0.0)
        squares += tl.sum(u * u, axis=0)
        if IN_PLACE:
            tl.debug_barrier()  # every thread's reads of this block of S and of its conv state done
        tl.store(S_out_ptr + s_offs, S_new, mask=s_mask)
        store_conv_state(out, sco_k, cv, mv, v_state, KC, KCP)
        tl.store(y_ptr + nh * V + rv, u.to(y_ptr.dtype.element_ty), mask=mv)
    # The gated RMSNorm over the head's channels (gated_norm/kernels.py's arithmetic), o read back from y
    rstd = 1.0 / tl.sqrt(squares / V + norm_eps)
    tl.debug_barrier()  # y's blocks as every thread wrote them
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        u = tl.load(y_ptr + nh * V + rv, mask=mv, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + i_h * V + rv, mask=mv, other=0.0).to(tl.float32)
        z = tl.load(row + conv_channels + i_h * V + rv, mask=mv, other=0.0).to(tl.float32)
        tl.store(y_ptr + nh * V + rv, (u * rstd * w * (z * tl.sigmoid(z))).to(y_ptr.dtype.element_ty), mask=mv)
    # The head's q and k conv channels and its carried key (read above, by every thread: the barrier passed)
    store_conv_state(out, sco_k, cq, mk, q_state, KC, KCP)
    store_conv_state(out, sco_k, ck, mk, k_state, KC, KCP)
    tl.store(last_out_ptr + nh * K + rk, k, mask=mk)


def forward(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias, lam_bias, norm_weight, *, heads: int,
            rule: str, shifted: bool, read_after: bool, nlms: bool, ridge_scaling: bool, eps: float, eps_gamma: float,
            beta_scale: float, lam_scale: float, qk_norm: int, qk_eps: float, qk_scale: float, norm_eps: float,
            in_place: bool = False):
    """y [N, H V] (p's dtype), the new conv state [N, KC-1, C] (p's dtype), S' [N, H, K, V] and the new last key
    [N, H, K] (float32) from p [N, width] (the input projection's row: any row stride, unit stride along it), the conv's
    weight [C, KC] and bias [C] or None, its state [N, KC-1, C] (p's dtype; any row and tap strides, unit along the
    channels), S [N, H, K, V] float32, last_k [N, H, K] float32 or None (a fresh shifted row: no write), the gains'
    biases, the norm's weight [H V] (any float dtype, contiguous). `in_place`: the new conv state, S' and last key
    written over conv_state, S and last_k (given for shifted pairing)."""
    N, H = p.shape[0], heads
    K, V = S.shape[2:]
    KC = conv_weight.shape[1]
    y = p.new_empty(N, H * V)
    conv_out = conv_state if in_place else conv_state.new_empty(conv_state.shape)
    S_out = S if in_place else torch.empty_like(S)
    last_out = last_k if in_place and last_k is not None else torch.empty(N, H, K, dtype=torch.float32,
                                                                          device=p.device)
    BK = block(K, 256)
    BV = min(block(V, 256), max(16, STATE_BLOCK // BK))
    mixer_step_kernel[(N * H,)](
        p, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state, conv_out, S,
        last_k if last_k is not None else S, S_out, last_out, beta_bias, lam_bias, norm_weight, y, H, p.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_out.stride(0), conv_out.stride(1), eps, 1.0 - eps_gamma,
        qk_eps, qk_scale, beta_scale, lam_scale, norm_eps, K=K, V=V, BK=BK, BV=BV, KC=KC, KCP=next_power_of_2(KC),
        CONV_BIAS=conv_bias is not None, WRITES=last_k is not None or not shifted, SHIFTED=shifted,
        REGRESSION=rule in ("1", "2"), PER_COLUMN=rule in ("2A", "2"), NLMS=nlms, SCALED=ridge_scaling,
        READ_AFTER=read_after, QK_NORM=qk_norm, IN_PLACE=in_place, num_warps=NUM_WARPS)
    return y, conv_out, S_out, last_out
