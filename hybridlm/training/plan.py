"""World-size planning of a `TrainConfig`: what the run is at a given number of ranks.

    parallel = resolve_parallel(config, world_size)       # the device mesh's sizes (a -1 filled in)
    schedule, total, note = schedule_config(config, dp)   # the lr schedule with its batch rampup, in global rows
    updates, tokens = plan_steps(config, dp)              # the run's length: train.steps or train.tokens
    fmt = checkpoint_format(config, world_size)           # "dcp" | "full": how this run writes checkpoints

`dp` is the number of data-parallel ranks (dp_replicate x dp_shard of `resolve_parallel`): the batch section counts
rows per data-parallel rank, so the run's tokens under train.steps, and its updates under train.tokens, depend on
it. What these functions find wrong is a ConfigError naming the keys and that number.

A resumed run passes `start=(updates, tokens)` it has done: the rest is planned at the `dp` it resumes under, so a
run resumed under another number of ranks keeps its token budget (train.tokens counts the tokens consumed, whatever
the batch they came in) and a token-unit schedule its total (the tokens done plus those of the updates left).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybridlm.training.config import ParallelSection, TrainConfig
from hybridlm.training.schedules import BatchRampup, ScheduleConfig
from hybridlm.training.typed_yaml import ConfigError
from hybridlm.training.validate import build_model_config, check_decay_fits

if TYPE_CHECKING:
    from hybridlm.models.config import HybridConfig
    from hybridlm.parallel.mesh import ParallelConfig


def _check_model_splits(hybrid: HybridConfig, p: ParallelSection) -> None:
    """The model's head, group and width counts against parallel.tp, checked on a meta-device model by the code
    that later splits it: a combination that cannot split fails with the keys named, before any model is built."""
    import torch

    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.parallel import check_mixer_parallel, check_tensor_parallel

    with torch.device("meta"):
        model = HybridForCausalLM(hybrid)
    try:
        if p.mixer_parallel == "off":
            check_tensor_parallel(model, p.tp, ssm_heads=p.ssm_tensor_parallel)
        else:
            check_mixer_parallel(model, p.tp, mode=p.mixer_parallel, ssm_heads=p.ssm_tensor_parallel)
    except ValueError as err:
        raise ConfigError(f"parallel.tp={p.tp} does not fit the model: {err}. Change parallel.tp or the sizes "
                          "under model.overrides; for SSM head or group counts, parallel.ssm_tensor_parallel=false "
                          "keeps the SSM mixers replicated instead") from err


def resolve_parallel(config: TrainConfig, world_size: int) -> ParallelConfig:
    """The run's `hybridlm.parallel.ParallelConfig` for `world_size` ranks (a -1 filled in, sizes checked);
    ConfigError naming the parallel keys if they do not multiply to the world size or tp does not split the
    model's heads / groups / widths."""
    from hybridlm.parallel.mesh import ParallelConfig  # (torch.distributed: imported when a run starts)

    p = config.parallel
    dp_replicate, dp_shard = p.dp_replicate, p.dp_shard
    fixed = p.cp * p.tp * (dp_shard if dp_replicate == -1 else dp_replicate)
    if -1 in (dp_replicate, dp_shard):
        if world_size % fixed:
            fewer = (f" (a run resumed in fewer processes than it had: e.g. --set parallel.tp=1 --set parallel.cp=1; "
                     "its checkpoints load under any mesh)" if world_size < fixed else "")
            raise ConfigError(
                f"parallel: the world size {world_size} is not divisible by the fixed sizes "
                f"(dp_replicate x dp_shard x cp x tp without the -1 = {fixed}); change parallel.tp / parallel.cp / "
                f"parallel.dp_* or the number of processes{fewer}"
            )
        rest = world_size // fixed
        dp_replicate, dp_shard = (rest, dp_shard) if dp_replicate == -1 else (dp_replicate, rest)
    if world_size > 1 and config.train.compile and config.train.compile_mode == "reduce-overhead":
        raise ConfigError("train.compile_mode: 'reduce-overhead' (CUDA graphs per block) runs in one process; under "
                          "torchrun (FSDP2, tensor parallelism) use train.compile_mode=default")
    product = dp_replicate * dp_shard * p.cp * p.tp
    if product != world_size:
        raise ConfigError(
            f"parallel: dp_replicate x dp_shard x cp x tp = {dp_replicate} x {dp_shard} x {p.cp} x {p.tp} = "
            f"{product}, but the world size is {world_size}; the product must equal it (set one of "
            "parallel.dp_replicate / parallel.dp_shard to -1 to fill the rest)"
        )
    if p.tp > 1:
        _check_model_splits(build_model_config(config), p)
    return ParallelConfig(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp,
        activation_checkpointing=p.activation_checkpointing, recompute_mixers=p.recompute_mixers,
        ssm_tensor_parallel=p.ssm_tensor_parallel,
        mixer_parallel=p.mixer_parallel,
    ).resolved(world_size)


