"""`TrainLoop`: the one training loop. What it trains on and what it minimizes are parts passed in.

    loop = TrainLoop(model, optimizer, data=source, loss=loss, plan=plan, clip=clip)
    loop.run(total_updates, should_stop=stop_flag, hooks=[after_update])   # or loop.update() one at a time

One update (`TrainLoop.update`, step s 0-based):
1. `plan(s)` -> `UpdatePlan(lr, wd, micro_batches)`: the schedule's lr / wd factors (every AdamW group's lr =
   base_lr x lr, weight_decay = base_weight_decay x wd: `hybridlm.training.optim.apply_schedule`) and how many
   micro-batches this update draws (more than one: gradient accumulation; a batch rampup changes it per update);
2. `data.next_micro_batches(s, n)` -> the micro-batches, on the device; `loss.count(batch)` of each, summed over
   the ranks (`distributed.row_sum`) -> the global count N (at least 1);
3. per micro-batch: `loss(model, batch)` (a scalar: the sum over the batch's `count` items), backward of
   value x dp / N (dp: FSDP2 averages over the data-parallel ranks), gradients synchronized on the last
   micro-batch only (`distributed.gradient_sync`), then summed over context-parallel ranks: the gradient of the
   mean over every item of the global batch, however it is split into ranks, chunks and micro-batches;
4. with a `guard` (`StepGuard`), the loss (each micro-batch's value added in float64 right after its backward)
   is read back and all-reduced; `clip(model)` -> the gradient norm (before clipping); the guard skips the update
   for a non-finite loss or norm (gradients zeroed) or, after a streak, raises `TrainingDivergedError`; otherwise
   the optimizer steps; the gradients are zeroed for the next update.

The parts (all typed below, each small):
- `DataSource`: `next_micro_batches(step, count)`, `state_dict()`, `load_state_dict(state)` (what a checkpoint
  saves so a resumed run draws the same batches). `BatchFunction` adapts a `batch_fn(step) -> dict`.
- `Loss`: `count(batch)` (known before the forward: every micro-batch's backward is already scaled by the
  global count) and `__call__(model, batch)` -> the summed loss. A mean loss counts 1 per micro-batch, so
  micro-batches average their means. `TokenCrossEntropy` (pretraining; SFT with the prompt's labels at -100),
  `ModelLoss` (`model(**batch).loss`, the model's own mean). A preference loss (DPO) runs its two forwards
  inside `__call__` and counts pairs.
- `plan`, `clip` (`distributed.clip_grad_norm` for sharded models, `local_grad_clip` for one process), `guard`.

Pretraining (`hybridlm.training.trainer.Trainer`) plugs in its packing loader (prepared rows: to the device,
this rank's context-parallel chunk), `TokenCrossEntropy` under its forward context (bf16 autocast when
train.dtype is bf16, context parallelism), the WSD / power schedule with the batch rampup, the distributed
gradient norm and the guard. A small model on a synthetic task (one micro-batch per update, the model's mean
loss, AdamW + clipping, bf16 autocast on CUDA, optionally a compiled forward; eval every N updates, a checkpoint
every M, a stop flag) plugs in like this:

    source = BatchFunction(batch_fn, device, state=generator_state(rng))   # batch_fn(step) -> {input_ids, labels}
    loss = ModelLoss(forward=torch.compile(model) if compile else None,
                     context=lambda model: autocast_for(device))            # bf16 autocast on CUDA only
    schedule = ScheduleConfig(kind="cosine", warmup=warmup, min_lr_ratio=min_lr_ratio)
    loop = TrainLoop(model, optimizer, data=source, loss=loss, plan=schedule_plan(schedule, steps),
                     clip=local_grad_clip(grad_clip), step=first_step)
    running = 0.0

    def after_update(loop: TrainLoop, out: UpdateOutput) -> None:
        nonlocal running
        running = running + out.losses[0]                  # the loss as the model gave it, on the device: no sync
        if loop.step % log_every == 0 or loop.step == steps:
            ...                                            # log float(running) / updates since the last log, reset
        if eval_fn is not None and ((eval_every and loop.step % eval_every == 0) or loop.step == steps):
            evaluate(loop.step)
        if loop.step < steps:
            if checkpoint_every and loop.step % checkpoint_every == 0: save(loop.step)
            if should_stop():
                save(loop.step)
                raise TrainingInterrupted(loop.step, steps, stem)   # a hook may end the run by raising

    loop.run(steps, hooks=[after_update])

With one micro-batch and a mean loss the global count is 1: the backward is the loss's own (no scaling), so
such a loop's numerics are those of `loss.backward(); clip; optimizer.step()`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from hybridlm.training import distributed as D
from hybridlm.training.guard import StepGuard
from hybridlm.training.optim import apply_schedule
from hybridlm.training.schedules import ScheduleConfig, schedule_factors

IGNORE_INDEX = -100  # labels that score nothing (padding, prompts, document ends without a next token)

Batch = dict[str, Any]
ForwardContext = Callable[[nn.Module], contextlib.AbstractContextManager]  # entered around a model's forward


class DataSource(Protocol):
    """Where an update's micro-batches come from. Its state is part of a checkpoint."""

    def next_micro_batches(self, step: int, count: int) -> list[Batch]:
        """The `count` micro-batches of update `step` (0-based), their tensors on the training device."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position in the data (a checkpoint saves it)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` (a resumed run draws the batches an uninterrupted one would)."""
        ...


