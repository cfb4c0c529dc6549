"""Rotary position embedding applied to a layer's queries and keys in one Triton kernel, for inference:

    x' = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x[D/2:], x[:D/2])      (cos, sin [B or 1, T, D])

computed in x's dtype as the torch form (`hybridlm.modules.rotary.apply_rotary`) computes it: cos and sin rounded
to x's dtype, each product rounded to it, then their sum (no fused multiply-add), so the kernel's outputs equal the
torch form's bit for bit, signed zeros included.

- `rotary_qk_triton(q, k, cos, sin)`: q [B, T, Hq, D] and k [B, T, Hk, D] (one dtype; read where they lie when
  unit-strided along D, else copied), cos and sin [B or 1, T, D] in float32 or q's dtype -> (q', k') contiguous, one
  launch (`kernels.py`; imported on the first call, so importing this package never needs triton). No backward:
  `hybridlm.modules.rotary.rotate_qk` takes it where no gradient is recorded (prefill and decoding), the torch form
  elsewhere.

On the torch form a layer's rotation is ten small kernels (a negation, a concatenation, two products and a sum, for
q and for k); a CUDA-graphed decoding step costs about one launch per kernel (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch

from hybridlm.ops.utils import TRITON_DTYPES


def rotary_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k') of the module docstring, on one Triton kernel (CUDA tensors, or CPU ones under the interpreter)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rotary_qk_triton: q and k must be [B, T, H, D] with one B, T and D, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if D % 2 != 0:
        raise ValueError(f"rotary_qk_triton: the head dim must be even, got {D}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or tuple(cos.shape[1:]) != (T, D):
        raise ValueError(f"rotary_qk_triton: cos and sin must be [B or 1, T, D] = [{B} or 1, {T}, {D}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or cos.dtype != sin.dtype or cos.dtype not in (
            torch.float32, q.dtype):
        raise ValueError(f"rotary_qk_triton: q and k must share one dtype among {TRITON_DTYPES}, cos and sin be "
                         f"float32 or that dtype; got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    from hybridlm.ops.rotary.kernels import rotary_qk

    return rotary_qk(q, k, cos, sin)


__all__ = ["rotary_qk_triton"]
