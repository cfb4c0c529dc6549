"""One process or many under torchrun: the process group and device mesh, `hybridlm.parallel`, full checkpoints.

    ctx = init_distributed(config, device="auto")             # RANK / WORLD_SIZE / LOCAL_RANK; mesh from `parallel`
    model = parallelize(model, config, ctx)                    # hybridlm.parallel.parallelize: TP -> AC -> compile -> FSDP2
    with gradient_sync(model, enabled=last_micro_step): loss.backward()
    norm = clip_grad_norm(model, max_norm, ctx, names=names)   # the global norm over sharded / replicated grads
    model_sd, optim_sd = full_state_dicts(model, optimizer, ctx, groups=canonical_groups)  # rank 0 (others: {})
    load_full_state_dicts(model, optimizer, model_sd, optim_sd, ctx, groups=canonical_groups)  # every rank

Launch (torchrun sets the environment; gloo on CPU, nccl on CUDA unless `distributed.backend` says):

    torchrun --nproc_per_node 8 -m hybridlm.cli train --config configs/hybrid-125m.yaml             # FSDP2 x 8
    torchrun --nproc_per_node 8 -m hybridlm.cli train --config configs/hybrid-125m.yaml --set parallel.tp=2
    torchrun --nproc_per_node 2 -m hybridlm.cli train --set train.device=cpu   # CPU, gloo

The mesh (`parallel` section, `hybridlm.parallel.build_mesh`) has the dims (dp_replicate, dp_shard, cp, tp).
Rows: each data-parallel rank (a (dp_replicate, dp_shard) coordinate, `DistContext.dp_rank`) reads its own
rows; the cp and tp ranks of one data-parallel rank read the same rows (cp then splits each row's sequence).
FSDP2 averages gradients over the dp_size data-parallel ranks; context parallelism's gradients are summed over
cp by `hybridlm.parallel.reduce_context_parallel_grads`.

Full checkpoints (`full_state_dicts`) have one layout whatever the mesh and world size: the unparallelized model's
state dict and the optimizer state as a single-process AdamW over the same parameter groups writes it (states keyed
by the parameter's position in the groups). `hybridlm.parallel.checkpoint` gathers and cuts the tensors (undoing
the SSM head split's row permutation and collecting the mixers that mixer parallelism spreads over ranks),
so a run saved under tp=2 x dp_shard=2 resumes in one process and the other way round. Under torchrun the trainer
writes sharded checkpoints instead (`hybridlm.training.sharded_checkpoint`), which reshard the same way.

Every collective here is a no-op with one process, so the trainer calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank / world / device, and with several processes the resolved
    `hybridlm.parallel.ParallelConfig` and its 4-D `DeviceMesh` (None with one process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (one process)
    parallel: Any = None  # hybridlm.parallel.ParallelConfig (resolved); None with one process
    mesh: Any = None  # torch DeviceMesh; None with one process
    owns_group: bool = False  # this context created the process group (one it found, e.g. a harness's, stays)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): the ranks that read different rows."""
        return 1 if self.parallel is None else self.parallel.dp_replicate * self.parallel.dp_shard

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        return self.mesh["dp_replicate"].get_local_rank() * self.parallel.dp_shard + self.mesh["dp_shard"].get_local_rank()

    @property
    def cp_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.cp

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return None if self.cp_size == 1 else self.mesh["cp"].get_group()

    @property
    def counts_rows(self) -> bool:
        """True on the one rank of each tp group whose per-row sums (loss, label counts) enter a world-wide
        sum: the tp ranks of a data-parallel rank hold the same rows, which must be counted once."""
        return self.mesh is None or self.mesh["tp"].get_local_rank() == 0

    def describe(self) -> str:
        if self.parallel is None:
            return "single process"
        p = self.parallel
        return (f"dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {p.cp} x tp {p.tp}"
                + (f", mixer parallelism {p.mixer_parallel}" if p.mixer_parallel != "off" else ""))


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


