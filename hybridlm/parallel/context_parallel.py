"""Context parallelism: one sequence split over the ranks of a cp group, each holding a contiguous chunk.

    local_ids, position_ids = shard_sequence(input_ids, cp_group)      # rank j: tokens [j Q, (j + 1) Q)
    with context_parallel(model, cp_group):
        logits = model(local_ids, position_ids=position_ids).logits     # [B, Q, V]: this rank's positions
        loss = local_loss(logits)                                       # this rank's share of the global loss
    loss.backward()                                                     # every rank, once per forward
    reduce_context_parallel_grads(model, cp_group)                      # sum parameter gradients over cp

How each mixer sees the whole sequence (hooks on the mixers; the layer code is unchanged):
- SSM mixers (Mamba-2 and fast-weight), by state passing: at every layer rank j receives rank j-1's final
  state, runs its chunk from it and sends its own final state to rank j+1. The state is what the mixer's
  decoding cache holds (`LayerCache.ssm`): the conv tail (last K-1 inputs) and the SSM state [B, H, P, N],
  or for fast-weight S, the shifted pairing's last key and the sliding rules' tail pairs. The ops are exact
  under state passing (and differentiable in the carried state), so this is exact. It is SEQUENTIAL over
  the ranks (rank j starts layer l's mixer after rank j-1 finished it; the ranks pipeline over the layers).
  Differentiable: the transfer is an autograd Function pair (`_SendState` on rank j-1, `_ReceiveState` on
  rank j) whose backward sends the gradient of the state back from rank j to rank j-1, so the loss summed over
  the ranks has the gradients of one process. The state travels as a flat list of tensors, after a small
  header (names, dtypes, shapes) so the receiver can preallocate; no pickled objects.
- Attention, by ring attention (`hybridlm.parallel.ring_attention`, default): K/V blocks travel around the
  ring, O(Q) key memory per rank, exact backward. `attention="allgather"` keeps the simpler all-gather of
  K/V (O(T) key memory per rank; its backward all-reduces the K/V gradients). Ring attention replaces the
  layer's `scaled_dot_product_attention` call through a TorchFunctionMode active only during that layer's
  forward, so RoPE, GQA and the projections stay the layer's own code.

Backward order (why it cannot deadlock): every rank runs the same graph, so its backward meets the
communicating nodes in the same order: per block, the attention branch (created after the SSM branch, so
autograd runs it first) with its ring exchange, then the SSM branch, whose `_SendState` node on rank j waits
for rank j+1's `_ReceiveState` node to send the state gradient. That wait only points to higher ranks, and
rank J-1 waits for nobody, so the chain always completes. Requirements for this: every rank calls backward
once per forward made with gradients enabled (the same grad mode on every rank), and no activation
checkpointing of blocks (the recomputation would repeat the state transfers in backward).

Requirements: every rank holds the same chunk length Q; no packed documents (`cu_seqlens` / position
restarts), no decoding cache, no attention dropout, no sliding-window attention (`attention_window`);
position_ids are the global positions (`shard_sequence` returns them). Parameters are replicated over the cp
ranks: after backward, sum their gradients over the cp group (`reduce_context_parallel_grads`) before the
optimizer step; data parallelism then averages over dp.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from hybridlm.layers.attention import Attention
from hybridlm.layers.block import HybridBlock
from hybridlm.layers.cache import LayerCache
from hybridlm.parallel.ring_attention import ring_attention

ATTENTION_MODES = ("ring", "allgather")


def shard_sequence(
    tokens: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T, ...] (the same on every rank) -> (this rank's chunk [B, T/J, ...], its global
    position_ids [1, T/J]). T must be divisible by the cp size J."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = tokens.shape[dim]
    if length % size:
        raise ValueError(f"context parallelism over {size} ranks needs a sequence length divisible by {size}, got {length}")
    chunk = length // size
    local = tokens.narrow(dim, rank * chunk, chunk)
    positions = torch.arange(rank * chunk, (rank + 1) * chunk, device=tokens.device).unsqueeze(0)
    return local, positions


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence` (not differentiable): every rank's chunk concatenated along `dim`."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def context_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, attention: str = "ring"
) -> Iterator[nn.Module]:
    """Inside: every block's mixers of `model` work on this rank's chunk of a sequence split over `group`.

    attention: "ring" (ring attention, O(Q) keys per rank) or "allgather" (all ranks' K/V gathered, O(T)).
    The hooks stay on the mixers only while inside; a backward of a graph built inside may run after it."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"context_parallel: attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        raise ValueError(
            "context_parallel: activation checkpointing is not supported (recomputing a block in backward would "
            "repeat its state transfers and ring exchanges out of order); build the model without it"
        )
    windowed = sorted({m.window for m in model.modules() if isinstance(m, Attention) and m.window is not None})
    if windowed:
        # Ring attention and the all-gather both attend causally over the whole sequence: a window would be ignored
        # on the other ranks' keys (refused even on one rank, so a config fails the same way at any scale).
        raise ValueError(f"context_parallel: sliding-window attention (attention_window={windowed[0]}) is not "
                         "supported; train it without context parallelism or with attention_window=None")
    if dist.get_world_size(group) == 1:
        yield model
        return
    handles = []
    for block in (m for m in model.modules() if isinstance(m, HybridBlock)):
        if block.ssm is not None:
            state = _StatePassing(group)
            handles.append(block.ssm.register_forward_pre_hook(state.before, with_kwargs=True))
            handles.append(block.ssm.register_forward_hook(state.after, with_kwargs=True))
        if block.attn is not None:
            if attention == "ring":
                ring = _RingAttentionHooks(group)
                handles.append(block.attn.register_forward_pre_hook(ring.before, with_kwargs=True))
                handles.append(block.attn.register_forward_hook(ring.after, always_call=True))
            else:
                handles.append(block.attn.register_forward_pre_hook(_GatheredAttention(group), with_kwargs=True))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def reduce_context_parallel_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter gradient of `model` over the cp `group`, in place (after backward, before the
    optimizer step). Why a sum: each cp rank holds all parameters but only its chunk's share of the loss, so
    the full gradient is the sum of the ranks' gradients. FSDP2-sharded gradients (DTensor) are reduced shard
    by shard (after FSDP's own reduce-scatter over dp, which averages over the data-parallel ranks).

    A parameter can have a gradient on some cp ranks only: a fast-weight mixer's gates get none from a one-token
    chunk at a sequence's start (no write pair there). Such a gradient is a zero on the ranks without one, so every
    rank's buffers line up; a parameter no rank has a gradient for keeps None. One all-reduce of which ones have
    gradients, then one per dtype and device (the gradients flattened into one buffer)."""
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has_grad, group=group)  # a sum: > 0 where any rank has one
    for param, anywhere in zip(params, has_grad.tolist()):
        if param.grad is None and anywhere:
            param.grad = torch.zeros_like(param)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


def _check_call(name: str, kwargs: dict) -> None:
    if kwargs.get("cache") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError(f"context parallelism: {name} got a decoding cache or cu_seqlens; neither is supported")


def _check_positions(hidden: torch.Tensor, kwargs: dict, group) -> None:
    positions = kwargs.get("position_ids")
    rank, length = dist.get_rank(group), hidden.shape[1]
    if positions is None or int(positions.reshape(-1, positions.shape[-1])[0, 0]) != rank * length:
        raise ValueError(
            "context parallelism: pass the global position_ids of this rank's chunk (see shard_sequence); "
            f"rank {rank} with chunk length {length} starts at position {rank * length}"
        )


# --------------------------------------------------------------------------- SSM mixers: state passing


class _StatePassing:
    """Hooks of one SSM mixer: receive rank j-1's final state before the forward, send ours after it.

    The state is the mixer's `cache.ssm` dict, sent as its tensors in sorted-name order. Under grad mode both
    ends are autograd nodes (tied to a zero-size anchor that requires grad, so that they exist on every rank
    even for a frozen model: the two ends must agree on whether a backward transfer will happen).

    The layout (names, dtypes, shapes) travels once per mixer, group and input signature (shape, dtype,
    autocast dtype):
    both ends remember it in `_LAYOUTS`, so later steps send only the tensors (reading a header back is a
    host synchronization per layer). The cp ranks run the same layers on equal shapes in lockstep, so the two
    ends always agree on whether a header comes."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))  # part of the layout key
        self.cache: LayerCache | None = None
        self.signature: tuple | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        _check_call(type(module).__name__, kwargs)
        hidden = args[0] if args else kwargs["hidden"]
        self.cache = LayerCache()
        device = hidden.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        self.signature = (self.ranks, tuple(hidden.shape), hidden.dtype, autocast)
        if self.rank > 0:
            peer = self.rank - 1
            known = _LAYOUTS.setdefault(module, {})
            layout = known.get(("received", self.signature))
            if layout is None:
                layout = known[("received", self.signature)] = _receive_layout(self.group, peer, hidden.device)
            state = _ReceiveState.apply(_anchor(hidden.device), self.group, peer, layout)
            self.cache.ssm.update(zip((slot[0] for slot in layout), state))
        return args, {**kwargs, "cache": self.cache}  # the mixer reads its initial state and writes its final one

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
        cache, self.cache = self.cache, None
        if self.rank + 1 == self.size:
            return None
        names = sorted(cache.ssm)
        state = [cache.ssm[name] for name in names]
        peer = self.rank + 1
        known = _LAYOUTS.setdefault(module, {})
        layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in zip(names, state))
        sent = known.get(("sent", self.signature))
        if sent is None:
            _send_layout(names, state, self.group, peer, output.device)
            known[("sent", self.signature)] = layout
        elif sent != layout:
            raise RuntimeError(f"context_parallel: the state layout of {type(module).__name__} changed for the same "
                               f"input signature ({sent} -> {layout}); the receiving rank would misread it")
        # The output passes through unchanged; its backward node is where the state's gradient comes back in.
        return _SendState.apply(output, _anchor(output.device), self.group, peer, *state)


# mixer -> {("sent" | "received", input signature): layout}; weak, so a dropped model takes its entries along
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

_Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) per state tensor


