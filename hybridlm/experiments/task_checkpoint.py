"""The checkpoint files of `train_on_task` (hybridlm/eval/train_task.py's docstring says what they hold).

    STEM.stepNNNNNNNN.safetensors   the tensors (model, AdamW state, best weights, torch RNG states, running loss)
    STEM.json                       everything else, and the tensor file's name, size and sha256

`save` writes the tensor file, then the JSON (each atomically: the JSON marks the checkpoint complete), then removes
older tensor files; `load` verifies a checkpoint against the run that wants to continue it. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridlm.fileio import write_atomic
from hybridlm.training.checkpoint import CheckpointError
from hybridlm.training.tensor_tree import flatten_tree, unflatten_tree

CHECKPOINT_FORMAT = "hybridlm-task-checkpoint"
CHECKPOINT_VERSION = 1


def stem_of(checkpoint: str | Path) -> Path:
    path = Path(checkpoint)
    return path.with_name(path.name[: -len(".json")]) if path.name.endswith(".json") else path


def json_of(stem: Path) -> Path:
    return stem.with_name(stem.name + ".json")


def fix_hint(stem: Path) -> str:
    return f"delete {stem}.* (the checkpoint's files) to start this run over"


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """Every file of the checkpoint at STEM: STEM.json, its tensor files and temporaries of interrupted saves."""
    stem = stem_of(checkpoint)
    if not stem.parent.is_dir():
        return []
    pattern = re.compile(re.escape(stem.name) + r"(\.json|\.step\d+\.safetensors)(\.tmp-\d+)?")
    return sorted(p for p in stem.parent.iterdir() if pattern.fullmatch(p.name))


def saved_fingerprint(checkpoint: str | Path) -> Any:
    """The fingerprint STEM.json records (None when there is no readable checkpoint JSON)."""
    try:
        record = json.loads(json_of(stem_of(checkpoint)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get("fingerprint") if isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT else None


def remove_checkpoint(checkpoint: str | Path) -> bool:
    """Delete the checkpoint at STEM (its JSON first: a partial removal leaves no checkpoint, only files
    the next save or removal deletes). Returns whether there was one."""
    stem = stem_of(checkpoint)
    json_path = json_of(stem)
    existed = json_path.is_file()
    json_path.unlink(missing_ok=True)
    for path in checkpoint_files(stem):
        path.unlink(missing_ok=True)
    return existed


def jsonable(value: Any, what: str) -> Any:
    """`value` as it comes back from JSON (tuples -> lists); TypeError when it is not JSON-able."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what} must be JSON-serializable: {err}") from err


def torch_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's CPU generator and, on CUDA, the training device's (dropout draws from them)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_torch_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"].to(torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8), device)


def save(stem: Path, tree: dict, record: dict) -> None:
    """The tensor file (atomically), then STEM.json naming it (atomically: now the checkpoint is complete),
    then older tensor files and temporaries."""
    from safetensors.torch import save as safetensors_bytes

    stem.parent.mkdir(parents=True, exist_ok=True)
    tensors, skeleton = flatten_tree(tree)
    data = safetensors_bytes(tensors)
    name = f"{stem.name}.step{record['step']:08d}.safetensors"
    digest = write_atomic(stem.parent / name, data)
    json_path = json_of(stem)
    record = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **record,
              "tensors": {"file": name, "bytes": len(data), "sha256": digest}, "tree": skeleton}
    write_atomic(json_path, (json.dumps(record, indent=1, allow_nan=True) + "\n").encode("utf-8"))
    for path in checkpoint_files(stem):
        if path.name not in (name, json_path.name):
            path.unlink(missing_ok=True)


def _differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in [*saved, *(k for k in now if k not in saved)]:
            out += _differences(saved.get(key, "(absent)"), now.get(key, "(absent)"), f"{prefix}{key}.")
        return out
    return [] if saved == now else [f"{prefix.rstrip('.') or 'value'}: saved {saved!r}, now {now!r}"]


def load(stem: Path, *, settings: dict, fingerprint: Any, model: nn.Module) -> tuple[dict, dict] | None:
    """(record, tensor tree) of the checkpoint at STEM, verified against this run; None when there is none."""
    from safetensors import SafetensorError
    from safetensors.torch import load as safetensors_load

    json_path = json_of(stem)
    if not json_path.is_file():
        return None
    try:
        record = json.loads(json_path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} file")
        if record.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"format version {record.get('version')!r}, this hybridlm reads {CHECKPOINT_VERSION}")
        step, info = record["step"], record["tensors"]
        if not isinstance(step, int) or not 0 < step <= settings["steps"]:
            raise ValueError(f"step {step!r} is outside 1..{settings['steps']}")
        for key in ("settings", "fingerprint", "result", "running_count", "batch_state", "seconds", "tree"):
            if key not in record:
                raise KeyError(key)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{json_path} is not a readable checkpoint ({type(err).__name__}: {err}); "
                              + fix_hint(stem)) from err
    mismatches = _differences(record["settings"], settings) + _differences(record["fingerprint"], fingerprint,
                                                                             "fingerprint.")
    if mismatches:
        raise CheckpointError(f"{json_path} was saved by a different run ({'; '.join(mismatches[:8])}): resume with "
                              "the settings it was saved with, or " + fix_hint(stem))
    name = info.get("file") if isinstance(info, dict) else None
    if not isinstance(name, str) or Path(name).name != name:
        raise CheckpointError(f"{json_path} names no valid tensor file ({name!r}); " + fix_hint(stem))
    tensor_path = stem.parent / name
    try:
        data = tensor_path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{tensor_path}, which {json_path} names, cannot be read ({err}); " + fix_hint(stem)) from err
    if len(data) != info.get("bytes"):
        raise CheckpointError(f"{tensor_path} has {len(data)} bytes, {json_path} records {info.get('bytes')}: the file "
                              "is truncated or from another save; " + fix_hint(stem))
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.get("sha256"):
        raise CheckpointError(f"{tensor_path} fails its checksum (sha256 {digest[:16]}..., {json_path} records "
                              f"{str(info.get('sha256'))[:16]}...): the file is corrupt; " + fix_hint(stem))
    try:
        tree = unflatten_tree(safetensors_load(data), record["tree"])
        if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict) or "optimizer" not in tree:
            raise ValueError("no model or optimizer state")
        saved = tree["model"]
    except (SafetensorError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{tensor_path} / {json_path} cannot be decoded ({err}); " + fix_hint(stem)) from err
    current = model.state_dict()
    problems = [f"missing {k}" for k in current if k not in saved][:3]
    problems += [f"unexpected {k}" for k in saved if k not in current][:3]
    problems += [f"{k}: saved {list(saved[k].shape)}, model {list(v.shape)}"
                 for k, v in current.items() if k in saved and saved[k].shape != v.shape][:3]
    if problems:
        raise CheckpointError(f"{tensor_path} does not fit the model ({'; '.join(problems)}): it was saved for "
                              "another model; " + fix_hint(stem))
    return record, tree
