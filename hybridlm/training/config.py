"""`TrainConfig`: the typed, validated description of a training run, read from YAML plus `--set` overrides.

    config = load_config("configs/demo.yaml", ["train.steps=12", "optim.lr=3e-3"])
    config = load_config(None)                      # the built-in demo (same as configs/demo.yaml)
    save_config(config, "runs/x/config.yaml")       # the resolved config; load_config reads it back equal

Sections (dotted keys address them: `--set batch.micro_batch=4`):

    model         preset (a name from hybridlm.models.presets), overrides (any HybridConfig field, typed
                  like the field: `model.overrides.ssm_multiplier_dt=0.5`), mup_base_width (the width the
                  forward multipliers were tuned at: they are transferred to hidden_size with
                  `training.optim.scale_multipliers`; None leaves them as given)
    data          demo (the built-in corpus, `training.demo`) or sources (prepared shard dirs with weights),
                  eval_sources (held-out shard dirs), tokenizer (a tokenizer dir, to print samples),
                  document_boundaries (false: one position run per row, documents not kept apart; for cp)
    optim         AdamW lr, weight_decay, betas, eps; per-role multipliers: elr / ewd (matrix roles,
                  `training.optim`), vector_lr (vector roles)
    schedule      `training.schedules.ScheduleConfig` (kind, unit, warmup, decay, ...; not rampup). An override
                  of kind (to cosine or constant), decay or decay_fraction drops the other decay key the file
                  or demo gave (`--set schedule.kind=cosine` on the demo, whose decay_fraction is 0.2, just works)
    batch         micro_batch (rows per rank per micro-step), seq_len, grad_accum; batch-size rampup:
                  rampup_start (rows at the start; None: off), rampup_tokens, ref_batch. Batch sizes count
                  rows per data-parallel rank: the global batch is micro_batch x grad_accum x dp_replicate x
                  dp_shard (the tp and cp ranks of one data-parallel rank share its rows)
    train         steps and / or tokens (the run ends at whichever comes first), out_dir, log_every, eval_every, eval_batches, save_every,
                  keep_last, seed, dtype ("fp32" | "bf16": autocast, fp32 master weights), grad_clip,
                  max_consecutive_skips, spike_factor, compile, compile_mode, deterministic, device, progress, samples
    parallel      the device mesh under torchrun (`hybridlm.parallel`): dp_replicate, dp_shard (one of the two
                  may be -1: the ranks left over), cp, tp, mixer_parallel ("off" | "on" | "interleaved"),
                  ssm_tensor_parallel, activation_checkpointing; dp_replicate x dp_shard x cp x tp must be the
                  world size. The default (dp_shard: -1) is FSDP2 over every rank; DDP-like replicas are
                  dp_replicate: -1, dp_shard: 1
    distributed   backend ("auto" | "gloo" | "nccl"); used under torchrun. (`distributed.strategy` is gone:
                  "fsdp" is parallel.dp_shard=-1, "ddp" is parallel.dp_replicate=-1 + parallel.dp_shard=1)

dt attenuation (report, "Training Stability and the dt Attenuation Mechanism") is the model field
`ssm_multiplier_dt` (the forward multiplier alpha of the dt activation, 0 < alpha < 1 attenuates);
clipping positive dt is `time_step_limit: [min, max]` (dt = clamp(softplus(.), min, max) in the Mamba-2
mixer). Both are ordinary `model.overrides`.

Typing: every value is parsed into the declared type of its field (ints, floats, bools, str, optional,
tuples, lists, dicts, nested sections); YAML's `3e-4` (a string to PyYAML) is read as a float where a
float is expected. Errors are `ConfigError`s that name the dotted key: an unknown key lists the valid
keys of its section, a wrong type says what was expected, an impossible combination (a decay longer than
the run, rampup batches that are not multiples of the micro batch, ...) names the keys involved, and so does a
setting that would have no effect (a batch.rampup_tokens without batch.rampup_start, schedule.power_t0 with
kind wsd, ...). What depends on the number of data-parallel ranks (the run's tokens under train.steps, its
updates under train.tokens) is checked by the trainer, through `schedule_config`. A config file must be UTF-8
YAML without a key given twice in one mapping (YAML would silently keep the last).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridlm.fileio import diff_nested
from hybridlm.training.schedules import ScheduleConfig, has_decay_stage

DTYPES = ("fp32", "bf16")
MIXER_PARALLEL = ("off", "on", "interleaved")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # train.compile_mode


class ConfigError(ValueError):
    """A configuration problem; the message starts with the dotted key it concerns."""


# ------------------------------------------------------------------------------------------------ sections
@dataclass
class ModelSection:
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
    steps: int | None = 300
    tokens: int | None = None  # stop after this many tokens (or after `steps`, whichever comes first)
    out_dir: str = "runs/demo"
    log_every: int = 10
    eval_every: int = 100  # 0: no periodic evaluation (one at the end if held-out data exists)
    eval_batches: int = 4
    save_every: int = 100  # 0: only at the end (and on SIGINT / SIGTERM)
    keep_last: int = 2
    seed: int = 0
    dtype: str = "fp32"
    grad_clip: float | None = 1.0
    max_consecutive_skips: int = 5
    spike_factor: float | None = None  # skip updates whose loss exceeds this x the recent median
    compile: bool = False
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


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(kind="wsd", warmup=30, decay_fraction=0.2))
    batch: BatchSection = field(default_factory=BatchSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def demo_config() -> TrainConfig:
    """What `hybridlm train` runs without --config: the tiny preset on the built-in stdlib corpus."""
    config = TrainConfig(data=DataSection(demo=True))
    config.optim.lr = 3e-3
    config.train.eval_batches = 16  # 32K held-out bytes: a batch holds consecutive bytes of one or two files
    validate(config)
    return config


# ------------------------------------------------------------------------------------------------ parsing
class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but a key given twice in one mapping is a ConfigError: plain YAML keeps the last
    one, so `train: {steps: 10}` further down a file would silently replace a whole `train:` section."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, as YAML says
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = key in first_line
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if seen:
                    raise ConfigError(f"duplicate key {key!r} at line {line} (first at line {first_line[key]}): a "
                                      "mapping takes each key once (YAML would keep only the last); delete one of them")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    """YAML text -> Python values (safe: no Python objects), refusing duplicate keys (ConfigError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


_HIDDEN_KEYS: dict[type, dict[str, str]] = {
    ScheduleConfig: {"rampup": "the batch rampup is set under batch.rampup_start / batch.rampup_tokens / batch.ref_batch"},
}
# Keys of older versions, with what to write instead (a resumed old run's config.yaml names them).
_REMOVED_KEYS: dict[type, dict[str, str]] = {
    DistributedSection: {
        "strategy": "the parallel section replaced it: 'fsdp' is parallel.dp_shard=-1 (the default, FSDP2 over "
        "all ranks), 'ddp' is parallel.dp_replicate=-1 with parallel.dp_shard=1 (replicas); delete the key",
    },
}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """`value` (from YAML) as an instance of the type `hint`; ConfigError naming `path` if it is not one."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                continue
        raise _fail(path, f"expected {_type_name(hint)}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _fail(path, f"expected a bool (true / false), got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _as_float(value)
        if number is not None and math.isfinite(number) and number.is_integer():
            return int(number)
        raise _fail(path, f"expected an int, got {value!r}")
    if hint is float:
        number = _as_float(value)
        if number is None:
            raise _fail(path, f"expected a number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # YAML reads fw_rule=1 or out_dir=2024 as ints
            return str(value)
        raise _fail(path, f"expected a string, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _fail(path, f"expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _fail(path, f"expected a list of {len(args)} values, got {len(value)}: {value!r}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, f"expected a mapping, got {value!r}")
        key_hint, value_hint = args if args else (Any, Any)
        return {_coerce(k, key_hint, path): _coerce(v, value_hint, f"{path}.{k}") for k, v in value.items()}
    raise _fail(path, f"cannot parse a value of type {_type_name(hint)}")  # a field type this parser lacks


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        text = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(text, text)
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _build(cls: type, raw: Any, path: str) -> Any:
    """Instantiate dataclass `cls` from the mapping `raw` (None: all defaults)."""
    if raw is None:
        raw = {}
    if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise _fail(path, f"expected a mapping of keys ({', '.join(_valid_keys(cls))}), got {raw!r}")
    hidden = _HIDDEN_KEYS.get(cls, {})
    removed = _REMOVED_KEYS.get(cls, {})
    valid = _valid_keys(cls)
    for key in raw:
        where = f"{path}.{key}" if path else str(key)
        if key in hidden:
            raise _fail(where, f"cannot be set here; {hidden[key]}")
        if key in removed:
            raise _fail(where, f"was removed; {removed[key]}")
        if key not in valid:
            raise ConfigError(f"unknown key {where!r}; valid keys of {path or 'the config'}: {', '.join(valid)}")
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        if (cls, key) in _YAML_BOOL_WORDS and isinstance(value, bool):
            value = _YAML_BOOL_WORDS[(cls, key)][value]  # YAML reads an unquoted on / off as true / false
        if (cls, key) in _TYPED_MAPPINGS:
            kwargs[key] = _coerce_fields_of(_TYPED_MAPPINGS[(cls, key)], value, where)
        else:
            kwargs[key] = _coerce(value, hints[key], where)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise _fail(path, f"missing required key(s): {', '.join(missing)}")
    if cls is ScheduleConfig:
        _check_schedule_decay(kwargs, path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        # The section's own messages speak of `ScheduleConfig.decay` or `ScheduleConfig(kind='power')`: name the
        # config keys instead (schedule.decay, schedule.kind='power'), which is what the user types.
        message = str(err)
        if path:
            message = re.sub(rf"\b{cls.__name__}\((\w+=[^)]*)\)", rf"{path}.\1", message)
            message = message.replace(f"{cls.__name__}.", f"{path}.")
        if path and message.startswith(f"{path}."):
            raise ConfigError(message) from err
        raise _fail(path, message) from err


def _check_schedule_decay(kwargs: dict[str, Any], path: str) -> None:
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


def _valid_keys(cls: type) -> list[str]:
    hidden = _HIDDEN_KEYS.get(cls, {})
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in hidden]


def _hybrid_config_class() -> type:
    from hybridlm.models.config import HybridConfig

    return HybridConfig


def _coerce_fields_of(cls_factory, raw: Any, path: str) -> dict[str, Any]:
    """A mapping whose keys are the fields of another dataclass (model.overrides -> HybridConfig)."""
    cls = cls_factory()
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(path, f"expected a mapping of {cls.__name__} fields, got {raw!r}")
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    hints = _hints(cls)
    out = {}
    for key, value in raw.items():
        if key not in valid:
            raise ConfigError(f"unknown key '{path}.{key}'; valid keys of {path} (the {cls.__name__} fields): "
                              + ", ".join(valid))
        hint = hints[key]
        if key == "mamba_d_head" and value == "auto":
            out[key] = value
            continue
        out[key] = _coerce(value, hint, f"{path}.{key}")
    return out


_TYPED_MAPPINGS: dict[tuple[type, str], Any] = {(ModelSection, "overrides"): _hybrid_config_class}
# String fields whose words YAML 1.1 reads as booleans: (word for false, word for true).
_YAML_BOOL_WORDS: dict[tuple[type, str], tuple[str, str]] = {(ParallelSection, "mixer_parallel"): ("off", "on")}


# ------------------------------------------------------------------------------------------------ overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b.c=value"` -> (["a", "b", "c"], value parsed as YAML: numbers, true/false, null, [lists], {maps})."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value (dotted key, e.g. train.steps=12)")
    key, _, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"--set {text!r}: {key!r} is not a dotted key like train.steps")
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except ConfigError as err:  # a duplicate key in a {mapping}
        raise ConfigError(f"--set {text!r}: {err}") from err
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket in a path): keep the string; the type check decides
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key=value` into the nested dict `raw` (a copy is returned)."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


# ------------------------------------------------------------------------------------------------ loading
def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build and validate a TrainConfig from a nested dict (as read from YAML)."""
    config = _build(TrainConfig, raw, "")
    validate(config)
    return config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML config (None: the built-in demo config), apply `key=value` overrides, validate.

    Raises ConfigError naming the key for unknown keys, wrong types and impossible settings.
    """
    if path is None:
        raw = config_to_dict(demo_config())
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
            raw = _load_yaml(text) or {}
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from err
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(_valid_keys(TrainConfig))})")
    merged = apply_overrides(raw, list(overrides))
    _drop_inherited_decay(merged, {".".join(parse_override(text)[0]) for text in overrides})
    return config_from_dict(merged)


_OTHER_DECAY_KEY = {"decay": "decay_fraction", "decay_fraction": "decay"}


def _drop_inherited_decay(raw: dict[str, Any], set_keys: set[str]) -> None:
    """A `--set` that chooses the decay replaces the config file's choice instead of clashing with it: setting
    schedule.kind to a kind without a decay stage (cosine, constant) drops the file's schedule.decay and
    schedule.decay_fraction; setting one of those two drops the other. A key set in the same command is kept
    (and a clash among the command's own keys stays an error)."""
    schedule = raw.get("schedule")
    if not isinstance(schedule, dict) or "schedule" in set_keys:
        return
    inherited = [k for k in ("decay", "decay_fraction") if f"schedule.{k}" not in set_keys]
    if "schedule.kind" in set_keys and isinstance(schedule.get("kind"), str) and not has_decay_stage(schedule["kind"]):
        drop = inherited
    else:
        drop = [k for k in inherited if schedule.get(_OTHER_DECAY_KEY[k]) is not None
                and f"schedule.{_OTHER_DECAY_KEY[k]}" in set_keys]
    for key in drop:
        if key in schedule:
            schedule[key] = None


def config_to_dict(config: Any) -> Any:
    """Plain dicts / lists / scalars (tuples as lists; the schedule without its rampup field)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        hidden = _HIDDEN_KEYS.get(type(config), {})
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)
                if f.init and f.name not in hidden}
    if isinstance(config, (list, tuple)):
        return [config_to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: config_to_dict(v) for k, v in config.items()}
    return config


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=None)


# The first line of a run's own config.yaml (`save_config`): it tells a run's record, which the trainer may rewrite
# or delete, from a config file of the user's that happens to sit in the output directory.
RUN_CONFIG_HEADER = "# hybridlm train: the resolved config of the run in this directory (rewritten by the run)\n"


def save_config(config: TrainConfig, path: str | Path) -> Path:
    """Write the resolved config (atomically), marked as a run's record by its first line (`RUN_CONFIG_HEADER`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(RUN_CONFIG_HEADER + dump_config(config), encoding="utf-8")
    tmp.replace(path)
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


# ------------------------------------------------------------------------------------------------ validation
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


def build_model_config(config: TrainConfig):
    """The HybridConfig of the run: preset + overrides, multipliers transferred from mup_base_width."""
    from hybridlm.models.presets import get_preset
    from hybridlm.training.optim import scale_multipliers

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
    if data.demo and data.sources:
        raise ConfigError("data.demo: true and data.sources are exclusive; use one of them")
    if not data.demo and not data.sources:
        raise ConfigError("data: no training data; list prepared datasets under data.sources, or set data.demo: true")
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
    # the run's length: only what holds at any number of data-parallel ranks is checked here; the rest (the run's
    # tokens under train.steps, its updates under train.tokens) `schedule_config` checks with the trainer's number
    if config.schedule.unit == "steps" and t.tokens is None:  # train.steps updates whatever the number of ranks
        _check_decay_fits(config.schedule, t.steps, ": train.steps")


def _validate_parallel(config: TrainConfig, hybrid) -> None:
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


def _check_model_splits(hybrid, p) -> None:
    """The model's head, group and width counts against parallel.tp, checked on a meta-device model by the code
    that later splits it: a combination that cannot split fails with the keys named, before any model is built."""
    import torch

    from hybridlm.models.configuration import HybridLMConfig
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.parallel import check_mixer_parallel, check_tensor_parallel

    with torch.device("meta"):
        model = HybridForCausalLM(HybridLMConfig.from_hybrid(hybrid))
    try:
        if p.mixer_parallel == "off":
            check_tensor_parallel(model, p.tp, ssm_heads=p.ssm_tensor_parallel)
        else:
            check_mixer_parallel(model, p.tp, mode=p.mixer_parallel, ssm_heads=p.ssm_tensor_parallel)
    except ValueError as err:
        raise ConfigError(f"parallel.tp={p.tp} does not fit the model: {err}. Change parallel.tp or the sizes "
                          "under model.overrides; for SSM head or group counts, parallel.ssm_tensor_parallel=false "
                          "keeps the SSM mixers replicated instead") from err


def resolve_parallel(config: TrainConfig, world_size: int):
    """The run's `hybridlm.parallel.ParallelConfig` for `world_size` ranks (a -1 filled in, sizes checked);
    ConfigError naming the parallel keys if they do not multiply to the world size or tp does not split the
    model's heads / groups / widths."""
    from hybridlm.parallel.mesh import ParallelConfig

    p = config.parallel
    dp_replicate, dp_shard = p.dp_replicate, p.dp_shard
    fixed = p.cp * p.tp * (dp_shard if dp_replicate == -1 else dp_replicate)
    if -1 in (dp_replicate, dp_shard):
        if world_size % fixed:
            raise ConfigError(
                f"parallel: the world size {world_size} is not divisible by the fixed sizes "
                f"(dp_replicate x dp_shard x cp x tp without the -1 = {fixed}); change parallel.tp / parallel.cp / "
                "parallel.dp_* or the number of processes"
            )
        rest = world_size // fixed
        dp_replicate, dp_shard = (rest, dp_shard) if dp_replicate == -1 else (dp_replicate, rest)
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
        activation_checkpointing=p.activation_checkpointing, ssm_tensor_parallel=p.ssm_tensor_parallel,
        mixer_parallel=p.mixer_parallel,
    ).resolved(world_size)


# ------------------------------------------------------------------------------------------------ run length
def rampup_of(config: TrainConfig, world_size: int):
    """The `BatchRampup` of the run in global rows (the batch section counts rows per rank), or None.

    Here and in `schedule_config` / `plan_steps`, `world_size` is the number of data-parallel ranks
    (dp_replicate x dp_shard of `resolve_parallel`): the world size when neither tp nor cp is used."""
    from hybridlm.training.schedules import BatchRampup

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


def schedule_config(config: TrainConfig, world_size: int) -> tuple[ScheduleConfig, float, str | None]:
    """(the run's ScheduleConfig with its rampup, its total in its unit, a note if the warmup was shortened).

    A warmup that does not fit (warmup + decay > total, e.g. `--set train.steps=12` on a config written
    for thousands of steps) is shortened to total - decay, with a note saying so, so that any config runs
    at any length; a batch rampup not shorter than the run is kept, with a note that the batch never
    reaches its target. A decay longer than the whole run is a ConfigError naming the keys and the
    number of data-parallel ranks (the run's tokens, or its updates under a token budget, depend on it:
    `validate` checks only what holds at any number).
    """
    steps, tokens, total = schedule_total(config, world_size)
    schedule = config.schedule
    notes = []
    ranks = f" at {world_size} data-parallel rank{'s' if world_size > 1 else ''}"
    _check_decay_fits(schedule, total, ranks if schedule.unit == "steps" else f": {steps} updates{ranks}")
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


def _check_decay_fits(schedule: ScheduleConfig, total: float, run: str) -> None:
    """ConfigError if the decay stage is longer than the run (`total` in the schedule's unit; `run`, appended to
    it, says what fixed that length)."""
    decay = schedule.decay_length(total)
    if decay > total:
        raise ConfigError(f"schedule.decay: the decay ({decay:g} {schedule.unit}) is longer than the whole run "
                          f"({total:g} {schedule.unit}{run}); shorten schedule.decay or train longer")


def plan_steps(config: TrainConfig, world_size: int) -> tuple[int, int]:
    """(updates, tokens) of the whole run: it ends after `train.steps` updates or once `train.tokens`
    tokens are consumed, whichever comes first (one of the two may be null)."""
    rampup = rampup_of(config, world_size)
    b = config.batch
    fixed = b.micro_batch * world_size * b.grad_accum * b.seq_len  # tokens per update without rampup
    max_steps, max_tokens = config.train.steps, config.train.tokens
    if rampup is None:
        steps = max_steps if max_tokens is None else -(-max_tokens // fixed)
        if max_steps is not None:
            steps = min(steps, max_steps)
        return steps, steps * fixed
    steps = tokens = 0
    while (max_steps is None or steps < max_steps) and (max_tokens is None or tokens < max_tokens):
        tokens += rampup.batch_size(tokens) * b.seq_len
        steps += 1
    return steps, tokens


def schedule_total(config: TrainConfig, world_size: int) -> tuple[int, int, float]:
    """(updates, tokens, the schedule's total in its unit)."""
    steps, tokens = plan_steps(config, world_size)
    return steps, tokens, steps if config.schedule.unit == "steps" else tokens
