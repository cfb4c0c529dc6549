"""Helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| (Frobenius, in float64); ||a|| when b is all zeros."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def assert_near_reference(pairs: dict, tol: float) -> None:
    """Each named (ours, reference) pair within `tol` in relative error (`rel_err`, ours moved to the CPU), and its
    largest single error within 10 tol of the reference's largest element: one wrong element hides in a norm over
    many."""
    errors = {name: rel_err(ours.cpu(), ref) for name, (ours, ref) in pairs.items()}
    assert max(errors.values()) < tol, {k: f"{v:.2e}" for k, v in errors.items()}
    worst = {name: ((ours.cpu().double() - ref).abs().max() / ref.abs().max()).item()
             for name, (ours, ref) in pairs.items()}
    assert max(worst.values()) < 10 * tol, {k: f"{v:.2e}" for k, v in worst.items()}


def free_port() -> int:
    """A free TCP port on the loopback interface, for the rendezvous of spawned gloo process groups."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def type_lines(monkeypatch, lines) -> Iterator[str]:
    """`input()` returns `lines` one per call, then raises EOFError (Ctrl-D); returns the iterator, so a test can see
    which lines were never read."""
    remaining = iter(lines)

    def typed(prompt: str = "") -> str:
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    return remaining


def chat_args(*flags: str):
    """`hybridlm chat`'s parsed arguments for `--model M` and `flags` (the parser's defaults otherwise)."""
    from hybridlm.cli import build_parser

    return build_parser().parse_args(["chat", "--model", "M", *flags])