def checkpoint_format(config: TrainConfig, world_size: int) -> str:
    """The format the run's checkpoints are written in: train.checkpoint_format, with "auto" resolved to "dcp" (each
    rank writes its own shards) under torchrun or with train.checkpoint_async, else "full" (one process: the
    single-process layout, readable without torch.distributed)."""
    fmt = config.train.checkpoint_format
    if fmt != "auto":
        return fmt
    return "dcp" if world_size > 1 or config.train.checkpoint_async else "full"


def rampup_of(config: TrainConfig, world_size: int) -> BatchRampup | None:
    """The `BatchRampup` of the run in global rows (the batch section counts rows per rank), or None.

    Here and in `schedule_config` / `plan_steps`, `world_size` is the number of data-parallel ranks
    (dp_replicate x dp_shard of `resolve_parallel`): the world size when neither tp nor cp is used."""
    b = config.batch
    if b.rampup_start is None:
        return None
    unit = b.micro_batch * world_size
    return BatchRampup(
        start=b.rampup_start * world_size,
        target=unit * b.grad_accum,
        rampup_tokens=b.rampup_tokens,
        micro_batch=unit,
        ref_batch=None if b.ref_batch is None else b.ref_batch * world_size,
        tokens_per_sample=b.seq_len,
    )


def schedule_config(config: TrainConfig, world_size: int, *,
                    start: tuple[int, int] = (0, 0)) -> tuple[ScheduleConfig, float, str | None]:
    """(the run's ScheduleConfig with its rampup, its total in its unit, a note if the warmup was shortened).

    A warmup that does not fit (warmup + decay > total, e.g. `--set train.steps=12` on a config written
    for thousands of steps) is shortened to total - decay, with a note saying so, so that any config runs
    at any length; a batch rampup not shorter than the run is kept, with a note that the batch never
    reaches its target. A decay longer than the whole run is a ConfigError naming the keys and the
    number of data-parallel ranks (the run's tokens, or its updates under a token budget, depend on it:
    `validate` checks only what holds at any number).
    """
    steps, tokens, total = schedule_total(config, world_size, start=start)
    schedule = config.schedule
    notes = []
    ranks = f" at {world_size} data-parallel rank{'s' if world_size > 1 else ''}"
    check_decay_fits(schedule, total, ranks if schedule.unit == "steps" else f": {steps} updates{ranks}")
    decay = schedule.decay_length(total)
    if schedule.warmup + decay > total:
        warmup = total - decay
        notes.append(f"schedule.warmup {schedule.warmup:g} + decay {decay:g} exceed the run's {total:g} "
                     f"{schedule.unit}; warmup shortened to {warmup:g}")
        schedule = dataclasses.replace(schedule, warmup=warmup)
    if config.batch.rampup_start is not None:
        budget = tokens if config.train.tokens is None else min(tokens, config.train.tokens)
        if config.batch.rampup_tokens >= budget:
            notes.append(f"batch.rampup_tokens {config.batch.rampup_tokens:,} is not shorter than the run's {budget:,} "
                         f"tokens ({steps} updates{ranks}): the batch never reaches batch.micro_batch x "
                         "batch.grad_accum and the lr stays scaled by sqrt(batch / ref_batch)")
    return dataclasses.replace(schedule, rampup=rampup_of(config, world_size)), total, "; ".join(notes) or None


def plan_steps(config: TrainConfig, world_size: int, *, start: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """(updates, tokens) of the whole run: it ends after `train.steps` updates or once `train.tokens`
    tokens are consumed, whichever comes first (one of the two may be null). `start`: the (updates, tokens) done
    before this process (a resumed run; the module docstring); none of them is undone."""
    rampup = rampup_of(config, world_size)
    b = config.batch
    fixed = b.micro_batch * world_size * b.grad_accum * b.seq_len  # tokens per update without rampup
    max_steps, max_tokens = config.train.steps, config.train.tokens
    done_steps, done_tokens = start
    if max_steps is not None and max_steps < done_steps:  # a run shorter than what is done (its caller refuses it)
        return max_steps, done_tokens
    if rampup is None:
        left = max_steps - done_steps if max_tokens is None else max(0, -(-(max_tokens - done_tokens) // fixed))
        if max_steps is not None:
            left = min(left, max_steps - done_steps)
        return done_steps + left, done_tokens + left * fixed
    steps, tokens = start
    while (max_steps is None or steps < max_steps) and (max_tokens is None or tokens < max_tokens):
        tokens += rampup.batch_size(tokens) * b.seq_len
        steps += 1
    return steps, tokens


def schedule_total(config: TrainConfig, world_size: int, *, start: tuple[int, int] = (0, 0)) -> tuple[int, int, float]:
    """(updates, tokens, the schedule's total in its unit)."""
    steps, tokens = plan_steps(config, world_size, start=start)
    return steps, tokens, steps if config.schedule.unit == "steps" else tokens
