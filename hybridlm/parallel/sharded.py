"""Sharded state of a parallelized model and its AdamW state for `torch.distributed.checkpoint` (DCP).

    state = sharded_state(model, optimizer)     # this rank's pieces: "model.<name>", "optim.<name>.<slot>"
    dcp.save(state, checkpoint_id=directory)    # every rank writes its own shards
    targets = load_targets(model, optimizer, saved_keys)   # empty pieces of the same keys, cut as this mesh needs
    dcp.load(targets, checkpoint_id=directory)  # every rank reads only the chunks that overlap its pieces
    apply_loaded(model, optimizer, targets)

No rank ever holds the whole model: a save writes each rank's local shards, a load reads each rank's share, and
DCP reshards between meshes from the global offsets of every chunk. What makes a checkpoint of one mesh load
under any other (another FSDP2 width, tp, cp, mixer parallelism, one process) is that the keys and the global
view of every tensor are the unparallelized model's (`hybridlm.parallel.checkpoint`'s canonical layout):

- names: `get_model_state_dict` drops the activation-checkpoint and compile wrappers, as `canonical_name` does;
- DTensors (FSDP2, TP) are saved as they are: their global view is the canonical tensor and DCP records each
  rank's chunk by offset;
- the SSM head split permutes the rows of a split `in_proj` / `conv` weight (and bias, and their AdamW
  moments): such a tensor is gathered (one tensor at a time), put back in canonical row order and cut evenly
  over its own mesh (Shard(0) on every mesh dim) before it is saved; loading reads that even cut, gathers it and
  applies this model's permutation;
- mixer parallelism: a rank saves and loads only the mixers it holds (DCP merges the ranks' keys).

The optimizer's per-parameter state (`step`, `exp_avg`, `exp_avg_sq`) is walked by canonical parameter name, as
`full_optimizer_state` does, rather than through `get_optimizer_state_dict`: the trainer's groups carry their
canonical `param_names` (empty on a mixer-parallel rank that holds none of a group) and its resume takes every
hyperparameter from the current config, so only the tensors belong in the checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed.tensor as dtensor
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hybridlm.parallel.checkpoint import (
    OPTIMIZER_STATE_KEYS,
    _copy_full_into,
    _like,
    canonical_name,
    canonical_parameters,
    row_permutations,
)

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optim."


def model_key(name: str) -> str:
    """The DCP key of a canonical model state name."""
    return MODEL_PREFIX + name


def optimizer_key(name: str, slot: str) -> str:
    """The DCP key of one optimizer slot (`step`, `exp_avg`, ...) of the canonical parameter `name`."""
    return f"{OPTIMIZER_PREFIX}{name}.{slot}"


# ------------------------------------------------------------------------------------------------ save
def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """This rank's pieces of the model and optimizer state under canonical DCP keys (see the module docstring).
    Every rank must call it (a head-split tensor's gather involves its mesh)."""
    perms = row_permutations(model)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _model_state(model).items():
        state[model_key(name)] = _canonical_rows(tensor, perms[name]) if name in perms else tensor
    if optimizer is not None:
        for name, param in canonical_parameters(model).items():
            slots = optimizer.state.get(param, {})
            unknown = set(slots) - set(OPTIMIZER_STATE_KEYS)
            if unknown:
                raise ValueError(f"optimizer state of {name} has keys {sorted(unknown)}; only {OPTIMIZER_STATE_KEYS} "
                                 "are known")
            for slot, value in slots.items():
                if name in perms and value.dim() > 0:
                    value = _canonical_rows(value, perms[name])
                state[optimizer_key(name, slot)] = value
    return state


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`get_model_state_dict` (sharded DTensors, wrapper-free names), checked to use the canonical names."""
    state = get_model_state_dict(model, options=StateDictOptions())
    odd = [name for name in state if canonical_name(name) != name]
    if odd:
        raise RuntimeError(f"get_model_state_dict kept wrapper names ({odd[:3]}); hybridlm.parallel.checkpoint."
                           "canonical_name would drop them, so checkpoints of other meshes would not match")
    return state


def _canonical_rows(tensor: torch.Tensor, rows: torch.Tensor) -> DTensor:
    """A head-split tensor (global view `canonical[rows]`) in canonical row order, cut evenly over its own mesh:
    gathered (one tensor), reordered, and this rank's even share copied out (the gathered tensor is freed)."""
    if not isinstance(tensor, DTensor):
        raise TypeError("a head-split SSM tensor is a DTensor (tensor parallelism); got a plain tensor")
    full = tensor.full_tensor()
    full = full[rows.argsort().to(full.device)]
    mesh = tensor.device_mesh
    even = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim, src_data_rank=None)
    return DTensor.from_local(even.to_local().clone(), mesh, even.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


# ------------------------------------------------------------------------------------------------ load
def load_targets(model: nn.Module, optimizer: torch.optim.Optimizer | None, saved: set[str]) -> dict[str, torch.Tensor]:
    """Tensors for `dcp.load` to fill in place, under the keys `sharded_state` would write for this rank: the
    model's own parameters and buffers (head-split ones as an even canonical cut), and for the optimizer new
    moments cut like their parameter, for every slot that the checkpoint (`saved`: its keys) holds."""
    perms = row_permutations(model)
    targets: dict[str, torch.Tensor] = {}
    for name, tensor in _model_state(model).items():
        targets[model_key(name)] = _even_cut_like(tensor) if name in perms else tensor
    if optimizer is not None:
        for name, param in canonical_parameters(model).items():
            for slot in OPTIMIZER_STATE_KEYS:
                key = optimizer_key(name, slot)
                if key not in saved:
                    continue
                if slot == "step":
                    targets[key] = torch.zeros((), dtype=torch.float32)  # AdamW's step: a CPU float scalar
                elif name in perms:
                    targets[key] = _even_cut_like(param)
                else:
                    targets[key] = torch.zeros_like(param.detach())
    return targets


def _even_cut_like(tensor: torch.Tensor) -> DTensor:
    """An empty DTensor of `tensor`'s global shape and dtype, Shard(0) on every dim of its mesh."""
    mesh = tensor.device_mesh
    return dtensor.empty(tuple(tensor.shape), dtype=tensor.dtype, device_mesh=mesh, placements=[Shard(0)] * mesh.ndim)


@torch.no_grad()
def apply_loaded(model: nn.Module, optimizer: torch.optim.Optimizer | None, targets: dict[str, torch.Tensor]) -> None:
    """After `dcp.load(targets)`: the model's tensors set (head-split ones gathered and permuted into this mesh's
    rows) and the optimizer's state replaced by the loaded slots (parameters without saved state have none)."""
    perms = row_permutations(model)
    plain = {}
    for name, tensor in _model_state(model).items():
        loaded = targets[model_key(name)]
        if name in perms:
            _copy_full_into(tensor, loaded.full_tensor()[perms[name].to(loaded.device)], name)
        else:
            plain[name] = loaded
    set_model_state_dict(model, plain, options=StateDictOptions(strict=False))
    if optimizer is None:
        return
    for name, param in canonical_parameters(model).items():
        slots = {}
        for slot in OPTIMIZER_STATE_KEYS:
            value = targets.get(optimizer_key(name, slot))
            if value is None:
                continue
            if name in perms and slot != "step":
                full = value.full_tensor()[perms[name].to(value.device)]
                value = _like(param, full.to(param.dtype), f"{name} ({slot})")
            slots[slot] = value
        if slots:
            optimizer.state[param] = slots
        else:
            optimizer.state.pop(param, None)
