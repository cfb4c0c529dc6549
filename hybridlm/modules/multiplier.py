"""muP forward multipliers (Falcon-H1): activations times a fixed scalar."""

from __future__ import annotations

import torch


def scaled(t: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`t * multiplier`, or `t` itself for a multiplier of 1, every multiplier's default: the same values and
    gradients without an elementwise kernel each way per call in eager mode (torch.compile fuses either form)."""
    return t if multiplier == 1.0 else t * multiplier
