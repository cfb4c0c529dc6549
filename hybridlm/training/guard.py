"""Skip optimizer steps whose loss or gradient norm is non-finite (optionally: a loss spike); stop on a streak.

Use after backward (and after unscaling, with a grad scaler), before the optimizer step:

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the norm before clipping
    if guard.check(loss, grad_norm, optimizer=optimizer, step=step):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

`check` returns False for a bad update: the loss or the norm is NaN/inf, or (with `spike_factor`) the
loss exceeds `spike_factor` times the median of the last `spike_window` accepted losses once that many
were seen. It then zeroes the gradients itself (set_to_none=True: torch optimizers skip parameters
without a gradient, so even a stray `optimizer.step()` leaves the weights and AdamW moments untouched),
logs a warning, and counts the streak; `max_consecutive_skips` bad updates in a row raise `TrainingDivergedError`. An
accepted update resets the streak. With data parallelism pass the all-reduced loss so every rank decides
alike (the gradient norm after DDP's all-reduce already agrees).

The guard's counters and loss window are part of the training state: save `state_dict()` in the
checkpoint's train_state and `load_state_dict` it on resume.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

import torch

logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """Too many consecutive optimizer steps were skipped; the message says what to try."""


def _as_float(value: float | torch.Tensor | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


class StepGuard:
    """Decide, per update, whether the optimizer may step; see the module docstring."""

    def __init__(
        self,
        max_consecutive_skips: int = 5,
        *,
        spike_factor: float | None = None,
        spike_window: int = 100,
    ) -> None:
        if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}")
        if spike_factor is not None and not (math.isfinite(spike_factor) and spike_factor > 1.0):
            raise ValueError(f"spike_factor must be None or a finite number > 1, got {spike_factor!r}")
        if not isinstance(spike_window, int) or spike_window < 1:
            raise ValueError(f"spike_window must be an int >= 1, got {spike_window!r}")
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.consecutive_skips = 0
        self.total_skips = 0
        self.recent_losses: deque[float] = deque(maxlen=spike_window)

    def reason_to_skip(self, loss: float | None, grad_norm: float | None) -> str | None:
        """Why this update must be skipped, or None if it may go ahead (pure: changes no counter)."""
        if loss is not None and not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        if (
            self.spike_factor is not None
            and loss is not None
            and len(self.recent_losses) == self.spike_window
        ):
            median = statistics.median(self.recent_losses)
            if loss > self.spike_factor * median:
                return f"loss spike {loss:.4g} > {self.spike_factor:g} x median {median:.4g} of the last {self.spike_window}"
        return None

    def check(
        self,
        loss: float | torch.Tensor | None,
        grad_norm: float | torch.Tensor | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
    ) -> bool:
        """True: step the optimizer. False: skipped (gradients zeroed if `optimizer` is given).

        Raises TrainingDivergedError on the `max_consecutive_skips`-th skip in a row.
        """
        loss_value, norm_value = _as_float(loss), _as_float(grad_norm)
        reason = self.reason_to_skip(loss_value, norm_value)
        if reason is None:
            self.consecutive_skips = 0
            if loss_value is not None:
                self.recent_losses.append(loss_value)
            return True
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips += 1
        self.total_skips += 1
        where = f"step {step}" if step is not None else "this step"
        logger.warning(
            "skipping the optimizer update at %s: %s (%d in a row, %d in total)",
            where, reason, self.consecutive_skips, self.total_skips,
        )
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise TrainingDivergedError(
                f"{self.consecutive_skips} consecutive optimizer updates skipped (last at {where}: {reason}); "
                "training has diverged. Resume from an earlier checkpoint with a lower learning rate (or a "
                "smaller dt multiplier for SSM spikes), and check the data batches at these steps"
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        """JSON-able counters and loss window (for the checkpoint's train_state)."""
        return {
            "consecutive_skips": self.consecutive_skips,
            "total_skips": self.total_skips,
            "recent_losses": list(self.recent_losses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        self.recent_losses = deque((float(v) for v in state["recent_losses"]), maxlen=self.spike_window)