class Loss(Protocol):
    """What an update minimizes: a sum over items (tokens, sequences, pairs) that `count` counts."""

    def count(self, batch: Batch) -> int:
        """The items this micro-batch's loss sums over, known before its forward."""
        ...

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The summed loss of one micro-batch: a scalar tensor with a graph to the model's parameters."""
        ...


class UpdatePlan(NamedTuple):
    """What update `step` uses: lr = base_lr x `lr`, weight_decay = base_weight_decay x `wd`, and the number of
    micro-batches it accumulates."""

    lr: float
    wd: float
    micro_batches: int = 1


@dataclass
class UpdateOutput:
    """What one update did."""

    step: int  # updates done, this one included
    plan: UpdatePlan
    # each micro-batch's loss value as the loss returned it, detached, on the device (reading it waits for the device).
    # Read it before the next update's forward: a loss that a CUDA graph outputs (a compiled forward in
    # "reduce-overhead" mode) is overwritten by the graph's next replay.
    losses: list[torch.Tensor]
    count: float  # the global count N the backward divided by
    grad_norm: float | torch.Tensor | None  # what `clip` returned: the norm before clipping; None without clipping
    skipped: bool  # the guard skipped the optimizer step
    seconds: float
    loss: float | None = None  # with a guard: the mean loss per item over every rank's micro-batches (sum / N)


