"""Full state dicts of a parallelized model and its AdamW state in the canonical (single-process) layout.

    model_sd = full_model_state_dict(model)              # every rank calls; rank 0 gets {name: full CPU tensor}
    moments = full_optimizer_state(model, optimizer)     # rank 0: {name: {"step", "exp_avg", "exp_avg_sq"}}
    load_full_model_state_dict(model, model_sd)          # every rank, each holding the whole dict
    load_full_optimizer_state(model, optimizer, moments)

One layout on disk, whatever the mesh: the keys, shapes and row order of the unparallelized model, so a
checkpoint written under tp=2 x dp_shard=2 (or mixer parallelism) loads in one process and the other way
round. Three things differ from the plain model and are undone here:

- DTensors (FSDP2 over dp, TP over tp, both): gathered with `DTensor.full_tensor()` (the redistribute to
  Replicate that `torch.distributed.checkpoint.state_dict` does per tensor) and cut back with
  `distribute_tensor(..., src_data_rank=None)` (every rank holds the file: slicing only, no communication);
- the SSM head split (`tensor_parallel.SegmentColwiseParallel` / `ShardRows`): the global view of a split
  `in_proj` / `conv` weight (and bias, and their AdamW moments) has its rows permuted by
  `segment_permutation(full segments, parts)`; saving applies `.argsort()` of it, loading the permutation;
- mixer parallelism: a rank holds one of the two mixers of a block, so rank 0 lacks the other half's
  parameters; after the gather, the lowest rank holding such a tensor sends it to rank 0 (point to point,
  shapes known from a small all_gather_object of names and shapes).

Why not `get_model_state_dict(full_state_dict=True, cpu_offload=True)` directly: it hands rank 0 only what
rank 0 holds (the third point) and knows nothing of the row permutation (the second), so every entry would
need a second pass anyway; this module does the same per-tensor redistribute once, in one loop that the
optimizer moments share. Names are canonical: activation checkpointing's `_checkpoint_wrapped_module.` and
compile's `_orig_mod.` are dropped.

Collective order: every rank walks its own state in module order; a DTensor's gather involves the ranks
of its mesh only, which hold the same parameters in the same order (mixer parallelism splits the tp
group by role, and each role's parameters live on a mesh of that role's ranks), so the walks never cross.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.parallel.tensor_parallel import (
    _LocalShortConvolution,
    segment_permutation,
    ssm_row_layout,
)

_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def canonical_name(name: str) -> str:
    """A parameter / buffer name without the wrappers' path parts (the unparallelized model's name)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def canonical_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical name -> parameter as held by this rank (sharded or not; absent: another rank's mixer)."""
    return {canonical_name(name): param for name, param in model.named_parameters()}


def row_permutations(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> row order of the head-split SSM tensors: `global_view = canonical[perm]`.

    Found from the model itself (a head-split mixer's conv was switched to `_LocalShortConvolution`, its
    sizes are the local ones): the split count is the global rows over the local segments' sum."""
    out: dict[str, torch.Tensor] = {}
    for module_name, mixer in model.named_modules():
        if not isinstance(mixer, (Mamba2Mixer, FastWeightMixer)) or not isinstance(mixer.conv, _LocalShortConvolution):
            continue
        layout = ssm_row_layout(mixer)  # local (per-rank) segment sizes
        local_rows = sum(layout["in_proj.weight"])
        parts = mixer.in_proj.weight.shape[0] // local_rows
        for path, segments in layout.items():
            if segments is None:
                continue
            full = tuple(size * parts for size in segments)
            out[canonical_name(f"{module_name}.{path}")] = segment_permutation(full, parts)
    return out


# ------------------------------------------------------------------------------------------------ save
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as one process would hold it (canonical names and rows, full CPU tensors) on
    rank 0; {} on the other ranks. Every rank must call it. Tied weights share one tensor (as in
    `state_dict()`), so safetensors' `save_model` stores them once."""
    perms = row_permutations(model)
    entries, aliases = [], {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = canonical_name(name)
        if id(tensor) in seen:
            aliases[key] = seen[id(tensor)]
            continue
        seen[id(tensor)] = key
        entries.append((key, tensor, perms.get(key)))
    out = _gather_to_rank0(entries)
    if _rank() == 0:
        for alias, key in aliases.items():
            out[alias] = out[key]
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq) by canonical name, full CPU tensors in
    the canonical rows, on rank 0 ({} elsewhere). Parameters without state yet are left out."""
    perms = row_permutations(model)
    entries = []
    for key, param in canonical_parameters(model).items():
        state = optimizer.state.get(param, {})
        unknown = set(state) - set(OPTIMIZER_STATE_KEYS)
        if unknown:
            raise ValueError(f"optimizer state of {key} has keys {sorted(unknown)}; only {OPTIMIZER_STATE_KEYS} are known")
        for slot in OPTIMIZER_STATE_KEYS:
            if slot in state:
                value = state[slot]
                rows = perms.get(key) if torch.is_tensor(value) and value.dim() > 0 else None
                entries.append((f"{key}\n{slot}", value, rows))
    flat = _gather_to_rank0(entries)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for joined, value in flat.items():
        key, _, slot = joined.partition("\n")
        out.setdefault(key, {})[slot] = value
    return out


def _gather_to_rank0(entries: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """Full canonical CPU tensors of `entries` (key, local tensor or DTensor, row permutation or None) on rank 0.

    Keys held by no process of rank 0's are sent by their lowest holder."""
    rank, world = _rank(), _world()
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    owners, specs = _catalogue(entries, world)
    for key, tensor, rows in entries:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if rows is not None:
            full = full[rows.argsort().to(full.device)]
        if rank == 0:
            out[key] = full.cpu().clone()
        elif owners[key][0] == rank and 0 not in owners[key]:
            pending[key] = full.cpu()  # off the device: the other half's weights and moments, all at once
    if world == 1:
        return out
    # the other half's mixers (mixer parallelism): the lowest holder sends, in one agreed order, through the
    # backend's device (NCCL moves CUDA tensors only; AdamW's `step` lives on the CPU)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    for key in sorted(k for k, holders in owners.items() if 0 not in holders):
        sender = owners[key][0]
        if rank == sender:
            dist.send(pending.pop(key).to(device).contiguous(), dst=0)
        elif rank == 0:
            shape, dtype = specs[key]
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=sender)
            out[key] = buffer.cpu()
    return out


# ------------------------------------------------------------------------------------------------ load
@torch.no_grad()
def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy a canonical full state dict (held by every rank) into this rank's part of `model`, in place.

    Returns (missing, unexpected) canonical keys: missing = held here but not in `state` under its name or a
    tied alias's; unexpected = in `state` but held by no rank (one all_gather_object of the names when
    distributed)."""
    perms = row_permutations(model)
    entries = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor under several names, saved once (safetensors)
    for name, tensor in entries.items():
        aliases.setdefault(id(tensor), []).append(canonical_name(name))
    held, missing = [], []
    for name, tensor in entries.items():
        key = canonical_name(name)
        held.append(key)
        source = next((alias for alias in [key, *aliases[id(tensor)]] if alias in state), None)
        if source is None:
            missing.append(key)
            continue
        full = state[source]
        if source in perms:
            full = full[perms[source]]
        _copy_full_into(tensor, full, key)
    known = set(_all_names(held))
    unexpected = sorted(k for k in state if k not in known)
    return missing, unexpected


@torch.no_grad()
def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, states: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Set this rank's optimizer state from canonical per-parameter states (`full_optimizer_state`'s format,
    held by every rank): each moment cut like its parameter (same mesh, placements, dtype); `step` as saved."""
    perms = row_permutations(model)
    for key, param in canonical_parameters(model).items():
        saved = states.get(key)
        if saved is None:
            optimizer.state.pop(param, None)
            continue
        new = {}
        for slot, value in saved.items():
            if slot == "step" or value.dim() == 0:
                new[slot] = value.detach().clone()  # AdamW keeps `step` a CPU float tensor (not capturable)
                continue
            full = value[perms[key]] if key in perms else value
            new[slot] = _like(param, full.to(param.dtype), f"{key} ({slot})")
        optimizer.state[param] = new


