"""A training checkpoint of a run as a model directory: `hybridlm checkpoint export`.

    export_checkpoint("runs/x", "models/x")                        # the newest checkpoint, hybridlm format
    export_checkpoint("runs/x", "models/x-h1", step=400, format="falcon_h1")
    for key, tensor in iter_sharded_tensors(step_dir): ...         # a sharded checkpoint, one tensor at a time

The output loads with `hybridlm.load_model` and transformers' Auto classes (config.json, safetensors shards with
their index, the run's tokenizer files: those its final/ gets, for sft / dpo model.init's and the chat template the
run trained with; a run whose tokenizer is not there is exported with a warning saying so). A sharded (dcp)
checkpoint is consolidated one tensor at a time: DCP's metadata gives each tensor's global shape and dtype, a
single-tensor `dcp.load` reads its chunks from every rank's file, and the tensors go into safetensors shards of at
most `shard_bytes`; host memory stays at one shard, so models larger than memory export. A full checkpoint's
model.safetensors is read tensor by tensor as well. No process group is needed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridlm.training.checkpoint import (
    MODEL_FILE,
    CheckpointError,
    check_no_damaged_newer,
    checkpoint_dir_name,
    checkpoint_format,
    latest_checkpoint,
    list_checkpoints,
    step_of,
    verify_checkpoint,
)
from hybridlm.training.config import ConfigError, TrainConfig, load_config
from hybridlm.training.run_dir import (
    CHAT_TEMPLATE_FILE,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    copy_tokenizer_files,
    missing_tokenizer,
    remove_path,
    run_tokenizer_dir,
    run_tokenizer_setting,
)
from hybridlm.training.sharded_checkpoint import DCP_DIR, single_process_quiet

log = logging.getLogger(__name__)

EXPORT_FORMATS = ("hybridlm", "falcon_h1")
SHARD_BYTES = 2 * 1024**3  # largest safetensors file written (transformers' default shard size is 5 GB)
INDEX_FILE = "model.safetensors.index.json"


def iter_sharded_tensors(path: str | Path, keys: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(DCP key, full CPU tensor) of each of `keys` (None: every tensor of the checkpoint; model tensors are
    `hybridlm.parallel.sharded.model_key(name)`), read one at a time from the sharded checkpoint at `path` (a step
    directory) with a single-tensor `dcp.load` (no process group)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = dcp.FileSystemReader(str(Path(path) / DCP_DIR))
    saved = reader.read_metadata().state_dict_metadata
    for key in saved if keys is None else keys:
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"{Path(path) / DCP_DIR} holds no tensor {key!r}; it was saved for another model")
        tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        with single_process_quiet():
            dcp.load({key: tensor}, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=True)
        yield key, tensor


def _iter_full_tensors(path: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(path / MODEL_FILE), framework="pt") as handle:
        held = set(handle.keys())  # noqa: SIM118 (not a dict)
        for name in names:
            if name not in held:
                raise CheckpointError(f"{path / MODEL_FILE} holds no tensor {name!r}; it was saved for another model")
            yield name, handle.get_tensor(name)


def export_checkpoint(run: str | Path, out: str | Path, *, step: int | None = None,
                      format: str = "hybridlm", shard_bytes: int = SHARD_BYTES,  # noqa: A002
                      overwrite: bool = False) -> Path:
    """Write the model of a run's checkpoint (`step`, default the newest complete one; refused with a CheckpointError
    while a newer step directory is damaged, as --resume refuses it) to the model directory `out`
    (written as `out`.tmp and renamed: an existing `out` is replaced only by a complete export, and only with
    `overwrite` and where it is a model directory; `out` is never the run, inside it or around it). Verifies the
    checkpoint's checksums first. Raises ConfigError for a run, step, format or `out` that cannot be exported (before
    anything is written) and CheckpointError for a damaged checkpoint."""
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.training.validate import build_model_config

    run, out = Path(run), Path(out)
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"--format: must be one of {', '.join(EXPORT_FORMATS)}, got {format!r}")
    if not run.is_dir():
        raise ConfigError(f"--run {run}: " + ("no such directory" if not os.path.lexists(run) else "not a directory")
                          + "; give the output directory of a `hybridlm train` run")
    if not (run / CONFIG_FILE).is_file():
        raise ConfigError(f"--run {run}: no {CONFIG_FILE}; give the output directory of a `hybridlm train` run")
    _check_out(run, out, overwrite)
    config = load_config(run / CONFIG_FILE)
    directory = run / CHECKPOINT_DIR
    path = latest_checkpoint(directory) if step is None else directory / checkpoint_dir_name(step)
    if path is None or not path.is_dir():
        which = "no complete checkpoint" if step is None else f"no checkpoint of step {step}"
        steps = [p.name for p in list_checkpoints(directory)] if directory.is_dir() else []
        held = f" (it holds {', '.join(steps)})" if steps else ""
        raise ConfigError(f"--run {run}: {which} in {directory}{held}")
    if step is None:
        check_no_damaged_newer(path, f"--run {run}", f"exporting {path.name} instead would give an older model than "
                               "the run's newest", f"to export {path.name}, or pass --step {step_of(path)} to export "
                               "it while they are there")
    verify_checkpoint(path)

    with torch.device("meta"):
        model = HybridForCausalLM(build_model_config(config))
    hybrid = model.config.to_hybrid()
    names = list(model.state_dict())
    if hybrid.tie_word_embeddings:  # stored once, under the embedding's name (as save_pretrained does)
        names.remove("lm_head.weight")
    if checkpoint_format(path) == "dcp":
        from hybridlm.parallel.sharded import MODEL_PREFIX, model_key

        tensors = ((key[len(MODEL_PREFIX):], value)
                   for key, value in iter_sharded_tensors(path, [model_key(name) for name in names]))
    else:
        tensors = _iter_full_tensors(path, names)

    tmp = out.with_name(out.name + ".tmp")
    remove_path(tmp)
    tmp.mkdir(parents=True)
    if format == "falcon_h1":
        from hybridlm.models.falcon_h1 import config_to_falcon_h1, state_dict_to_falcon_h1

        try:
            falcon = config_to_falcon_h1(hybrid)
        except ValueError as err:
            raise ConfigError(f"--format falcon_h1: {err}; export with --format hybridlm") from err
        falcon.dtype = model.model.embed_tokens.weight.dtype
        falcon.save_pretrained(str(tmp))
        tensors = ((key, value) for name, tensor in tensors
                   for key, value in state_dict_to_falcon_h1({name: tensor}).items())
    else:
        model.config.architectures = [type(model).__name__]
        model.config.dtype = model.model.embed_tokens.weight.dtype
        model.config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
    _write_shards(tensors, tmp, shard_bytes)
    _write_tokenizer(config, run, tmp, out)
    old = out.with_name(out.name + ".old.tmp")
    remove_path(old)
    if os.path.lexists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    remove_path(old)
    return out


def _write_tokenizer(config: TrainConfig, run: Path, directory: Path, out: Path) -> None:
    """The run's tokenizer into the export being written in `directory` (`out` once renamed), as the run's final/
    gets it (`Trainer.export`): the files of `run_tokenizer_dir` (model.init's for sft / dpo, with its chat template)
    and data.chat_template, the template the run trained with instead, as chat_template.jinja. Read from where the
    run's config names them now; what is missing there is logged as a warning (the weights are exported anyway)."""
    tokenizer_dir = run_tokenizer_dir(config, run)
    copy_tokenizer_files(tokenizer_dir, directory)
    missing = missing_tokenizer(tokenizer_dir, directory, run_tokenizer_setting(config))
    if missing:
        log.warning("%s has no tokenizer: %s", out, missing)
    template = config.data.chat_template
    if template is not None:
        try:
            text = Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            log.warning("%s lacks the chat template the run trained with: its data.chat_template %s cannot be read "
                        "(%s); copy that template to %s", out, template, err, out / CHAT_TEMPLATE_FILE)
        else:
            (directory / CHAT_TEMPLATE_FILE).write_text(text, encoding="utf-8")


def _check_out(run: Path, out: Path, overwrite: bool) -> None:
    """Refuse an `out` whose replacement would lose what is not an export: the run itself, a path inside it (its
    checkpoints) or one holding it; an existing path that is not a model directory; a model directory without
    `overwrite`."""
    run_path, out_path = run.resolve(), out.resolve()
    if out_path == run_path or run_path in out_path.parents or out_path in run_path.parents:
        where = ("is the run" if out_path == run_path else "is inside the run" if run_path in out_path.parents
                 else "holds the run")
        raise ConfigError(f"--out {out} {where} --run {run}; write the model to a directory of its own")
    if not os.path.lexists(out):
        return
    if not _is_model_dir(out):  # said first: --overwrite would not help
        raise ConfigError(f"--out {out} exists and is not a model directory (config.json and .safetensors files, no "
                          "folders), so it is not replaced; choose another --out")
    if not overwrite:
        raise ConfigError(f"--out {out} already exists; pass --overwrite to replace it")


def _is_model_dir(path: Path) -> bool:
    """A directory that an export (or `save_pretrained`) writes: files only, config.json and safetensors among them."""
    if not path.is_dir() or path.is_symlink():
        return False
    entries = list(path.iterdir())
    return (all(entry.is_file() for entry in entries) and (path / "config.json").is_file()
            and any(entry.suffix == ".safetensors" for entry in entries))


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], directory: Path, shard_bytes: int) -> None:
    """Safetensors files of at most `shard_bytes` (one larger tensor gets a file of its own): `model.safetensors`
    when one is enough, else `model-XXXXX-of-YYYYY.safetensors` and their index (transformers' layout)."""
    files: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, str(directory / f"shard-{len(files):05d}.tmp"), metadata={"format": "pt"})
            files.append(list(shard))
            shard, size = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        os.replace(directory / "shard-00000.tmp", directory / "model.safetensors")
        return
    weight_map = {}
    for index, keys in enumerate(files):
        name = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(directory / f"shard-{index:05d}.tmp", directory / name)
        weight_map.update(dict.fromkeys(keys, name))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=1) + "\n", encoding="utf-8")
