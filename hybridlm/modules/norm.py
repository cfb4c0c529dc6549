"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as Falcon-H1 computes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.modules.linear import is_plain
from hybridlm.ops.rms_norm import MAX_DIM, rms_norm_scaled_triton, rms_normalize_triton, sums_in_one_dtype
from hybridlm.ops.utils import (MAX_KERNEL_ROWS, TRITON_DTYPES, compute_dtype, needs_grad, runs_kernels,
                                triton_available)


def rms_normalize(u: torch.Tensor, *, eps: float, backend: str = "auto") -> torch.Tensor:
    """u / sqrt(mean(u^2) + eps) over the last dim, no scale, with float32 math (float64 for float64).

    backend "torch": `F.rms_norm`, one fused kernel each way on a GPU (the spelled-out formula launches seven). A
    bfloat16 CUDA tensor goes in as it is and comes back bfloat16, under autocast too (float32 math inside the kernel,
    the result rounded once; the backward keeps the bfloat16 input and a float32 1/rms per row, where autocast, which
    runs `rms_norm` in float32, would keep a float32 copy of the input); anything else goes in, and comes back, in the
    compute dtype (on the CPU the same numbers as the spelled-out formula).
    backend "triton": `hybridlm.ops.rms_norm`'s kernels (32- or 16-bit u, at most MAX_DIM channels; the result in u's
    dtype), one launch each way, whose backward keeps the output and 1/rms per row instead of the input: a slice of
    a wider tensor (a mixer's conv output) normalized this way does not keep that tensor alive. No double backward;
    16-bit gradients cancel the part along the output to 16-bit precision (`hybridlm.ops.rms_norm`).
    backend "auto": the kernels for a 32- or 16-bit CUDA tensor of at most MAX_DIM channels outside torch.compile
    (where inductor fuses the torch form) when triton is installed, else "torch"."""
    if runs_kernels("rms_normalize", backend, u, lambda: _auto_takes_kernels(u)):
        return rms_normalize_triton(u, eps)
    if u.is_cuda and u.dtype == torch.bfloat16:
        with torch.autocast("cuda", enabled=False):
            return F.rms_norm(u, (u.shape[-1],), eps=eps)
    u = u.to(compute_dtype(u.dtype))
    return F.rms_norm(u, (u.shape[-1],), eps=eps)


def _auto_takes_kernels(u: torch.Tensor) -> bool:
    return (u.is_cuda and u.dtype in TRITON_DTYPES and 0 < u.shape[-1] <= MAX_DIM
            and u.numel() // u.shape[-1] <= MAX_KERNEL_ROWS and not torch.compiler.is_compiling()
            and triton_available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, backend: str = "auto") -> torch.Tensor:
    """Normalize the last dim of `x` [..., D] by its root mean square, then scale by `weight` [D].

    The statistics run in float32 (float64 stays float64); the normalized tensor goes back to `x.dtype` before the
    scale, so a float32 `weight` returns float32 (Falcon-H1's RMSNorm does the same). `backend`: `rms_normalize`'s.
    The scale's backward keeps the normalized tensor, so the kernels' output-keeping backward adds nothing to it: x
    itself (the residual stream) is not kept. Where no gradient is recorded and the kernels run, the scale rides on
    the normalization's launch (`rms_norm_scaled_triton`: the same values).
    """
    if _scaled_kernel_takes(x, weight, (), backend):
        return rms_norm_scaled_triton(x, weight, eps)[1]
    return weight * rms_normalize(x, eps=eps, backend=backend).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residuals: tuple[torch.Tensor, ...], weight: torch.Tensor, *, eps: float,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h, weight)) with h = x + residuals[0] + residuals[1] + ..., added in that order: a block's
    residual adds and the next norm, which read the same rows. Where no gradient is recorded and the kernels run,
    all in one launch (`rms_norm_scaled_triton`, up to two residuals of one sum dtype), else apart: the same values
    either way."""
    if _scaled_kernel_takes(x, weight, residuals, backend):
        return rms_norm_scaled_triton(x, weight, eps, residuals)
    h = x
    for residual in residuals:
        h = h + residual
    return h, rms_norm(h, weight, eps=eps, backend=backend)


def add_and_norm(x: torch.Tensor, residuals: tuple[torch.Tensor, ...],
                 norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) with h = x + residuals[0] + ... for a norm module: residual adds and the norm after them, in one
    launch where `add_rms_norm` takes them (a plain `RMSNorm`), else apart; the same values either way."""
    if is_plain(norm, RMSNorm):
        return add_rms_norm(x, residuals, norm.weight, eps=norm.eps, backend=norm.backend)
    h = x
    for residual in residuals:
        h = h + residual
    return h, norm(h)


def _scaled_kernel_takes(x: torch.Tensor, weight: torch.Tensor, residuals: tuple[torch.Tensor, ...],
                         backend: str) -> bool:
    """Whether the one-launch inference norm runs: the normalization's kernels would (`rms_normalize`'s backend
    rule), nothing records a gradient, and the weight and residuals (at most two, their partial sums in one dtype)
    are kernel dtypes on x's device, shaped to match."""
    if backend == "torch" or (backend == "auto" and not x.is_cuda) or len(residuals) > 2:
        return False  # the common refusals first: this runs for every norm of every call
    if needs_grad(x, weight, *residuals):
        return False
    if (x.dtype not in TRITON_DTYPES or weight.dtype not in TRITON_DTYPES or not 0 < x.shape[-1] <= MAX_DIM
            or weight.shape != (x.shape[-1],) or weight.device != x.device
            or x.numel() // x.shape[-1] > MAX_KERNEL_ROWS):
        return False
    if any(r.shape != x.shape or r.dtype not in TRITON_DTYPES for r in residuals) or not sums_in_one_dtype(
            x, residuals):
        return False
    return runs_kernels("rms_norm", backend, x, lambda: _auto_takes_kernels(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned scale (initialized to ones); `backend` as
    `rms_normalize`'s ("auto" by default)."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = "auto"  # `rms_normalize`'s

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend}"
