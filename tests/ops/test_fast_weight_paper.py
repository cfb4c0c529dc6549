"""naive.py against the paper's equations, written out again here as a plain loop over one head.

Every other backend is tested against naive.py, so this is the test that pins the spec itself: the write pair,
the window's statistic (|x_t|^2, Ebar_t, mu_t), the NLMS step, ridge as decay, the 1/B_t average, read
before / after and ridge scaling. A change to any of them in naive.py alone, or in every backend alike, fails it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import SLIDING, make_inputs


def paper_loop(q, k, v, beta, lam, *, rule, window, pairing, read, step_size, ridge_scaling, eps=1e-6, eps_gamma=1e-6):
    """One head of one fresh sequence: q, k [T, K], v [T, V], beta [T] (or [T, V] for 2 / 2A), lam [T]."""
    T, K = k.shape
    S = torch.zeros(K, v.shape[1], dtype=k.dtype)
    pairs = {}  # step -> (x, y): the write pair revealed at that step
    out = []
    for t in range(T):
        if pairing == "same_step":
            pairs[t] = (k[t], v[t])
        elif t > 0:  # shifted: (k_{t-1}, v_t); a fresh sequence has no pair at its first step
            pairs[t] = (k[t - 1], v[t])
        before = S
        if t in pairs:
            window_steps = [j for j in range(t - window + 1, t + 1) if j in pairs]  # the last B_t pairs
            X = torch.stack([pairs[j][0] for j in window_steps])                    # [B_t, K]
            Y = torch.stack([pairs[j][1] for j in window_steps])                    # [B_t, V]
            count = len(window_steps)
            x, y = pairs[t]
            if rule == "3":  # mu_t: the top eigenvalue of the window's average outer product
                E = torch.linalg.eigvalsh(X.T @ X / count)[-1]
            elif rule == "3A":  # Ebar_t: the window's mean energy
                E = (X * X).sum() / count
            else:
                E = x @ x
            ridge = lam[t] * E.detach() if ridge_scaling else lam[t]
            eta = beta[t] / (E + ridge + eps) if step_size == "nlms" else beta[t]
            gamma = 1 - torch.clamp(eta * ridge, max=1 - eps_gamma)  # ridge as decay
            if rule == "1":
                S = gamma * before + eta * torch.outer(x, y - before.T @ x)
            elif rule == "1A":
                S = gamma * before + eta * torch.outer(x, y)
            elif rule == "2":  # eta and gamma per value column
                S = before * gamma + torch.outer(x, eta * (y - before.T @ x))
            elif rule == "2A":
                S = before * gamma + torch.outer(x, eta * y)
            elif rule == "3":
                S = gamma * before + eta / count * sum(torch.outer(a, b - before.T @ a) for a, b in zip(X, Y))
            else:  # 3A
                S = gamma * before + eta / count * sum(torch.outer(a, b) for a, b in zip(X, Y))
        out.append((S if read == "after" else before).T @ q[t])
    return torch.stack(out), S


CASES = [(rule, window) for rule in ("1", "2", "1A", "2A") for window in (1,)]
CASES += [(rule, window) for rule in SLIDING for window in (1, 3)]


@pytest.mark.parametrize("rule, window", CASES)
@pytest.mark.parametrize("pairing, read, step_size, ridge_scaling", list(itertools.product(
    ("shifted", "same_step"), ("after", "before"), ("nlms", "direct"), (False, True))))
def test_naive_is_the_papers_loop(rule, window, pairing, read, step_size, ridge_scaling):
    q, k, v, beta, lam = make_inputs(rule, B=2, T=9, H=2, K=3, V=2, seed=11, lam_scale=2.0)
    if step_size == "direct":
        beta = 0.2 * beta  # step sizes, not gains
    options = dict(rule=rule, window=window, pairing=pairing, read=read, step_size=step_size,
                   ridge_scaling=ridge_scaling)
    o, state = fast_weight_attention(q, k, v, beta, lam, backend="naive", output_final_state=True, **options)
    for n, h in itertools.product(range(2), range(2)):  # beta [B, T, H] or, for rules 2 / 2A, [B, T, H, V]
        expected_o, expected_S = paper_loop(q[n, :, h], k[n, :, h], v[n, :, h], beta[n, :, h], lam[n, :, h],
                                            **options)
        assert rel_err(o[n, :, h], expected_o) < 1e-12
        assert rel_err(state.S[n, h], expected_S) < 1e-12
