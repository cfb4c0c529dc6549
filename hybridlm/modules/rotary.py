"""Rotary position embedding (RoPE), half-split layout: the pair of dim i is dim i + D/2.

Frequency of pair i: base^(-2i/D). Falcon-H1 uses a very large base (1e11), so most pairs barely
rotate within any trained length and context extension needs no rescaling.

`rotate_qk` rotates a layer's queries and keys: on CUDA outside torch.compile in one Triton kernel each way
(`hybridlm.ops.rotary`: the same values and gradients bit for bit), else the torch form `apply_rotary`. A decoding
step into a fixed-address cache rotates and appends in one kernel where `rotate_into_cache_fuses`.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.ops.rotary import rotary_qk_triton
from hybridlm.ops.utils import TRITON_DTYPES, needs_grad, triton_available


def rotary_inv_freq(head_dim: int, *, base: float, device: torch.device | None = None) -> torch.Tensor:
    """[D/2] inverse frequencies base^(-2i/D), float32."""
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (base**exponent)


def rotary_cos_sin(
    position_ids: torch.Tensor, *, head_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T] (or [T]) -> cos, sin [B, T, D] (or [T, D]) in float32."""
    inv_freq = rotary_inv_freq(head_dim, base=base, device=position_ids.device)  # [D/2]
    angles = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, D]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos, sin [B, T, D] (cast to x.dtype, as the reference does)."""
    cos = cos.to(x.dtype).unsqueeze(-2)  # [B, T, 1, D]
    sin = sin.to(x.dtype).unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (x1, x2) -> (-x2, x1)
    return x * cos + rotated * sin


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)) for q [B, T, Hq, D], k [B, T, Hk, D] and the tables
    cos, sin [B or 1, T, D] (or [T, D]) of `rotary_cos_sin`, rounded to q's dtype as apply_rotary does. One Triton
    kernel each way (which rounds the tables itself) for CUDA tensors outside torch.compile (whose inductor fuses
    the torch form) and tables that take no gradient; the torch form, with the tables cast once for q and k,
    otherwise (DTensors too)."""
    if _takes_kernel(q, k, cos, sin):
        return rotary_qk_triton(q, k, cos, sin)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rotate_into_cache_fuses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            keys: torch.Tensor | None) -> bool:
    """Whether a decoding step's rotation and its append to a fixed-address cache's storage `keys` run as one kernel
    (`hybridlm.ops.rotary.rotary_qk_into_cache_triton`): where `rotate_qk` would take its kernel, one token, nothing
    recording a gradient, and v and the storage in q's dtype (the storage unit-strided along D). Metadata only."""
    return (keys is not None and q.dim() == 4 and q.shape[1] == 1 and _takes_kernel(q, k, cos, sin)
            and v.dtype == q.dtype and keys.dtype == q.dtype and keys.stride(-1) == 1 and not needs_grad(q, k, v))


def _takes_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    B, T, _, D = q.shape
    tables = cos.dim() == 3 and cos.shape[0] in (1, B) and tuple(cos.shape[1:]) == (T, D) and sin.shape == cos.shape
    return (q.is_cuda and q.dtype in TRITON_DTYPES and k.dtype == q.dtype and tables
            and cos.dtype == sin.dtype and cos.dtype in (torch.float32, q.dtype)
            and not any(hasattr(t, "to_local") for t in (q, k, cos, sin))
            and not needs_grad(cos, sin) and not torch.compiler.is_compiling() and triton_available())


class RotaryEmbedding(nn.Module):
    """Holds (head_dim, base); `forward(position_ids)` returns (cos, sin). No buffers: the [D/2]
    frequencies are recomputed per call, so the module is safe to build on the meta device."""

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.base = base

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(position_ids, head_dim=self.head_dim, base=self.base)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"
