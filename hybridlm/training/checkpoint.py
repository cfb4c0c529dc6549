"""Training checkpoints: one directory per step, written atomically, verified on load, no pickle.

Layout of `<directory>/step_XXXXXXXX/` (8 digits, more past 10^8 steps):

    model.safetensors        model.state_dict() (tied weights stored once: safetensors.torch.save_model)
    optimizer.safetensors    the optimizer state's tensors ...
    optimizer.json           ... and the rest of optimizer.state_dict() (param groups: lr, base_lr, role,
                             param_names, betas, ...), see `hybridlm.training.tensor_tree`
    rng.safetensors, rng.json   torch CPU / CUDA, numpy and python `random` states (`training.rng`)
    train_state.json         {"step": int, "train_state": the caller's JSON dict}: token count, schedule
                             config, data-loader position, guard counters, ... whatever resuming needs
    manifest.json            {"format", "version", "step", "files": {name: {"sha256", "bytes"}}}

Atomicity: everything is written into `step_XXXXXXXX.tmp/`, each file fsynced, the manifest (with the
sha256 of every other file) last; then the directory is renamed to `step_XXXXXXXX/` with `os.replace`.
A crash leaves at most a `.tmp` directory, which `latest_checkpoint` ignores and the next save of that
step removes. `keep_last=K` then deletes the checkpoints older than the K newest verified ones (every checksum
checked): a step directory that cannot be read, or a checkpoint that fails its checksums, never counts, so no good
checkpoint is deleted for it; a step directory without a readable manifest is never deleted.

The sharded layout (`training.sharded_checkpoint`: torch.distributed.checkpoint files written by every rank) shares
these step directories, the manifest (format `SHARDED_FORMAT`), the verification and the rotation; `checkpoint_format`
tells the two apart.

Loading verifies the manifest and every checksum before touching the model and raises `CheckpointError`
naming the bad file and saying what to do (remove the directory to fall back to the previous one); an intact
checkpoint saved for another model or optimizer raises its subclass `CheckpointMismatchError`.
Resuming exactly: save after an update and before the next draws any random number; restoring then
continues the same random streams (`restore_rng=True`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from hybridlm.fileio import fsync_dir, fsync_file, sha256_file
from hybridlm.training.rng import capture_rng_state, restore_rng_state
from hybridlm.training.tensor_tree import flatten_tree, unflatten_tree

FORMAT = "hybridlm-training-checkpoint"
SHARDED_FORMAT = "hybridlm-sharded-training-checkpoint"
FORMATS = {FORMAT: "full", SHARDED_FORMAT: "dcp"}  # manifest format -> the train.checkpoint_format that writes it
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
RNG_JSON = "rng.json"
TRAIN_STATE_FILE = "train_state.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or loaded; the message names the file and says what to do."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint saved for another model or optimizer (other parameter names, groups or shapes): the
    settings changed since the save, the files are fine (a caller may report it as a configuration error)."""


class LoadedCheckpoint(NamedTuple):
    path: Path
    step: int
    train_state: dict[str, Any]


def checkpoint_dir_name(step: int) -> str:
    """`step_XXXXXXXX` for a step count >= 0."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------- helpers
def _write_json(path: Path, obj: Any, what: str) -> None:
    try:
        text = json.dumps(obj, indent=1, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{what} must be JSON-serializable (dict, list, str, int, finite float, bool, None): {err}"
        ) from err
    path.write_text(text + "\n", encoding="utf-8")


def step_of(path: Path) -> int | None:
    """The step a `step_XXXXXXXX` checkpoint directory's name gives (None for any other name)."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Every `step_XXXXXXXX` directory under `directory` (complete or not), oldest first; `.tmp` excluded."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if p.is_dir() and (step := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _looks_complete(path: Path) -> bool:
    """Cheap check (no hashing): the manifest parses and every file it lists exists with its size."""
    return not incomplete_reason(path)


