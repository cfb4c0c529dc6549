"""Helpers shared by the tests."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| (Frobenius, in float64); ||a|| when b is all zeros."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def free_port() -> int:
    """A free TCP port on the loopback interface, for the rendezvous of spawned gloo process groups."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