def _like(param: torch.Tensor, full: torch.Tensor, what: str) -> torch.Tensor:
    """`full` (canonical-shape, rows already permuted) cut the way `param` is: a DTensor with its mesh and
    placements, or a plain tensor on its device."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"{what}: the checkpoint holds shape {tuple(full.shape)}, the model {tuple(param.shape)}")
    if isinstance(param, DTensor):
        device = param.to_local().device
        return distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device).clone()


def _copy_full_into(target: torch.Tensor, full: torch.Tensor, what: str) -> None:
    local = _like(target, full.to(target.dtype), what)
    if isinstance(target, DTensor):
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(local)


# ------------------------------------------------------------------------------------------------ helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_names(names: Iterable[str]) -> list[str]:
    names = list(names)
    if _world() == 1:
        return names
    gathered: list[list[str]] = [[] for _ in range(_world())]
    dist.all_gather_object(gathered, names)
    return [n for part in gathered for n in part]


def _catalogue(entries, world: int) -> tuple[dict[str, list[int]], dict[str, tuple]]:
    """(key -> sorted ranks holding it, key -> (global shape, dtype)) over every rank's entries: one
    all_gather_object of names, shapes and dtypes (no tensors)."""
    mine = {key: (list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for key, tensor, _ in entries}
    if world == 1:
        gathered = [mine]
    else:
        gathered = [{} for _ in range(world)]
        dist.all_gather_object(gathered, mine)
    owners: dict[str, list[int]] = {}
    specs: dict[str, tuple] = {}
    for rank, part in enumerate(gathered):
        for key, (shape, dtype) in part.items():
            owners.setdefault(key, []).append(rank)
            specs.setdefault(key, (tuple(shape), getattr(torch, dtype)))
    return owners, specs
