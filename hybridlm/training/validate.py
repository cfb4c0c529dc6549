"""Validation of a `TrainConfig`: value ranges and the combinations that cannot run, checked when a config is
loaded, before any process or model is started. Every ConfigError names the keys involved and the way out; a
setting that would have no effect (a batch.rampup_tokens without batch.rampup_start, an unembedding multiplier on a
model with tied embeddings) is refused too. What depends on the number of data-parallel ranks is checked by
`hybridlm.training.plan`, with the trainer's number.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from hybridlm.training.schedules import ScheduleConfig, has_decay_stage
from hybridlm.training.typed_yaml import ConfigError

if TYPE_CHECKING:
    from hybridlm.models.config import HybridConfig
    from hybridlm.training.config import TrainConfig

DTYPES = ("fp32", "bf16")
MIXER_PARALLEL = ("off", "on", "interleaved")
RECOMPUTE_MIXERS = ("fast_weight", "all", "none")  # layers.block.RECOMPUTE_MIXERS (not imported: no torch here)
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # train.compile_mode
TASKS = ("pretrain", "sft", "dpo")  # train.task
CHECKPOINT_FORMATS = ("auto", "dcp", "full")  # train.checkpoint_format
LM_HEAD_LOSSES = ("chunked", "logits")  # train.lm_head_loss


def _positive_int(value: Any, key: str, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}: must be an int >= {minimum}, got {value!r}")


def _finite(value: float, key: str, *, low: float | None = None, high: float | None = None, strict=True) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be finite, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ConfigError(f"{key}: must be {'>' if strict else '>='} {low}, got {value!r}")
    if high is not None and value >= high:
        raise ConfigError(f"{key}: must be < {high}, got {value!r}")


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")


def build_model_config(config: TrainConfig) -> HybridConfig:
    """The HybridConfig of the run: the config of model.init's directory, or preset + overrides, multipliers
    transferred from mup_base_width."""
    from hybridlm.models.presets import get_preset
    from hybridlm.training.optim import scale_multipliers

    if config.model.init is not None:
        from hybridlm.models.hf import read_model_config

        if config.model.overrides or config.model.mup_base_width is not None:
            raise ConfigError("model.overrides / model.mup_base_width: unused with model.init (the model directory "
                              "fixes the model); remove them")
        try:
            return read_model_config(config.model.init)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.init: {err}") from err

    try:
        hybrid = get_preset(config.model.preset, **config.model.overrides)
    except ValueError as err:
        key = "model.preset" if "preset" in str(err) else "model.overrides"
        raise ConfigError(f"{key}: {err}") from err
    base = config.model.mup_base_width
    if base is not None and base != hybrid.hidden_size:
        names = hybrid.multiplier_names()
        scaled = scale_multipliers({n: getattr(hybrid, n) for n in names}, base, hybrid.hidden_size)
        hybrid = hybrid.replace(**scaled)
    return hybrid


def validate(config: TrainConfig) -> None:
    """Cross-field checks; raises ConfigError naming the keys. The model config is built once here."""
    from hybridlm.training.optim import MATRIX_ROLES, VECTOR_ROLES

    # model
    hybrid = build_model_config(config)
    if config.model.mup_base_width is not None:
        _positive_int(config.model.mup_base_width, "model.mup_base_width")
    # data
    data = config.data
    _choice(config.train.task, "train.task", TASKS)
    _validate_task_data(config)
    for key, sources in (("data.sources", data.sources), ("data.eval_sources", data.eval_sources)):
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"{key}: source names must be unique, got {names}")
        for i, s in enumerate(sources):
            _finite(s.weight, f"{key}[{i}].weight", low=0.0, strict=False)
            if s.max_epochs is not None:
                _finite(s.max_epochs, f"{key}[{i}].max_epochs", low=0.0)
    _choice(data.verify, "data.verify", ("full", "size"))
    _positive_int(data.demo_max_bytes, "data.demo_max_bytes", 1000)
    _positive_int(data.demo_heldout_every, "data.demo_heldout_every", 2)
    # optim
    o = config.optim
    _finite(o.lr, "optim.lr", low=0.0)
    _finite(o.weight_decay, "optim.weight_decay", low=0.0, strict=False)
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas[{i}]: must be in [0, 1), got {beta!r}")
    _finite(o.eps, "optim.eps", low=0.0)
    for key, table, roles in (("optim.elr", o.elr, MATRIX_ROLES), ("optim.ewd", o.ewd, MATRIX_ROLES),
                              ("optim.vector_lr", o.vector_lr, VECTOR_ROLES)):
        for role, value in table.items():
            if role not in roles:
                kind = "matrix" if roles is MATRIX_ROLES else "vector"
                raise ConfigError(f"unknown key '{key}.{role}'; valid keys of {key} (the {kind} roles): {', '.join(roles)}")
            _finite(value, f"{key}.{role}", low=0.0, strict=key != "optim.vector_lr")
    if hybrid.tie_word_embeddings:  # lm_head is embed_tokens: one "embedding" group, no "unembedding" one
        for key, table in (("optim.elr", o.elr), ("optim.ewd", o.ewd)):
            if table.get("unembedding", 1.0) != 1.0:
                raise ConfigError(
                    f"{key}.unembedding: has no effect: the model ties its embeddings (tie_word_embeddings, from "
                    f"model.preset or model.overrides), so lm_head is embed_tokens and there is no unembedding group; "
                    f"set {key}.embedding instead, or untie (model.overrides.tie_word_embeddings=false)"
                )
    # batch
    b = config.batch
    _positive_int(b.micro_batch, "batch.micro_batch")
    _positive_int(b.seq_len, "batch.seq_len", 2)
    _positive_int(b.grad_accum, "batch.grad_accum")
    _positive_int(b.rampup_tokens, "batch.rampup_tokens", 0)
    if b.rampup_start is not None:
        _positive_int(b.rampup_start, "batch.rampup_start")
        target = b.micro_batch * b.grad_accum  # rows per rank, like rampup_start
        if b.rampup_start % b.micro_batch:
            raise ConfigError(f"batch.rampup_start: {b.rampup_start} must be a multiple of batch.micro_batch "
                              f"({b.micro_batch})")
        if b.rampup_start > target:
            raise ConfigError(f"batch.rampup_start: {b.rampup_start} exceeds the target batch "
                              f"batch.micro_batch x batch.grad_accum = {target}")
        if b.rampup_tokens == 0:
            raise ConfigError("batch.rampup_tokens: must be > 0 with batch.rampup_start set (the global tokens over "
                              "which the batch grows to batch.micro_batch x batch.grad_accum); with 0 the run would "
                              "start at the target batch: set the rampup's length, or unset batch.rampup_start")
    elif b.rampup_tokens:
        raise ConfigError(f"batch.rampup_tokens: {b.rampup_tokens} has no effect without batch.rampup_start (the rows "
                          "per rank the rampup starts from); set batch.rampup_start, or batch.rampup_tokens=0 for no "
                          "rampup")
    if b.ref_batch is not None:
        _positive_int(b.ref_batch, "batch.ref_batch")
        if b.rampup_start is None:
            raise ConfigError("batch.ref_batch: only used with the rampup (set batch.rampup_start)")
    if b.seq_len > hybrid.max_position_embeddings:
        raise ConfigError(f"batch.seq_len: {b.seq_len} exceeds the model's max_position_embeddings "
                          f"{hybrid.max_position_embeddings} (model.overrides.max_position_embeddings)")
    # train
    t = config.train
    if t.steps is None and t.tokens is None:
        raise ConfigError("train.steps / train.tokens: give at least one (the run ends at whichever comes first)")
    if t.steps is not None:
        _positive_int(t.steps, "train.steps")
    if t.tokens is not None:
        _positive_int(t.tokens, "train.tokens")
    for key in ("log_every", "eval_batches", "keep_last", "max_consecutive_skips", "sample_tokens"):
        _positive_int(getattr(t, key), f"train.{key}")
    for key in ("eval_every", "save_every", "samples", "seed"):
        _positive_int(getattr(t, key), f"train.{key}", 0)
    _choice(t.dtype, "train.dtype", DTYPES)
    _choice(t.device, "train.device", DEVICES)
    _choice(t.compile_mode, "train.compile_mode", COMPILE_MODES)
    if t.compile_mode != "default" and not t.compile:
        raise ConfigError(f"train.compile_mode: {t.compile_mode!r} needs train.compile=true")
    _choice(t.checkpoint_format, "train.checkpoint_format", CHECKPOINT_FORMATS)
    _choice(t.lm_head_loss, "train.lm_head_loss", LM_HEAD_LOSSES)
    if t.checkpoint_async and t.checkpoint_format == "full":
        raise ConfigError("train.checkpoint_async: asynchronous saves write the sharded format; set "
                          "train.checkpoint_format=dcp (or auto), or train.checkpoint_async=false")
    if t.grad_clip is not None:
        _finite(t.grad_clip, "train.grad_clip", low=0.0)
    if t.spike_factor is not None:
        _finite(t.spike_factor, "train.spike_factor", low=1.0)
    _finite(t.sample_temperature, "train.sample_temperature", low=0.0, strict=False)  # 0: greedy, as in generate
    if not t.out_dir:
        raise ConfigError("train.out_dir: must not be empty")
    # parallel (sizes against the world size: `resolve_parallel`, called by the trainer)
    _validate_parallel(config, hybrid)
    # distributed
    _choice(config.distributed.backend, "distributed.backend", BACKENDS)
    # post-training
    _finite(config.dpo.beta, "dpo.beta", low=0.0)
    _choice(config.dpo.loss, "dpo.loss", DPO_LOSSES)
    _choice(config.dpo.reference, "dpo.reference", DPO_REFERENCES)
    lora = config.lora
    _positive_int(lora.r, "lora.r", 0)
    if lora.r:
        _finite(lora.alpha, "lora.alpha", low=0.0)
        _finite(lora.dropout, "lora.dropout", low=0.0, high=1.0, strict=False)
        if not lora.targets:
            raise ConfigError("lora.targets: empty; name the modules to adapt, e.g. [q_proj, v_proj, in_proj]")
    # the run's length: only what holds at any number of data-parallel ranks is checked here; the rest (the run's
    # tokens under train.steps, its updates under train.tokens) `schedule_config` checks with the trainer's number
    if config.schedule.unit == "steps" and t.tokens is None:  # train.steps updates whatever the number of ranks
        check_decay_fits(config.schedule, t.steps, ": train.steps")


DPO_LOSSES = ("sigmoid", "norm")
DPO_REFERENCES = ("precomputed", "frozen")


def _validate_task_data(config: TrainConfig) -> None:
    """The data keys each task reads: pretraining reads prepared shards (or the demo corpus), sft / dpo read chat
    records (or the demo conversations) and start from a model directory."""
    data, task = config.data, config.train.task
    if task == "pretrain":
        if data.chat is not None:
            raise ConfigError("data.chat: chat records are for sft / dpo (hybridlm sft, hybridlm dpo); pretraining "
                              "reads prepared shards under data.sources")
        if data.demo and data.sources:
            raise ConfigError("data.demo: true and data.sources are exclusive; use one of them")
        if not data.demo and not data.sources:
            raise ConfigError("data: no training data; list prepared datasets under data.sources, or set data.demo: "
                              "true")
        return
    if config.model.init is None:
        raise ConfigError(f"model.init: {task} fine-tunes a trained model: give its directory (--model DIR, e.g. the "
                          "final/ of a `hybridlm train` run)")
    if data.sources or data.eval_sources:
        raise ConfigError(f"data.sources: {task} reads chat records (data.chat, or data.demo: true), not prepared "
                          "shards; remove data.sources / data.eval_sources")
    if data.demo == (data.chat is not None):
        raise ConfigError(f"data.chat / data.demo: {task} needs exactly one of them: a records file or directory "
                          "(--data FILE), or the generated demo conversations (data.demo: true)")
    _choice(data.train_on, "data.train_on", ("assistant", "all"))
    if not data.document_boundaries:
        raise ConfigError(f"data.document_boundaries: {task} keeps every sample apart in its packed rows; set it "
                          "to true")


def _validate_parallel(config: TrainConfig, hybrid: HybridConfig) -> None:
    """What can be checked without the world size: value ranges and the combinations the parallel code
    refuses (named by key here, before any process starts)."""
    p = config.parallel
    for key in ("cp", "tp"):
        _positive_int(getattr(p, key), f"parallel.{key}")
    for key in ("dp_replicate", "dp_shard"):
        value = getattr(p, key)
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise ConfigError(f"parallel.{key}: must be an int >= 1, or -1 (the ranks left over), got {value!r}")
    if p.dp_replicate == -1 and p.dp_shard == -1:
        raise ConfigError("parallel.dp_replicate / parallel.dp_shard: at most one of them can be -1 (the rest); "
                          "e.g. dp_replicate: -1 with dp_shard: 1 for replicas, or dp_shard: -1 for FSDP2")
    _choice(p.mixer_parallel, "parallel.mixer_parallel", MIXER_PARALLEL)
    _choice(p.recompute_mixers, "parallel.recompute_mixers", RECOMPUTE_MIXERS)
    if p.mixer_parallel != "off" and p.tp % 2:
        raise ConfigError(f"parallel.mixer_parallel: {p.mixer_parallel!r} splits every tp group into two halves "
                          f"(attention | SSM), so parallel.tp must be even, got {p.tp}")
    if p.cp > 1:
        if p.activation_checkpointing:
            raise ConfigError("parallel.activation_checkpointing: not supported with parallel.cp > 1 (recomputing "
                              "a block in backward would repeat its state transfers and ring exchanges)")
        if config.data.document_boundaries:
            raise ConfigError(
                "parallel.cp: context parallelism cannot run packed documents: the rows' position_ids restart at "
                "every document start, which the model turns into cu_seqlens, and CP's state passing and ring "
                "attention support neither; set data.document_boundaries=false (position_ids 0..seq_len-1 in "
                "every row: documents in one row attend across their boundary) to train with cp > 1"
            )
        if config.batch.seq_len % p.cp:
            raise ConfigError(f"batch.seq_len: {config.batch.seq_len} must be divisible by parallel.cp={p.cp} "
                              "(each cp rank holds seq_len / cp tokens of every row)")
        if hybrid.attention_dropout:
            raise ConfigError("model.overrides.attention_dropout: must be 0 with parallel.cp > 1 (ring attention "
                              "has no dropout)")
        if hybrid.attention_window is not None:
            raise ConfigError(f"model.overrides.attention_window: {hybrid.attention_window} cannot run with "
                              "parallel.cp > 1 (ring attention attends over the whole sequence); set it to null or "
                              "parallel.cp=1")
    if config.train.compile_mode == "reduce-overhead" and (p.activation_checkpointing or p.tp > 1 or p.cp > 1):
        raise ConfigError("train.compile_mode: 'reduce-overhead' (CUDA graphs per block) runs in one process without "
                          "activation checkpointing (FSDP2's hooks and the recomputation in backward are untested "
                          "with CUDA graphs); set parallel.activation_checkpointing=false and tp = cp = 1, or use "
                          "train.compile_mode=default")
    if config.train.compile and (p.cp > 1 or p.mixer_parallel != "off"):
        raise ConfigError("train.compile: not combined with parallel.cp > 1 or parallel.mixer_parallel yet (their "
                          "hooks and point-to-point transfers are untested under torch.compile); set train.compile=false")
    # mixer_parallel with cp > 1 is allowed: a rank's cp peers have its tp coordinate and so its mixer in every
    # layer (ring attention among attention ranks, state passing among SSM ranks; tests/parallel/test_combined.py)


def check_schedule_decay(kwargs: dict[str, Any], path: str) -> None:
    """The decay keys against schedule.kind, with the keys to type (ScheduleConfig checks the same, in terms of its
    fields): a kind with a decay stage needs exactly one of decay / decay_fraction, the others take neither."""
    kind = kwargs.get("kind", ScheduleConfig.kind)
    unit = kwargs.get("unit", ScheduleConfig.unit)
    given = {k: kwargs[k] for k in ("decay", "decay_fraction") if kwargs.get(k) is not None}
    if not isinstance(kind, str):
        return  # ScheduleConfig names the wrong kind
    if has_decay_stage(kind):
        if not given:
            raise ConfigError(
                f"{path}.decay / {path}.decay_fraction: kind {kind!r} ends with a decay stage and needs its length: "
                f"{path}.decay (in {unit}) or {path}.decay_fraction (of the run), e.g. --set {path}.decay_fraction=0.2"
            )
        if len(given) == 2:
            raise ConfigError(
                f"{path}.decay / {path}.decay_fraction: give only one of them (got decay={given['decay']!r}, "
                f"decay_fraction={given['decay_fraction']!r}); unset the other, e.g. --set {path}.decay_fraction=null"
            )
    elif given:
        settings = " and ".join(f"{path}.{k}={v!r}" for k, v in given.items())
        flags = " ".join(f"--set {path}.{k}=null" for k in given)
        lines = ", ".join(f"`{k}: null`" for k in given)
        raise ConfigError(
            f"{settings}: {path}.kind={kind!r} has no separate decay stage, so this would have no effect; unset it "
            f"with {flags} (in a config file: {lines}), or choose a kind with a decay stage (wsd, power, "
            "effective_power)"
        )


def check_decay_fits(schedule: ScheduleConfig, total: float, run: str) -> None:
    """ConfigError if the decay stage is longer than the run (`total` in the schedule's unit; `run`, appended to
    it, says what fixed that length)."""
    decay = schedule.decay_length(total)
    if decay > total:
        raise ConfigError(f"schedule.decay: the decay ({decay:g} {schedule.unit}) is longer than the whole run "
                          f"({total:g} {schedule.unit}{run}); shorten schedule.decay or train longer")
