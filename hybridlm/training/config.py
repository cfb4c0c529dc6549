"""`TrainConfig`: the typed, validated description of a training run, read from YAML plus `--set` overrides.

    config = load_config("configs/demo.yaml", ["train.steps=12", "optim.lr=3e-3"])
    config = load_config(None)                      # the built-in demo (same as configs/demo.yaml)
    save_config(config, "runs/x/config.yaml")       # the resolved config; load_config reads it back equal

Sections (dotted keys address them: `--set batch.micro_batch=4`):

    model         init (a model directory to start from: fine-tuning; preset and overrides are then unused),
                  preset (a name from hybridlm.models.presets), overrides (any HybridConfig field, typed
                  like the field: `model.overrides.ssm_multiplier_dt=0.5`), mup_base_width (the width the
                  forward multipliers were tuned at: they are transferred to hidden_size with
                  `training.optim.scale_multipliers`; None leaves them as given)
    data          demo (the built-in corpus, `training.demo`; for sft / dpo the generated demo conversations) or
                  sources (prepared shard dirs with weights; pretraining) or chat (sft / dpo records: a .jsonl /
                  .parquet file or directory, `hybridlm.data.chat`), chat_template (a Jinja file; default: the
                  model's), train_on ("assistant" | "all": the tokens the SFT loss trains on),
                  skip_bad_records (skip and count records that do not parse instead of stopping),
                  eval_sources (held-out shard dirs), tokenizer (a tokenizer dir, to print samples),
                  document_boundaries (false: one position run per row, documents not kept apart; for cp)
    optim         AdamW lr, weight_decay, betas, eps; per-role multipliers: elr / ewd (matrix roles,
                  `training.optim`), vector_lr (vector roles)
    schedule      `training.schedules.ScheduleConfig` (kind, unit, warmup, decay, ...; not rampup). An override
                  of kind drops the settings the file or demo gave that the new kind does not read, and one of
                  decay or decay_fraction drops the other (`--set schedule.kind=cosine` on the demo, whose
                  decay_fraction is 0.2, just works)
    batch         micro_batch (rows per rank per micro-step), seq_len, grad_accum; batch-size rampup:
                  rampup_start (rows at the start; None: off), rampup_tokens, ref_batch. Batch sizes count
                  rows per data-parallel rank: the global batch is micro_batch x grad_accum x dp_replicate x
                  dp_shard (the tp and cp ranks of one data-parallel rank share its rows)
    train         steps and / or tokens (the run ends at whichever comes first), out_dir, log_every,
                  eval_every, eval_batches, save_every, keep_last, checkpoint_format ("auto" | "dcp" | "full"),
                  checkpoint_async, seed, dtype ("fp32" | "bf16": autocast, fp32
                  master weights), grad_clip, max_consecutive_skips, spike_factor, compile, compile_mode,
                  deterministic, device, progress, samples
    parallel      the device mesh under torchrun (`hybridlm.parallel`): dp_replicate, dp_shard (one of the two
                  may be -1: the ranks left over), cp, tp, mixer_parallel ("off" | "on" | "interleaved"),
                  ssm_tensor_parallel, activation_checkpointing; dp_replicate x dp_shard x cp x tp must be the
                  world size. The default (dp_shard: -1) is FSDP2 over every rank; DDP-like replicas are
                  dp_replicate: -1, dp_shard: 1
    dpo           beta, loss ("sigmoid": DPO; "norm": length-normalized DPO, the Falcon-H1 report's), reference
                  ("precomputed": the starting model's log-probabilities computed once before training; "frozen": a
                  frozen copy of the starting model beside the trained one)
    lora          r (0: off; > 0: peft LoRA adapters of rank r, the base weights frozen), alpha, dropout, targets
                  (module names), save_adapter (also write final/adapter/); final/ holds the merged weights
    distributed   backend ("auto" | "gloo" | "nccl"); used under torchrun. The parallel section replaces
                  distributed.strategy (refused, with the keys to write): "fsdp" is parallel.dp_shard=-1, "ddp"
                  is parallel.dp_replicate=-1 + parallel.dp_shard=1

dt attenuation (report, "Training Stability and the dt Attenuation Mechanism") is the model field
`ssm_multiplier_dt` (the forward multiplier alpha of the dt activation, 0 < alpha < 1 attenuates);
clipping positive dt is `time_step_limit: [min, max]` (dt = clamp(softplus(.), min, max) in the Mamba-2
mixer). Both are ordinary `model.overrides`.

The file is read by `hybridlm.training.typed_yaml` (every value parsed into the declared type of its field; an
unknown key lists the valid keys of its section; a key given twice in one mapping is refused) and checked by
`hybridlm.training.validate` (ranges, impossible combinations and settings that would have no effect, each named
by key); `hybridlm.training.plan` resolves what depends on the number of ranks. Errors are `ConfigError`s whose
message starts with the dotted key. A config file must be UTF-8 YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridlm.fileio import diff_nested, write_atomic
from hybridlm.training.schedules import KINDS, ScheduleConfig, unused_settings
from hybridlm.training.typed_yaml import (
    ConfigError,
    FieldsMapping,
    Schema,
    apply_overrides,
    load_yaml,
    parse_override,
)
from hybridlm.training.validate import check_schedule_decay, validate


# ------------------------------------------------------------------------------------------------ sections
@dataclass
class ModelSection:
    init: str | None = None  # a model directory (ours or falcon_h1) to start from; None: a fresh model of preset
    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)  # HybridConfig fields (typed by HybridConfig)
    mup_base_width: int | None = None


@dataclass
class SourceSection:
    """A prepared dataset (`hybridlm data prepare`) in the mixture."""

    name: str
    path: str
    weight: float = 1.0
    max_epochs: float | None = None


@dataclass
class DataSection:
    demo: bool = False
    sources: list[SourceSection] = field(default_factory=list)
    eval_sources: list[SourceSection] = field(default_factory=list)
    tokenizer: str | None = None  # a tokenizer dir, only to decode the samples printed at the end
    cross_doc_labels: bool = True
    shuffle: bool = True
    verify: str = "full"  # "full" (sha256 of every shard on open) | "size"
    demo_dir: str | None = None  # where the demo corpus is prepared; None: <train.out_dir>/demo_data
    demo_max_bytes: int = 16_000_000
    demo_heldout_every: int = 20  # one stdlib file in this many is held out
    # True: position_ids restart at every document start packed into a row (the model keeps documents apart:
    # cu_seqlens). False: position_ids 0..seq_len-1 in every row, documents in a row see each other (as
    # nanoGPT); needed by parallel.cp > 1, which cannot split packed documents.
    document_boundaries: bool = True
    chat: str | None = None  # sft / dpo: a .jsonl / .parquet file or directory of records (hybridlm.data.chat)
    chat_template: str | None = None  # a Jinja chat template file; None: the model tokenizer's own
    train_on: str = "assistant"  # sft: "assistant" (assistant messages / completions) | "all" (every token)
    skip_bad_records: bool = False  # sft / dpo: skip and count bad records instead of stopping at the first


@dataclass
class OptimSection:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    elr: dict[str, float] = field(default_factory=dict)  # matrix role -> effective-lr multiplier
    ewd: dict[str, float] = field(default_factory=dict)  # matrix role -> effective-wd multiplier
    vector_lr: dict[str, float] = field(default_factory=dict)  # vector role -> lr multiplier


@dataclass
class BatchSection:
    micro_batch: int = 8  # rows (sequences) per rank per micro-step
    seq_len: int = 256
    grad_accum: int = 1  # micro-steps per update (the final value when rampup is on)
    rampup_start: int | None = None  # rows (per rank) at the start of the rampup; None: no rampup
    # (global) tokens over which the batch grows linearly to micro_batch x grad_accum: > 0 with rampup_start (0
    # without); one not shorter than the run is kept, with a note from the trainer
    rampup_tokens: int = 0
    ref_batch: int | None = None  # rows (per rank) the lr was tuned at (sqrt lr scaling); None: the target


@dataclass
class TrainSection:
    task: str = "pretrain"  # "pretrain" | "sft" | "dpo": what the data and the loss are (`hybridlm sft` sets "sft")
    steps: int | None = 300
    tokens: int | None = None  # stop after this many tokens (or after `steps`, whichever comes first)
    out_dir: str = "runs/demo"
    log_every: int = 10
    eval_every: int = 100  # 0: no periodic evaluation (one at the end if held-out data exists)
    eval_batches: int = 4
    save_every: int = 100  # 0: only at the end (and on SIGINT / SIGTERM)
    keep_last: int = 2
    # "dcp": every rank writes its own shards (torch.distributed.checkpoint; resumes under any mesh); "full": the
    # single-process layout gathered on rank 0; "auto": dcp under torchrun (world size > 1) or with checkpoint_async,
    # full in one process. Resume reads either, whatever this says.
    checkpoint_format: str = "auto"
    checkpoint_async: bool = False  # dcp only: write from a thread while training goes on; the next save waits for it
    seed: int = 0
    dtype: str = "fp32"
    grad_clip: float | None = 1.0
    max_consecutive_skips: int = 5
    spike_factor: float | None = None  # skip updates whose loss exceeds this x the recent median
    compile: bool = False
    # the LM head's loss in pretraining and SFT: "chunked" (the head and the cross entropy together over row chunks,
    # no [B, T, V] logits kept: `hybridlm.modules.linear_cross_entropy`) or "logits" (the logits, then torch's cross
    # entropy: more memory); DPO reads the logits whatever this says
    lm_head_loss: str = "chunked"
    # torch.compile's mode for the blocks: "default"; "reduce-overhead" (CUDA graphs: one process, no activation
    # checkpointing; gradients stay allocated between updates and are zeroed in place, so AdamW also decays a
    # parameter no forward reaches); "max-autotune-no-cudagraphs"
    compile_mode: str = "default"
    # deterministic kernels (`training.rng.deterministic_kernels`): a rerun on the same hardware and software repeats
    # the run bit for bit; slower
    deterministic: bool = False
    device: str = "auto"
    progress: bool = True
    samples: int = 3  # generated at the end (needs data.tokenizer or the demo); 0: none
    sample_tokens: int = 200
    sample_temperature: float = 0.8


@dataclass
class DpoSection:
    beta: float = 0.1
    loss: str = "sigmoid"  # "sigmoid" | "norm" (log-probabilities averaged over each response's tokens)
    reference: str = "precomputed"  # "precomputed" | "frozen"


# every linear layer of the blocks: attention, the SSM half's projections (Mamba-2 or fast-weight), the MLP
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSection:
    r: int = 0  # 0: no LoRA (every weight trains)
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    save_adapter: bool = False  # also write the adapter alone to final/adapter (peft's format)


@dataclass
class DistributedSection:
    backend: str = "auto"


@dataclass
class ParallelSection:
    """Sizes of the mesh dimensions (`hybridlm.parallel.ParallelConfig`), resolved against the world size by
    the trainer. Exactly one of dp_replicate / dp_shard may be -1 ("the ranks left over"), so one config
    serves any number of GPUs."""

    dp_replicate: int = 1  # replicas (DDP-like; HSDP with dp_shard > 1)
    dp_shard: int = -1  # FSDP2 sharding degree
    cp: int = 1  # context parallelism: each row's sequence split over cp ranks
    tp: int = 1  # tensor parallelism: attention / SSM heads and MLP channels split over tp ranks
    mixer_parallel: str = "off"  # "on" | "interleaved": attention and SSM mixers on the two halves of tp
    ssm_tensor_parallel: bool = True  # False: SSM mixers replicated over tp (needed when mamba_n_groups % tp)
    activation_checkpointing: bool = False  # recompute every block in backward (not with cp > 1)
    # which SSM mixers on their Triton kernels recompute their conv, norms and write preparation in backward, not the
    # scans: "fast_weight" (the default: Mamba-2 keeps its, a small share of the peak that costs more host time than
    # it saves), "all" or "none" (true / false read as all / none; none under activation_checkpointing)
    recompute_mixers: str = "fast_weight"


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(kind="wsd", warmup=30, decay_fraction=0.2))
    batch: BatchSection = field(default_factory=BatchSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    lora: LoraSection = field(default_factory=LoraSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def demo_config() -> TrainConfig:
    """What `hybridlm train` runs without --config: the tiny preset on the built-in stdlib corpus."""
    config = TrainConfig(data=DataSection(demo=True))
    config.optim.lr = 3e-3
    # the decay starts where the warmup ends: no plateau at the peak lr, so the held-out loss falls at each evaluation
    config.schedule = ScheduleConfig(kind="wsd", warmup=30, decay_fraction=0.9)
    config.train.eval_batches = 64  # 128K held-out bytes, several files (a batch holds consecutive bytes of one or two)
    validate(config)
    return config


def command_of(task: str) -> str:
    """The `hybridlm` command that trains a run of train.task `task`: train (pretrain), sft, dpo."""
    return "train" if task == "pretrain" else task


def post_training_defaults(task: str) -> dict[str, Any]:
    """What `hybridlm sft` / `hybridlm dpo` start from without --config (model.init and the data come from the
    command): a short fine-tune of a small model, in minutes on a CPU. The report's recipes for real models are
    configs/sft-falcon-h1.yaml and configs/dpo-falcon-h1.yaml."""
    config = TrainConfig(data=DataSection(demo=True))
    config.train.task = task
    config.optim.weight_decay = 0.0  # the report's SFT and the common DPO setting: no weight decay
    config.batch = BatchSection(micro_batch=8, seq_len=256)
    config.train.eval_every, config.train.save_every, config.train.log_every = 0, 50, 10
    config.train.sample_tokens = 80
    if task == "sft":
        config.optim.lr = 2e-3
        config.train.steps, config.train.out_dir = 300, "runs/sft"
        # the report's SFT shape: warmup, stable, then an exponential decay to lr / 8
        config.schedule = ScheduleConfig(kind="wsd", warmup=10, decay_fraction=0.5, decay_shape="exponential",
                                         min_lr_ratio=0.125)
    else:
        config.optim.lr = 1e-4
        config.train.steps, config.train.out_dir = 60, "runs/dpo"
        # the report's DPO shape: a 10% warmup, then a linear decay to 0
        config.schedule = ScheduleConfig(kind="wsd", warmup=6, decay_fraction=0.9)
    return config_to_dict(config)


# ------------------------------------------------------------------------------------------------ schema
def _hybrid_config_class() -> type:
    from hybridlm.models.config import HybridConfig

    return HybridConfig


SCHEMA = Schema(
    hidden={ScheduleConfig: {"rampup": "the batch rampup is set under batch.rampup_start / batch.rampup_tokens / "
                             "batch.ref_batch"}},
    # keys of older versions, with what to write instead (a resumed old run's config.yaml names them)
    removed={DistributedSection: {
        "strategy": "the parallel section replaced it: 'fsdp' is parallel.dp_shard=-1 (the default, FSDP2 over "
        "all ranks), 'ddp' is parallel.dp_replicate=-1 with parallel.dp_shard=1 (replicas); delete the key",
    }},
    mappings={(ModelSection, "overrides"): FieldsMapping(_hybrid_config_class, literals={"mamba_d_head": ("auto",)})},
    bool_words={(ParallelSection, "mixer_parallel"): ("off", "on"),
                (ParallelSection, "recompute_mixers"): ("none", "all")},
    checks={ScheduleConfig: check_schedule_decay},
)


# ------------------------------------------------------------------------------------------------ loading
def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build and validate a TrainConfig from a nested dict (as read from YAML)."""
    config = SCHEMA.build(TrainConfig, raw)
    validate(config)
    return config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                task: str = "pretrain") -> TrainConfig:
    """Read a YAML config (None: the built-in demo config, or `post_training_defaults(task)` for "sft" / "dpo"),
    apply `key=value` overrides, validate.

    Raises ConfigError naming the key for unknown keys, wrong types and impossible settings.
    """
    if path is None:
        raw = config_to_dict(demo_config()) if task == "pretrain" else post_training_defaults(task)
    else:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"--config {path}: is a directory; give a YAML file (e.g. configs/demo.yaml)")
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not a UTF-8 text file (byte {err.start} cannot be decoded); a config is "
                              "YAML text, e.g. configs/demo.yaml") from err
        try:
            raw = load_yaml(text) or {}
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from err
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(SCHEMA.valid_keys(TrainConfig))})")
    merged = apply_overrides(raw, list(overrides))
    _drop_inherited_schedule_keys(merged, {".".join(parse_override(text)[0]) for text in overrides})
    return config_from_dict(merged)