def init_distributed(config: Any, *, device: str = "auto", timeout_s: float = 1800) -> DistContext:
    """The process group from torchrun's environment (or none for one process), this rank's device, and the
    device mesh of the config's `parallel` section (its sizes checked against the world size: ConfigError).

    An already initialized default group (e.g. created by a test harness) is reused."""
    from hybridlm.training.plan import resolve_parallel

    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    parallel = resolve_parallel(config, world)  # before any process group: a wrong size fails fast
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistContext(device=dev)
    backend = config.distributed.backend
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        from hybridlm.training.typed_yaml import ConfigError

        raise ConfigError(f"distributed.backend: nccl needs CUDA devices, this run's is {dev}; set "
                          "distributed.backend=gloo (or auto) on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns_group = not dist.is_initialized()
    if owns_group:
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    from hybridlm.parallel import build_mesh

    mesh = build_mesh(parallel, device_type=dev.type)
    return DistContext(rank, world, local_rank, dev, dist.get_backend(), parallel, mesh, owns_group)


def destroy_distributed(ctx: DistContext, *, together: bool = True) -> None:
    """Leave together, then tear the process group down (only one this process's `init_distributed` created: a group
    it found, e.g. a test harness's, is its owner's to destroy). Without the barrier a rank could destroy its group while
    another still finishes its last save (seen on 2 gloo CPU processes: "terminate called without an active
    exception", SIGABRT at exit). A barrier that fails (a peer already gone) does not stop the teardown.

    `together=False`: this rank leaves on its own (an error, or a stop at once), while the others may be inside a
    collective that never completes without it: no barrier, which would wait for them until the group's timeout; the
    rank exits with its error and the launcher stops the others."""
    if ctx.distributed and ctx.owns_group and dist.is_initialized():
        if together:
            # A peer that exited first (DistBackendError, a RuntimeError) reports its own error through the launcher.
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- wrapping
def parallelize(model: nn.Module, config: Any, ctx: DistContext) -> nn.Module:
    """Apply the config's parallelism to `model` (already on `ctx.device`, the same weights on every rank) in
    place and return it: `hybridlm.parallel.parallelize` under torchrun (TP or mixer parallelism ->
    compile -> activation checkpointing -> FSDP2 over the data-parallel dims). With one process there is no
    mesh: the same two single-device steps (compile per block, then activation checkpointing around it) are
    applied."""
    from hybridlm.parallel.parallelize import parallelize as parallelize_model
    from hybridlm.parallel.parallelize import wrap_blocks

    mode = config.train.compile_mode
    if ctx.mesh is not None:
        return parallelize_model(model, ctx.mesh, ctx.parallel, compile=config.train.compile, compile_mode=mode)
    wrap_blocks(model, activation_checkpointing=config.parallel.activation_checkpointing, compile=config.train.compile,
                compile_mode=mode, recompute_mixers=config.parallel.recompute_mixers)
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """After a forward under no_grad (evaluation, samples): FSDP2 keeps the root's parameters unsharded for
    the backward it expects, and the next training step would then not reduce the root's gradients
    (hybridlm/parallel/parallelize.py). Reshard them; a no-op without FSDP2."""
    if is_fsdp(model):
        model.reshard()


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Inside: backward reduce-scatters (FSDP2) gradients only if `enabled`; use enabled=False for every
    micro-step but the last of a gradient-accumulation step."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@contextlib.contextmanager
def context_parallel(model: nn.Module, ctx: DistContext):
    """Inside: the model's forward runs on this rank's chunk of every row (`hybridlm.parallel.context_parallel`);
    nothing with cp = 1."""
    if ctx.cp_size == 1:
        yield model
        return
    from hybridlm.parallel import context_parallel as cp_hooks

    with cp_hooks(model, ctx.cp_group):
        yield model


def shard_rows(batch: dict, ctx: DistContext) -> dict:
    """This cp rank's chunk of a batch's rows: input_ids and labels (already the next tokens: shifted before
    the split) cut along the sequence, position_ids the chunk's global positions. Unchanged with cp = 1."""
    if ctx.cp_size == 1:
        return batch
    from hybridlm.parallel import shard_sequence

    group = ctx.cp_group
    input_ids, positions = shard_sequence(batch["input_ids"], group)
    labels, _ = shard_sequence(batch["labels"], group)
    return {**batch, "input_ids": input_ids, "labels": labels, "position_ids": positions}


def reduce_context_parallel_grads(model: nn.Module, ctx: DistContext) -> None:
    """Sum the gradients over the cp ranks (each holds its chunk's share of the loss); no-op with cp = 1."""
    if ctx.cp_size > 1:
        from hybridlm.parallel import reduce_context_parallel_grads as reduce

        reduce(model, ctx.cp_group)


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


def row_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over the world of per-rank sums over rows (losses, label counts), each row counted once: the tp
    ranks of one data-parallel rank hold the same rows, so only tp rank 0 contributes."""
    return all_reduce_sum(values if ctx.counts_rows else torch.zeros_like(values), ctx)


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


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, ctx: DistContext, *, names: list[str]) -> float:
    """The 2-norm of the whole model's gradient, as one process computes it, and clip to `max_norm` (torch's
    rule: scale by min(1, max_norm / (norm + 1e-6))); returns the norm before clipping.

    `names`: every canonical parameter name of the model (the same list on every rank). Why not
    `clip_grad_norm_` (torch 2.13, checked on gloo): with tp only it raises (`_foreach_norm` got mixed
    torch.Tensor and DTensor: the embeddings and norms are not split), with tp x dp_shard too (`stack` of norms
    on different meshes: (dp_shard, tp) and (dp_shard,)); under mixer parallelism it could not see the mixers
    other ranks hold anyway. Here each rank adds, per parameter, the squared sum of its local
    shard divided by the number of mesh ranks holding the same shard (Replicate dims), and 1 / mesh size to
    a count of the parameter's mesh copies; after one all-reduce, norm^2 = sum(squares / copies) counts every
    element once."""
    from torch.distributed.tensor import DTensor

    from hybridlm.parallel.checkpoint import canonical_parameters

    index = {name: i for i, name in enumerate(names)}
    squares: list[torch.Tensor] = []
    slots: list[int] = []
    copies = torch.zeros(len(names), dtype=torch.float64)
    grads: list[torch.Tensor] = []
    for name, param in canonical_parameters(model).items():
        grad = param.grad
        if grad is None:
            continue
        grads.append(grad)
        if isinstance(grad, DTensor):
            local = grad.to_local()
            mesh = grad.device_mesh
            replicas = math.prod(mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate())
            mesh_size = mesh.size()
        else:
            local, replicas, mesh_size = grad, 1, 1
        squares.append(local.detach().double().pow(2).sum() / replicas)
        slots.append(index[name])
        copies[index[name]] += 1.0 / mesh_size
    summed = torch.zeros(len(names), dtype=torch.float64)
    if squares:
        summed.index_add_(0, torch.tensor(slots), torch.stack(squares).cpu())
    totals = all_reduce_sum(torch.cat([summed, copies]), ctx)
    summed, copies = totals[: len(names)], totals[len(names):]
    held = copies > 0
    norm = float((summed[held] / copies[held]).sum().sqrt())
    if math.isfinite(norm) and math.isfinite(max_norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return norm


# ----------------------------------------------------------------------------------------------- full state
def _flat_names(groups: list[dict]) -> list[str]:
    """Canonical parameter names in optimizer order (the groups carry `param_names`, see training.optim)."""
    names: list[str] = []
    for index, group in enumerate(groups):
        if "param_names" not in group:
            raise ValueError(f"optimizer param group {index} has no param_names; build it with build_param_groups")
        names += list(group["param_names"])
    return names


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext, *, groups: list[dict]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state_dict, optimizer state_dict) in the single-process format, full tensors on the CPU.

    `groups`: the canonical parameter groups (every parameter's name, as the unparallelized model has them;
    a rank's own groups may lack the mixers other ranks hold). Every rank must call it; only rank 0 gets
    the dicts, the other ranks get ({}, {})."""
    from hybridlm.parallel.checkpoint import full_model_state_dict, full_optimizer_state

    model_sd = full_model_state_dict(model)
    moments = full_optimizer_state(model, optimizer)
    if not ctx.is_main:
        return {}, {}
    names = _flat_names(groups)
    state = {i: moments[name] for i, name in enumerate(names) if name in moments}
    saved_groups, start = [], 0
    for local, canonical in zip(optimizer.param_groups, groups):
        group = {k: v for k, v in local.items() if k not in ("params", "param_names")}
        count = len(canonical["param_names"])
        group["params"] = list(range(start, start + count))
        group["param_names"] = list(canonical["param_names"])
        start += count
        saved_groups.append(group)
    return model_sd, {"state": state, "param_groups": saved_groups}