def _anchor(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())


def _send_layout(names: list[str], state: list[torch.Tensor], group, peer: int, device: torch.device) -> None:
    """The header: (name, dtype, shape) of every state tensor as JSON bytes, after its length."""
    text = json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in zip(names, state)])
    payload = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group, group_dst=peer)
    dist.send(payload, group=group, group_dst=peer)


def _receive_layout(group, peer: int, device: torch.device) -> _Layout:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, group=group, group_src=peer)
    payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.recv(payload, group=group, group_src=peer)
    entries = json.loads(bytes(payload.cpu().tolist()).decode())
    return tuple((name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in entries)


class _ReceiveState(torch.autograd.Function):
    """Rank j's end: forward receives the state tensors from rank j-1 (`peer`); backward sends their
    gradients back to it (zeros for a state tensor the graph did not use; none for integer tensors)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, group, peer: int, layout: _Layout) -> tuple[torch.Tensor, ...]:
        state = tuple(torch.empty(shape, dtype=dtype, device=anchor.device) for _, dtype, shape in layout)
        for tensor in state:
            dist.recv(tensor, group=group, group_src=peer)
        ctx.group, ctx.peer = group, peer
        ctx.mark_non_differentiable(*(t for t in state if not t.is_floating_point()))
        ctx.floating = [t.is_floating_point() for t in state]
        return state

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        for grad, floating in zip(grads, ctx.floating):
            if floating:  # materialized: a state tensor without gradient arrives as zeros
                dist.send(grad.contiguous(), group=ctx.group, group_dst=ctx.peer)
        return None, None, None, None


class _SendState(torch.autograd.Function):
    """Rank j-1's end: forward sends the final state to rank j (`peer`) and returns the mixer output as is;
    backward receives the state's gradient from rank j and hands it to the state's producers."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, anchor: torch.Tensor, group, peer: int, *state: torch.Tensor) -> torch.Tensor:
        for tensor in state:
            dist.send(tensor.detach().contiguous(), group=group, group_dst=peer)
        ctx.group, ctx.peer = group, peer
        ctx.slots = [(t.shape, t.dtype, t.device) for t in state]
        return output.view_as(output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        grads = []
        for shape, dtype, device in ctx.slots:
            if dtype.is_floating_point:
                grad = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(grad, group=ctx.group, group_src=ctx.peer)
                grads.append(grad)
            else:
                grads.append(None)
        return grad_output, None, None, None, *grads


# --------------------------------------------------------------------------- attention: ring


class _RingAttentionHooks:
    """Hooks of one Attention: while its forward runs, its `scaled_dot_product_attention` call becomes
    `ring_attention` over the group (the layer computes q, k, v with RoPE at the global positions itself)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.mode: _RingSDPA | None = None

    def before(self, module: Attention, args: tuple, kwargs: dict):
        _check_call("Attention", kwargs)
        hidden = args[0] if args else kwargs["hidden"]
        _check_positions(hidden, kwargs, self.group)
        if module.training and module.dropout > 0:
            raise ValueError("context parallelism: attention dropout is not supported (set attention_dropout=0)")
        self.mode = _RingSDPA(self.group)
        self.mode.__enter__()

    def after(self, module: Attention, args: tuple, output: torch.Tensor) -> None:  # always_call: also on errors
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)


class _RingSDPA(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention(q, k, v, is_causal=...)` ([B, H, T, D] layouts) to ring attention;
    every other function runs unchanged."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _sdpa_arguments(*args, **kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        if call["attn_mask"] is not None or call["dropout_p"] != 0.0 or not (call["is_causal"] or q.shape[-2] == 1):
            raise ValueError("context parallelism: ring attention takes causal attention without a mask or dropout")
        out = ring_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.group, scale=call["scale"]
        )  # [B, T, Hq, Dv]
        return out.transpose(1, 2)  # [B, Hq, T, Dv], as SDPA returns


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's signature, to read a call's arguments by name (positional or keyword)."""
    return {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}


# --------------------------------------------------------------------------- attention: all-gather


class _GatheredAttention:
    """Pre-hook of one Attention: hand it the K/V of the earlier ranks as if they were a decoding cache."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, module: Attention, args: tuple, kwargs: dict):
        _check_call("Attention", kwargs)
        hidden = args[0] if args else kwargs["hidden"]
        _check_positions(hidden, kwargs, self.group)
        past = dist.get_rank(self.group) * hidden.shape[1]
        return args, {**kwargs, "cache": _EarlierKeys(self.group, past=past)}


class _EarlierKeys:
    """The part of `LayerCache` that `Attention.forward` uses: `length` earlier key slots and `append_kv`,
    which all-gathers every rank's keys/values and returns those of ranks 0..j (the causal prefix)."""

    pad = None

    def __init__(self, group: dist.ProcessGroup | None, past: int) -> None:
        self.group, self.length = group, past

    def append_kv(self, key: torch.Tensor, value: torch.Tensor, *, saved_for_backward: bool = False,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # LayerCache's keywords: the gathered keys are new tensors (nothing written in place that autograd saved), and
        # a window never reaches here (`context_parallel` refuses one)
        keep = self.length + key.shape[1]  # [B, j Q + Q, Hkv, D]
        keys = _AllGatherTime.apply(key.contiguous(), self.group)[:, :keep]
        values = _AllGatherTime.apply(value.contiguous(), self.group)[:, :keep]
        return keys, values


class _AllGatherTime(torch.autograd.Function):
    """[B, Q, ...] per rank -> [B, J Q, ...] (ranks in order); backward: the sum over ranks of the gradient
    of this rank's slice (an all-reduce, which gloo supports, then the slice)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.chunk = group, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.chunk
        return grad[:, start : start + ctx.chunk], None
