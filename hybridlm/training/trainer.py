"""`Trainer`: one training run of a hybrid LM from a `TrainConfig`, on one process or under torchrun.

    trainer = Trainer(load_config("configs/demo.yaml", ["train.steps=50"]), resume=False)
    result = trainer.train()          # TrainResult(status, step, tokens, loss, eval_loss, checkpoint)

What one update does (step s, 0-based; t = tokens consumed before it):
1. agree across ranks whether to stop (SIGINT / SIGTERM / `request_stop`): if so, save and return;
2. schedule factors for (s, t) (`training.schedules.schedule_factors`: warmup / WSD / power / EPS and
   the batch rampup with sqrt lr scaling) -> every group's lr and wd (`training.optim.apply_schedule`);
3. draw the step's micro-batches from the packing loader (grad_accum of them, or global batch /
   (micro_batch x dp) during a rampup; the loader's rank / world are the data-parallel rank / size, so the
   tp and cp ranks of one data-parallel rank get the same rows); with cp > 1 cut every row's input_ids and
   labels (the next tokens: shifted before the cut) to this rank's chunk; count the labels and all-reduce
   the count (each row once: tp rank 0 counts);
4. per micro-batch: forward under bf16 autocast (if train.dtype is bf16; weights and AdamW state stay
   fp32; the recurrent states are carried in fp32, the kernels' matmul operands stay 16-bit) inside
   `context_parallel` when cp > 1, summed cross entropy over this rank's labels (-100 skipped), backward of
   sum / global count (x dp, since FSDP2 averages over the data-parallel ranks): the gradient of the mean
   loss over every label of the global batch, however it is split into ranks, chunks and micro-batches.
   Gradients are synchronized on the last micro-batch only, then summed over cp (`reduce_context_parallel_grads`);
5. all-reduce the loss; clip the global gradient norm (`train.grad_clip`; `distributed.clip_grad_norm`
   over sharded and replicated gradients); the `StepGuard` skips the update (zeroing the gradients) for a
   non-finite loss or norm and stops the run after `train.max_consecutive_skips` in a row; otherwise AdamW
   steps.

Parallelism (`parallel` section, under torchrun): `hybridlm.parallel.parallelize` in one place (TP or mixer
parallelism, compile, activation checkpointing, FSDP2); after a forward under no_grad (evaluation, samples)
FSDP2's root is resharded before the next step.

Run directory (`train.out_dir`): `config.yaml` (resolved config), `metrics.jsonl` (one object per
`log_every` steps: step, tokens, loss and grad_norm (means over the interval), lr and wd (base value x
schedule factor), tokens_per_s, skipped (updates skipped in the interval), elapsed_s), `eval.jsonl`
(step, tokens, eval_loss on the held-out data), `checkpoints/step_XXXXXXXX/` (`training.checkpoint`:
model, optimizer, RNG, and train_state = tokens, loader position, guard, schedule, config), `loss.png`,
`samples.txt` (`hybridlm.inference.generate` continuing the first tokens of held-out documents), `final/`
(the trained model as a `from_pretrained` directory with the tokenizer's own files: `hybridlm generate --model
<out_dir>/final --prompt ...`), `.train.lock` (see below). Only rank 0 writes.

Resuming (`resume=True`): the newest complete checkpoint in `<out_dir>/checkpoints` is verified and
loaded (model, AdamW state, RNG streams, step, tokens, data-loader position, guard counters); the
metrics files are cut back to its step; with the same config the run continues exactly as if it had
not stopped (tested: 2N steps == N + resume + N on CPU in fp32). Checkpoints hold the unparallelized
layout, so a run saved under one mesh (tp=2 x dp_shard=2, mixer parallelism, ...) resumes under another or in
one process (`hybridlm.parallel.checkpoint`). The config given at resume time wins
(e.g. a larger train.steps, or a new lr or betas: the AdamW groups' hyperparameters are all taken from it, only
the moments and step counts from the checkpoint), and its differences
from the saved one are printed; the schedule is recomputed for the new length (a pure function of the progress), so
extending a run whose WSD decay has finished puts the lr straight back at the new schedule's value there, the
peak for a run still short of the new decay: no second warmup. The loader state is moved to the current data-parallel size, so a run
saved under 2 ranks resumes under 1 with the same stream of tokens (keep the global batch the same for exactness).
A train.steps below the checkpoint's step is a ConfigError (a run is not shortened after the fact); a run resumed at
its full length with final/ written is "already complete": nothing is trained or rewritten.

A new run (resume=False) into an out_dir that holds one (checkpoints, final/, metrics.jsonl, its config.yaml, ...) is
a ConfigError unless `overwrite=True`, which deletes those outputs (links are unlinked, their targets left alone)
only after every check (config, data, model, the directory itself) has passed, just before config.yaml is written:
a bad setting leaves the previous run as it was. resume=True with no checkpoint starts the run (a preemptible job can
always pass --resume), but with a final/ and no checkpoint it is refused (the run looks finished: starting it over
would replace its outputs). The run's config.yaml starts with `RUN_CONFIG_HEADER`; a config.yaml without it, and
with no other run output beside it, is the user's file: never replaced or deleted (a ConfigError says to move it).

One run per directory: rank 0 holds an exclusive lock (flock) on `<out_dir>/.train.lock` from the start until
`train()` returns (or `close()`; the system releases it if the process dies); a second Trainer on the directory, in
this or another process (a job started twice), is a ConfigError at once. The lock file itself is never deleted.

Stopping: SIGINT or SIGTERM (or `request_stop()` from a callback) finishes the current update, saves
a checkpoint and returns status "interrupted"; a second signal more than 2 s later raises KeyboardInterrupt at once
(`hybridlm.training.stop.StopRequest`, `SecondSignal`: `timeout` signals the command and then its process group, a
double signal that counts as one). After the loop (samples, final/) SIGINT raises KeyboardInterrupt at once: the
last checkpoint is saved, and --resume writes final/. The CLI reports either in one line (exit 128 + signal).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybridlm.fileio import save_figure_atomic, write_atomic
from hybridlm.training import distributed as D
from hybridlm.training.checkpoint import (
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointMismatchError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from hybridlm.training.config import (
    ConfigError,
    TrainConfig,
    build_model_config,
    config_to_dict,
    diff_configs,
    dump_config,
    is_run_config,
    plan_steps,
    save_config,
    schedule_config,
)
from hybridlm.training.guard import StepGuard
from hybridlm.training.optim import (
    MatrixMultipliers,
    apply_schedule,
    build_param_groups,
)
from hybridlm.training.rng import deterministic_kernels
from hybridlm.training.schedules import schedule_factors
from hybridlm.training.stop import StopRequest

try:
    import fcntl
except ImportError:  # Windows: no lock on the run directory (two runs there are not kept apart)
    fcntl = None

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"
SAMPLES_FILE = "samples.txt"
FINAL_DIR = "final"
# Held (flock) by the running process's rank 0: a second `train` into the same out_dir is refused. Never deleted.
LOCK_FILE = ".train.lock"
# What a run writes into its out_dir (demo_data/ aside: the corpus is reusable): --overwrite removes these. Any of
# them but config.yaml means a run is there (config.yaml alone may be the user's own config).
_RUN_OUTPUTS = (CHECKPOINT_DIR, FINAL_DIR, METRICS_FILE, EVAL_FILE, CONFIG_FILE, LOSS_PLOT, SAMPLES_FILE)
# What export() copies from data.tokenizer into final/: the files `HybridTokenizer.save` writes (tokenizer.json,
# tokenizer_config.json, hybridlm_tokenizer.json) and these HF ones where present; never a model's config.json or
# weights (data.tokenizer may well be an earlier run's final/).
_TOKENIZER_EXTRA_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


@dataclass
class TrainResult:
    status: str  # "completed" | "interrupted" | "already complete" (resumed a finished run: nothing done)
    step: int
    tokens: int
    loss: float | None  # mean training loss of the last logged interval
    eval_loss: float | None
    checkpoint: Path | None
    out_dir: Path
    samples: list[str] = field(default_factory=list)


@dataclass
class _Data:
    loader: Any
    eval_sources: list  # hybridlm.data.loader.Source
    tokenizer_dir: Path | None
    vocab_size: int


class _ModelState(torch.nn.Module):
    """What safetensors' save_model / load_model see: a fixed state dict (a gathered full one) on save,
    a sink on load (the trainer then loads it into the real, possibly sharded, model)."""

    def __init__(self, state: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self._state = state or {}
        self.loaded: dict[str, torch.Tensor] | None = None

    def state_dict(self, *args, **kwargs):
        return self._state

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.loaded = dict(state_dict)
        return [], []


class _OptimizerState:
    """The optimizer as `training.checkpoint` sees it: state_dict() on save, load_state_dict() on load,
    param_groups for its parameter-name check."""

    def __init__(self, param_groups: list[dict], state: dict[str, Any] | None = None) -> None:
        self.param_groups = param_groups
        self._state = state or {}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


_INTERVAL_KEYS = ("loss", "lr", "wd", "grad_norm", "step_tokens", "seconds", "skipped")  # what _log_interval reads


def _finite_or_not_float(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


class Trainer:
    """See the module docstring. `callbacks` are called as `fn(trainer, record)` after every update. A context
    manager: `with Trainer(config) as trainer: trainer.train()` closes it (the directory's lock, the process group)
    on the way out, also when the trainer is built and never trained."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        callbacks: Sequence[Callable[[Trainer, dict], None]] = (),
        config_path: str | Path | None = None,
    ) -> None:
        """`config_path`: the file `config` was read from (the CLI's --config, or the run's config.yaml that --resume
        reads), if any: --overwrite refuses to delete it inside the outputs, unless it is the run's own config.yaml
        (read already, and rewritten)."""
        self.config = config
        self.config_path = Path(config_path) if config_path is not None else None
        self._unlock: weakref.finalize | None = None  # releases the run directory's lock (rank 0, while held)
        self.callbacks = list(callbacks)
        if config.train.device == "cuda" and not torch.cuda.is_available():
            # a setting this machine cannot honour: a configuration error (exit 2), not a failed run
            raise ConfigError("train.device: 'cuda' but CUDA is not available on this machine (no GPU, or a CPU-only "
                              "PyTorch); use train.device=auto (the GPU where there is one) or train.device=cpu")
        self.ctx = D.init_distributed(config, device=config.train.device)
        self.out_dir = Path(config.train.out_dir)
        self.checkpoint_dir = self.out_dir / CHECKPOINT_DIR
        self._stop = StopRequest(on_signal=lambda name: self._print(
            f"{name}: finishing this update, then saving a checkpoint (send it again to abort at once)"))
        self.history: list[dict] = []  # every update's record (this session), for tests and tools
        # the updates since the last metrics record: saved with checkpoints, so a resumed run logs the same records
        self._interval: list[dict] = []
        try:
            self._prepare_out_dir(resume, overwrite)
            self._build(config, resume, overwrite)
        except BaseException:
            self._release_lock()
            raise

    def _build(self, config: TrainConfig, resume: bool, overwrite: bool) -> None:
        """Everything after the output directory's checks: data, model, optimizer, resume; then (every check
        passed) --overwrite's removal of the previous run and the first write, config.yaml."""
        self._seed(config.train.seed)

        # sizes and schedule: batch sizes count rows per data-parallel rank
        dp = self.ctx.dp_size
        self.hybrid = build_model_config(config)
        self.total_steps, self.total_tokens = plan_steps(config, dp)
        # ConfigError (the CLI's one-line config error) if the decay does not fit the run at dp; notes for a shortened
        # warmup or a rampup the run outlasts
        self.schedule, self.schedule_total, note = schedule_config(config, dp)
        if note:
            self._print(note)
        b = config.batch
        self.rows_per_micro = b.micro_batch * dp  # global rows drawn per micro-step
        self.tokens_per_update = self.rows_per_micro * b.grad_accum * b.seq_len  # without rampup

        # data, model, optimizer
        self.data = self._build_data()
        if self.data.vocab_size > self.hybrid.vocab_size:
            raise ConfigError(
                f"model.overrides.vocab_size: the data's tokenizer has {self.data.vocab_size} ids but the model's "
                f"vocabulary is {self.hybrid.vocab_size}; set model.overrides.vocab_size >= {self.data.vocab_size}"
            )
        self.loader = self.data.loader
        from hybridlm.models.configuration import HybridLMConfig
        from hybridlm.models.model import HybridForCausalLM

        self.raw_model = HybridForCausalLM(HybridLMConfig.from_hybrid(self.hybrid)).to(self.ctx.device)
        self.parameters = sum(p.numel() for p in self.raw_model.parameters())
        # The groups of the unparallelized model, by name: checkpoints and the gradient norm use them (a
        # mixer-parallel rank holds only some of the parameters); each rank's optimizer holds its share.
        self.canonical_groups = [{k: v for k, v in g.items() if k != "params"} for g in self._param_groups()]
        self.param_names = [n for g in self.canonical_groups for n in g["param_names"]]
        self.model = D.parallelize(self.raw_model, config, self.ctx)
        self._cuda_graphs = config.train.compile and config.train.compile_mode == "reduce-overhead"
        self.optimizer = torch.optim.AdamW(
            self._local_groups(), lr=config.optim.lr, betas=config.optim.betas, eps=config.optim.eps,
            weight_decay=config.optim.weight_decay,
        )
        self.guard = StepGuard(config.train.max_consecutive_skips, spike_factor=config.train.spike_factor)
        self.step = 0
        self.tokens = 0
        self.resumed_from: Path | None = None
        self._last_saved_step: int | None = None
        # True when --resume found the run finished (its last checkpoint at the planned length and final/ written):
        # train() then changes nothing
        self.already_complete = False
        if resume:
            self._resume()
        if overwrite:  # only now, every check passed: a bad setting leaves the previous run as it was
            self._remove_previous_run()
        if self.ctx.is_main and not self.already_complete:
            save_config(config, self.out_dir / CONFIG_FILE)

    # ------------------------------------------------------------------------------------------ setup
    def _print(self, message: str) -> None:
        if self.ctx.is_main:
            from tqdm.auto import tqdm

            tqdm.write(message)

    def _seed(self, seed: int) -> None:
        import random

        import numpy as np

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _prepare_out_dir(self, resume: bool, overwrite: bool) -> None:
        """Check the output directory before anything is built or written (ConfigError naming what to do); rank 0
        creates it and takes its lock. Nothing is deleted here: `overwrite` removes the previous run's outputs in
        `_remove_previous_run`, once every other check has passed.

        Refused: a new run over an existing one unless `overwrite` (a finished run whose checkpoints were deleted
        still has final/, metrics.jsonl, ... to lose); a directory another process trains into (its lock); a file
        where checkpoints/ or final/ go, or a link there to nothing (without `overwrite`); a config.yaml that is not
        a run's record (the user's); and with `overwrite`, a config, tokenizer or dataset inside an output that
        would be deleted."""
        out = self.out_dir
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                              f"{out}, --overwrite replaces it; pass one of them")
        if os.path.lexists(out) and not out.is_dir():
            raise ConfigError(f"train.out_dir: {out} is a file, not a directory; give a directory path (or move the "
                              "file away)")
        self._lock_out_dir()
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
        existing = list_checkpoints(self.checkpoint_dir)
        # (checkpoints/ counts through `existing`: an empty one, or one with only a .tmp save, holds no run)
        outputs = [name for name in _RUN_OUTPUTS if name != CHECKPOINT_DIR and os.path.lexists(out / name)]
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
            self._check_nothing_needed_is_deleted()

    def _lock_out_dir(self) -> None:
        """Rank 0 creates the output directory and takes an exclusive lock on its LOCK_FILE, held until the run ends
        (`_release_lock`; the system releases it when the process dies): a second `train` into the directory (a
        job started twice) is refused at once instead of mixing its checkpoints and metrics with the first's.
        Where the file system has no flock (some network file systems) or on Windows, the run goes unlocked."""
        problem = None
        if self.ctx.is_main:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                if self._unlock is None and fcntl is not None:
                    problem = self._take_lock(self.out_dir / LOCK_FILE)
            except OSError as err:
                problem = f"train.out_dir: {self.out_dir}: {err}"
        problem = D.broadcast_object(problem, self.ctx)
        if problem:
            raise ConfigError(problem)

    def _take_lock(self, path: Path) -> str | None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                return (f"train.out_dir: another `hybridlm train` is running in {self.out_dir} (it holds "
                        f"{path.name}); wait for it to end or stop it, or choose another --out (in Python: close() "
                        "a Trainer of this process that will not train, or build it in a with statement)")
            log.warning("cannot lock %s (%s): this run is not protected from a second one in %s", path, err,
                        self.out_dir)
            return None
        self._unlock = weakref.finalize(self, _unlock_fd, fd)
        return None

    def _release_lock(self) -> None:
        """Let another run into the output directory (at the end of `train`, in `close`, after a failed start)."""
        if self._unlock is not None:
            self._unlock()
            self._unlock = None

    def _check_nothing_needed_is_deleted(self) -> None:
        """--overwrite: a file the run reads (config, tokenizer, data) inside an output it would delete is a
        ConfigError (a link is removed, not what it points to)."""
        c = self.config.data
        # (the run's own config.yaml as --config is read already, and rewritten: not needed)
        own = self.config_path is not None and _same_file(self.config_path, self.out_dir / CONFIG_FILE)
        needed = [("--config", None if own else self.config_path), ("data.tokenizer", c.tokenizer),
                  ("data.demo_dir", c.demo_dir)]
        needed += [("data.sources", s.path) for s in c.sources] + [("data.eval_sources", s.path)
                                                                      for s in c.eval_sources]
        for name in _RUN_OUTPUTS:
            target = self.out_dir / name
            if target.is_symlink() or not target.exists():
                continue
            target = target.resolve()
            for what, path in needed:
                if path is None:
                    continue
                path = Path(path).resolve()
                if path == target or target in path.parents:
                    raise ConfigError(f"{what}: {path} is inside {self.out_dir / name}, which --overwrite deletes; "
                                      f"copy it out of {self.out_dir} first and point {what} at the copy")

    def _remove_previous_run(self) -> None:
        """--overwrite, after every check: rank 0 removes the previous run's outputs (a symbolic link is unlinked;
        what it points to is left alone). The lock file and demo_data/ stay."""
        problem = None
        if self.ctx.is_main:
            for name in _RUN_OUTPUTS:
                path = self.out_dir / name
                if path.is_symlink():
                    self._print(f"--overwrite: removed the link {path} (to {os.readlink(path)}; its target is left "
                                "as it is)")
                try:
                    _remove(path)
                except OSError as err:
                    problem = f"--overwrite: cannot remove {path} ({err}); remove it yourself or choose another --out"
                    break
        # every rank raises (a rank-0-only error would leave the others waiting in a barrier)
        problem = D.broadcast_object(problem, self.ctx)
        if problem:
            raise ConfigError(problem)

    def _build_data(self) -> _Data:
        from hybridlm.data.errors import DataError
        from hybridlm.data.loader import PackedLoader, Source
        from hybridlm.data.shards import check_tokenizer_matches, load_manifest

        c = self.config
        if c.data.demo:
            from hybridlm.training.demo import prepare_demo

            directory = Path(c.data.demo_dir) if c.data.demo_dir else self.out_dir / "demo_data"
            if self.ctx.is_main:
                self._print(f"preparing the built-in demo corpus (the Python standard library) in {directory}")
                try:
                    demo = prepare_demo(directory, max_bytes=c.data.demo_max_bytes,
                                        heldout_every=c.data.demo_heldout_every)
                except ValueError as err:
                    raise ConfigError(f"data.demo_max_bytes: {err}") from err
                self._print(f"demo corpus: {demo.train_files} training files, {demo.heldout_files} held out")
            D.barrier(self.ctx)
            sources = [Source("stdlib", directory / "train")]
            eval_sources = [Source("stdlib_heldout", directory / "heldout")]
            tokenizer_dir: Path | None = directory / "tokenizer"
        else:
            sources = [Source(s.name, s.path, s.weight, s.max_epochs) for s in c.data.sources]
            eval_sources = [Source(s.name, s.path, s.weight, s.max_epochs) for s in c.data.eval_sources]
            tokenizer_dir = Path(c.data.tokenizer) if c.data.tokenizer else None
        try:
            loader = PackedLoader(
                sources, batch_size=c.batch.micro_batch, seq_len=c.batch.seq_len, seed=c.train.seed,
                shuffle=c.data.shuffle, cross_doc_labels=c.data.cross_doc_labels, rank=self.ctx.dp_rank,
                world_size=self.ctx.dp_size, verify=c.data.verify,
            )
        except Exception as err:  # DataError, ValueError: name the section
            raise ConfigError(f"data.sources: {err}") from err
        if eval_sources:  # opened now, so a wrong held-out source fails before training, not at the first evaluation
            try:
                self._eval_loader(eval_sources)
            except Exception as err:
                raise ConfigError(f"data.eval_sources: {err}") from err
        if tokenizer_dir is not None and not c.data.demo:  # checked now: it is used after training (samples, final/)
            try:
                for source in sources:
                    check_tokenizer_matches(tokenizer_dir, source.path)
            except DataError as err:
                raise ConfigError(f"data.tokenizer: {err}") from err
        vocab = max(int(load_manifest(s.path)["vocab_size"]) for s in sources)
        return _Data(loader, eval_sources, tokenizer_dir, vocab)

    def _eval_loader(self, eval_sources: list):
        """The held-out rows, in order: the same rows at every evaluation and for any split into ranks."""
        from hybridlm.data.loader import PackedLoader

        c = self.config
        return PackedLoader(
            eval_sources, batch_size=c.batch.micro_batch, seq_len=c.batch.seq_len, seed=c.train.seed,
            shuffle=False, cross_doc_labels=c.data.cross_doc_labels, rank=self.ctx.dp_rank,
            world_size=self.ctx.dp_size, verify="size",
        )

    def _param_groups(self) -> list[dict]:
        """The AdamW groups of the unparallelized model (call before `parallelize`)."""
        o = self.config.optim
        roles = set(o.elr) | set(o.ewd)
        matrix = {r: MatrixMultipliers(o.elr.get(r, 1.0), o.ewd.get(r, 1.0)) for r in roles}
        return build_param_groups(
            self.raw_model.named_parameters(), lr=o.lr, weight_decay=o.weight_decay,
            matrix_multipliers=matrix, vector_lr_multipliers=o.vector_lr,
        )

    def _local_groups(self) -> list[dict]:
        """The canonical groups over this rank's (parallelized) parameters, found by canonical name; every
        group is kept, empty where this rank holds none of it, so the groups line up on every rank."""
        from hybridlm.parallel.checkpoint import canonical_parameters

        held = canonical_parameters(self.model)
        groups = []
        for group in self.canonical_groups:
            names = [n for n in group["param_names"] if n in held]
            groups.append({**group, "params": [held[n] for n in names], "param_names": names})
        return groups

    # ------------------------------------------------------------------------------------------ checkpoints
    def _train_state(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "loader": self.loader.state_dict(),
            "guard": self.guard.state_dict(),
            "schedule": self.schedule.to_dict(),
            "world_size": self.ctx.world_size,
            "data_parallel_size": self.ctx.dp_size,
            "mesh": self.ctx.describe(),
            "config": dump_config(self.config),
            # JSON has no NaN / inf (a skipped update's loss): None, read back as NaN, which _mean leaves out
            "interval": [{k: r[k] if _finite_or_not_float(r[k]) else None for k in _INTERVAL_KEYS}
                         for r in self._interval],
        }

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (every rank must call it; rank 0 writes)."""
        model_sd, optim_sd = D.full_state_dicts(self.model, self.optimizer, self.ctx, groups=self.canonical_groups)
        path = None
        if self.ctx.is_main:
            path = save_checkpoint(
                self.checkpoint_dir, self.step, model=_ModelState(model_sd),
                optimizer=_OptimizerState(self.canonical_groups, optim_sd),
                train_state=self._train_state(), keep_last=self.config.train.keep_last, overwrite=True,
            )
        D.barrier(self.ctx)
        self._last_saved_step = self.step
        return path

    def _resume(self) -> None:
        path = latest_checkpoint(self.checkpoint_dir)
        found = list_checkpoints(self.checkpoint_dir)
        if path is None and found:  # never start over (and truncate the metrics) past checkpoints that are there
            raise CheckpointError(
                f"--resume: no checkpoint in {self.checkpoint_dir} is complete ({', '.join(p.name for p in found)}: "
                "a file missing or of the wrong size); remove them to start this run over, or restore them"
            )
        if path is None:
            self._print(f"--resume: no checkpoint in {self.checkpoint_dir}; starting from scratch")
            if self.ctx.is_main:
                for name in (METRICS_FILE, EVAL_FILE):
                    self._truncate_jsonl(self.out_dir / name, 0)
            return
        skipped = [p.name for p in found if p.name > path.name]
        if skipped:
            self._print(f"--resume: skipping incomplete newer checkpoint(s) {', '.join(skipped)}")
        model_state = _ModelState()
        # The config given now wins: every group's hyperparameters (base lr / wd for the schedule, betas, eps and
        # torch's own options) stay those of the fresh groups; the checkpoint gives only the per-parameter state
        # (moments, step counts). `load_full_state_dicts` copies the saved groups' values, as torch's loader does.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        optim_state = _OptimizerState(self.canonical_groups)
        try:
            loaded = load_checkpoint(path, model=model_state, optimizer=optim_state, restore_rng=True)
        except CheckpointMismatchError as err:  # e.g. another layer count or preset: other parameter names
            raise self._misfit(path, err, self._changes_since(path)) from err
        self._check_resume_length(loaded.step)
        state = loaded.train_state
        changes = self._config_changes(state)
        loader_state = json.loads(json.dumps(state["loader"]))
        # The stream position does not depend on how many rows each rank takes per batch.
        loader_state["config"]["batch_size"] = self.loader.batch_size
        loader_state["config"]["world_size"] = self.loader.world_size
        try:
            D.load_full_state_dicts(self.model, self.optimizer, model_state.loaded, optim_state.loaded, self.ctx,
                                    groups=self.canonical_groups)
            self.loader.load_state_dict(loader_state)
        except ValueError as err:
            raise self._misfit(path, err, changes) from err
        for group, values in zip(self.optimizer.param_groups, fresh):
            params = group["params"]
            group.clear()
            group.update(values, params=params)
        self.step, self.tokens = loaded.step, int(state["tokens"])
        self.guard.load_state_dict(state["guard"])
        self._interval = [{k: math.nan if v is None else v for k, v in r.items()} for r in state.get("interval", [])]
        self.resumed_from = path
        self._last_saved_step = self.step
        if self.step == self.total_steps and (self.out_dir / FINAL_DIR).is_dir():
            # finished, exported too: nothing to train, and nothing to rewrite (metrics, config.yaml, final/)
            self.already_complete = True
            self._print(f"--resume: the run in {self.out_dir} is already complete ({self.step} of {self.total_steps} "
                        f"updates, {FINAL_DIR}/ written); nothing to do. To train it longer, resume with a larger "
                        f"train.steps (e.g. --set train.steps={2 * self.step})")
            return
        self._print(f"resumed from {path} (step {self.step}, {self.tokens:,} tokens)"
                    + ("; settings changed since: " + "; ".join(changes) if changes else ""))
        if self.ctx.is_main:  # the records after the checkpoint, and a partial one its open interval replaces
            self._truncate_jsonl(self.out_dir / METRICS_FILE, self.step - len(self._interval))
            self._truncate_jsonl(self.out_dir / EVAL_FILE, self.step)

    def _config_changes(self, train_state: dict) -> list[str]:
        """The settings that differ between a checkpoint's config and this one ("key: old -> new")."""
        import yaml

        changes = diff_configs(yaml.safe_load(train_state.get("config", "{}")) or {}, config_to_dict(self.config))
        return [c for c in changes if not c.startswith("train.out_dir")]

    def _changes_since(self, path: Path) -> list[str]:
        """`_config_changes` of the checkpoint at `path`, read from its train_state.json ([] if unreadable)."""
        try:
            record = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
            return self._config_changes(record["train_state"])
        except Exception:  # noqa: BLE001 - only for the message: the load itself reported what is wrong
            return []

    @staticmethod
    def _misfit(path: Path, err: Exception, changes: list[str]) -> ConfigError:
        return ConfigError(
            f"--resume: {path} does not fit this configuration ({err}). Settings changed since it was saved: "
            + ("; ".join(changes) or "none") + ". Resume with the run's own settings, or train into a new --out"
        )

    def _check_resume_length(self, step: int) -> None:
        """ConfigError if the configured run ends before the checkpoint's step: it cannot be shortened after the
        fact (training would do nothing, then overwrite final/ and config.yaml with the shorter length)."""
        if self.total_steps >= step:
            return
        t = self.config.train
        if t.steps is not None and t.steps < step:
            problem = f"train.steps: {t.steps} is below the checkpoint's step {step}"
        else:
            problem = (f"train.tokens: {t.tokens:,} tokens end the run after {self.total_steps} updates, below the "
                       f"checkpoint's step {step}")
        raise ConfigError(
            f"{problem} (a run cannot be shortened by resuming it); resume with train.steps >= {step}, or start a "
            "shorter run in another --out"
        )

    @staticmethod
    def _truncate_jsonl(path: Path, step: int) -> None:
        """Drop records logged after `step` (by a run that died before its next checkpoint)."""
        if not path.is_file():
            return
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        write_atomic(path, "".join(line + "\n" for line in keep).encode("utf-8"))

    # ------------------------------------------------------------------------------------------ stopping
    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop before the next update: save a checkpoint and return status "interrupted"."""
        self._stop.request(reason)

    @property
    def stop_reason(self) -> str | None:
        """Why training stopped early (a signal's name or `request_stop`'s reason), None otherwise."""
        return self._stop.reason

    def _agree_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop.reason else 0.0])
        return bool(D.all_reduce_sum(flag, self.ctx).item() > 0)

    # ------------------------------------------------------------------------------------------ the update
    def _autocast(self):
        enabled = self.config.train.dtype == "bf16"
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _to_device(self, batch: dict) -> dict:
        """The batch's tensors on this rank's device, except the document offsets: the model reads those on the
        host (`_model_inputs`)."""
        return {k: v.to(self.ctx.device, non_blocking=True) if torch.is_tensor(v) and k != "cu_seqlens" else v
                for k, v in batch.items()}

    def _prepare(self, batch: dict) -> dict:
        """A loader batch on this rank's device, as this rank computes it: without document boundaries the
        position_ids run 0..T-1 in every row; with cp > 1 this rank's chunk of every row (`D.shard_rows`)."""
        batch = self._to_device(batch)
        if not self.config.data.document_boundaries:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length, device=self.ctx.device).unsqueeze(0).expand(rows, -1)
        return D.shard_rows(batch, self.ctx)

    def compute_loss_sum(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Summed next-token cross entropy of one micro-batch over this rank's labels (fp32 scalar); with
        cp > 1, of this rank's chunk (the chunks' sums add up to the rows' sum)."""
        if self._cuda_graphs:  # a new step of the graphs: the previous forward's outputs are used up
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast(), D.context_parallel(model, self.ctx):
            logits = model(**self._model_inputs(batch)).logits  # [B, T or T/cp, V], or [1, B T, V] packed
        return F.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def _keep_grads_outside_graphs(self) -> None:
        """Give every trainable parameter a zero `.grad` allocated here, outside the CUDA graphs (where a skipped update
        or the first step left none). Backward then adds each micro-batch's gradient into it. A `.grad` that is
        itself a graph's output (what autograd keeps when the gradient is None) lives in the graphs' memory pool
        and is invalid after the next micro-batch's forward, so gradient accumulation would read a dead buffer."""
        for param in self.model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)

    def _model_inputs(self, batch: dict) -> dict:
        """The model's arguments for a batch, decided on the host from the loader's document offsets, so the model
        need not read position_ids back from the device to find the documents (twice per forward):
        - cp > 1: this rank's chunk with its global positions (no document boundaries with cp); a batch without
          offsets: its position_ids, as they come;
        - one document per row, or boundaries not kept: the rows alone (positions 0..T-1 are the default);
        - documents packed in rows: one packed row with its offsets (`cu_seqlens`, on the host), what the model
          would make of the restarting position_ids itself."""
        offsets = batch.get("cu_seqlens")
        if self.ctx.cp_size > 1 or offsets is None:
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if not self.config.data.document_boundaries or len(offsets) - 1 == batch["input_ids"].shape[0]:
            return {"input_ids": batch["input_ids"]}
        return {"input_ids": batch["input_ids"].reshape(1, -1), "cu_seqlens": offsets,
                "position_ids": batch["position_ids"].reshape(1, -1)}

    def _next_batches(self, count: int) -> list[dict]:
        try:
            return [self._prepare(next(self.loader)) for _ in range(count)]
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at update {self.step} ({self.tokens:,} tokens): every source reached "
                "its max_epochs; lower train.steps / train.tokens or allow more epochs"
            ) from None

    def _train_step(self) -> dict:
        c = self.config
        dp = self.ctx.dp_size
        started = time.perf_counter()
        factors = schedule_factors(self.schedule, total=self.schedule_total, step=self.step, tokens=self.tokens,
                                   batch_tokens=self.tokens_per_update)
        apply_schedule(self.optimizer, factors.lr, factors.wd)
        accum = c.batch.grad_accum if factors.batch_size is None else factors.batch_size // self.rows_per_micro
        batches = self._next_batches(accum)
        local_count = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        total_count = max(1.0, float(D.row_sum(torch.tensor([float(local_count)]), self.ctx).item()))

        self.model.train()
        if self._cuda_graphs:
            self._keep_grads_outside_graphs()
        # summed on the device: a host read per micro-batch would stall the queue (one read per update, below)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i, batch in enumerate(batches):
            with D.gradient_sync(self.model, enabled=i == accum - 1):
                micro = self.compute_loss_sum(self.model, batch)
                (micro * (dp / total_count)).backward()
            loss_sum += micro.detach().double()
        D.reduce_context_parallel_grads(self.model, self.ctx)
        loss = float(D.row_sum(loss_sum.cpu().reshape(1), self.ctx).item()) / total_count
        max_norm = c.train.grad_clip if c.train.grad_clip is not None else math.inf
        grad_norm = D.clip_grad_norm(self.model, max_norm, self.ctx, names=self.param_names)
        if self.guard.check(loss, grad_norm, optimizer=self.optimizer, step=self.step):
            self.optimizer.step()
            skipped = False
        else:
            skipped = True
        self.optimizer.zero_grad(set_to_none=not self._cuda_graphs)
        step_tokens = accum * self.rows_per_micro * c.batch.seq_len
        self.step += 1
        self.tokens += step_tokens
        return {
            "step": self.step, "tokens": self.tokens, "loss": loss, "grad_norm": grad_norm,
            "lr": c.optim.lr * factors.lr, "wd": c.optim.weight_decay * factors.wd, "skipped": skipped,
            "step_tokens": step_tokens, "seconds": time.perf_counter() - started,
        }

    # ------------------------------------------------------------------------------------------ evaluation
    def _eager_without_grad(self) -> contextlib.AbstractContextManager:
        """Forwards under no_grad (evaluation, samples) skip the blocks' CUDA graphs and run eagerly. Without a
        pending backward, CUDA-graph trees start a new generation at every call of a compiled block, and its replay
        may reuse the memory of the previous block's output: its own input (seen on an H200, torch 2.11)."""
        return torch.compiler.set_stance("force_eager") if self._cuda_graphs else contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float | None:
        """Mean loss per label over the first `eval_batches` global batches (micro_batch x grad_accum x
        dp rows each) of the held-out sources: the same rows every time and for any split of the
        global batch into ranks, chunks and micro-batches. None without held-out data."""
        if not self.data.eval_sources:
            return None
        c = self.config
        loader = self._eval_loader(self.data.eval_sources)
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        with self._eager_without_grad():
            for _ in range((batches or c.train.eval_batches) * c.batch.grad_accum):
                # every rank of a data-parallel group draws the same rows and stops together (same loader state)
                try:
                    batch = self._prepare(next(loader))
                except StopIteration:
                    break
                totals[0] += float(self.compute_loss_sum(self.model, batch))
                totals[1] += int((batch["labels"] != IGNORE_INDEX).sum())
        self.model.train()
        D.reshard(self.model)  # FSDP2's root stays unsharded after a no_grad forward
        totals = D.row_sum(totals, self.ctx)
        return float(totals[0] / totals[1]) if totals[1] > 0 else None

    # ------------------------------------------------------------------------------------------ samples
    def _write_samples(self) -> list[str]:
        c = self.config.train
        if c.samples == 0 or self.data.tokenizer_dir is None:
            return []
        if self.ctx.parallel is not None and self.ctx.parallel.mixer_parallel != "off":
            self._print("no samples under mixer parallelism (its decoding is not tested through the trainer)")
            return []
        from hybridlm.data.shards import TokenDataset
        from hybridlm.data.tokenizer import HybridTokenizer

        tok = HybridTokenizer.load(self.data.tokenizer_dir)
        source = (self.data.eval_sources or self.loader.sources)[0]
        dataset = TokenDataset(source.path, verify="size")
        prompt_len = 32
        prompts = []
        for i in range(min(dataset.num_docs, 100 * c.samples)):
            doc = dataset.doc(i)
            if len(doc) > prompt_len:
                prompts.append(doc[:prompt_len].tolist())
            if len(prompts) == c.samples:
                break
        if not prompts:
            return []
        from hybridlm.inference.generate import generate

        # Every rank runs the forward (FSDP2 gathers, TP splits); no context parallelism while decoding (the
        # cp ranks, which hold whole parameters, each decode the prompts).
        model = self.model
        model.eval()
        # Decoding's growing caches, mutated in place, are no shapes for the blocks' CUDA graphs either.
        with self._autocast(), self._eager_without_grad():
            out = generate(model, torch.tensor(prompts, device=self.ctx.device), max_new_tokens=c.sample_tokens,
                           temperature=c.sample_temperature, eos_token_id=tok.eos_id, seed=c.seed)
        model.train()
        D.reshard(model)
        texts = []
        for row, mask in zip(out.sequences.tolist(), out.attention_mask.tolist()):
            new = [t for t, m in zip(row[prompt_len:], mask[prompt_len:]) if m and t != tok.eos_id]
            texts.append(tok.decode(row[:prompt_len]) + tok.decode(new))
        if self.ctx.is_main:
            sep = "\n" + "-" * 72 + "\n"
            body = sep.join(f"[prompt: {tok.decode(p)!r}]\n{t}" for p, t in zip(prompts, texts))
            write_atomic(self.out_dir / SAMPLES_FILE, (body + "\n").encode("utf-8"))
            how = f"temperature {c.sample_temperature}" if c.sample_temperature > 0 else "greedy"
            self._print(f"samples ({how}) after {self.step} updates:{sep}{body}{sep}")
        return texts

    # ------------------------------------------------------------------------------------------ logging
    def _append_jsonl(self, name: str, record: dict) -> None:
        if self.ctx.is_main:
            with open(self.out_dir / name, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        """Train to `total_steps` (or until stopped); see the module docstring. The output directory's lock is
        released when it returns (or raises)."""
        self._lock_out_dir()  # (held since __init__; taken again by a second call)
        try:
            with deterministic_kernels(self.config.train.deterministic):
                return self._train()
        finally:
            self._release_lock()

    def _train(self) -> TrainResult:
        from tqdm.auto import tqdm

        c = self.config.train
        if self.already_complete:  # (said so when resuming) the outputs stay as they are
            last_loss, eval_loss = self._logged_losses()
            return TrainResult("already complete", self.step, self.tokens, last_loss, eval_loss, self.resumed_from,
                               self.out_dir)
        model = self.config.model
        shape = model.preset + (f" + {len(model.overrides)} overrides" if model.overrides else "")
        self._print(
            f"training {self.parameters / 1e6:.2f}M parameters ({shape}) on {self.ctx.device}"
            f" x {self.ctx.world_size} ({self.ctx.describe()}), "
            f"{self.total_steps} updates, {self.total_tokens:,} tokens, dtype {c.dtype} -> {self.out_dir}"
        )
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (c.progress and self.ctx.is_main))
        status, last_loss, eval_loss = "completed", None, None
        began = time.perf_counter()
        try:
            with self._stop.handle_signals():
                while self.step < self.total_steps:
                    if self._agree_stop():
                        status = "interrupted"
                        break
                    record = self._train_step()
                    self.history.append(record)
                    self._interval.append(record)
                    bar.update(1)
                    tps = record["step_tokens"] / max(record["seconds"], 1e-9)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{tps:,.0f}",
                                    refresh=False)
                    last = self.step == self.total_steps
                    if self.step % c.log_every == 0 or last:
                        last_loss = self._log_interval(self._interval, began)
                        self._interval = []
                    if last:  # saved before the final evaluation and samples: a failure there loses no training
                        self.save()
                    if (c.eval_every and self.step % c.eval_every == 0) or last:
                        eval_loss = self._log_eval()
                    if c.save_every and self.step % c.save_every == 0 and not last:
                        self.save()
                    for callback in self.callbacks:
                        callback(self, record)
        finally:
            bar.close()
        checkpoint = None
        if self._last_saved_step != self.step or latest_checkpoint(self.checkpoint_dir) is None:
            checkpoint = self.save()  # (with the interval still open: a resumed run completes it)
        else:
            checkpoint = latest_checkpoint(self.checkpoint_dir)
        if self._interval:  # stopped between records: this one covers fewer updates; a resumed run replaces it
            last_loss = self._log_interval(self._interval, began)
        if not self.history:  # no update this session (resumed at its last step, final/ missing): the logged losses
            last_loss, eval_loss = self._logged_losses()
        if status == "interrupted":
            self._print(f"stopped ({self._stop.reason}) at update {self.step}; checkpoint {checkpoint}; continue "
                        f"with `hybridlm train --resume --out {self.out_dir}`")
            samples: list[str] = []
        else:
            samples = self._write_samples()
            self.export()
        if self.ctx.is_main:
            plot_losses(self.out_dir)
        return TrainResult(status, self.step, self.tokens, last_loss, eval_loss,
                           Path(checkpoint) if checkpoint else None, self.out_dir, samples)

    def export(self) -> Path | None:
        """`<out_dir>/final/`: the trained model as a `from_pretrained` directory (safetensors) with the run's
        tokenizer beside it, ready for `hybridlm generate --model <out_dir>/final`. Every rank calls it (FSDP
        gathers); rank 0 writes, through a temporary directory renamed into place."""
        from hybridlm.parallel.checkpoint import full_model_state_dict

        model_sd = full_model_state_dict(self.model)
        final = self.out_dir / FINAL_DIR
        if self.ctx.is_main:
            tmp = self.out_dir / f"{FINAL_DIR}.tmp"
            _remove(tmp)
            self.raw_model.save_pretrained(tmp, state_dict=model_sd, safe_serialization=True)
            if self.data.tokenizer_dir is not None:
                from hybridlm.data.tokenizer import HF_CONFIG_FILE, META_FILE, TOKENIZER_FILE

                # The tokenizer's files only, and none the model wrote: data.tokenizer may be an earlier run's
                # final/, whose config.json and weights must not replace this model's.
                for name in (TOKENIZER_FILE, HF_CONFIG_FILE, META_FILE, *_TOKENIZER_EXTRA_FILES):
                    source = Path(self.data.tokenizer_dir) / name
                    if source.is_file() and not os.path.lexists(tmp / name):
                        shutil.copy2(source, tmp / name)
            # Move the previous export aside before the new one takes its name: a crash leaves one of them.
            old = self.out_dir / f"{FINAL_DIR}.old.tmp"
            _remove(old)
            if os.path.lexists(final):  # (a link named final is moved aside and unlinked, its target left alone)
                os.replace(final, old)
            os.replace(tmp, final)
            with contextlib.suppress(OSError):
                _remove(old)
        D.barrier(self.ctx)
        return final if self.ctx.is_main else None

    def _log_interval(self, interval: list[dict], began: float) -> float | None:
        seconds = sum(r["seconds"] for r in interval)
        record = {
            "step": self.step,
            "tokens": self.tokens,
            "loss": _mean([r["loss"] for r in interval]),
            "lr": interval[-1]["lr"],
            "wd": interval[-1]["wd"],
            "grad_norm": _mean([r["grad_norm"] for r in interval]),
            "tokens_per_s": sum(r["step_tokens"] for r in interval) / max(seconds, 1e-9),
            "skipped": sum(r["skipped"] for r in interval),
            "elapsed_s": time.perf_counter() - began,
        }
        self._append_jsonl(METRICS_FILE, record)
        return record["loss"]

    def _logged_losses(self) -> tuple[float | None, float | None]:
        """(training loss, held-out loss) of the last records in metrics.jsonl / eval.jsonl, None where absent."""
        train = [r["loss"] for r in read_jsonl(self.out_dir / METRICS_FILE) if r.get("loss") is not None]
        held = [r["eval_loss"] for r in read_jsonl(self.out_dir / EVAL_FILE) if r.get("eval_loss") is not None]
        return (train[-1] if train else None), (held[-1] if held else None)

    def _log_eval(self) -> float | None:
        value = self.evaluate()
        if value is not None:
            self._append_jsonl(EVAL_FILE, {"step": self.step, "tokens": self.tokens, "eval_loss": value})
            self._print(f"update {self.step}: held-out loss {value:.4f}")
        return value

    def close(self) -> None:
        self._release_lock()
        D.destroy_distributed(self.ctx)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _unlock_fd(fd: int) -> None:
    """Release the run directory's lock (explicitly: a forked child may hold a copy of the descriptor) and close it."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _remove(path: Path) -> None:
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