def incomplete_reason(path: Path) -> str:
    """Why the checkpoint directory `path` is not complete (no hashing: the manifest and the listed files' sizes),
    "" if it looks complete: the first problem, naming the file."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"no {MANIFEST_FILE}"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") not in FORMATS:
            return f"{MANIFEST_FILE} names no known format"
        for name, entry in files.items():
            if not (path / name).is_file():
                return f"{name} is missing"
            size = (path / name).stat().st_size
            if size != entry["bytes"]:
                return f"{name} is {size:,} bytes, its manifest says {entry['bytes']:,}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST_FILE} is unreadable ({type(err).__name__})"
    return ""


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory` (None if there is none).

    Complete: a `step_XXXXXXXX` directory (never `.tmp`) whose manifest parses and whose listed files
    all exist with the recorded sizes. Checksums are verified by `load_checkpoint`, not here.
    """
    for path in reversed(list_checkpoints(directory)):
        if _looks_complete(path):
            return path
    return None


def check_no_damaged_newer(path: Path, who: str, consequence: str, fallback: str) -> None:
    """CheckpointError when step directories newer than `path`, the newest complete checkpoint of its directory
    (`latest_checkpoint`), are there: a save leaves only a `.tmp` directory unfinished, so these were complete and
    were damaged since, and going on from `path` would silently use an older state than the run's newest. The message
    names each one and its problem; the caller gives `who` (its option, e.g. "--resume"), `consequence` (what using
    `path` instead would do) and `fallback` (the end of "move them out ... (or delete them) ...": what that allows)."""
    directory = path.parent
    found = list_checkpoints(directory)
    damaged = found[found.index(path) + 1:]
    if damaged:
        problems = "; ".join(f"{p.name}: {incomplete_reason(p)}" for p in damaged)
        raise CheckpointError(
            f"{who}: checkpoint(s) in {directory} newer than the newest complete one, {path.name}, are damaged "
            f"({problems}); {consequence}. Restore their files, or move them out of {directory} (or delete them) "
            f"{fallback}"
        )


