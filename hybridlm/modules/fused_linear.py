"""Several linear maps of one input as one GEMM, their weights stored once (`hybridlm.models.fuse`).

    fused = FusedLinear({"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj})
    parts = fused(hidden, {"q": attn.q_proj, ...})   # {"q": [..., out_q], ...} views of one [..., sum(out)] result,
                                                     # or None where the given projections are no longer the parts

The parts' weights (and biases) become views of the concatenated ones, so no weight is held twice and anything that
updates a part in place (loading a state dict, an optimizer) updates the fused weight too. A part whose storage left
the fused weight (`.to()` of the model moves each tensor apart), or that was replaced or wrapped (an adapter, a
hook, a subclass) is noticed at the call, which then returns None: the caller runs the projections apart.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.modules.linear import AlignedLinear, padded_linear, pads, is_plain

FUSABLE = (nn.Linear, AlignedLinear)


class FusedLinear(nn.Module):
    """The projections `parts` (name -> `nn.Linear` or `AlignedLinear`, all of one input width, dtype and device) as
    one weight [sum(out), in] and bias (zeros for the parts without one; None when none has one). The fused tensors
    are buffers left out of the state dict: the checkpoint keeps each projection under its own name."""

    def __init__(self, parts: dict[str, nn.Linear]) -> None:
        super().__init__()
        linears = list(parts.values())
        first = linears[0].weight
        for name, linear in parts.items():
            if type(linear) not in FUSABLE or not is_plain(linear, type(linear)):
                raise ValueError(f"FusedLinear: {name} is a {type(linear).__name__} (wrapped or replaced): only plain "
                                 "nn.Linear projections fuse (merge adapters first, or fuse before adding them)")
            if (linear.in_features != linears[0].in_features or linear.weight.dtype != first.dtype
                    or linear.weight.device != first.device or hasattr(linear.weight, "to_local")):
                raise ValueError("FusedLinear: the parts must share their input width, dtype and device, with plain "
                                 f"(not sharded) weights; {name} differs")
        with torch.no_grad():
            weight = torch.cat([linear.weight for linear in linears])  # [sum(out), in]
            bias = None
            if any(linear.bias is not None for linear in linears):
                bias = torch.cat([linear.bias if linear.bias is not None else first.new_zeros(linear.out_features)
                                  for linear in linears])
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.names = list(parts)
        self.widths = [linear.out_features for linear in linears]
        self.paths = [tuple(name.split(".")) for name in self.names]  # attribute paths, for the owner's lookups
        self._names = tuple(self.names)
        self._starts = [sum(self.widths[:i]) for i in range(len(self.widths))]  # each part's first row
        start = 0
        for linear, width in zip(linears, self.widths):
            linear.weight.data = weight[start : start + width]
            if linear.bias is not None:
                linear.bias.data = bias[start : start + width]
            start += width

    def reads(self, parts: dict[str, nn.Module]) -> bool:
        """Whether `parts` (the projections as their owners hold them now) are still this fusion's: the same names,
        plain linears whose weights and biases lie where the fused tensors keep them. Run at every call of an eager
        step, so it compares addresses (a part moved or cast by `.to()` has storage of its own) rather than building
        views to compare. Under torch.compile, which traces no address, the modules only: the compiled graph guards
        on the fused tensors (a `.to()` gives them new storage and the graph recompiles), and they hold the parts'
        values as they were when fused or moved."""
        if tuple(parts) != self._names:
            return False
        if torch.compiler.is_compiling():
            return all(type(linear) in FUSABLE and is_plain(linear, type(linear)) for linear in parts.values())
        weight, bias = self.weight, self.bias
        w_ptr, w_row = weight.data_ptr(), weight.stride(0) * weight.element_size()
        b_ptr, b_row = (0, 0) if bias is None else (bias.data_ptr(), bias.element_size())
        for linear, start in zip(parts.values(), self._starts):
            if type(linear) not in FUSABLE or not is_plain(linear, type(linear)):
                return False
            params = linear._parameters  # the dict itself: Module.__getattr__ costs more than the rest of the check
            part = params["weight"]
            if part is None or part.dtype is not weight.dtype or part.data_ptr() != w_ptr + start * w_row:
                return False
            part = params.get("bias")
            if part is not None and (bias is None or part.dtype is not bias.dtype
                                     or part.data_ptr() != b_ptr + start * b_row):
                return False
        return True

    def forward(self, x: torch.Tensor, parts: dict[str, nn.Module]) -> dict[str, torch.Tensor] | None:
        """x [..., in] -> {name: [..., out of that part]} (views of one GEMM's output), or None where `parts` are no
        longer this fusion's (`reads`)."""
        if not self.reads(parts):
            warnings.warn("fused projections no longer hold the model's weights (moved or cast after fusing, or "
                          "replaced): they run apart; fuse again after .to() to fuse them", stacklevel=2)
            return None
        if pads(self.weight.shape[0], self.weight.shape[1], self.weight, x):  # `AlignedLinear`'s reason, many rows
            out = padded_linear(x, self.weight, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return dict(zip(self.names, out.split_with_sizes(self.widths, dim=-1)))
