"""The Triton kernels of `rotary_qk_triton` (the math in `__init__.py`): one program per (row b, step t) rotates every
query and key head of that step, reading q and k where they lie (unit stride along D) and cos, sin once. The same
kernel runs the backward (BACKWARD): the rotation's transpose, on the gradients. `rotary_qk_cache_kernel`: a decoding
step's rotation that writes the rotated key, and the value, straight into a fixed-address cache's storage at the
row's slot (`rotary_qk_into_cache_triton`), where a separate rotation and two copies would run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.utils import next_power_of_2, on_tensor_device, unit_last_stride

# No fused multiply-add: the torch form rounds each product to the activations' dtype before the sum.
LAUNCH = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _rotate(x_ptr, out_ptr, cos, sin, b, t, T, H, s_b, s_t, s_h, D: tl.constexpr, BH: tl.constexpr,
            BD: tl.constexpr, BACKWARD: tl.constexpr):
    """out[b, t] = x[b, t] * cos + rotate_half(x[b, t]) * sin for heads < H (out contiguous [B, T, H, D]): `_rotate_row`
    at row (b, t)."""
    _rotate_row(x_ptr + b * s_b + t * s_t, out_ptr + (b * T + t) * H * D, cos, sin, H, s_h, D, D, BH, BD, BACKWARD)


@triton.jit
def _rotate_row(x_row, out_row, cos, sin, H, s_h, so_h, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                BACKWARD: tl.constexpr):
    """out_row[h] = x_row[h] * cos + rotate_half(x_row[h]) * sin for heads h < H (heads s_h / so_h apart), with cos
    and sin rounded to x's dtype first and each product rounded to it before the sum, as the torch form. BACKWARD:
    out = x * cos + rotate_half^T(x * sin_partner), rotate_half^T(y) = (y[D/2:], -y[:D/2]) (sin given at the
    partner's place, sin_partner[d] = sin[d +- D/2]): the gradient the torch form's autograd gives, product by
    product."""
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    half = D // 2
    mask = (h < H) & (d < D)
    row = x_row + h * s_h
    x = tl.load(row + d, mask=mask, other=0.0)
    partner = tl.load(row + (d + half) % D, mask=mask, other=0.0)  # x[d + D/2] for d < D/2, x[d - D/2] after
    dtype = x.dtype
    # A product, not a subtraction from 0: -(+0) stays -0, as torch's negation.
    if BACKWARD:
        sign = tl.where(d < half, 1.0, -1.0)
    else:
        sign = tl.where(d < half, -1.0, 1.0)
    first = (x.to(tl.float32) * cos.to(dtype).to(tl.float32)).to(dtype)
    second = (partner.to(tl.float32) * sign * sin.to(dtype).to(tl.float32)).to(dtype)
    out = (first.to(tl.float32) + second.to(tl.float32)).to(dtype)
    tl.store(out_row + h * so_h + d, out, mask=mask)


@triton.jit
def rotary_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T, HQ, HK, sq_b, sq_t, sq_h, sk_b, sk_t,
                     sk_h, cos_rows, D: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
                     BACKWARD: tl.constexpr):
    i_bt = tl.program_id(0).to(tl.int64)
    b, t = i_bt // T, i_bt % T
    d = tl.arange(0, BD)[None, :]
    table = (tl.minimum(b, cos_rows - 1) * T + t) * D  # cos, sin [B or 1, T, D] contiguous
    cos = tl.load(cos_ptr + table + d, mask=d < D, other=0.0)
    if BACKWARD:  # the product with sin is taken at the partner's place (rotate_half^T after it)
        sin = tl.load(sin_ptr + table + (d + D // 2) % D, mask=d < D, other=0.0)
    else:
        sin = tl.load(sin_ptr + table + d, mask=d < D, other=0.0)
    _rotate(q_ptr, q_out_ptr, cos, sin, b, t, T, HQ, sq_b, sq_t, sq_h, D, BHQ, BD, BACKWARD)
    _rotate(k_ptr, k_out_ptr, cos, sin, b, t, T, HK, sk_b, sk_t, sk_h, D, BHK, BD, BACKWARD)


@triton.jit
def rotary_qk_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, key_ptr, value_ptr, slot_ptr, HQ, HK,
                           sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, skey_b, skey_s, skey_h, sval_b, sval_s, sval_h,
                           slot_stride, cos_rows, ring, D: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr,
                           BD: tl.constexpr, RING: tl.constexpr):
    # One decoding step's row b (T = 1): q rotated into q_out [B, 1, HQ, D] (contiguous), k rotated and v copied into
    # the key / value storage [B, S, HK, D] at the row's slot (slot_ptr[b * slot_stride], modulo `ring` for a ring).
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)[None, :]
    table = tl.minimum(b, cos_rows - 1) * D  # cos, sin [B or 1, 1, D] contiguous
    cos = tl.load(cos_ptr + table + d, mask=d < D, other=0.0)
    sin = tl.load(sin_ptr + table + d, mask=d < D, other=0.0)
    _rotate_row(q_ptr + b * sq_b, q_out_ptr + b * HQ * D, cos, sin, HQ, sq_h, D, D, BHQ, BD, False)
    slot = tl.load(slot_ptr + b * slot_stride).to(tl.int64)
    if RING:
        slot = slot % ring
    _rotate_row(k_ptr + b * sk_b, key_ptr + b * skey_b + slot * skey_s, cos, sin, HK, sk_h, skey_h, D, BHK, BD, False)
    h = tl.arange(0, BHK)[:, None]
    mask = (h < HK) & (d < D)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + d, mask=mask, other=0.0)
    tl.store(value_ptr + b * sval_b + slot * sval_s + h * sval_h + d, v.to(value_ptr.dtype.element_ty), mask=mask)


def rotary_qk_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, *,
                         ring: int | None) -> torch.Tensor:
    """Checked inputs (`__init__.rotary_qk_into_cache_triton`) -> q' [B, 1, HQ, D] contiguous; k' and v written into
    `keys` and `values` [B, S, HK, D] at each row's slot."""
    B, _, HQ, D = q.shape
    HK = k.shape[2]
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = q.new_empty(q.shape)
    if q.numel() == 0:
        return q_out
    with on_tensor_device(q):
        rotary_qk_cache_kernel[(B,)](
            q, k, v, cos, sin, q_out, keys, values, slot, HQ, HK, q.stride(0), q.stride(2), k.stride(0), k.stride(2),
            v.stride(0), v.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0),
            values.stride(1), values.stride(2), slot.stride(0) if slot.dim() else 0, cos.shape[0], ring or 1, D=D,
            BHQ=next_power_of_2(HQ), BHK=next_power_of_2(HK), BD=next_power_of_2(D), RING=ring is not None,
            **LAUNCH)
    return q_out


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
              backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs (`__init__.rotary_qk_triton`) -> (q', k') contiguous; `backward`: (dq, dk) for the gradients
    (dq', dk') in place of q and k."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    q, k = unit_last_stride(q), unit_last_stride(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
    if q.numel() == 0:
        return q_out, k_out
    with on_tensor_device(q):
        rotary_qk_kernel[(B * T,)](
            q, k, cos, sin, q_out, k_out, T, HQ, HK, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), cos.shape[0], D=D, BHQ=next_power_of_2(HQ), BHK=next_power_of_2(HK),
            BD=next_power_of_2(D), BACKWARD=backward, **LAUNCH)
    return q_out, k_out


class RotaryQK(torch.autograd.Function):
    """(q', k') differentiable in q and k (the tables take no gradient): the backward is the same kernel on the
    gradients (BACKWARD), once differentiable."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.shapes = q.shape, k.shape
        return rotary_qk(q, k, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        if dq_out is None and dk_out is None:
            return None, None, None, None
        given = dq_out if dq_out is not None else dk_out  # an output nothing read has no gradient: zeros
        dq_out, dk_out = (given.new_zeros(shape) if grad is None else grad
                          for grad, shape in zip((dq_out, dk_out), ctx.shapes))
        dq, dk = rotary_qk(dq_out, dk_out, cos, sin, backward=True)
        return dq, dk, None, None
