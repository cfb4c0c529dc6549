"""The LM head and its cross entropy in one pass over row chunks: the [N, V] logits are never held whole.

Spelled out, `F.cross_entropy(scaled(h @ W^T, m).float(), y)` keeps the logits for the backward: under bf16 autocast
their bf16 copy and the float32 one the loss reads, 6 bytes per token per vocabulary entry (a 32K vocabulary: 196 KB
per token, more than a whole hybrid block of the 125m shape keeps), and the backward makes a float32 gradient of the
same size. `linear_cross_entropy` takes rows of h in chunks of about `CHUNK_ELEMENTS / V` and for each computes the
logits, the loss and, when a gradient is wanted, the gradients of h's rows and of W right away (the loss is a sum, so
d loss / d logits = m (softmax - onehot) needs nothing from later chunks); the backward scales those by the
incoming gradient. It keeps dh [N, D] (in the product's dtype, bf16 under autocast, as the LM head's backward makes
it) and dW [V, D] (float32) instead of the logits.

Per chunk c of rows (h_c [n, D]; W [V, D]; m the multiplier; y_c [n] with -100 skipped):

    z = m * (h_c W^T)            in the autocast dtype where autocast is on (as the LM head)
    logp = log_softmax(z)        float32
    loss_c = -sum_valid logp[y]
    g = softmax(z) - onehot(y) = exp(logp), and expm1(logp[y]) at the targets: float32, then the autocast dtype
    dh_c = valid * (m * g W)     dW += m * g^T (valid * h_c)  (float32 sum over chunks)

Each chunk makes two elementwise passes over its [n, V] block beside the three products: log_softmax (reading the
product's dtype, writing float32) and exp (writing the product's dtype); the spelled-out form makes about five
(the float32 cast, log_softmax, and in the backward the gradient of the logits and its cast).

The values equal the spelled-out form's: the same roundings of the logits (bf16 product, the multiplier in bf16,
float32 after), float32 softmax; the gradients differ by the order of the float32 sums (dW: here one float32 sum over
chunks of bf16-operand products, there one bf16 product over all rows). float64 inputs run in float64.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from hybridlm.modules.multiplier import scaled

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # logits per chunk: 128 MiB in float32 (1,024 rows of a 32K vocabulary)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """sum over rows with targets != -100 of cross_entropy(multiplier * hidden @ weight^T, targets), a 0-dim float32
    tensor (float64 for float64 inputs). hidden [N, D], weight [V, D], targets [N] (int). `chunk_rows`: rows per
    chunk (default: CHUNK_ELEMENTS // V, at least 1). Under autocast the products run in its dtype, as `F.linear`
    would."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden [N, D] and weight [V, D] with one D, got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: targets must be integer [N] = [{hidden.shape[0]}], got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    device_type = hidden.device.type
    compute = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
               and hidden.dtype != torch.float64 else torch.promote_types(hidden.dtype, weight.dtype))
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, float(multiplier), int(chunk_rows), compute,
                                         wants_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients computed together in the forward, chunk by chunk; the backward scales the gradients (once
    differentiable: the gradients it returns have no graph)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, multiplier, chunk_rows, compute, wants_grad):
        accumulate = torch.float64 if compute == torch.float64 else torch.float32
        w = weight.to(compute)                                                            # [V, D]
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        scored = torch.zeros((), dtype=torch.int64, device=hidden.device)  # targets counted (a tensor: no sync)
        dh = torch.empty(hidden.shape, dtype=compute, device=hidden.device) if wants_grad else None  # [N, D]
        dw = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if wants_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h = hidden[rows].to(compute)                                                  # [n, D]
            logp = torch.log_softmax(scaled(h @ w.T, multiplier), dim=1, dtype=accumulate)  # [n, V]
            y = targets[rows]
            valid = y != IGNORE_INDEX
            picked = y.masked_fill(~valid, 0).unsqueeze(1)                                # [n, 1]
            target_logp = logp.gather(1, picked)                                          # [n, 1]
            total = total - torch.where(valid, target_logp.squeeze(1), 0).sum()
            scored = scored + valid.sum()
            if wants_grad:
                # softmax rounded once to the product dtype; at the targets softmax - 1, also rounded once
                g = torch.exp(logp, out=torch.empty(logp.shape, dtype=compute, device=logp.device))
                g.scatter_(1, picked, torch.expm1(target_logp).to(compute))
                g = scaled(g, multiplier)                                                 # [n, V]
                # rows without a target count zero: masked in the [n, D] operands and results, not in g
                skipped = ~valid.unsqueeze(1)
                dh[rows] = (g @ w).masked_fill_(skipped, 0)
                dw.add_(g.T @ h.masked_fill(skipped, 0))
        if wants_grad:
            ctx.save_for_backward(dh, dw, scored)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dh, dw, scored = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # With nothing scored the gradients are zero whatever comes in: a mean over no targets divides by 0, and its
        # infinite gradient would turn the zeros into NaN (the spelled-out backward writes zeros there).
        grad = torch.where(scored > 0, grad.to(dw.dtype), 0)
        return ((dh.to(dw.dtype) * grad).to(hidden_dtype) if ctx.needs_input_grad[0] else None,
                (dw * grad).to(weight_dtype) if ctx.needs_input_grad[1] else None,
                None, None, None, None, None)
