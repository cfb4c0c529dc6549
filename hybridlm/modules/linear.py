"""A linear layer whose GEMMs stay on aligned shapes when its output width is odd.

The mixers' fused input projections have widths like 2580 (fast-weight: q, k, v, z, then H beta and H lam logits)
or 1546 (Mamba-2: z, x, B, C, then H dt). A bf16 row of 2580 elements is not a multiple of 16 bytes, and cuBLAS
then leaves its sm90 kernels for slower ones: the GEMMs of such widths run several times slower than those of the
aligned width below them (benchmarks/RESULTS.md). Under `torch.compile` (inductor) the padding leaves a hybrid's
training throughput unchanged, so the gain is for eager runs.

`AlignedLinear` keeps the checkpoint layout (`weight [out, in]`, `bias [out]`, the same names), and on CUDA with
many rows it multiplies by the weight padded with zero rows to a multiple of `ALIGN_ROWS`, then drops the extra
columns of the output (a view). The padding is a copy of the weight per call (2 M elements for the 125M preset's
in_proj), so it is skipped for few rows (decoding), where the GEMM is small anyway. A weight sharded by tensor
parallelism (a DTensor) takes the plain path: its local shard's width is the parallel plan's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ALIGN_ROWS = 8  # 8 bf16/fp16 elements = 16 bytes, the row alignment cuBLAS's fast kernels ask for
MIN_PADDED_ROWS = 1024  # fewer input rows (decoding, short prompts): the weight copy costs more than it saves


def padded_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, multiple: int = ALIGN_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed with `weight`'s rows (and `bias`) zero-padded to a multiple of `multiple`.

    x [..., in], weight [out, in], bias [out] -> [..., out] (a view of a [..., out + pad] result). Gradients flow to
    x, weight and bias as through `F.linear`: the padded rows' gradients are dropped by the pad's backward.
    """
    out_features = weight.shape[0]
    pad = -out_features % multiple
    if pad == 0:
        return F.linear(x, weight, bias)
    weight = F.pad(weight, (0, 0, 0, pad))  # [out + pad, in]
    if bias is not None:
        bias = F.pad(bias, (0, pad))
    return F.linear(x, weight, bias)[..., :out_features]


def pads(out_features: int, in_features: int, weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `AlignedLinear` pads for this call: on CUDA, an output width not a multiple of ALIGN_ROWS, at least
    MIN_PADDED_ROWS input rows, and a plain (not DTensor) weight. The GEMM's dtype is not looked at: under autocast
    a float32 weight multiplies in bf16, and asking for autocast's state inside a compiled graph is avoided; a float32
    GEMM padded needlessly costs one copy of the weight."""
    if not x.is_cuda or hasattr(weight, "to_local"):  # a DTensor under tensor parallelism: the plain path
        return False
    return out_features % ALIGN_ROWS != 0 and x.numel() // max(1, in_features) >= MIN_PADDED_ROWS


def linear_input(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a projection with `dtype` operands should take it: under autocast as it is (autocast casts it for the
    GEMM itself; a bf16 mixer output cast up to a float32 residual's dtype first would cost two casts each way for
    the same values), otherwise `t.to(dtype)`."""
    if torch.is_autocast_enabled(t.device.type):
        return t
    return t.to(dtype)


def is_plain(module: nn.Module, cls: type) -> bool:
    """Whether `module` is exactly a `cls` with its class's forward and no hooks of its own: its forward may then be
    run as the functional form it stands for, without the module call (a subclass, an adapter, a hook, or a forward
    replaced on the instance as accelerate's offloading does would be skipped). Global module hooks
    (`register_module_forward_hook`) are not looked at: they do not fire for a module whose call is skipped."""
    return type(module) is cls and "forward" not in vars(module) and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)



class AlignedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) that pads its weight's rows on CUDA (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if pads(self.out_features, self.in_features, self.weight, x):
            return padded_linear(x, self.weight, self.bias)
        return super().forward(x)
