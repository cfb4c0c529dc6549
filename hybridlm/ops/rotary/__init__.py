"""Rotary position embedding applied to a layer's queries and keys in one Triton kernel each way:

    x' = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x[D/2:], x[:D/2])      (cos, sin [B or 1, T, D])

computed in x's dtype as the torch form (`hybridlm.modules.rotary.apply_rotary`) computes it: cos and sin rounded
to x's dtype, each product rounded to it, then their sum (no fused multiply-add), so the kernel's outputs equal the
torch form's bit for bit, signed zeros included.

- `rotary_qk_triton(q, k, cos, sin)`: q [B, T, Hq, D] and k [B, T, Hk, D] (one dtype; read where they lie when
  unit-strided along D, else copied), cos and sin [B or 1, T, D] in float32 or q's dtype -> (q', k') contiguous, one
  launch (`kernels.py`; imported on the first call, so importing this package never needs triton). Differentiable
  in q and k (not in the tables), once: the backward is one launch of the same kernel on the gradients,

      dx = dx' * cos + rotate_half^T(dx' * sin),   rotate_half^T(y) = (y[D/2:], -y[:D/2]),

  rounded as the torch form's autograd rounds it (each product, then the sum), so the gradients equal it bit for
  bit (up to the sign of a zero: autograd also adds the zeros of its slices' gradients).

On the torch form a layer's rotation is ten small kernels forward (a negation, a concatenation, two products and a
sum, for q and for k) and as many backward; the kernel is one launch each way (`hybridlm.modules.rotary.rotate_qk`
takes it on CUDA outside torch.compile).
"""

from __future__ import annotations

import torch

from hybridlm.ops.utils import TRITON_DTYPES, needs_grad


def rotary_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k') of the module docstring, on one Triton kernel (CUDA tensors, or CPU ones under the interpreter)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rotary_qk_triton: q and k must be [B, T, H, D] with one B, T and D, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if D % 2 != 0:
        raise ValueError(f"rotary_qk_triton: the head dim must be even, got {D}")
    if needs_grad(cos, sin):
        raise ValueError("rotary_qk_triton: the tables take no gradient (cos and sin require one); use "
                         "`hybridlm.modules.rotary.apply_rotary`")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or tuple(cos.shape[1:]) != (T, D):
        raise ValueError(f"rotary_qk_triton: cos and sin must be [B or 1, T, D] = [{B} or 1, {T}, {D}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or cos.dtype != sin.dtype or cos.dtype not in (
            torch.float32, q.dtype):
        raise ValueError(f"rotary_qk_triton: q and k must share one dtype among {TRITON_DTYPES}, cos and sin be "
                         f"float32 or that dtype; got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    from hybridlm.ops.rotary.kernels import RotaryQK, rotary_qk

    if needs_grad(q, k):
        return RotaryQK.apply(q, k, cos, sin)
    return rotary_qk(q, k, cos, sin)


__all__ = ["rotary_qk_triton"]