@dataclass
class BatchFunction:
    """A `DataSource` from a function of the update's step: `batch_fn(step) -> {name: tensor}` (on the CPU; moved to
    `device` here), called once per micro-batch. `state` is (get, set) of the JSON-able state that `batch_fn`
    draws from (its random generator, a loader's position): `state_dict()` saves it."""

    batch_fn: Callable[[int], Batch]
    device: torch.device | str
    state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None

    def next_micro_batches(self, step: int, count: int) -> list[Batch]:
        return [{k: v.to(self.device, non_blocking=True) for k, v in self.batch_fn(step).items()}
                for _ in range(count)]

    def state_dict(self) -> dict[str, Any]:
        return {"batch_state": self.state[0]() if self.state is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.state is not None:
            self.state[1](state["batch_state"])


def _no_context(model: nn.Module) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class TokenCrossEntropy:
    """Summed next-token cross entropy over the labels that are not `IGNORE_INDEX`, in fp32 at least (16-bit logits
    are cast; float64 ones stay float64), computed by the model, by default without holding the logits
    (`model(..., shift_labels=labels, return_logits=False)`: its LM head and the cross entropy over row chunks).

    batch: `labels` [B, T] (the next tokens, shifted already; -100 where nothing is scored) and the model's keyword
    arguments (`input_ids`, `position_ids`, `cu_seqlens`, ...); labels are reshaped to input_ids' shape, the rows as
    the model sees them. `context(model)` is entered around the forward and the loss (autocast, context
    parallelism).

    `scored_only`: the model computes logits only at the time positions some row scores (`logits_to_keep` as a
    tensor of positions), which saves the LM head's time and memory where most labels are -100 (SFT trains on the
    assistant's tokens); the positions are data-dependent shapes, so not for CUDA graphs.
    `chunked=False`: the model computes the [B, T, V] logits and then the loss from them (`train.lm_head_loss`
    "logits"; the same values up to rounding, more memory)."""

    context: ForwardContext = _no_context
    scored_only: bool = False
    chunked: bool = True

    def count(self, batch: Batch) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = batch["labels"].reshape(inputs["input_ids"].shape)  # [B, T] as the model sees the rows
        if self.scored_only:
            inputs["logits_to_keep"] = scored_positions(labels)
            labels = labels[:, inputs["logits_to_keep"]]
        with self.context(model):
            # The model's chunked LM head + cross entropy (no [B, T, V] logits held); num_items_in_batch=1: the sum.
            return model(**inputs, shift_labels=labels, num_items_in_batch=1, return_logits=not self.chunked).loss


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """The time positions [K] at which some row of labels [B, T] scores (is not `IGNORE_INDEX`)."""
    return (labels != IGNORE_INDEX).any(0).nonzero().squeeze(1)


@dataclass
class ModelLoss:
    """The loss the model computes itself, `model(**batch).loss` (a mean over the batch): one count per micro-batch.
    `forward` runs instead of the model (e.g. its `torch.compile`d form; the loop's `model` stays the module that
    owns the parameters); `context(model)` is entered around it (e.g. bf16 autocast)."""

    forward: Callable[..., Any] | None = None
    context: ForwardContext = _no_context

    def count(self, batch: Batch) -> int:
        return 1

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        with self.context(model):
            return (self.forward if self.forward is not None else model)(**batch).loss


def schedule_plan(schedule: ScheduleConfig, total: int) -> Callable[[int], UpdatePlan]:
    """`plan` for a schedule counted in updates over a run of `total` updates, one micro-batch each."""

    def plan(step: int) -> UpdatePlan:
        factors = schedule_factors(schedule, total=total, step=step)
        return UpdatePlan(factors.lr, factors.wd)

    return plan


def local_grad_clip(max_norm: float) -> Callable[[nn.Module], torch.Tensor] | None:
    """`clip` for a model in one process: `torch.nn.utils.clip_grad_norm_` to `max_norm`; None (no clipping) for
    max_norm <= 0."""
    if max_norm <= 0:
        return None
    return lambda model: nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def allocate_missing_grads(model: nn.Module) -> None:
    """Give every trainable parameter without a `.grad` a zero one allocated here. Backward then adds into it: with
    the backward inside CUDA graphs, a `.grad` that autograd made would be a graph's output, living in the graphs'
    memory pool and overwritten by the next micro-batch's replay."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


@dataclass
class TrainLoop:
    """The update of the module docstring, and `run` to repeat it. `step` counts the updates done (set it when
    resuming). `ctx`: this process's place among the ranks (one process by default). `grads_in_place`: gradients
    stay allocated between updates and are zeroed in place (`allocate_missing_grads`; needed when the backward
    runs in CUDA graphs)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: DataSource
    loss: Loss
    plan: Callable[[int], UpdatePlan]
    clip: Callable[[nn.Module], float | torch.Tensor] | None = None
    guard: StepGuard | None = None
    ctx: D.DistContext = field(default_factory=D.DistContext)
    grads_in_place: bool = False
    step: int = 0

    def update(self) -> UpdateOutput:
        """One optimizer update; see the module docstring."""
        started = time.perf_counter()
        plan = self.plan(self.step)
        if plan.micro_batches < 1:
            raise ValueError(f"plan: update {self.step} has {plan.micro_batches} micro-batches; it needs at least 1")
        apply_schedule(self.optimizer, plan.lr, plan.wd)
        batches = self.data.next_micro_batches(self.step, plan.micro_batches)
        local_count = sum(int(self.loss.count(b)) for b in batches)
        total_count = max(1.0, float(D.row_sum(torch.tensor([float(local_count)]), self.ctx).item()))
        scale = self.ctx.dp_size / total_count

        self.model.train()
        if self.grads_in_place:
            allocate_missing_grads(self.model)
        losses = []
        loss_sum = None  # for the guard: float64 on the device, added right after each backward
        for i, batch in enumerate(batches):
            with D.gradient_sync(self.model, enabled=i == len(batches) - 1):
                micro = self.loss(self.model, batch)
                (micro if scale == 1.0 else micro * scale).backward()
            losses.append(micro.detach())
            if self.guard is not None:
                if loss_sum is None:
                    loss_sum = torch.zeros((), dtype=torch.float64, device=micro.device)
                loss_sum += losses[-1].double()
        D.reduce_context_parallel_grads(self.model, self.ctx)
        # the mean loss over every rank's micro-batches (read back from the device: the guard decides on the host)
        loss = None if loss_sum is None else float(D.row_sum(loss_sum.cpu().reshape(1), self.ctx).item()) / total_count
        grad_norm = self.clip(self.model) if self.clip is not None else None
        accepted = self.guard is None or self.guard.check(loss, grad_norm, optimizer=self.optimizer, step=self.step)
        if accepted:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.grads_in_place)
        self.step += 1
        return UpdateOutput(self.step, plan, losses, total_count, grad_norm, not accepted,
                            time.perf_counter() - started, loss)

    def run(self, until: int, *, should_stop: Callable[[], bool] | None = None,
            hooks: Sequence[Callable[[TrainLoop, UpdateOutput], None]] = ()) -> bool:
        """Update until `step == until`, calling every hook as `hook(loop, output)` after each update. Before every
        update `should_stop()` (if given) may end the run. True: `until` was reached; False: stopped. A hook that
        raises ends the run with its exception."""
        while self.step < until:
            if should_stop is not None and should_stop():
                return False
            output = self.update()
            for hook in hooks:
                hook(self, output)
        return True
