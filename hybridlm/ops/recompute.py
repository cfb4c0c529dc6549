"""Recompute a region of a forward in the backward, except its scan kernels, whose outputs are reused.

A mixer's scan (the fast-weight rules' chunk scans, Mamba-2's SSD) keeps its inputs for its backward: the
normalized queries, keys and values, the write events. They are cheap functions of the mixer's input projection
(a short conv, a norm, an elementwise preparation), which stays alive anyway (it holds the output gate). Keeping
them costs several copies of the mixer's width per token; recomputing them costs a few elementwise passes.

    out = recompute_except_kernels(fn, *inputs)

runs `fn(*inputs)` under torch's non-reentrant activation checkpointing (`torch.utils.checkpoint`), so the region
keeps nothing but its inputs: in the backward it runs again to give each node its saved tensors. A kernel launcher
called through `kept_kernel(launch, *args)` (the scans' forward custom ops do) runs once. The region holds its
outputs by weak reference only: an output still alive when the recomputation runs is handed back in it; one freed by
then comes back as a NaN-filled placeholder of its shape. In the mixers every kept output is freed by then: a final
state nobody asked for and a padded output gathered into the packed rows right after the forward, and the mixer's
output once the backward of the gated output projection, the only holder of it and the first to run, is done. So the
region costs no memory beyond the plain call's, and a region that computed a saved tensor from a freed output's
values would show NaN gradients rather than wrong ones. This is selective activation checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) for a named set of kernels, without its dispatch
mode, which would intercept every op of the region twice.

Under torch.compile the region is that: selective checkpointing whose policy saves the outputs of the custom ops
registered with `keep_in_compiled_regions` and recomputes the rest; the partitioner writes it into the backward
graph (no runtime cost beyond the recomputation). torch notes once per process that such a region must not hold
in-place ops.

The contract: fn is deterministic, calls its kept kernels in the same order each time (a mismatch raises), holds no
in-place op, and computes no saved tensor from a kept kernel's output other than by keeping that output itself; a
kept output changed in place after the forward raises in the backward. `kept_kernel` must be called below autograd
(inside a custom op's implementation, whose autograd formula saves the recomputed inputs): it returns new aliases,
which the custom op hands to autograd as new outputs. Values and gradients are the plain call's, bit for bit (the
same kernels on the same inputs).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# The region whose forward or recomputation runs on this thread (autograd's backward runs the recomputation on its
# own thread, where it is set too).
_local = threading.local()
_COMPILED_KEPT: set = set()  # the custom ops (OpOverloads) whose outputs a compiled region keeps


def recompute_except_kernels(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), its intermediate tensors recomputed in the backward rather than kept, its `kept_kernel` calls
    (compiled: the ops of `keep_in_compiled_regions`) not (module docstring). fn may read parameters and tensors it
    closes over; it must not change state or run in-place ops."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *inputs, use_reentrant=False, context_fn=_compiled_contexts)
    region = _Region()
    # Deterministic by contract: no RNG state to save and restore, no recomputed tensor's metadata to compare (both
    # host work per region and call; the tests hold the values and gradients to the plain call's, bit for bit).
    return checkpoint(fn, *inputs, use_reentrant=False, context_fn=region.contexts, preserve_rng_state=False,
                      determinism_check="none")


def keep_in_compiled_regions(op: torch._ops.OpOverload) -> None:
    """Register a custom op whose outputs a compiled `recompute_except_kernels` region keeps (a scan's forward)."""
    _COMPILED_KEPT.add(op)


def _compiled_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _COMPILED_KEPT else CheckpointPolicy.PREFER_RECOMPUTE


_compiled_contexts = functools.partial(create_selective_checkpoint_contexts, _compiled_policy)


_CONTIGUOUS_LAUNCHERS: dict = {}  # launcher -> its `on_contiguous` wrapper


def on_contiguous(launch: Callable) -> Callable:
    """launch, its tensor arguments made contiguous first: as a `kept_kernel` launcher, a recomputation's replay then
    makes no copies to throw away. One wrapper per launcher, the same object for every call and thread (`setdefault`
    is atomic), since `kept_kernel` matches a replay's launcher to the forward's by identity."""
    wrapper = _CONTIGUOUS_LAUNCHERS.get(launch)
    if wrapper is None:
        @functools.wraps(launch)
        def wrapper(*args):
            return launch(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))
        wrapper = _CONTIGUOUS_LAUNCHERS.setdefault(launch, wrapper)
    return wrapper


def kept_kernel(launch: Callable, *args):
    """launch(*args) (a tuple of tensors or a tensor), or inside a `recompute_except_kernels` region's recomputation
    the outputs its forward got from this call."""
    region = getattr(_local, "region", None)
    if region is None:
        return launch(*args)
    return region.call(launch, args)


class _KeptCall:
    """One kept kernel call: its launcher, and its outputs by weak reference with what the replay needs to check
    them (their version counters) or stand in for them (shape, strides, dtype, device)."""

    def __init__(self, launch: Callable, outputs) -> None:
        self.launch = launch
        self.single = isinstance(outputs, torch.Tensor)
        tensors = (outputs,) if self.single else tuple(outputs)
        self.refs = [weakref.ref(t) for t in tensors]
        self.versions = [t._version for t in tensors]
        self.layouts = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]

    def replay(self):
        outputs = []
        for ref, version, (shape, stride, dtype, device) in zip(self.refs, self.versions, self.layouts):
            tensor = ref()
            if tensor is None:  # freed after the forward: nothing the backward keeps was computed from it
                outputs.append(torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(float("nan")))
                continue
            if tensor._version != version:
                raise RuntimeError("recompute_except_kernels: a kept kernel's output was modified in place after the "
                                   "forward; the recomputation would hand back the modified values")
            outputs.append(tensor.detach())  # a new alias, for the custom op to hand to autograd
        return outputs[0] if self.single else tuple(outputs)


class _Region:
    """The kept calls of one region, in call order; `replay_at` the next to hand back in a recomputation (None in
    the forward)."""

    def __init__(self) -> None:
        self.kept: list[_KeptCall] = []
        self.replay_at: int | None = None

    def contexts(self):
        """(the forward's context, the recomputations' context): torch's checkpoint enters the second once per
        recomputation, so both are re-enterable objects rather than generator contexts."""
        return _Active(self, replay=False), _Active(self, replay=True)

    def call(self, launch: Callable, args):
        if self.replay_at is None:
            outputs = launch(*args)
            self.kept.append(_KeptCall(launch, outputs))
            return outputs
        if self.replay_at >= len(self.kept) or self.kept[self.replay_at].launch is not launch:
            raise RuntimeError(f"recompute_except_kernels: call {self.replay_at + 1} of the recomputation is not the "
                               f"forward's ({len(self.kept)} kept kernel calls); the region must call its kept kernels "
                               "in the same order each time")
        self.replay_at += 1
        return self.kept[self.replay_at - 1].replay()


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
