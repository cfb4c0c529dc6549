"""Sharded training checkpoints: every rank writes and reads its own part with torch.distributed.checkpoint (DCP).

    checkpointer = ShardedCheckpointer()
    checkpointer.save(directory, step, model=model, optimizer=optimizer, groups=groups, train_state={...},
                      keep_last=2, async_save=False)          # every rank; returns the step directory on rank 0
    checkpointer.wait()                                       # completes an async save (the next save does too)
    loaded = load_sharded_checkpoint(path, model=model, optimizer=optimizer, groups=groups)   # every rank

Why: the full layout (`training.checkpoint`) gathers the whole model and AdamW state on rank 0 and has every rank
read all of it back, so a save or load holds O(model) host memory on one rank. Here a rank holds its own shards
plus one tensor (a head-split SSM tensor is gathered one at a time), and a load under another mesh reshards
(`hybridlm.parallel.sharded`: canonical keys and rows).

Layout of `<directory>/step_XXXXXXXX/` (the step directories, manifest, verification and `keep_last` rotation of
`training.checkpoint`, whose `latest_checkpoint` finds either layout):

    dcp/                     DCP's files: `__<rank>_<n>.distcp` (a rank's shards of the model and AdamW state) and
                             `.metadata` (every chunk's global offsets; DCP writes it with pickle: load only
                             checkpoints you trust, as with any torch checkpoint)
    rng/rank_XXXXX.safetensors, rank_XXXXX.json   each rank's RNG streams (`training.rng`, no pickle)
    optimizer_groups.json    the canonical AdamW groups (parameter names, roles, hyperparameters): the resume checks
                             that the model has the same parameters
    train_state.json         {"step", "train_state"}: as in the full layout
    manifest.json            format `SHARDED_FORMAT`, the world size, and the sha256 and size of every file above

Atomicity: rank 0 makes `step_XXXXXXXX.tmp/`; every rank writes its DCP shards and RNG files into it, fsyncs and
hashes what it wrote; rank 0 collects every rank's list (a rank whose write failed fails the save on every rank),
checks that each file DCP's metadata names was written, writes the manifest last and renames the directory into
place (`training.checkpoint.publish`). A crash before the rename leaves a `.tmp` directory, which is never the newest
checkpoint and never counts for `keep_last`; the next save of that step replaces it.

Asynchronous saves (`async_save=True`): `dcp.async_save` copies this rank's pieces to host memory and writes them
from a thread (its collectives on a gloo group of their own, so they do not interleave with training's) while
training goes on; the manifest and the rename wait for the next save, `wait()`, or the end of training. A crash in
between leaves the `.tmp` directory: the previous checkpoint stays the newest.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hybridlm.training.checkpoint import (
    SHARDED_FORMAT,
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointMismatchError,
    LoadedCheckpoint,
    _check_param_names,
    _previous_hint,
    _read_tree,
    _write_json,
    checkpoint_dir_name,
    commit_checkpoint,
    file_record,
    verify_checkpoint,
)
from hybridlm.training.rng import capture_rng_state, restore_rng_state
from hybridlm.training.tensor_tree import flatten_tree

DCP_DIR = "dcp"
RNG_DIR = "rng"
GROUPS_FILE = "optimizer_groups.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (small picklable values), in rank order."""
    if _world() == 1:
        return [obj]
    gathered: list[Any] = [None] * _world()
    dist.all_gather_object(gathered, obj)
    return gathered


def _agree(problem: str | None) -> str | None:
    """The first rank's problem (a message) if any rank has one: every rank then raises the same error, none is left
    waiting in a collective."""
    return next((p for p in _all_gather(problem) if p), None)


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Inside: DCP's warning, given at every save or load without a process group, that it assumes one process (what
    is meant here) is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def rng_files(rank: int) -> tuple[str, str]:
    """The (tensors, skeleton) file names of rank `rank`'s RNG state, relative to the step directory."""
    return f"{RNG_DIR}/rank_{rank:05d}.safetensors", f"{RNG_DIR}/rank_{rank:05d}.json"


@dataclass
class _PendingSave:
    tmp: Path
    final: Path
    step: int
    keep_last: int | None
    written: list[str]  # what this rank wrote besides its DCP files (relative to tmp)
    future: Future | None  # dcp.async_save's, None for a save already written