_OTHER_DECAY_KEY = {"decay": "decay_fraction", "decay_fraction": "decay"}


def _drop_inherited_schedule_keys(raw: dict[str, Any], set_keys: set[str]) -> None:
    """A `--set` that chooses the schedule replaces the config file's choice instead of clashing with it: setting
    schedule.kind drops the file's settings the new kind does not read (`unused_settings`: decay and decay_fraction
    for cosine and constant, power_t0 outside the power kinds, decay_shape and min_lr_ratio for constant); setting
    decay or decay_fraction drops the other. A key set in the same command is kept (and a clash among the command's
    own keys stays an error)."""
    schedule = raw.get("schedule")
    if not isinstance(schedule, dict) or "schedule" in set_keys:
        return
    drop = set()
    if "schedule.kind" in set_keys and schedule.get("kind") in KINDS:
        drop.update(unused_settings(schedule["kind"]))
    drop.update(key for key, other in _OTHER_DECAY_KEY.items()
                if schedule.get(other) is not None and f"schedule.{other}" in set_keys)
    for key in drop:
        if f"schedule.{key}" not in set_keys:
            schedule.pop(key, None)  # the field's default


def config_to_dict(config: Any) -> Any:
    """Plain dicts / lists / scalars (tuples as lists; the schedule without its rampup field)."""
    return SCHEMA.to_plain(config)


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=None)


# The first line of a run's own config.yaml (`save_config`): it tells a run's record, which the trainer may rewrite
# or delete, from a config file of the user's that happens to sit in the output directory.
RUN_CONFIG_HEADER = "# hybridlm train: the resolved config of the run in this directory (rewritten by the run)\n"


def save_config(config: TrainConfig, path: str | Path) -> Path:
    """Write the resolved config (atomically), marked as a run's record by its first line (`RUN_CONFIG_HEADER`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (RUN_CONFIG_HEADER + dump_config(config)).encode("utf-8"))
    return path


def is_run_config(path: str | Path) -> bool:
    """Whether the file at `path` is a config.yaml that `save_config` wrote (a run's record)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline() == RUN_CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def diff_configs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts ("key: old -> new"; an absent key reads as None)."""
    return [f"{d.key}: {d.old!r} -> {d.new!r}" for d in diff_nested(old, new)]
