"""Recompute a region of a forward in the backward, except its scan kernels, whose outputs are kept.

A mixer's scan (the fast-weight rules' chunk scans, Mamba-2's SSD) keeps its inputs for its backward: the
normalized queries, keys and values, the write events. They are cheap functions of the mixer's input projection
(a short conv, a norm, an elementwise preparation), which stays alive anyway (it holds the output gate). Keeping
them costs several copies of the mixer's width per token; recomputing them costs a few elementwise passes.

    out = recompute_except_kernels(fn, *inputs)

runs `fn(*inputs)` under torch's non-reentrant activation checkpointing (`torch.utils.checkpoint`), so the region
keeps nothing but its inputs: in the backward it runs again to give each node its saved tensors. A kernel launcher
called through `kept_kernel(launch, *args)` (the scans' forward custom ops do) runs once: its outputs are kept from
the forward (they are usually kept anyway, the mixer's output going into its gated norm), and in the recomputation
the launcher is not called and returns them again. This is selective activation checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) for a named set of kernels, without its dispatch
mode, which would intercept every op of the region twice. Under torch.compile the region is that: selective
checkpointing whose policy keeps the outputs of the custom ops registered with `keep_in_compiled_regions` and
recomputes the rest, which the partitioner turns into the backward graph (no runtime cost beyond the recomputation).

`kept_kernel` must be called below autograd (inside a custom op's implementation, whose autograd formula saves the
recomputed inputs): it returns fresh aliases of the kept outputs, which the custom op hands to autograd as new
outputs. The region must be deterministic and call its kept kernels in the same order each time (a mismatch raises).
Values and gradients are the plain call's, bit for bit (the same kernels on the same inputs).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_local = threading.local()  # the region whose forward or recomputation runs on this thread (autograd's backward
# runs the recomputation on its own thread, where it sets this too)


_COMPILED_KEPT: set = set()  # the custom ops (OpOverloads) whose outputs a compiled region keeps


def recompute_except_kernels(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), its intermediate tensors recomputed in the backward rather than kept, its `kept_kernel` calls
    (compiled: the ops of `keep_in_compiled_regions`) not (module docstring). fn may read parameters and tensors it
    closes over; it must not change state or run in-place ops."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *inputs, use_reentrant=False, context_fn=_compiled_contexts)
    region = _Region()
    return checkpoint(fn, *inputs, use_reentrant=False, context_fn=region.contexts)


def keep_in_compiled_regions(op: torch._ops.OpOverload) -> None:
    """Register a custom op whose outputs a compiled `recompute_except_kernels` region keeps (a scan's forward)."""
    _COMPILED_KEPT.add(op)


def _compiled_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _COMPILED_KEPT else CheckpointPolicy.PREFER_RECOMPUTE


_compiled_contexts = functools.partial(create_selective_checkpoint_contexts, _compiled_policy)


class _NoInPlaceNotice(logging.Filter):
    """torch warns once that a compiled checkpoint with a context_fn must not hold in-place ops; the regions here
    hold none (`recompute_except_kernels`'s contract, tested), so the notice says nothing to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceNotice())


def kept_kernel(launch: Callable, *args):
    """launch(*args) (a tuple of tensors or a tensor), or inside a `recompute_except_kernels` region's recomputation
    the outputs its forward got from this call."""
    region = getattr(_local, "region", None)
    if region is None:
        return launch(*args)
    return region.call(launch, args)


def _aliases(outputs):
    """New tensors over the same storage (no autograd history): what a custom op may return as its outputs."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    return type(outputs)(t.detach() if isinstance(t, torch.Tensor) else t for t in outputs)


class _Region:
    """The kept calls of one region, (launcher, outputs) in call order; `replay_at` the next to return in a
    recomputation (None in the forward)."""

    def __init__(self) -> None:
        self.kept: list = []
        self.replay_at: int | None = None

    def contexts(self):
        """(the forward's context, the recomputations' context): torch's checkpoint enters the second once per
        recomputation, so both are re-enterable objects rather than generator contexts."""
        return _Active(self, replay=False), _Active(self, replay=True)

    def call(self, launch: Callable, args):
        if self.replay_at is None:
            outputs = launch(*args)
            self.kept.append((launch, _aliases(outputs)))
            return outputs
        if self.replay_at >= len(self.kept) or self.kept[self.replay_at][0] is not launch:
            raise RuntimeError(f"recompute_except_kernels: call {self.replay_at + 1} of the recomputation is not the "
                               f"forward's ({len(self.kept)} kept kernel calls); the region must call its kept kernels "
                               "in the same order each time")
        outputs = self.kept[self.replay_at][1]
        self.replay_at += 1
        return _aliases(outputs)


class _Active:
    """Makes `region` this thread's region while entered (`replay`: returning its kept outputs from the first)."""

    def __init__(self, region: _Region, *, replay: bool) -> None:
        self.region, self.replay = region, replay
        self.previous = None

    def __enter__(self) -> None:
        self.previous = getattr(_local, "region", None)
        _local.region = self.region
        self.region.replay_at = 0 if self.replay else None

    def __exit__(self, *exc) -> None:
        _local.region = self.previous
        self.region.replay_at = None
