"""The carried state of the Falcon fast-weight recurrences.

The matrix state alone is not enough to continue a sequence exactly (paper C.5, C.7):
- the shifted pairing writes (k_{t-1}, v_t), so the next segment's first write needs the last key;
- the sliding rules 3/3A average over the last `window` pairs, so the next segment's first steps need
  the last window - 1 pairs of this one.
`FastWeightState` holds all three, one row per sequence (per batch row, or per packed sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FastWeightState:
    """Everything needed to continue a fast-weight recurrence exactly.

    Attributes:
        S: `[N, H, K, V]` the matrix state (float32, or float64 for float64 inputs).
        last_k: `[N, H, K]` the last key seen (shifted pairing only; None for a fresh sequence, whose first
            step then writes nothing).
        tail_x, tail_v: `[N, H, window - 1, K]` / `[..., V]` the last window - 1 causal pairs (sliding rules
            with window > 1 only), right-aligned: the newest pair is at index -1.
        tail_len: `[N]` int64, how many of the tail slots hold a pair that exists (the last `tail_len` ones).
    """

    S: torch.Tensor
    last_k: torch.Tensor | None = None
    tail_x: torch.Tensor | None = None
    tail_v: torch.Tensor | None = None
    tail_len: torch.Tensor | None = None

    def detach(self) -> FastWeightState:
        """A copy cut from the autograd graph (for truncated backpropagation through time)."""
        return FastWeightState(*(None if t is None else t.detach() for t in self._fields()))

    def to(self, *args, **kwargs) -> FastWeightState:
        """Move every tensor (like `Tensor.to`); `tail_len` keeps its integer dtype."""
        moved = [None if t is None else t.to(*args, **kwargs) for t in self._fields()[:4]]
        tail_len = None if self.tail_len is None else self.tail_len.to(device=moved[0].device)
        return FastWeightState(*moved, tail_len)

    def __getitem__(self, rows: slice) -> FastWeightState:
        """The states of a range of sequences, `state[start:stop]` (views)."""
        return FastWeightState(*(None if t is None else t[rows] for t in self._fields()))

    @staticmethod
    def cat(states: list[FastWeightState]) -> FastWeightState:
        """The states of several calls over consecutive sequences, one row per sequence in order (slicing's inverse)."""
        columns = zip(*(s._fields() for s in states))
        return FastWeightState(*(None if parts[0] is None else torch.cat(parts) for parts in columns))

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        return (self.S, self.last_k, self.tail_x, self.tail_v, self.tail_len)
