"""Decoding steps as a replayed CUDA graph: one launch per token instead of one per operator.

    decoder = GraphedDecoder(model, cache, capacity=prompt_len + max_new_tokens)   # after a prefill into `cache`
    logits = decoder.step(token)                # token [B] -> logits [B, V] of the next position

A decoding step of these models is hundreds of small kernels whose launches, not their math, set its time on a GPU
(launch counts per step: benchmarks/RESULTS.md). Capturing the step once and replaying it needs every step to run the
same kernels on the same addresses: the decoder converts the filled cache into a `StaticCache` (attention keys/values
in storage of fixed capacity written at a device-side slot, masks over the whole storage, positions from device
tensors), feeds the token through a static input buffer, and keeps every SSM state (conv tails, SSD and fast-weight
states, carried keys) in the buffers the step reads: the mixers' step kernels write the new states over them
(`StaticCache` takes states in place), and a new state a step returns as a new tensor (the torch paths: the CPU, the
other rules) is copied back into its buffer, the copies part of the graph.

`compile_step="inductor"` runs the model's step through torch.compile before the capture, so the graph holds
inductor's fused kernels instead of one kernel per operator (a step is mostly small elementwise work: norms, gates,
casts); the same logits as the plain step (checked with "aot_eager" on the CPU, and the inductor capture by the GPU
tests; its speed-up: benchmarks/RESULTS.md). The warm-up step compiles; the capture then runs the same call with the
same host counts (restored), so it must not compile again: it runs with dynamo's `error_on_recompile`, and a guard
miss fails the capture (states restored, no graph kept) instead of compiling inside it or capturing an uncompiled
step.

On the CPU (or with `use_graph=False`) the same static step runs eagerly: that is what the CPU tests check against
the dynamic cache. Attention then reads all `capacity` slots every step (the empty ones masked), so keep the capacity
at what the generation needs; with sliding-window attention (`attention_window` W < capacity) it reads a ring of W
slots instead, whatever the capacity. Capture happens on the first `step` (after one eager warm-up step on a side
stream whose effect on the states is undone); `step` refuses to run past the capacity. Under a caller's autocast the
capture runs with autocast's weight-cast cache off: a cast cached before the capture would be read by every replay
from memory the cache frees when its context ends, so the graph recomputes the casts itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hybridlm.layers.block import capturing_soon
from hybridlm.layers.cache import HybridCache, StaticCache, filled_rows


class GraphedDecoder:
    """Decoding steps of `model` over `cache` (already filled by a prefill) with room for `capacity` slots."""

    def __init__(self, model, cache: HybridCache, *, capacity: int, batch_size: int,
                 use_graph: bool | None = None, compile_step: str | None = None) -> None:
        rows = filled_rows(cache)
        if rows is not None and rows != batch_size:
            raise ValueError(f"batch_size {batch_size} does not match the cache's {rows} rows")
        self.model = model
        self.device = next(model.parameters()).device
        with torch.no_grad():  # the storage must not carry the prefill's autograd graph
            self.cache = StaticCache(cache, capacity=capacity, batch_size=batch_size, device=self.device)
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device (use_graph=False runs the static step)")
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)  # the step's input
        self.buffers = [dict(layer.ssm) for layer in self.cache.layers]  # the state tensors every step reads
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output [B, V]
        # compile_step: a torch.compile backend ("inductor") for the model's step: fused kernels, so fewer of them per
        # replay (the module docstring). The unbound function, not `self._step`: a bound method kept on the object
        # would make every decoder a reference cycle, holding its key/value storage until the garbage collector runs.
        self._compiled_step = None
        if compile_step is not None:
            self._compiled_step = torch.compile(GraphedDecoder._step, backend=compile_step)

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed `token` [B] (int64): the logits [B, V] of the next position. They live in a buffer the next call
        overwrites (clone to keep them)."""
        if token.numel() != self.token.shape[0] or token.dtype.is_floating_point:
            raise ValueError(f"step takes one integer token per row: [{self.token.shape[0]}], got "
                             f"{list(token.shape)} {token.dtype}")
        if self.cache.free < 1:
            raise ValueError(f"the decoder's cache is full ({self.cache.capacity} slots): build it with a larger "
                             "capacity (prompt length + new tokens)")
        self.token.copy_(token.view(-1, 1))
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        # The host's counts (the replayed graph advances the device-side slot and positions, not these).
        self.cache.seq_len += 1
        for layer in self.cache.layers:
            if layer._key is not None:
                layer.length += 1
        return self.logits

    def _step(self) -> torch.Tensor:
        return self.model(self.token, cache=self.cache, logits_to_keep=1).logits[:, -1]

    def _forward(self) -> torch.Tensor:
        """One static step: the model on the token buffer, then any new SSM state that is not already in its buffer
        copied there."""
        logits = self._step() if self._compiled_step is None else self._compiled_step(self)
        for layer, buffers in zip(self.cache.layers, self.buffers):
            if layer.ssm.keys() != buffers.keys():
                raise RuntimeError(f"a decoding step changed the cached state's fields ({sorted(buffers)} -> "
                                   f"{sorted(layer.ssm)}): this model's step cannot be replayed")
            for name, buffer in buffers.items():
                if layer.ssm[name] is not buffer:
                    buffer.copy_(layer.ssm[name])
                    layer.ssm[name] = buffer
        return logits

    def _capture(self) -> None:
        """Record the step into `self.graph`. Whether it succeeds or raises, the states and counters are left as
        they were (capture records the step without running it; the warm-up step's effect is undone), and a
        failed capture leaves no graph behind to replay."""
        saved = self._snapshot()
        casts = contextlib.nullcontext()
        if torch.is_autocast_enabled("cuda"):  # the module docstring: no cached weight casts inside the graph
            casts = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
        try:
            with casts:
                graph, logits = capture_step(self.device, self._forward, between=lambda: self._restore(saved),
                                             compiled=self._compiled_step is not None)
            self.graph, self.logits = graph, logits
        finally:
            self._restore(saved)

    def _snapshot(self) -> dict:
        """What a step changes besides the key/value slot it writes (which the next real step rewrites)."""
        return {"seq_len": self.cache.seq_len, "lengths": [layer.length for layer in self.cache.layers],
                "slot": self.cache.slot.clone(), "positions": self.cache.next_positions.clone(),
                "states": [{name: t.clone() for name, t in buffers.items()} for buffers in self.buffers]}

    def _restore(self, saved: dict) -> None:
        self.cache.seq_len = saved["seq_len"]
        for layer, length in zip(self.cache.layers, saved["lengths"]):
            layer.length = length
        self.cache.slot.copy_(saved["slot"])
        self.cache.next_positions.copy_(saved["positions"])
        for buffers, states in zip(self.buffers, saved["states"]):
            for name, value in states.items():
                buffers[name].copy_(value)


def capture_step(device: torch.device, step: Callable[[], Any], *, between: Callable[[], None], compiled: bool,
                 pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """The capture of both graphed decoders (this one and the serving engine's): `step()` once on a side stream
    (lazy library set-up and kernel selection happen outside the capture), `between()` (undo its effect), then
    `step()` recorded into a new CUDA graph; returns (the graph, what the recorded call returned). On `device`, with a
    capture stream of it: torch.cuda.graph's default stream belongs to the device current at its first capture, where
    a model on another GPU would record an empty graph. `compiled`: a step through torch.compile, which must not
    compile inside the capture (the module docstring). `pool`: a memory pool shared with other graphs."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), capturing_soon():
            step()
        torch.cuda.current_stream(device).wait_stream(stream)
        between()
        graph = torch.cuda.CUDAGraph()
        no_recompile = torch._dynamo.config.patch(error_on_recompile=True) if compiled else contextlib.nullcontext()
        with no_recompile, torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            out = step()
    return graph, out

