"""Shared pieces of the SSD op tests: random inputs, time slices, and the outputs and gradients of one call."""

from __future__ import annotations

import torch

NAMES = ["y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "dh0"]


def make_inputs(b, T, H, P, G, N, *, dtype=torch.float64, seed=0, dt_scale=0.3, n_states=None):
    """Random SSD inputs with moderate decays (state survives a few chunks), all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    inputs = dict(
        x=randn(b, T, H, P),
        dt=rand(b, T, H) * dt_scale,  # >= 0, like softplus(dt) after limiting
        A=-(0.2 + rand(H)),  # negative
        B=randn(b, T, G, N),
        C=randn(b, T, G, N),
        D=randn(H),
        initial_state=randn(n_states or b, H, P, N),
    )
    return {k: v.to(dtype).requires_grad_() for k, v in inputs.items()}


def time_slice(inputs, start, end):
    """The inputs restricted to steps [start, end) (initial_state, A and D unchanged)."""
    return {k: (v[:, start:end] if v.dim() >= 3 and k != "initial_state" else v) for k, v in inputs.items()}


def outputs_and_grads(inputs, y, h):
    """`[y, final_state, grads of x, dt, A, B, C, D, initial_state]` for a fixed random linear loss."""
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
    gh = torch.randn(h.shape, generator=g, dtype=torch.float64).to(h.device, h.dtype)
    names = ["x", "dt", "A", "B", "C", "D", "initial_state"]
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), [inputs[k] for k in names])
    return [y.detach(), h.detach(), *grads]
