"""Grouped, gated RMSNorm: the output norm of the Mamba-2 mixer.

Channels are cut into `groups` equal groups, each normalized on its own (so the norm stays local to
a tensor-parallel shard that holds whole groups). The gate multiplies by SiLU(z) either after the
norm (`norm_before_gate=True`: y = norm(x) * silu(z)) or before it (`False`: y = norm(x * silu(z))).
The math runs in `compute_dtype(x.dtype)` (float32, or float64 for float64 inputs) and the result goes
back to the input dtype.

On a GPU the norm runs on `hybridlm.ops.gated_norm`'s Triton kernels (one launch forward, one backward, where the
torch form below takes several each way plus float32 copies of x and the gate): `backend="auto"` takes them for a
32- or 16-bit CUDA tensor (a gate of x's shape) with groups of at most `MAX_GROUP` channels outside torch.compile
(inductor fuses the torch form), in training and decoding alike, and warns once (`SlowPathWarning`) when only a
missing triton or too wide a group keeps it on the torch form. The two agree to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.modules.gate import silu_gate
from hybridlm.modules.linear import is_plain, linear_input
from hybridlm.modules.recomputed_linear import recomputed_linear
from hybridlm.ops.gated_norm import MAX_GROUP, gated_norm_triton
from hybridlm.ops.utils import (
    TRITON_DTYPES,
    check_backend,
    compute_dtype,
    triton_available,
    triton_runs_on,
    warn_slow_path,
)


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    groups: int = 1,
    eps: float = 1e-6,
    norm_before_gate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """x [..., D], gate [..., D] or None, weight [D] -> [..., D] in `x.dtype`. backend: "torch" (the form below),
    "triton" (the kernels: 32- or 16-bit x and gate, groups of at most MAX_GROUP channels) or "auto" (see the module
    docstring)."""
    dim = x.shape[-1]
    if dim % groups != 0:
        raise ValueError(f"gated_rms_norm: groups={groups} must divide the channel count {dim}")
    check_backend("gated_rms_norm", backend)
    if _takes_kernels(backend, x, gate, dim // groups):
        return gated_norm_triton(x, weight, gate, groups=groups, eps=eps, norm_before_gate=norm_before_gate)
    dtype = compute_dtype(x.dtype)
    out = x.to(dtype)
    if gate is not None and not norm_before_gate:
        out = out * F.silu(gate.to(dtype))
    # [..., G, D/G]: out / sqrt(mean out^2 + eps) per group (`F.rms_norm`: one fused kernel each way on a GPU)
    out = F.rms_norm(out.unflatten(-1, (groups, dim // groups)), (dim // groups,), eps=eps)
    out = (weight.to(dtype).view(groups, dim // groups) * out).flatten(-2)  # [..., D]
    if gate is not None and norm_before_gate:
        out = out * F.silu(gate.to(dtype))
    return out.to(x.dtype)


def _takes_kernels(backend: str, x: torch.Tensor, gate: torch.Tensor | None, group: int) -> bool:
    """Whether `gated_rms_norm` runs the Triton kernels (see its `backend`)."""
    dtypes_taken = x.dtype in TRITON_DTYPES and (gate is None or gate.dtype in TRITON_DTYPES)
    if backend == "triton":
        if not triton_runs_on(x):
            raise ValueError(f"gated_rms_norm: backend='triton' needs triton and a CUDA tensor, got a {x.device.type} "
                             "tensor; use backend='auto'")
        if not dtypes_taken:
            raise ValueError("gated_rms_norm: backend='triton' takes float32, bfloat16 or float16 x and gate, got "
                             f"{x.dtype} / {None if gate is None else gate.dtype}; use backend='torch' or 'auto'")
        if group > MAX_GROUP:
            raise ValueError(f"gated_rms_norm: backend='triton' takes groups of at most {MAX_GROUP} channels, got "
                             f"{group}; use backend='torch' or 'auto'")
        return True
    if backend != "auto" or not x.is_cuda or torch.compiler.is_compiling():
        return False
    if not dtypes_taken or x.shape[-1] == 0 or (gate is not None and gate.shape != x.shape):
        return False  # float64 (the torch form computes in float64), no channels, or a gate that broadcasts
    if group > MAX_GROUP:
        warn_slow_path(WIDE_GROUP.format(group=group))
        return False
    if not triton_available():
        warn_slow_path(NO_TRITON)
        return False
    return True


WIDE_GROUP = ("gated_rms_norm: groups of {group} channels are wider than the Triton kernels take (" + str(MAX_GROUP)
              + "), so this norm runs the torch form on CUDA (several kernels and float32 copies per call): more "
              "groups (mamba_n_groups) keep it on the kernels")
NO_TRITON = ("gated_rms_norm: triton is not installed, so the mixers' gated norms run the torch form on CUDA (several "
             "kernels and float32 copies per call, where the Triton kernels take one each way): pip install triton")


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with a learned scale [D] (initialized to ones); `backend` as there ("auto" by default)."""

    def __init__(self, hidden_size: int, *, groups: int = 1, eps: float = 1e-6, norm_before_gate: bool = True) -> None:
        super().__init__()
        if hidden_size % groups != 0:
            raise ValueError(f"GatedRMSNorm: groups={groups} must divide hidden_size={hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.groups = groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.backend = "auto"

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return gated_rms_norm(
            x, self.weight, gate, groups=self.groups, eps=self.eps, norm_before_gate=self.norm_before_gate,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, groups={self.groups}, eps={self.eps}, "
                f"norm_before_gate={self.norm_before_gate}, backend={self.backend}")


def gated_output_projection(
    y: torch.Tensor, z: torch.Tensor, proj: nn.Module, norm: nn.Module | None, dtype: torch.dtype
) -> torch.Tensor:
    """A mixer's output: proj(norm(y, z)), or proj(y * SiLU(z)) without a norm, the projection's input in `dtype` as
    `linear_input` gives it. y, z [..., d] -> [..., out]. The gated output is recomputed in the backward rather than
    kept (`recomputed_linear`: y and z are kept by the norm anyway); a norm other than a `GatedRMSNorm`, or one with
    hooks, runs as a module call."""
    if norm is None:
        return recomputed_linear(lambda a, b: linear_input(silu_gate(a, b), dtype), (y, z), proj)
    if not is_plain(norm, GatedRMSNorm):
        return proj(linear_input(norm(y, z), dtype))
    options = dict(groups=norm.groups, eps=norm.eps, norm_before_gate=norm.norm_before_gate, backend=norm.backend)
    return recomputed_linear(lambda a, b, w: linear_input(gated_rms_norm(a, w, b, **options), dtype),
                             (y, z, norm.weight), proj)
