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

- `rotary_qk_into_cache_triton(q, k, v, cos, sin, keys, values, slot)`: a decoding step's rotation that writes k' and
  v straight into a fixed-address cache's storage at each row's slot (one launch where a rotation and two copies
  would be three).

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


def rotary_qk_into_cache_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, *,
                                ring: int | None = None) -> torch.Tensor:
    """A decoding step's rotation in one launch, without autograd: q' [B, 1, HQ, D] returned (contiguous), k' and v
    [B, 1, HK, D] written into the cache's storage `keys` and `values` [B, S, HK, D] (unit stride along D) at each
    row's slot: `slot` a device integer scalar (every row's) or [B] (each row's own), taken modulo `ring` for a ring
    of `ring` slots. The same values as `rotary_qk_triton` then copying k' and v in."""
    B, T, HQ, D = q.shape if q.dim() == 4 else (None,) * 4
    if (q.dim() != 4 or T != 1 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != (B, 1) or k.shape[3] != D
            or keys.dim() != 4 or values.shape != keys.shape or keys.shape[0] != B or keys.shape[2:] != k.shape[2:]):
        raise ValueError(f"rotary_qk_into_cache_triton: q [B, 1, Hq, D], k and v [B, 1, Hk, D] and the storages "
                         f"[B, S, Hk, D]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}, {list(keys.shape)}, "
                         f"{list(values.shape)}")
    if D % 2 != 0:
        raise ValueError(f"rotary_qk_into_cache_triton: the head dim must be even, got {D}")
    if needs_grad(q, k, v, cos, sin):
        raise ValueError("rotary_qk_into_cache_triton: a decoding step records no gradient")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or tuple(cos.shape[1:]) != (1, D):
        raise ValueError(f"rotary_qk_into_cache_triton: cos and sin must be [B or 1, 1, D]; got {tuple(cos.shape)}")
    if (q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != keys.dtype or keys.dtype != q.dtype
            or values.dtype != q.dtype or cos.dtype != sin.dtype or cos.dtype not in (torch.float32, q.dtype)):
        raise ValueError(f"rotary_qk_into_cache_triton: q, k, v and the storages in one dtype among {TRITON_DTYPES}, "
                         f"the tables float32 or that dtype; got {q.dtype}, {k.dtype}, {v.dtype}, {keys.dtype}, "
                         f"{cos.dtype}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or slot.dtype not in (torch.int32, torch.int64) or (
            slot.dim() not in (0, 1) or (slot.dim() == 1 and slot.shape[0] != B)):
        raise ValueError("rotary_qk_into_cache_triton: storages unit-strided along D, and an integer slot (a scalar "
                         f"or [B]); got slot {list(slot.shape)} {slot.dtype}")
    from hybridlm.ops.rotary.kernels import rotary_qk_into_cache

    return rotary_qk_into_cache(q, k, v, cos, sin, keys, values, slot, ring=ring)


__all__ = ["rotary_qk_into_cache_triton", "rotary_qk_triton"]
