"""Context parallelism: one sequence split over the ranks of a cp group, each holding a contiguous chunk.

    local_ids, position_ids = shard_sequence(input_ids, cp_group)      # rank j: tokens [j Q, (j + 1) Q)
    with context_parallel(model, cp_group), torch.no_grad():
        logits = model(local_ids, position_ids=position_ids).logits     # [B, Q, V]: this rank's positions

How each mixer sees the whole sequence (hooks on the mixers; the layer code is unchanged):
- SSM mixers (Mamba-2 and fast-weight), by state passing: at every layer rank j waits for rank j-1's final
  state, runs its chunk from it and sends its own final state to rank j+1. The state is what the mixer's
  decoding cache holds (`LayerCache.ssm`): the conv tail (last K-1 inputs) and the SSM state [B, H, P, N],
  or for fast-weight S, the shifted pairing's last key and the sliding rules' tail pairs. The ops are exact
  under state passing, so this is exact. It is SEQUENTIAL over the ranks (rank j starts layer l's mixer
  after rank j-1 finished it; the ranks pipeline over the layers), correct but not yet overlapped.
  Forward only: the passed states are constants for autograd, so a forward with gradients enabled raises.
- Attention, by all-gathering K/V over the cp group (the simplest exact form, O(T) key memory per rank, not
  ring attention): rank j's queries attend causally to the keys of ranks 0..j. Implemented as a "cache" of
  j Q earlier keys handed to `Attention.forward`, whose causal mask then has the right offset. The gather
  is differentiable (backward sums every rank's key/value gradients).

Requirements: every rank holds the same chunk length Q; no packed documents (`cu_seqlens` / position
restarts) and no decoding cache; position_ids are the global positions (`shard_sequence` returns them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from hybridlm.layers.attention import Attention
from hybridlm.layers.block import HybridBlock
from hybridlm.layers.cache import LayerCache


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
def context_parallel(model: nn.Module, group: dist.ProcessGroup | None = None):
    """Inside: every block's mixers of `model` work on this rank's chunk of a sequence split over `group`."""
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
            handles.append(block.attn.register_forward_pre_hook(_GatheredAttention(group), with_kwargs=True))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _check_call(name: str, kwargs: dict) -> None:
    if kwargs.get("cache") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError(f"context parallelism: {name} got a decoding cache or cu_seqlens; neither is supported")


class _StatePassing:
    """Hooks of one SSM mixer: receive rank j-1's final state before the forward, send ours after it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.cache: LayerCache | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        _check_call(type(module).__name__, kwargs)
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(
                "context parallelism of SSM mixers is forward-only (states passed between ranks carry no "
                "gradient); run the forward under torch.no_grad() / torch.inference_mode()"
            )
        self.cache = LayerCache()
        if self.rank > 0:
            box = [None]
            dist.recv_object_list(box, src=dist.get_global_rank(self.group, self.rank - 1), group=self.group,
                                  device=_object_device(self.group))
            self.cache.ssm.update(box[0])
        return args, {**kwargs, "cache": self.cache}  # the mixer reads its initial state and writes its final one

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if self.rank + 1 < self.size:
            state = {name: value.detach() for name, value in self.cache.ssm.items()}
            dist.send_object_list([state], dst=dist.get_global_rank(self.group, self.rank + 1), group=self.group,
                                  device=_object_device(self.group))
        self.cache = None


class _GatheredAttention:
    """Pre-hook of one Attention: hand it the K/V of the earlier ranks as if they were a decoding cache."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, module: Attention, args: tuple, kwargs: dict):
        _check_call("Attention", kwargs)
        hidden = args[0] if args else kwargs["hidden"]
        positions = kwargs.get("position_ids")
        rank, length = dist.get_rank(self.group), hidden.shape[1]
        if positions is None or int(positions.reshape(-1, positions.shape[-1])[0, 0]) != rank * length:
            raise ValueError(
                "context parallelism: pass the global position_ids of this rank's chunk (see shard_sequence); "
                f"rank {rank} with chunk length {length} starts at position {rank * length}"
            )
        return args, {**kwargs, "cache": _EarlierKeys(self.group, past=rank * length)}


class _EarlierKeys:
    """The part of `LayerCache` that `Attention.forward` uses: `length` earlier key slots and `append_kv`,
    which all-gathers every rank's keys/values and returns those of ranks 0..j (the causal prefix)."""

    pad = None

    def __init__(self, group: dist.ProcessGroup | None, past: int) -> None:
        self.group, self.length = group, past

    def append_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _object_device(group) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