def load_full_state_dicts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any] | None,
    ctx: DistContext,
    *,
    groups: list[dict] | None = None,
) -> None:
    """Load `full_state_dicts` output (read on every rank) into this rank's part of the model and optimizer.

    As torch's `Optimizer.load_state_dict`, the saved groups' hyperparameters (lr, betas, eps, base_lr, ...)
    replace the optimizer's; a caller whose current settings should win (the trainer's --resume) puts them back.
    Raises RuntimeError when the checkpoint does not fit the model (missing or unexpected names)."""
    from hybridlm.parallel.checkpoint import (
        load_full_model_state_dict,
        load_full_optimizer_state,
    )

    missing, unexpected = load_full_model_state_dict(model, model_sd)
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}; "
            "build the model with the configuration it was saved with"
        )
    if optimizer is None or optim_sd is None:
        return
    if len(optim_sd["param_groups"]) != len(optimizer.param_groups):  # checked before anything is loaded
        raise RuntimeError(f"the checkpoint has {len(optim_sd['param_groups'])} optimizer groups, the optimizer "
                           f"{len(optimizer.param_groups)}; build it with the configuration it was saved with")
    names = _flat_names(groups if groups is not None else optimizer.param_groups)
    states = {names[int(i)]: value for i, value in optim_sd["state"].items()}
    load_full_optimizer_state(model, optimizer, states)
    for local, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):
        local.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
