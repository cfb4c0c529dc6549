"""The engine's decoding step as replayed CUDA graphs: one launch per step instead of one per operator.

    steps = SlotStepGraphs(model, slots)          # over the engine's slot cache
    logits = steps.step(tokens)                   # tokens: one per running row -> logits [n, V] (a view: copy to keep)

A step of a small model at small batch is hundreds of short kernels whose launches, not their math, set its time
(`hybridlm.models.graphed` captures single-request decoding the same way). A graph replays fixed shapes on fixed
addresses, while the running batch changes every step, so each step runs at a fixed shape that holds it:
- rows: the smallest bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to `max_num_seqs`) at least the running rows;
  the rows past them are padding (position 0, token 0), their outputs ignored;
- key span: the slots attention reads, the smallest power of two from `min_span` (at most the slots' capacity) above
  the longest row's length, so a step reads keys in proportion to the rows' lengths, not to `max_model_len`.
  Sliding-window layers read their ring of W slots whatever the span.
One graph per (rows, span) pair, captured the first time the pair is needed (or all of them at once:
`capture_all`), all in one memory pool. The token buffer and the slot cache's storage (keys, values, SSM states,
positions) are the graphs' inputs; their storage is allocated once, when the first sequence is installed, and the
graphs are dropped should it ever be allocated again.

`compile_step="inductor"` runs the step through torch.compile before each capture, so a graph replays inductor's
fused kernels (norms, gates, casts, residuals: a step is mostly such small elementwise work) instead of one kernel per
operator. It compiles with dynamic shapes, so a compilation serves every row count and span rather than one shape
(the row buckets start at 2 then, since dynamo would compile a size of 1 on its own): a CPU trace compiles once, a
CUDA one twice. A capture runs after a warm-up step of its shape (which compiles if anything must be) under dynamo's
`error_on_recompile`, so a guard miss fails the capture instead of compiling inside it. Dynamo keeps its compilations per Python function, not per
engine: an engine over another model's configuration compiles again, and past dynamo's recompile limit it runs the
step uncompiled (with dynamo's warning).

On the CPU (`use_graph=False`) the same fixed-shape step runs eagerly: the tests check it against the engine's
variable-shape step, so what the graphs replay is the checked computation (compiled too, with `compile_step`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridlm.models.graphed import capture_step
from hybridlm.serving.slots import SlotCache

log = logging.getLogger("hybridlm.serving")


def row_buckets(max_rows: int, *, smallest: int = 1) -> list[int]:
    """The step sizes graphs are captured for: powers of two from `smallest` up to 16, then steps of a quarter of the
    next power (24, 32, 48, 64, 96, ...; padding stays under a third of a step), ending at `max_rows`."""
    out, size = [], min(smallest, max_rows)
    while size < max_rows:
        out.append(size)
        size = size * 2 if size < 16 else size + (1 << (size.bit_length() - 1)) // 2
    return [*out, max_rows]


def span_buckets(capacity: int, min_span: int) -> list[int]:
    """Key spans: powers of two from `min_span` below `capacity`, then `capacity`."""
    out, span = [], min_span
    while span < capacity:
        out.append(span)
        span *= 2
    return [*out, capacity]


@dataclass
class _Graph:
    tokens: torch.Tensor  # [rows, 1] the step's input buffer
    logits: torch.Tensor  # [rows, V] its output
    graph: torch.cuda.CUDAGraph | None  # None: the step runs eagerly (CPU)


class SlotStepGraphs:
    """Fixed-shape decoding steps of `slots`'s running rows, replayed as CUDA graphs (the module docstring)."""

    def __init__(self, model, slots: SlotCache, *, use_graph: bool | None = None, min_span: int = 256,
                 compile_step: str | Callable | None = None) -> None:
        self.model, self.slots = model, slots
        self.device = next(model.parameters()).device
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device (use_graph=False runs the fixed-shape step)")
        # A compiled step starts at 2 rows: dynamo compiles a size of 1 on its own, and a padding row costs less than
        # a second compilation.
        self.rows = row_buckets(slots.max_rows, smallest=1 if compile_step is None else 2)
        self.spans = span_buckets(slots.capacity, min(min_span, slots.capacity))
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._version = slots.storage_version
        self._pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        # compile_step: a torch.compile backend for the model's step (the module docstring)
        self._model_step = _model_step if compile_step is None else torch.compile(
            _model_step, backend=compile_step, dynamic=True)
        self.compiled = compile_step is not None

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, span) shapes stepped so far (captured, with graphs)."""
        return sorted(self._graphs)

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per running row: the logits [n, V] of each row's next position (a view of the graph's
        output buffer, which the next step overwrites)."""
        slots = self.slots
        n = slots.rows
        if len(tokens) != n or n == 0:
            raise ValueError(f"a step takes one token per running row ({n}), got {len(tokens)}")
        rows = next(b for b in self.rows if b >= n)
        span = next(s for s in self.spans if s > slots.longest)
        entry = self._entry(rows, span)
        entry.tokens[:n, 0].copy_(torch.tensor(tokens), non_blocking=True)
        entry.tokens[n:].zero_()
        self._pad(rows)
        if entry.graph is None:
            self._forward(entry, rows, span)
        else:
            slots.begin(rows, span, views=False)  # the checks: the replay has its addresses
            entry.graph.replay()
        slots.count_step()
        return entry.logits[:n]

    @torch.no_grad()
    def capture_all(self) -> int:
        """Capture every (rows, span) graph now (a server does this before taking requests); the number captured.
        Needs the storage allocated: call after the first sequence is installed."""
        if not self.use_graph:
            return 0
        start, before = time.perf_counter(), len(self._graphs)
        for rows in reversed(self.rows):  # largest first: the smaller graphs reuse the pool's blocks
            for span in reversed(self.spans):
                if span > self.slots.longest:
                    self._entry(rows, span)
        log.info("captured %d CUDA graphs of the decoding step in %.1fs", len(self._graphs) - before,
                 time.perf_counter() - start)
        return len(self._graphs) - before

    def _entry(self, rows: int, span: int) -> _Graph:
        if self.slots.storage_version != self._version:  # the captured addresses are gone
            self._graphs.clear()
            self._version = self.slots.storage_version
        entry = self._graphs.get((rows, span))
        if entry is None:
            tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
            entry = _Graph(tokens, torch.empty(0), None)
            if self.use_graph:
                self._capture(entry, rows, span)
            self._graphs[(rows, span)] = entry
        return entry

    def _pad(self, rows: int) -> None:
        """Padding rows at position 0: they write their key at slot 0 (`SlotCache.begin`), never past the storage."""
        self.slots.lengths_device[self.slots.rows : rows].zero_()

    def _forward(self, entry: _Graph, rows: int, span: int) -> torch.Tensor:
        """The step at fixed shapes: the model on the token buffer, the new SSM states written into their rows."""
        self.slots.begin(rows, span)
        with _independent_sizes() if self.compiled else contextlib.nullcontext():
            entry.logits = self._model_step(self.model, entry.tokens, self.slots)  # [rows, V]
        self.slots.commit()
        return entry.logits

    def _capture(self, entry: _Graph, rows: int, span: int) -> None:
        """Record the step into `entry.graph`: a warm-up step on a side stream (lazy set-up outside the capture),
        then the capture; the slots' states and counts are restored after each (capture records without running,
        the warm-up's effect is undone; the key/value slot both write is the one the next real step rewrites), as
        `hybridlm.models.graphed.capture_step` makes them."""
        saved = self.slots.snapshot(rows)
        try:
            self._pad(rows)
            entry.graph, _ = capture_step(self.device, lambda: self._forward(entry, rows, span),
                                          between=lambda: (self.slots.restore(saved), self._pad(rows)),
                                          compiled=self.compiled, pool=self._pool)
        finally:
            self.slots.restore(saved)


def _model_step(model, tokens: torch.Tensor, slots: SlotCache) -> torch.Tensor:
    """tokens [rows, 1] -> the logits [rows, V] of each row's next position (a module function: the one dynamo
    compiles, whatever the engine)."""
    return model(tokens, cache=slots, logits_to_keep=1).logits[:, -1]


def _independent_sizes():
    """While dynamo traces the step: sizes that happen to be equal (2 rows and 2 key/value heads, say) stay separate
    symbols. Otherwise dynamo assumes they are equal ("duck sizing") and compiles again when a step's rows differ."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)
