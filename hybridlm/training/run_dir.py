"""`RunDirectory`: the output directory of one `hybridlm train` run (`train.out_dir`). Only rank 0 writes.

What a run writes there:
- `config.yaml`: the resolved config, its first line `RUN_CONFIG_HEADER` (a run's record, rewritten by the run);
- `metrics.jsonl`: one object per `log_every` updates (step, tokens, loss and grad_norm (means over the interval),
  lr and wd (base value x schedule factor), tokens_per_s, skipped (updates skipped in the interval), elapsed_s);
- `eval.jsonl`: step, tokens, eval_loss on the held-out data;
- `checkpoints/step_XXXXXXXX/` (`hybridlm.training.checkpoint`), `loss.png` (`plot_losses`), `samples.txt`;
- `final/`: the trained model as a `from_pretrained` directory with the tokenizer's own files (`hybridlm generate
  --model <out_dir>/final --prompt ...`; `run_tokenizer_dir`: model.init's for sft / dpo, with data.chat_template as
  chat_template.jinja; a run without a tokenizer says so), written through a temporary directory renamed into place
  (the model's `save_pretrained` prints no progress bar);
- `.train.lock` (`LOCK_FILE`).

A new run (resume=False) into a directory that holds one (checkpoints, final/, metrics.jsonl, its config.yaml, ...)
is a ConfigError unless `overwrite=True`, which deletes those outputs (links are unlinked, their targets left alone)
only after every check (config, data, model, the directory itself) has passed, just before config.yaml is written
(`remove_previous_run`): a bad setting leaves the previous run as it was. resume=True with no checkpoint starts the
run (a preemptible job can always pass --resume), but with a final/ and no checkpoint it is refused (the run looks
finished: starting it over would replace its outputs). A config.yaml without the header line, and with no other run
output beside it, is the user's file: never replaced or deleted (a ConfigError says to move it).

One run per directory: rank 0 holds an exclusive lock (`hybridlm.fileio.FileLock`) on `<out_dir>/.train.lock` from
`prepare` until `release` (the system releases it if the process dies); a second run on the directory, in this or
another process (a job started twice), is a ConfigError at once. The lock file is deleted only by a run that fails
before it starts (`abandon`) and that created it, with the folders `lock` created for it while they are empty: a
refused run leaves no trace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridlm.fileio import FileLock, save_figure_atomic, write_atomic
from hybridlm.training import distributed as D
from hybridlm.training.checkpoint import list_checkpoints
from hybridlm.training.config import ConfigError, TrainConfig, is_run_config, save_config

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"
SAMPLES_FILE = "samples.txt"
FINAL_DIR = "final"
# Held by the running process's rank 0: a second `train` into the same out_dir is refused. Never deleted.
LOCK_FILE = ".train.lock"
# What a run writes into its out_dir (demo_data/ aside: the corpus is reusable): --overwrite removes these. Any of
# them but config.yaml means a run is there (config.yaml alone may be the user's own config).
RUN_OUTPUTS = (CHECKPOINT_DIR, FINAL_DIR, METRICS_FILE, EVAL_FILE, CONFIG_FILE, LOSS_PLOT, SAMPLES_FILE)
# What `export` copies from the tokenizer directory into final/: the files `HybridTokenizer.save` writes
# (tokenizer.json, tokenizer_config.json, hybridlm_tokenizer.json) and these HF ones where present; never a model's
# config.json or weights (the tokenizer directory may well be an earlier run's final/).
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' tokenizer loading prefers it to tokenizer_config.json's
TOKENIZER_EXTRA_FILES = ("special_tokens_map.json", "added_tokens.json", CHAT_TEMPLATE_FILE)


class RunDirectory:
    """The output directory at `path` as seen from one rank (see the module docstring). Methods that coordinate
    (`prepare`, `lock`, `remove_previous_run`, `export`) are called on every rank; the others write on rank 0 only.
    `say` prints a message (rank 0's console)."""

    def __init__(self, path: str | Path, ctx: D.DistContext, *, say: Callable[[str], None] = print) -> None:
        self.path = Path(path)
        self.ctx = ctx
        self.say = say
        self.checkpoints = self.path / CHECKPOINT_DIR
        self._lock = FileLock(self.path / LOCK_FILE)
        self._created: list[Path] = []  # what `lock` created (the lock file, then folders, deepest first): `abandon`

    # ------------------------------------------------------------------------------------------ checks and lock
    def prepare(self, *, resume: bool, overwrite: bool, needed: Sequence[tuple[str, Path | None]] = ()) -> None:
        """Check the directory before anything is built or written (ConfigError naming what to do); rank 0 creates it
        and takes its lock. Nothing is deleted here: `remove_previous_run` does, once every other check has passed.

        Refused: a new run over an existing one unless `overwrite` (a finished run whose checkpoints were deleted
        still has final/, metrics.jsonl, ... to lose); a directory another process trains into (its lock); a file
        where checkpoints/ or final/ go, or a link there to nothing (without `overwrite`); a config.yaml that is not
        a run's record (the user's); and with `overwrite`, a file the run reads (`needed`: (setting, path) pairs
        such as ("data.tokenizer", path)) inside an output that would be deleted."""
        out = self.path
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                              f"{out}, --overwrite replaces it; pass one of them")
        if os.path.lexists(out) and not out.is_dir():
            raise ConfigError(f"train.out_dir: {out} is a file, not a directory; give a directory path (or move the "
                              "file away)")
        self.lock()
        for name, what in ((CHECKPOINT_DIR, "its checkpoints"), (FINAL_DIR, "the trained model")):
            path = out / name
            if path.is_symlink() and not path.exists():
                if not overwrite:
                    raise ConfigError(
                        f"train.out_dir: {path} is a symbolic link to {os.readlink(path)}, which does not exist (the "
                        f"run writes {what} there); create its target, remove the link, or pass --overwrite"
                    )
            elif os.path.lexists(path) and not path.is_dir():
                raise ConfigError(f"train.out_dir: {path} is a file, not a directory (the run writes {what} "
                                  "there); move it away or choose another --out")
        existing = list_checkpoints(self.checkpoints)
        # (checkpoints/ counts through `existing`: an empty one, or one with only a .tmp save, holds no run)
        outputs = [name for name in RUN_OUTPUTS if name != CHECKPOINT_DIR and os.path.lexists(out / name)]
        config_yaml = out / CONFIG_FILE
        # A run's record (its first line says so, or other outputs of a run lie beside it) is the run's to rewrite or
        # delete; any other config.yaml is the user's, never replaced or deleted.
        if outputs == [CONFIG_FILE] and not existing and not is_run_config(config_yaml):
            raise ConfigError(
                f"train.out_dir: {config_yaml} is not a run's record (a config of yours?) and the run writes its "
                f"resolved config there; move it out of {out} (pass it to --config from there), or choose "
                "another --out"
            )
        if resume and not existing and FINAL_DIR in outputs:
            # Starting from scratch here would truncate the metrics and replace final/ of a finished run.
            raise ConfigError(
                f"--resume: {out} has no checkpoint but holds {FINAL_DIR}/: the run looks finished (its "
                "checkpoints were removed), so there is nothing to continue; to train it again from scratch pass "
                "--overwrite instead of --resume (replaces its outputs), or choose another --out"
            )
        if not resume and not overwrite and (existing or outputs):
            found = ", ".join(([f"{CHECKPOINT_DIR}/{existing[-1].name}"] if existing else [])
                              + [f"{n}/" if n == FINAL_DIR else n for n in outputs])
            advice = "pass --resume to continue it, " if existing else ""
            raise ConfigError(
                f"train.out_dir: {out} already holds a run ({found}); {advice}pass --overwrite to replace "
                "it (deletes its outputs), or choose another --out"
            )
        if overwrite:
            self._check_nothing_needed_is_deleted(needed)

    def lock(self) -> None:
        """Rank 0 creates the directory and takes the lock on its LOCK_FILE (a no-op while held), kept until `release`:
        a second `train` into the directory (a job started twice) is refused at once instead of mixing its
        checkpoints and metrics with the first's. Where the file system cannot lock (some network file systems) or
        on Windows, the run goes unlocked."""
        problem = None
        if self.ctx.is_main:
            try:
                absent = _absent(self._lock.path)
                self.path.mkdir(parents=True, exist_ok=True)
                if not self._lock.acquire():
                    problem = (f"train.out_dir: another `hybridlm train` is running in {self.path} (it holds "
                               f"{LOCK_FILE}); wait for it to end or stop it, or choose another --out (in Python: "
                               "close() a Trainer of this process that will not train, or build it in a with "
                               "statement)")
                else:
                    self._created = [path for path in absent if os.path.lexists(path)]
            except OSError as err:
                problem = f"train.out_dir: {self.path}: {err}"
        problem = D.broadcast_object(problem, self.ctx)
        if problem:
            raise ConfigError(problem)

    def release(self) -> None:
        """Let another run into the directory (a no-op when not held)."""
        self._lock.release()

    def abandon(self) -> None:
        """`release` for a run that fails before it starts: rank 0 first removes what the last `lock` created, the
        lock file and then the output directory and the folders above it that did not exist, each only while empty
        (a directory that existed before, or that holds anything else, such as a demo corpus prepared in it, stays).
        The lock file goes while still held, and the folders before the release, so that no other run takes a lock
        in what is removed."""
        created, self._created = self._created, []
        if self.ctx.is_main:
            with contextlib.suppress(OSError):  # (stops at the first that is not empty)
                for path in created:
                    if path == self._lock.path:
                        path.unlink()
                    else:
                        path.rmdir()
        self.release()

    def _check_nothing_needed_is_deleted(self, needed: Sequence[tuple[str, Path | None]]) -> None:
        """--overwrite: a file the run reads inside an output it would delete is a ConfigError (a link is removed,
        not what it points to)."""
        for name in RUN_OUTPUTS:
            target = self.path / name
            if target.is_symlink() or not target.exists():
                continue
            target = target.resolve()
            for what, path in needed:
                if path is None:
                    continue
                path = Path(path).resolve()
                if path == target or target in path.parents:
                    raise ConfigError(f"{what}: {path} is inside {self.path / name}, which --overwrite deletes; "
                                      f"copy it out of {self.path} first and point {what} at the copy")

    def remove_previous_run(self) -> None:
        """--overwrite, after every check: rank 0 removes the previous run's outputs (a symbolic link is unlinked;
        what it points to is left alone). The lock file and demo_data/ stay."""
        problem = None
        if self.ctx.is_main:
            for name in RUN_OUTPUTS:
                path = self.path / name
                if path.is_symlink():
                    self.say(f"--overwrite: removed the link {path} (to {os.readlink(path)}; its target is left as "
                             "it is)")
                try:
                    remove_path(path)
                except OSError as err:
                    problem = f"--overwrite: cannot remove {path} ({err}); remove it yourself or choose another --out"
                    break
        # every rank raises (a rank-0-only error would leave the others waiting in a barrier)
        problem = D.broadcast_object(problem, self.ctx)
        if problem:
            raise ConfigError(problem)

    # ------------------------------------------------------------------------------------------ records
    def write_config(self, config: TrainConfig) -> None:
        if self.ctx.is_main:
            save_config(config, self.path / CONFIG_FILE)

    def append(self, name: str, record: dict[str, Any]) -> None:
        """One JSON line at the end of `name` (METRICS_FILE, EVAL_FILE)."""
        if self.ctx.is_main:
            with open(self.path / name, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    def truncate(self, name: str, step: int) -> None:
        """Drop the records of `name` logged after `step` (by a run that died before its next checkpoint)."""
        path = self.path / name
        if not self.ctx.is_main or not path.is_file():
            return
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        write_atomic(path, "".join(line + "\n" for line in keep).encode("utf-8"))

    def logged_losses(self) -> tuple[float | None, float | None]:
        """(training loss, held-out loss) of the last records in metrics.jsonl / eval.jsonl, None where absent."""
        train = [r["loss"] for r in read_jsonl(self.path / METRICS_FILE) if r.get("loss") is not None]
        held = [r["eval_loss"] for r in read_jsonl(self.path / EVAL_FILE) if r.get("eval_loss") is not None]
        return (train[-1] if train else None), (held[-1] if held else None)

    def write_samples(self, text: str) -> None:
        """samples.txt, replaced atomically (a failed write keeps the previous samples)."""
        if self.ctx.is_main:
            write_atomic(self.path / SAMPLES_FILE, text.encode("utf-8"))

    def plot(self) -> Path | None:
        return plot_losses(self.path) if self.ctx.is_main else None

    # ------------------------------------------------------------------------------------------ final/
    def export(self, model: Any, state_dict: dict[str, torch.Tensor], tokenizer_dir: Path | None, *,
               extras: dict[str, Callable[[Path], None]] | None = None,
               tokenizer_setting: str = "data.tokenizer") -> Path | None:
        """`final/`: `model.save_pretrained` with the full `state_dict` (safetensors) and the tokenizer's files from
        `tokenizer_dir` beside it; `extras` maps more names in final/ to a function writing that path. Every rank
        calls it; rank 0 writes, through a temporary directory renamed into place (the previous final/ is moved aside
        first: a crash leaves one of them). A final/ left without a tokenizer is said (`say`), naming
        `tokenizer_setting`, the setting that gave `tokenizer_dir`."""
        final = self.path / FINAL_DIR
        if self.ctx.is_main:
            tmp = self.path / f"{FINAL_DIR}.tmp"
            remove_path(tmp)
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            copy_tokenizer_files(tokenizer_dir, tmp)
            missing = missing_tokenizer(tokenizer_dir, tmp, tokenizer_setting)
            if missing:
                self.say(f"{final} has no tokenizer: {missing}")
            for name, write in (extras or {}).items():
                write(tmp / name)
            old = self.path / f"{FINAL_DIR}.old.tmp"
            remove_path(old)
            if os.path.lexists(final):  # (a link named final is moved aside and unlinked, its target left alone)
                os.replace(final, old)
            os.replace(tmp, final)
            with contextlib.suppress(OSError):
                remove_path(old)
        D.barrier(self.ctx)
        return final if self.ctx.is_main else None


def copy_tokenizer_files(tokenizer_dir: Path | None, model_dir: Path) -> list[str]:
    """The tokenizer's files from `tokenizer_dir` (None: nothing) into a model directory, none that the model wrote:
    the tokenizer directory may be an earlier run's final/, whose config.json and weights must not replace these.
    Returns the names copied (`missing_tokenizer` says what a model directory still lacks)."""
    if tokenizer_dir is None:
        return []
    from hybridlm.data.tokenizer import HF_CONFIG_FILE, META_FILE, TOKENIZER_FILE

    copied = []
    for name in (TOKENIZER_FILE, HF_CONFIG_FILE, META_FILE, *TOKENIZER_EXTRA_FILES):
        source = Path(tokenizer_dir) / name
        if source.is_file() and not os.path.lexists(model_dir / name):
            shutil.copy2(source, model_dir / name)
            copied.append(name)
    return copied


def missing_tokenizer(tokenizer_dir: Path | None, model_dir: Path, setting: str) -> str | None:
    """Why `model_dir` holds no tokenizer (neither tokenizer.json nor tokenizer_config.json, which transformers and
    `hybridlm generate` / `chat` load), and what to do, for a message "<model_dir> has no tokenizer: ..."; None when
    it holds one. `tokenizer_dir` is where its files were to come from, given by the run's `setting`
    (`run_tokenizer_setting`)."""
    from hybridlm.data.tokenizer import HF_CONFIG_FILE, TOKENIZER_FILE

    if (model_dir / TOKENIZER_FILE).is_file() or (model_dir / HF_CONFIG_FILE).is_file():
        return None
    if tokenizer_dir is None:
        why = f"the run names no tokenizer ({setting} is not set)"
    elif not Path(tokenizer_dir).is_dir():
        why = f"the run's tokenizer directory {tokenizer_dir} ({setting}) does not exist (any more)"
    else:
        why = f"the run's tokenizer directory {tokenizer_dir} ({setting}) holds no {TOKENIZER_FILE} / {HF_CONFIG_FILE}"
    return (f"{why}; copy the tokenizer's files ({TOKENIZER_FILE}, {HF_CONFIG_FILE}, ...) into it before "
            "`hybridlm generate` / `hybridlm chat` load it")


def run_tokenizer_dir(config: TrainConfig, out_dir: Path) -> Path | None:
    """The tokenizer directory of a run, whose files its final/ and its exports get: for sft / dpo, model.init (the
    model directory they start from: its tokenizer and chat template are the ones they train with); for
    pretraining, the demo corpus's (in data.demo_dir, else <out_dir>/demo_data), else data.tokenizer (None when not
    given). `run_tokenizer_setting` names the setting it comes from."""
    c = config.data
    if config.train.task != "pretrain" and config.model.init is not None:
        return Path(config.model.init)
    if c.demo:
        return (Path(c.demo_dir) if c.demo_dir else Path(out_dir) / "demo_data") / "tokenizer"
    return Path(c.tokenizer) if c.tokenizer else None


def run_tokenizer_setting(config: TrainConfig) -> str:
    """The setting `run_tokenizer_dir` reads, for messages."""
    if config.train.task != "pretrain" and config.model.init is not None:
        return "model.init"
    if config.data.demo:
        return "data.demo_dir (the demo corpus's tokenizer)"
    return "data.tokenizer"


def _absent(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist, deepest first."""
    absent = []
    while not os.path.lexists(path) and path != path.parent:
        absent.append(path)
        path = path.parent
    return absent


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def remove_path(path: Path) -> None:
    """Remove a file, a directory tree or a symbolic link (the link only, never what it points to)."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_losses(out_dir: str | Path) -> Path | None:
    """`<out_dir>/loss.png`: training loss (and held-out loss) against tokens; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return None
    out_dir = Path(out_dir)
    train = [r for r in read_jsonl(out_dir / METRICS_FILE) if r.get("loss") is not None]
    held = read_jsonl(out_dir / EVAL_FILE)
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train")
    if held:
        ax.plot([r["tokens"] for r in held], [r["eval_loss"] for r in held], "o-", label="held-out")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"{out_dir.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / LOSS_PLOT
    try:
        save_figure_atomic(fig, path, dpi=100)  # a crash mid-write keeps the previous curve
    finally:
        plt.close(fig)
    return path