def _previous_hint(path: Path) -> str:
    older = [p for p in list_checkpoints(path.parent) if (step_of(p) or 0) < (step_of(path) or 0)]
    if older:
        return f"remove {path} to fall back to the previous checkpoint ({older[-1].name})"
    return f"remove {path}; there is no older checkpoint to fall back to, so training restarts from scratch"


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(
    directory: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    train_state: dict[str, Any] | None = None,
    save_rng: bool = True,
    keep_last: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `<directory>/step_XXXXXXXX/` atomically and return its path.

    `train_state` is the caller's JSON dict (tokens, schedule config, data-loader position, ...).
    `keep_last=K` afterwards deletes the checkpoints older than the K newest verified ones (see the module
    docstring). An existing directory for this step raises CheckpointError unless `overwrite=True`.
    """
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    directory = Path(directory)
    final = directory / checkpoint_dir_name(step)
    tmp = directory / (final.name + ".tmp")
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by an interrupted save of this step
        shutil.rmtree(tmp)
    tmp.mkdir()

    written: list[str] = []
    save_model(model, str(tmp / MODEL_FILE))
    written.append(MODEL_FILE)
    if optimizer is not None:
        tensors, skeleton = flatten_tree(optimizer.state_dict())
        save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
        _write_json(tmp / OPTIMIZER_JSON, skeleton, "the optimizer state")
        written += [OPTIMIZER_TENSORS, OPTIMIZER_JSON]
    if save_rng:
        tensors, skeleton = flatten_tree(capture_rng_state())
        save_file(tensors, str(tmp / RNG_TENSORS))
        _write_json(tmp / RNG_JSON, skeleton, "the RNG state")
        written += [RNG_TENSORS, RNG_JSON]
    _write_json(tmp / TRAIN_STATE_FILE, {"step": step, "train_state": dict(train_state or {})}, "train_state")
    written.append(TRAIN_STATE_FILE)

    commit_checkpoint(tmp, final, step, {name: file_record(tmp / name) for name in written}, keep_last=keep_last)
    return final


def file_record(path: Path) -> dict[str, Any]:
    """A written file's manifest entry, {"sha256", "bytes"}, after it is fsynced."""
    fsync_file(path)
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def commit_checkpoint(tmp: Path, final: Path, step: int, files: dict[str, dict[str, Any]], *, keep_last: int | None,
                      format: str = FORMAT, **extra: Any) -> None:  # noqa: A002
    """The last steps of every save: the manifest (`files`: name -> `file_record`, relative to `tmp`; `extra` keys
    beside them) written and fsynced in `tmp`, `tmp` renamed to `final` (`publish`), then `keep_last` rotation."""
    manifest = {"format": format, "version": VERSION, "step": step, **extra, "files": files}
    _write_json(tmp / MANIFEST_FILE, manifest, "manifest")
    fsync_file(tmp / MANIFEST_FILE)
    fsync_dir(tmp)
    publish(tmp, final)
    _VERIFIED[final] = _signature(final)  # its checksums were just computed from the files
    if keep_last is not None:
        _rotate(final.parent, keep_last, final)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete `tmp` directory to `final` (an existing `final` is moved aside first and removed after:
    a crash leaves one of them whole) and fsync the parent. Until this returns the checkpoint is not the newest."""
    if final.exists():
        old = final.parent / (final.name + ".old.tmp")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


# Checkpoints whose checksums this process has verified (or computed), with the signature they had then: rotation
# checks each kept checkpoint once per process, not at every save.
_VERIFIED: dict[Path, tuple | None] = {}


def _signature(path: Path) -> tuple | None:
    """The manifest's text and every listed file's (name, size, mtime, inode); None if it cannot be read."""
    try:
        text = (path / MANIFEST_FILE).read_text(encoding="utf-8")
        stats = [(name, (path / name).stat()) for name in sorted(json.loads(text)["files"])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return text, tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats)


def _is_verified(path: Path) -> bool:
    """Whether every checksum of the checkpoint at `path` matches its manifest (remembered while it is unchanged)."""
    signature = _signature(path)
    if signature is not None and _VERIFIED.get(path) == signature:
        return True
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    _VERIFIED[path] = signature
    return True


def _rotate(directory: Path, keep_last: int, saved: Path) -> None:
    """Delete the checkpoints older than the `keep_last` newest verified ones; `saved`, just written, is never
    deleted. A directory that does not look like a complete checkpoint (no readable manifest, a listed file missing
    or of another size) is never deleted and, like one that fails its checksums, never counts."""
    found = list_checkpoints(directory)
    kept = 0
    for index in range(len(found) - 1, -1, -1):
        if _looks_complete(found[index]) and _is_verified(found[index]):
            kept += 1
            if kept == keep_last:
                break
    else:
        return
    for stale in found[:index]:
        if stale != saved and _looks_complete(stale):
            _VERIFIED.pop(stale, None)
            shutil.rmtree(stale)


# ---------------------------------------------------------------------------------------------- load
def checkpoint_format(path: str | Path) -> str:
    """"full" or "dcp": the layout of the checkpoint at `path`, from its manifest (CheckpointError if unreadable)."""
    path = Path(path)
    try:
        return FORMATS[json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))["format"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / MANIFEST_FILE} is unreadable or not a checkpoint manifest ({err}); "
                              + _previous_hint(path)) from err


def verify_checkpoint(path: str | Path, *, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Check the manifest and the sha256 and size of every file it lists; return the manifest.

    `share=(index, count)`: check the checksums of every count-th listed file from the index-th only (the ranks of
    a sharded load split the reading); the manifest and every file's presence and size are always checked.
    Raises CheckpointError naming the first problem (missing or unreadable manifest, missing file, size or
    checksum mismatch) and saying what to do.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: the checkpoint is incomplete (its save was interrupted); "
            + _previous_hint(path)
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") not in FORMATS or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        for name, entry in files.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                    and isinstance(entry.get("sha256"), str)):
                raise ValueError(f"the entry of {name!r} needs 'bytes' and 'sha256'")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is unreadable or not a hybridlm checkpoint manifest ({err}); "
                              + _previous_hint(path)) from err
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {manifest.get('version')!r}; this hybridlm reads version {VERSION}"
        )
    index, count = share
    for position, (name, entry) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in the manifest but missing; " + _previous_hint(path))
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes, the manifest records {entry['bytes']}: the file is corrupt or truncated; "
                + _previous_hint(path)
            )
        if position % count != index:
            continue
        digest = sha256_file(file)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{file} fails its checksum (sha256 {digest[:16]}..., manifest {entry['sha256'][:16]}...): the file "
                "is corrupt; " + _previous_hint(path)
            )
    return manifest


def _read_tree(path: Path, tensor_file: str, json_file: str) -> Any:
    try:
        tensors = load_file(str(path / tensor_file))
        skeleton = json.loads((path / json_file).read_text(encoding="utf-8"))
        return unflatten_tree(tensors, skeleton)
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"{path / json_file} / {tensor_file} cannot be read ({err}); " + _previous_hint(path)) from err


def _check_param_names(saved: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"{path / OPTIMIZER_JSON} has {len(saved_groups)} parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer the way the saved run did"
        )
    for index, (old, new) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if "param_names" in old and "param_names" in new and list(old["param_names"]) != list(new["param_names"]):
            diff = next((a, b) for a, b in zip(old["param_names"] + [None], new["param_names"] + [None]) if a != b)
            raise CheckpointMismatchError(
                f"{path / OPTIMIZER_JSON}: parameter group {index} ({old.get('role', '?')}) was saved for other "
                f"parameters (first difference: saved {diff[0]!r}, now {diff[1]!r}); the model changed since the save"
            )


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Verify `path` (a step directory), then load the model, the optimizer and the RNG states into place.

    The model must have exactly the saved parameter and buffer names and shapes. Returns the step and the
    caller's train_state. Raises CheckpointError for a corrupt, incomplete or mismatched checkpoint; files
    are verified and read before any object changes, but a model that does not fit may be left partly
    loaded (rebuild it).
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} is a sharded (dcp) checkpoint: load it with "
                              "hybridlm.training.sharded_checkpoint.load_sharded_checkpoint, or export it with "
                              "`hybridlm checkpoint export`")
    files = manifest["files"]

    # read and check everything before changing any object
    saved_optimizer = None
    if optimizer is not None:
        if OPTIMIZER_TENSORS not in files:
            raise CheckpointError(f"{path} holds no optimizer state (saved with optimizer=None)")
        saved_optimizer = _read_tree(path, OPTIMIZER_TENSORS, OPTIMIZER_JSON)
        _check_param_names(saved_optimizer, optimizer, path)
    saved_rng = None
    if restore_rng:
        if RNG_TENSORS not in files:
            raise CheckpointError(f"{path} holds no RNG state (saved with save_rng=False); pass restore_rng=False")
        saved_rng = _read_tree(path, RNG_TENSORS, RNG_JSON)
    try:
        record = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
        loaded = LoadedCheckpoint(path, int(record["step"]), dict(record["train_state"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / TRAIN_STATE_FILE} cannot be read ({err}); " + _previous_hint(path)) from err

    try:
        missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
    except RuntimeError as err:  # shapes that differ
        raise CheckpointMismatchError(f"{path / MODEL_FILE} does not fit the model: {err}") from err
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{path / MODEL_FILE} cannot be read: {err}") from err
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{path / MODEL_FILE} does not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; build the model with the saved configuration"
        )
    if saved_optimizer is not None:
        try:
            optimizer.load_state_dict(saved_optimizer)
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointMismatchError(f"{path / OPTIMIZER_JSON} does not fit the optimizer: {err}") from err
    if saved_rng is not None:
        restore_rng_state(saved_rng)
    return loaded