class ShardedCheckpointer:
    """Writes sharded checkpoints (see the module docstring); holds at most one pending asynchronous save."""

    def __init__(self) -> None:
        self._pending: _PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None

    def save(
        self,
        directory: str | Path,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        groups: list[dict],
        train_state: dict[str, Any],
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> Path | None:
        """Write `<directory>/step_XXXXXXXX/` (replacing one of the same step). Every rank must call it. Synchronous:
        returns the step directory on rank 0 (None elsewhere) once it is in place. Asynchronous: returns None once
        this rank's pieces are copied to host memory; `wait()` or the next save completes it."""
        from torch.distributed import checkpoint as dcp

        from hybridlm.parallel.sharded import sharded_state

        self.wait()
        directory = Path(directory)
        final = directory / checkpoint_dir_name(step)
        tmp = directory / (final.name + ".tmp")
        rank = _rank()
        problem = None
        if rank == 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by an interrupted save of this step
                    shutil.rmtree(tmp)
                (tmp / DCP_DIR).mkdir(parents=True)
                (tmp / RNG_DIR).mkdir()
            except OSError as err:
                problem = f"cannot create {tmp}: {err}"
        problem = _agree(problem)
        if problem:
            raise CheckpointError(problem)

        written = self._write_records(tmp, step, rank, groups, train_state)
        state = sharded_state(model, optimizer)
        writer = dcp.FileSystemWriter(str(tmp / DCP_DIR))
        future = None
        with single_process_quiet():
            if async_save:
                future = dcp.async_save(state, storage_writer=writer, process_group=self._group(),
                                        no_dist=_world() == 1)
            else:
                dcp.save(state, storage_writer=writer, no_dist=_world() == 1)
        self._pending = _PendingSave(tmp, final, step, keep_last, written, future)
        return None if async_save else self.wait()

    def _group(self) -> dist.ProcessGroup | None:
        """The gloo group of the asynchronous writes (created by every rank at the first one); None in one process."""
        if _world() == 1:
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    @staticmethod
    def _write_records(tmp: Path, step: int, rank: int, groups: list[dict], train_state: dict) -> list[str]:
        """This rank's RNG files, and on rank 0 the JSON records; the names written (relative to `tmp`)."""
        tensors, skeleton = flatten_tree(capture_rng_state())
        tensor_file, json_file = rng_files(rank)
        save_file(tensors, str(tmp / tensor_file))
        _write_json(tmp / json_file, skeleton, "the RNG state")
        written = [tensor_file, json_file]
        if rank == 0:
            _write_json(tmp / GROUPS_FILE, {"param_groups": groups}, "the optimizer groups")
            _write_json(tmp / TRAIN_STATE_FILE, {"step": step, "train_state": dict(train_state)}, "train_state")
            written += [GROUPS_FILE, TRAIN_STATE_FILE]
        return written

    def wait(self) -> Path | None:
        """Complete the pending save, if any (every rank must call it): wait for its writes, then the manifest, the
        rename and the rotation. Returns the step directory on rank 0, None elsewhere or with nothing pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rank, tmp = _rank(), pending.tmp
        problem, records = None, {}
        try:
            if pending.future is not None:
                pending.future.result()
            names = list(pending.written) + [f"{DCP_DIR}/{p.name}" for p in sorted((tmp / DCP_DIR).glob(f"__{rank}_*"))]
            if rank == 0:
                names.append(f"{DCP_DIR}/.metadata")
            records = {name: file_record(tmp / name) for name in names}
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            problem = f"rank {rank} could not write its part of {tmp}: {type(err).__name__}: {err}"
        gathered = _all_gather((problem, records))
        problem = next((p for p, _ in gathered if p), None)
        if problem is None and rank == 0:
            files = {name: record for _, part in gathered for name, record in part.items()}
            problem = _unlisted_dcp_files(tmp, files)
            try:
                if problem is None:
                    commit_checkpoint(tmp, pending.final, pending.step, files, keep_last=pending.keep_last,
                                      format=SHARDED_FORMAT, world_size=_world())
            except OSError as err:
                problem = f"the manifest or the rename failed ({err})"
        problem = _agree(problem)
        if problem:
            raise CheckpointError(f"the checkpoint of step {pending.step} was not saved: {problem}")
        return pending.final if rank == 0 else None

    def abandon(self) -> None:
        """Leave a pending save unfinished (on the way out after an error: no collective is safe then): its writes
        end, its `.tmp` directory stays, and the previous checkpoint remains the newest."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.future is not None:
            try:
                pending.future.result()
            except Exception:  # noqa: BLE001, S110 - the save is abandoned either way
                pass


def _unlisted_dcp_files(tmp: Path, files: dict[str, Any]) -> str | None:
    """What is wrong if a file DCP's metadata names is not among the files the ranks wrote (a rank's piece missing)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(tmp / DCP_DIR)).read_metadata()
    except Exception as err:  # noqa: BLE001 - named in the message
        return f"{tmp / DCP_DIR / '.metadata'} cannot be read ({err})"
    named = {f"{DCP_DIR}/{info.relative_path}" for info in (metadata.storage_data or {}).values()}
    missing = sorted(named - set(files))
    return f"the DCP metadata names {missing[:3]}, which no rank reported writing" if missing else None


# ------------------------------------------------------------------------------------------------ load
def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    groups: list[dict],
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Verify the sharded checkpoint at `path` (each rank a share of the checksums), then load this rank's part of
    the model and optimizer state, resharded to the current mesh, and this rank's RNG streams (rank 0's where the
    saving run had fewer ranks). Every rank must call it; all raise the same CheckpointError for a corrupt,
    incomplete or mismatched checkpoint (CheckpointMismatchError: another model or optimizer groups). `groups`:
    the canonical optimizer groups (with `param_names`)."""
    if not dist.is_available():
        raise CheckpointError(f"{path} is a sharded (dcp) checkpoint, which needs torch.distributed, and this PyTorch "
                              "build has none: install a build with distributed support, or export the checkpoint on "
                              "a machine that has one (`hybridlm checkpoint export --run RUN --out MODEL_DIR`)")
    from torch.distributed import checkpoint as dcp

    from hybridlm.parallel.checkpoint import _all_names
    from hybridlm.parallel.sharded import MODEL_PREFIX, apply_loaded, load_targets

    path = Path(path)
    rank, world = _rank(), _world()
    problem, loaded, saved_meta = None, None, None
    try:
        verify_checkpoint(path, share=(rank, world))
        record = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
        loaded = LoadedCheckpoint(path, int(record["step"]), dict(record["train_state"]))
        saved_meta = dcp.FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata
    except CheckpointError as err:
        problem = str(err)
    except Exception as err:  # noqa: BLE001 - a file that verifies but does not parse
        problem = f"{path} cannot be read ({type(err).__name__}: {err}); " + _previous_hint(path)
    problem = _agree(problem)
    if problem:
        raise CheckpointError(problem)

    mismatch = None
    try:
        _check_param_names(json.loads((path / GROUPS_FILE).read_text(encoding="utf-8")),
                           SimpleNamespace(param_groups=groups), path / GROUPS_FILE)
    except CheckpointMismatchError as err:
        mismatch = str(err)
    targets = load_targets(model, optimizer, set(saved_meta))
    held = [key for key in targets if key.startswith(MODEL_PREFIX)]
    missing = sorted(k[len(MODEL_PREFIX):] for k in held if k not in saved_meta)
    shapes = [f"{k[len(MODEL_PREFIX):]} {tuple(saved_meta[k].size)} vs {tuple(targets[k].shape)}" for k in held
              if k in saved_meta and tuple(saved_meta[k].size) != tuple(targets[k].shape)]
    known = set(_all_names(held))
    unexpected = sorted(k[len(MODEL_PREFIX):] for k in saved_meta if k.startswith(MODEL_PREFIX) and k not in known)
    if mismatch is None and (missing or unexpected or shapes):
        mismatch = (f"{path / DCP_DIR} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                    f"other shapes (saved vs model) {shapes[:3]}; build the model with the saved configuration")
    mismatch = _agree(mismatch)
    if mismatch:
        raise CheckpointMismatchError(mismatch)

    with single_process_quiet():
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(path / DCP_DIR)), no_dist=world == 1)
    apply_loaded(model, optimizer, targets)
    if restore_rng:
        own = rng_files(rank)
        tensor_file, json_file = own if (path / own[0]).is_file() else rng_files(0)
        restore_rng_state(_read_tree(path, tensor_file, json_file))
    return loaded
