"""The Triton kernel of `rotary_qk_triton` (the math in `__init__.py`): one program per (row b, step t) rotates every
query and key head of that step, reading q and k where they lie (unit stride along D) and cos, sin once. The same
kernel runs the backward (BACKWARD): the rotation's transpose, on the gradients."""

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
    """out[b, t] = x[b, t] * cos + rotate_half(x[b, t]) * sin for heads < H (out contiguous [B, T, H, D]), with cos
    and sin rounded to x's dtype first and each product rounded to it before the sum, as the torch form. BACKWARD:
    out = x * cos + rotate_half^T(x * sin_partner), rotate_half^T(y) = (y[D/2:], -y[:D/2]) (sin given at the
    partner's place, sin_partner[d] = sin[d +- D/2]): the gradient the torch form's autograd gives, product by
    product."""
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    half = D // 2
    mask = (h < H) & (d < D)
    row = x_ptr + b * s_b + t * s_t + h * s_h
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
    tl.store(out_ptr + ((b * T + t) * H + h) * D + d, out, mask=mask)


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
