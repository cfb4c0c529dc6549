"""A linear layer fed by an elementwise function, whose output is recomputed in the backward instead of kept.

`linear(fn(*inputs))` keeps fn's output y for the weight's gradient (dW = dout^T y). Where fn is elementwise and keeps
its own inputs for its backward, y is a second copy of what those inputs already hold:

- the gated MLP: y = up * SiLU(gate) before `down_proj` (`silu_gate` keeps up and gate);
- the mixers: y = the gated norm's (or gate's) output before `out_proj` (the norm keeps its input and the gate z).

`recomputed_linear(fn, inputs, linear)` keeps `inputs` and the weight only, and runs fn again in the backward: one
elementwise pass more, no GEMM again. Per token of the 125m shape that drops 5,376 bytes per Transformer block and
3,584 + 1,280 per hybrid block (`benchmarks/saved_activations.py`).

The values and gradients are the plain path's: the forward runs fn and `F.linear` under the caller's autocast; the
backward recomputes fn under the same autocast state and makes the GEMMs `F.linear`'s backward makes, on the same
operands in the same dtypes (bf16 under autocast, the weight's gradient cast back to the weight's dtype).

The gradients are once differentiable (a double backward raises; the plain path allows one where fn does). The plain
path `linear(fn(*inputs))` is taken when nothing needs a gradient, under torch.compile (inductor's
partitioner recomputes cheap elementwise work on its own), for a module that is not exactly `nn.Linear` (a PEFT
adapter, a parallel plan's wrapper) or has hooks or an instance forward (`is_plain`), and for DTensor (tensor
parallelism) or meta (offloaded) weights and inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hybridlm.modules.linear import is_plain


def recomputed_linear(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], linear: nn.Module) -> torch.Tensor:
    """`linear(fn(*inputs))`, fn's output recomputed in the backward rather than kept (module docstring). fn must be
    a deterministic function of `inputs` alone (every tensor it reads that needs a gradient, parameters too, is one
    of `inputs`): [..., in] for `linear` [out, in]; returns [..., out]."""
    if not _takes(inputs, linear):
        return linear(fn(*inputs))
    return _RecomputedLinear.apply(fn, linear.weight, linear.bias, *inputs)


def _takes(inputs: Sequence[torch.Tensor], linear: nn.Module) -> bool:
    if not is_plain(linear, nn.Linear):
        return False
    tensors = [linear.weight, *inputs] + ([linear.bias] if linear.bias is not None else [])
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and any(t.requires_grad for t in tensors)
            and not any(hasattr(t, "to_local") or t.is_meta for t in tensors))


class _RecomputedLinear(torch.autograd.Function):
    """Forward: F.linear(fn(*inputs)), keeping the inputs and the weight. Backward: y = fn(*inputs) again, then
    dy = dout W, dW = dout^T y, db = sum dout, and fn's backward from dy."""

    @staticmethod
    def forward(ctx, fn, weight, bias, *inputs):
        device = weight.device.type
        ctx.fn, ctx.device = fn, device
        ctx.autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.save_for_backward(weight, bias, *inputs)
        out = F.linear(fn(*inputs), weight, bias)  # under the caller's autocast, as the plain path
        ctx.dtype = out.dtype  # the GEMM's operand dtype (autocast leaves float64 as it is)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        weight, bias, *inputs = ctx.saved_tensors
        autocast, autocast_dtype = ctx.autocast
        wants = ctx.needs_input_grad[3:]
        leaves = [x.detach().requires_grad_(w) for x, w in zip(inputs, wants)]
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=autocast_dtype, enabled=autocast):
            y = ctx.fn(*leaves)                                                       # [..., in]
        dtype = ctx.dtype                                                             # F.linear's operands
        g = dout.to(dtype).reshape(-1, dout.shape[-1])                                # [N, out]
        dweight = (g.T @ y.detach().to(dtype).reshape(-1, y.shape[-1])).to(weight.dtype) if ctx.needs_input_grad[1] \
            else None                                                                 # [out, in]
        dbias = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        grads = [None] * len(inputs)
        needed = [i for i, w in enumerate(wants) if w]
        if needed:
            dy = (g @ weight.to(dtype)).reshape(y.shape).to(y.dtype)                  # [..., in]
            for i, grad in zip(needed, torch.autograd.grad(y, [leaves[i] for i in needed], dy, allow_unused=True)):
                grads[i] = grad
        return None, dweight, dbias, *grads
