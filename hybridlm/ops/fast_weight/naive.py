"""The executable specification of the Falcon fast-weight rules: one step at a time.

Paper: "Fast Weight Attention for Continual Learning" (../shared/papers). Per head the state S is [K, V];
at step t the write pair is (x_t, y_t) = (k_{t-1}, v_t) (shifted, eq. 3.1) or (k_t, v_t) (same_step);
the read is o_t = S_t^T q_t (read after write, C.5) or S_{t-1}^T q_t (read before write).

    rule 1 : S = gamma S + eta x (y - S^T x)^T            eta  = beta / (|x|^2 + lam + eps)      (NLMS, eq. 3.4)
    rule 2 : S = S Diag(gamma_j) + x (eta * (y - S^T x))^T eta_j = beta_j / (|x|^2 + lam + eps)
    rule 3 : S = gamma S + eta/B_t sum_j x_j (y_j - S^T x_j)^T   eta = beta / (mu_t + lam + eps),
             mu_t = lambda_max(X_t^T X_t) / B_t  (Alg. 2, eq. 4.15)
    rule 1A: S = gamma S + eta x y^T                       eta  = beta / (|x|^2 + lam + eps)
    rule 2A: S = S Diag(gamma_j) + x (eta * y)^T           eta_j = beta_j / (|x|^2 + lam + eps)
    rule 3A: S = gamma S + eta/B_t sum_j x_j y_j^T         eta  = beta / (Ebar_t + lam + eps), Ebar_t = sum_j |x_j|^2 / B_t

S on the right is S_{t-1}; the sums run over the last `window` pairs that exist (I_t, B_t = |I_t|).
Ridge as decay (C.6): alpha = min(eta * lam, 1 - eps_gamma), gamma = 1 - alpha.
Boundary (C.5): with the shifted pairing the first step of a fresh sequence has no pair (x_1 = 0, eta_1 = 0):
S_1 = S_0, no write and no decay.
Scale-coupled ridge (4.1, C.1): with ridge_scaling the actual ridge is lam * E_t (E_t = |x_t|^2, mu_t or Ebar_t,
detached), used in both the step size and the decay.

This file favours clarity over speed: a Python loop over sequences and steps, vectorized over heads only.
It runs in any dtype the caller gives it (the front door casts to float32 or float64).
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState


def fast_weight_naive(
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
    """Run the recurrence. Inputs are validated and cast by the front door (`fast_weight_attention`).

    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (rules 2/2A: [B, T, H, V]); lam [B, T, H];
    initial_state has one row per sequence; offsets are the packed sequence starts (B == 1) or None.
    Returns o [B, T, H, V] and the final state (one row per sequence).
    """
    if offsets is None:
        spans = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        spans = [(0, int(offsets[i]), int(offsets[i + 1])) for i in range(len(offsets) - 1)]
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(spans):
        o, final = _run_sequence(
            q[b, start:end], k[b, start:end], v[b, start:end], beta[b, start:end], lam[b, start:end], options,
            state=_row(initial_state, n),
        )
        outputs.append(o)
        finals.append(final)
    if offsets is None:
        o = torch.stack(outputs)
    else:
        o = torch.cat(outputs).unsqueeze(0)
    return o, _stack_rows(finals, window=options.window, head_dims=(k.shape[2], k.shape[3], v.shape[3]))


def _run_sequence(q, k, v, beta, lam, options: FastWeightOptions, *, state):
    """One sequence: q, k [T, H, K], v [T, H, V], beta [T, H] or [T, H, V], lam [T, H]."""
    window = options.window
    S = state["S"]                                              # [H, K, V]
    prev_k = state["last_k"]                                    # [H, K] or None (fresh sequence)
    pairs = list(state["tail"])                                 # the last window - 1 pairs (x [H, K], y [H, V])
    outputs = []
    for t in range(q.shape[0]):
        # The write pair (x_t, y_t): shifted (k_{t-1}, v_t) or same-step (k_t, v_t).
        if options.shifted:
            x, prev_k = prev_k, k[t]
        else:
            x = k[t]
        y = v[t]
        S_prev = S
        if x is not None:  # x is None only at the first step of a fresh shifted sequence: S_1 = S_0
            pairs = (pairs + [(x, y)])[-window:]
            S = _write(S, x, y, pairs, beta[t], lam[t], options)
        read_state = S if options.read_after else S_prev
        outputs.append(torch.einsum("hkv,hk->hv", read_state, q[t]))  # o_t = S^T q_t   [H, V]
    tail = pairs[-(window - 1):] if window > 1 else []
    return torch.stack(outputs), {"S": S, "last_k": prev_k if options.shifted else None, "tail": tail}


def _write(S, x, y, pairs, beta, lam, options: FastWeightOptions):
    """One step of the rule table. S [H, K, V] is S_{t-1}; x [H, K], y [H, V]; pairs hold I_t (newest last)."""
    rule, eps = options.rule, options.eps
    X = torch.stack([p[0] for p in pairs], dim=1)               # [H, B_t, K]
    Y = torch.stack([p[1] for p in pairs], dim=1)               # [H, B_t, V]
    B_t = X.shape[1]
    # The rule's smoothness statistic E_t (the NLMS normalizer).
    if rule == "3":
        gram = X @ X.transpose(1, 2)                            # [H, B_t, B_t]: same top eigenvalue as X^T X
        E = torch.linalg.eigvalsh(gram)[:, -1] / B_t            # mu_t  [H]
    elif rule == "3A":
        E = (X * X).sum(dim=(1, 2)) / B_t                       # Ebar_t  [H]
    else:
        E = (x * x).sum(-1)                                     # |x_t|^2  [H]
    ridge = lam * E.detach() if options.ridge_scaling else lam  # the actual ridge  [H]
    per_column = options.per_column
    denom = E + ridge + eps
    if options.step_size == "nlms":
        eta = beta / (denom[:, None] if per_column else denom)  # [H] or [H, V]
    else:
        eta = beta
    alpha = torch.clamp(eta * (ridge[:, None] if per_column else ridge), max=1.0 - options.eps_gamma)
    gamma = 1.0 - alpha                                         # carry  [H] or [H, V]
    if rule == "1":
        residual = y - torch.einsum("hkv,hk->hv", S, x)         # y - S^T x  [H, V]
        return gamma[:, None, None] * S + eta[:, None, None] * torch.einsum("hk,hv->hkv", x, residual)
    if rule == "2":
        residual = y - torch.einsum("hkv,hk->hv", S, x)
        return S * gamma[:, None, :] + torch.einsum("hk,hv->hkv", x, eta * residual)
    if rule == "3":
        residual = Y - torch.einsum("hkv,hbk->hbv", S, X)       # y_j - S^T x_j  [H, B_t, V]
        update = torch.einsum("hbk,hbv->hkv", X, residual) / B_t
        return gamma[:, None, None] * S + eta[:, None, None] * update
    if rule == "1A":
        return gamma[:, None, None] * S + eta[:, None, None] * torch.einsum("hk,hv->hkv", x, y)
    if rule == "2A":
        return S * gamma[:, None, :] + torch.einsum("hk,hv->hkv", x, eta * y)
    # rule 3A
    update = torch.einsum("hbk,hbv->hkv", X, Y) / B_t
    return gamma[:, None, None] * S + eta[:, None, None] * update


def _row(state: FastWeightState, n: int) -> dict:
    """Row n of a batched state as plain per-sequence pieces."""
    tail = []
    if state.tail_x is not None:
        count = int(state.tail_len[n])
        slots = state.tail_x.shape[2]
        tail = [(state.tail_x[n, :, i], state.tail_v[n, :, i]) for i in range(slots - count, slots)]
    return {"S": state.S[n], "last_k": None if state.last_k is None else state.last_k[n], "tail": tail}


def _stack_rows(rows: list[dict], *, window: int, head_dims: tuple[int, int, int]) -> FastWeightState:
    """Per-sequence final pieces -> one batched state; the tail is right-aligned in window - 1 slots."""
    S = torch.stack([r["S"] for r in rows])
    last_k = torch.stack([r["last_k"] for r in rows]) if rows[0]["last_k"] is not None else None
    if window == 1:
        return FastWeightState(S=S, last_k=last_k)
    H, K, V = head_dims
    tail_x = S.new_zeros(len(rows), H, window - 1, K)
    tail_v = S.new_zeros(len(rows), H, window - 1, V)
    tail_len = torch.tensor([len(r["tail"]) for r in rows], dtype=torch.int64, device=S.device)
    for n, r in enumerate(rows):
        for i, (x, y) in enumerate(r["tail"]):
            slot = window - 1 - len(r["tail"]) + i
            tail_x[n, :, slot] = x
            tail_v[n, :, slot] = y
    return FastWeightState(S=S, last_k=last_k, tail_x=tail_x, tail_v=tail_v, tail_len=tail_len)
