"""Backend "recurrent": naive.py's step loop, vectorized over the batch rows (the decoding path).

The spec (naive.py) loops over sequences and steps with one Python iteration per row; that is clear, and it
is what a batch of decoding rows should not pay: `"auto"` takes this backend for T == 1 without packed
sequences. Each step runs the rule table of naive.py once for all rows [N, H, ...]. The sliding window is a
fixed [N, H, window, ...] buffer (the carried tail's window - 1 slots, then the new pair) with a validity
mask from `tail_len`, so rows whose windows hold different numbers of pairs (B_t) step together: invalid
slots are zero, add nothing to the sums, and B_t divides per row. Packed sequences (`cu_seqlens`) are not
handled here (the front door sends them to naive.py).
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState


def fast_weight_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    options: FastWeightOptions,
    *,
    initial_state: FastWeightState,
    offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, FastWeightState]:
    """Same contract as `fast_weight_naive` (inputs validated and cast by the front door), without offsets."""
    if offsets is not None:
        raise ValueError("the recurrent backend does not take packed sequences (cu_seqlens or seq_idx); use 'naive' "
                         "or 'chunk'")
    N, T, H, K = q.shape
    V = v.shape[-1]
    window = options.window
    S = initial_state.S                                             # [N, H, K, V]
    last_k = initial_state.last_k if options.shifted else None      # [N, H, K] or None (fresh rows)
    slots = window - 1
    if window > 1:  # (window 1 allocates nothing per call: a decoding step's kernel launches)
        if initial_state.tail_x is not None:
            tail_x, tail_v, tail_len = initial_state.tail_x, initial_state.tail_v, initial_state.tail_len
        else:
            tail_x, tail_v = S.new_zeros(N, H, slots, K), S.new_zeros(N, H, slots, V)
            tail_len = torch.zeros(N, dtype=torch.int64, device=S.device)
        positions = torch.arange(window, device=S.device)           # [W]: slot index, the new pair last
    outputs = []
    for t in range(T):
        # The write pair (x_t, y_t): shifted (k_{t-1}, v_t) or same-step (k_t, v_t).
        if options.shifted:
            x, last_k = last_k, k[:, t]
        else:
            x = k[:, t]
        y = v[:, t]                                                 # [N, H, V]
        S_prev = S
        if x is not None and window == 1:  # one pair, no tail: views, no window arithmetic (a decoding step's ops)
            S = _write(S, x, y, x[:, :, None], y[:, :, None], None, beta[:, t], lam[:, t], options)
        elif x is not None:  # None only at the first step of fresh shifted rows: S_1 = S_0, no write
            count = (tail_len + 1).clamp(max=window)                # B_t  [N]
            valid = (positions >= window - count[:, None]).to(S.dtype)[:, None, :, None]  # [N, 1, W, 1]
            X = torch.cat([tail_x, x[:, :, None]], dim=2) * valid   # I_t's keys  [N, H, W, K]
            Y = torch.cat([tail_v, y[:, :, None]], dim=2) * valid   # I_t's values  [N, H, W, V]
            S = _write(S, x, y, X, Y, count, beta[:, t], lam[:, t], options)
            tail_x, tail_v = X[:, :, 1:], Y[:, :, 1:]
            tail_len = count.clamp(max=slots)
        read_state = S if options.read_after else S_prev
        outputs.append(torch.einsum("nhkv,nhk->nhv", read_state, q[:, t]))  # o_t = S^T q_t  [N, H, V]
    final = FastWeightState(S=S, last_k=last_k)
    if window > 1:
        final = FastWeightState(S=S, last_k=last_k, tail_x=tail_x, tail_v=tail_v, tail_len=tail_len)
    return torch.stack(outputs, dim=1), final


def _write(S, x, y, X, Y, count, beta, lam, options: FastWeightOptions):
    """naive._write for all rows: S [N, H, K, V] is S_{t-1}; x [N, H, K], y [N, H, V]; X, Y the window
    [N, H, W, ...] with invalid slots zeroed; count = B_t [N] (None: window 1, B_t = 1); beta [N, H] (rules 2/2A:
    [N, H, V]); lam [N, H]."""
    rule, eps = options.rule, options.eps
    if rule == "3":
        gram = X @ X.transpose(-1, -2)                              # [N, H, W, W]: zero rows add zero eigenvalues
        E = _per_pair(torch.linalg.eigvalsh(gram)[..., -1], count)  # mu_t  [N, H]
    elif rule == "3A":
        E = _per_pair((X * X).sum(dim=(-2, -1)), count)             # Ebar_t  [N, H]
    else:
        E = (x * x).sum(-1)                                         # |x_t|^2  [N, H]
    ridge = lam * E.detach() if options.ridge_scaling else lam      # [N, H]
    per_column = options.per_column
    denom = E + ridge + eps
    if options.step_size == "nlms":
        eta = beta / (denom[..., None] if per_column else denom)    # [N, H] or [N, H, V]
    else:
        eta = beta
    alpha = torch.clamp(eta * (ridge[..., None] if per_column else ridge), max=1.0 - options.eps_gamma)
    gamma = 1.0 - alpha
    if rule == "1":
        residual = y - torch.einsum("nhkv,nhk->nhv", S, x)         # y - S^T x  [N, H, V]
        return gamma[..., None, None] * S + eta[..., None, None] * torch.einsum("nhk,nhv->nhkv", x, residual)
    if rule == "2":
        residual = y - torch.einsum("nhkv,nhk->nhv", S, x)
        return S * gamma[:, :, None, :] + torch.einsum("nhk,nhv->nhkv", x, eta * residual)
    if rule == "3":
        residual = Y - torch.einsum("nhkv,nhwk->nhwv", S, X)       # y_j - S^T x_j  [N, H, W, V]
        update = _per_pair(torch.einsum("nhwk,nhwv->nhkv", X, residual), count)
        return gamma[..., None, None] * S + eta[..., None, None] * update
    if rule == "1A":
        return gamma[..., None, None] * S + eta[..., None, None] * torch.einsum("nhk,nhv->nhkv", x, y)
    if rule == "2A":
        return S * gamma[:, :, None, :] + torch.einsum("nhk,nhv->nhkv", x, eta * y)
    update = _per_pair(torch.einsum("nhwk,nhwv->nhkv", X, Y), count)  # rule 3A
    return gamma[..., None, None] * S + eta[..., None, None] * update


def _per_pair(total: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """total [N, ...] / B_t per row (count [N]; None: B_t = 1, nothing to divide)."""
    if count is None:
        return total
    return total / count.to(total.dtype).view(-1, *([1] * (total.dim() - 1)))
