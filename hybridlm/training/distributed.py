"""One process or many under torchrun: the process group, `parallelize`, and rank-0 full checkpoints.

    ctx = init_distributed(config.distributed, device="auto")   # reads RANK / WORLD_SIZE / LOCAL_RANK
    model = parallelize(model, config, ctx)                       # compile -> FSDP2 or DDP, in one place
    with gradient_sync(model, enabled=last_micro_step): loss.backward()
    model_sd, optim_sd = full_state_dicts(model, optimizer, ctx)  # on rank 0 (others: empty dicts)
    load_full_state_dicts(model, optimizer, model_sd, optim_sd, ctx)   # on every rank

Launch (torchrun sets the environment; gloo on CPU, nccl on CUDA unless `distributed.backend` says):

    torchrun --nproc_per_node 8 -m hybridlm.cli train --config configs/hybrid-125m.yaml
    torchrun --nproc_per_node 2 -m hybridlm.cli train --set train.device=cpu   # CPU, gloo

Strategies (`distributed.strategy`): "ddp" (`DistributedDataParallel`: replicated weights, all-reduced
gradients) or "fsdp" (FSDP2, `torch.distributed.fsdp.fully_shard` on every hybrid block, then on the
root: parameters, gradients and AdamW moments sharded over the ranks). With one process neither wraps.

Checkpoints have one format whatever the strategy and world size: the unwrapped model's state_dict and
the optimizer's state_dict as a single-process AdamW over the same parameter groups would write it
(states keyed by the parameter's position in the groups). FSDP gathers the full tensors with
`torch.distributed.checkpoint.state_dict` (full_state_dict=True, cpu_offload=True) and converts the
optimizer state between that API's parameter names and positions. So a run saved under 2 ranks resumes
under 1 and the other way round.

Every collective here is a no-op with one process, so the trainer calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (one process)
    strategy: str = "ddp"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """"auto": the local rank's GPU when CUDA is available, else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but CUDA is not available; use train.device=cpu")
    return torch.device("cuda", local_rank)


def init_distributed(section: Any, *, device: str = "auto", timeout_s: float = 1800) -> DistContext:
    """The process group from torchrun's environment (or none for one process) and this rank's device.

    `section` is the config's `distributed` section (strategy, backend). An already initialized default
    group (e.g. created by a test harness) is reused.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistContext(device=dev, strategy=section.strategy)
    backend = section.backend
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise RuntimeError("distributed.backend nccl needs CUDA devices; use gloo on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank, world, local_rank, dev, dist.get_backend(), section.strategy)


def destroy_distributed(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- wrapping
def parallelize(model: nn.Module, config: Any, ctx: DistContext) -> nn.Module:
    """Apply `torch.compile` (per block, if `train.compile`) and then FSDP2 or DDP per
    `distributed.strategy`; returns the module to call (the same object for FSDP2, a DDP wrapper for
    DDP, `model` itself with one process). `model` must already be on `ctx.device`."""
    blocks = list(getattr(getattr(model, "model", model), "layers", []))
    if config.train.compile:
        for block in blocks:
            block.compile()
    if not ctx.distributed:
        return model
    if ctx.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The model without a DDP wrapper (FSDP2 shards in place, so its module is the model)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Inside: backward all-reduces (DDP) / reduce-scatters (FSDP2) gradients only if `enabled`; use
    enabled=False for every micro-step but the last of a gradient-accumulation step."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    elif _is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


# ----------------------------------------------------------------------------------------------- collectives
def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks (a copy; float64 on CPU for gloo-friendly, exact-enough scalars)."""
    out = values.detach().to(torch.float64).clone()
    if not ctx.distributed:
        return out
    if ctx.backend == "nccl":
        out = out.to(ctx.device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (picklable Python objects only; used for small decisions)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=ctx.device if ctx.backend == "nccl" else None)
    return box[0]


def grad_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """`clip_grad_norm_`'s result as a plain tensor (FSDP2 returns a DTensor)."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# ----------------------------------------------------------------------------------------------- full state
def _param_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in optimizer order (the groups carry `param_names`, see training.optim)."""
    names: list[str] = []
    for index, group in enumerate(optimizer.param_groups):
        if "param_names" not in group:
            raise ValueError(f"optimizer param group {index} has no param_names; build it with build_param_groups")
        names += list(group["param_names"])
    return names


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state_dict, optimizer state_dict) in the single-process format, full tensors on the CPU.

    Every rank must call it (FSDP gathers); only rank 0 gets the dicts, the other ranks get ({}, {}).
    """
    if not _is_fsdp(model):
        if not ctx.is_main:
            return {}, {}
        model_sd = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
        return model_sd, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    named_osd = get_optimizer_state_dict(model, optimizer, options=options)
    if not ctx.is_main:
        return {}, {}
    index = {name: i for i, name in enumerate(_param_names(optimizer))}
    state = {index[name]: value for name, value in named_osd["state"].items()}
    groups = []
    for group in named_osd["param_groups"]:
        group = dict(group)
        group["params"] = [index[name] for name in group["params"]]
        groups.append(group)
    return model_sd, {"state": state, "param_groups": groups}


def load_full_state_dicts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any] | None,
    ctx: DistContext,
) -> None:
    """Load `full_state_dicts` output (read on every rank) into a plain, DDP or FSDP2 model and its optimizer.

    Missing model keys are allowed only for weights tied to a loaded one (saved once by safetensors).
    """
    raw = unwrap(model)
    if not _is_fsdp(model):
        missing, unexpected = raw.load_state_dict(model_sd, strict=False)
        _check_keys(raw, missing, unexpected)
        if optimizer is not None and optim_sd is not None:
            optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(model, model_sd, options=options)
    _check_keys(raw, result.missing_keys, result.unexpected_keys)
    if optimizer is not None and optim_sd is not None:
        names = _param_names(optimizer)
        state = {names[int(i)]: value for i, value in optim_sd["state"].items()}
        groups = []
        for group in optim_sd["param_groups"]:
            group = dict(group)
            group["params"] = [names[int(i)] for i in group["params"]]
            groups.append(group)
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))


def _check_keys(raw: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    tied = set()
    for names in _shared_parameter_names(raw):
        if any(n not in missing for n in names):
            tied |= set(names)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}; "
            "build the model with the configuration it was saved with"
        )


def _shared_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of state_dict names that are one tensor (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
