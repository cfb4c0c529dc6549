"""`Trainer`: one pretraining run of a hybrid LM from a `TrainConfig`, on one process or under torchrun.

    trainer = Trainer(load_config("configs/demo.yaml", ["train.steps=50"]), resume=False)
    result = trainer.train()          # TrainResult(status, step, tokens, loss, eval_loss, checkpoint)

The Trainer builds the parts of a run and trains through `hybridlm.training.loop.TrainLoop`; its output directory
(config.yaml, metrics, checkpoints, final/, --overwrite, the lock) is a `hybridlm.training.run_dir.RunDirectory`.
What it plugs into the loop (update s, 0-based; t = tokens consumed before it):
- plan: the schedule's factors for (s, t) (`training.schedules.schedule_factors`: warmup / WSD / power / EPS and the
  batch rampup with sqrt lr scaling) and the micro-batch count: grad_accum, or global batch / (micro_batch x dp)
  during a rampup;
- data: the packing loader, whose rank / world are the data-parallel rank / size (the tp and cp ranks of one
  data-parallel rank get the same rows); each batch on this rank's device, with cp > 1 every row's input_ids and
  labels (the next tokens: shifted before the cut) cut to this rank's chunk, and the model's inputs decided on the
  host from the loader's document offsets (`_model_inputs`);
- loss: `TokenCrossEntropy` (the model's LM head and cross entropy over row chunks: no logits held), the forward
  under bf16 autocast (if train.dtype is bf16; weights and AdamW state stay
  fp32; the recurrent states are carried in fp32, the kernels' matmul operands stay 16-bit) inside
  `context_parallel` when cp > 1; labels are counted once per row (tp rank 0) over every rank: the gradient is
  that of the mean loss over every label of the global batch, however it is split into ranks, chunks and
  micro-batches;
- clip: `distributed.clip_grad_norm` to `train.grad_clip` over sharded and replicated gradients; guard: the
  `StepGuard` skips the update for a non-finite loss or norm and stops the run after `train.max_consecutive_skips`
  in a row.
Before every update the ranks agree whether to stop (SIGINT / SIGTERM / `request_stop`); after it the Trainer
logs, evaluates, saves and calls its callbacks.

Configuration errors (`ConfigError`, the CLI's exit status 2) come before training and before anything of a previous
run is deleted; those that need no data (the run's length and schedule, the files sft / dpo read, --resume's
train.steps against the newest checkpoint) before the output directory is created or locked and before any note is
printed. Once the data is open, an update's global batch larger than one pass over the training data is one too
(`_check_batch_fits_data`): it would repeat data in every update, and a batch that large tends to exhaust memory.
A run that fails before it starts removes the lock file and the output directory that it created
(`RunDirectory.abandon`), so a config error found after the directory's checks leaves nothing behind either.

Parallelism (`parallel` section, under torchrun): `hybridlm.parallel.parallelize` in one place (TP or mixer
parallelism, compile, activation checkpointing, FSDP2); after a forward under no_grad (evaluation, samples)
FSDP2's root is resharded before the next step.

After the last update: a checkpoint, the held-out loss, `samples.txt` (`hybridlm.inference.generate` continuing the
first tokens of held-out documents; where none is longer than the prompt, or the run has no tokenizer, a line says
why there are none), `final/` (the trained model and the tokenizer's files) and `loss.png`.

Resuming (`resume=True`): the newest complete checkpoint in `<out_dir>/checkpoints` is verified and
loaded (model, AdamW state, RNG streams, step, tokens, data-loader position, guard counters); the
metrics files are cut back to its step; with the same config the run continues exactly as if it had
not stopped (tested: 2N steps == N + resume + N on CPU in fp32). Checkpoints (train.checkpoint_format: "dcp", the
default under torchrun, each rank writing its shards, `training.sharded_checkpoint`; or "full", the one-process
default, gathered on rank 0) hold the unparallelized layout's names and rows, so a run saved under one mesh (tp=2 x
dp_shard=2, mixer parallelism, ...) resumes under another or in one process; resume reads either format. The config given at resume time wins (e.g. a larger train.steps,
or a new lr or betas: the AdamW groups' hyperparameters are all taken from it, only the moments and step counts
from the checkpoint), and its differences from the saved one are printed; the schedule is recomputed for the new
length (a pure function of the progress), so extending a run whose WSD decay has finished puts the lr straight
back at the new schedule's value there, the peak for a run still short of the new decay: no second warmup. The
loader state is moved to the current data-parallel size, so a run saved under 2 ranks resumes under 1 with the
same stream of tokens (keep the global batch the same for exactness).
A train.steps below the checkpoint's step is a ConfigError (a run is not shortened after the fact); a run resumed at
its full length with final/ written is "already complete": nothing is trained or rewritten. A step directory newer
than the newest complete checkpoint is a damaged one (an interrupted save leaves only a `.tmp` directory, which is
passed over): the resume refuses it with a CheckpointError naming it and its problem, rather than train past it and
replace it with a new save; move it away (or delete it) to resume from the older checkpoint.

Stopping: SIGINT or SIGTERM (or `request_stop()` from a callback) finishes the current update, saves
a checkpoint and returns status "interrupted"; a second signal more than 2 s later raises KeyboardInterrupt at once
(`hybridlm.training.stop.StopRequest`, `SecondSignal`: `timeout` signals the command and then its process group, a
double signal that counts as one). After the loop (samples, final/) SIGINT raises KeyboardInterrupt at once: the
last checkpoint is saved, and --resume writes final/. The CLI reports either in one line (exit 128 + signal).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridlm.training import distributed as D
from hybridlm.training.checkpoint import (
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointMismatchError,
    check_no_damaged_newer,
    checkpoint_format,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    step_of,
)
from hybridlm.training.config import (
    ConfigError,
    TrainConfig,
    command_of,
    config_to_dict,
    diff_configs,
    dump_config,
)
from hybridlm.training.guard import StepGuard
from hybridlm.training.loop import Batch, TokenCrossEntropy, TrainLoop, UpdateOutput, UpdatePlan
from hybridlm.training.optim import MatrixMultipliers, build_param_groups
from hybridlm.training.plan import checkpoint_format as resolve_checkpoint_format
from hybridlm.training.plan import plan_steps, schedule_config
from hybridlm.training.rng import deterministic_kernels
from hybridlm.training.run_dir import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    EVAL_FILE,
    FINAL_DIR,
    METRICS_FILE,
    RunDirectory,
    run_tokenizer_dir,
    run_tokenizer_setting,
    same_file,
)
from hybridlm.training.schedules import schedule_factors
from hybridlm.training.sharded_checkpoint import ShardedCheckpointer, load_sharded_checkpoint
from hybridlm.training.stop import StopRequest
from hybridlm.training.validate import build_model_config


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
    loader: Any  # an iterator of batches with state_dict / load_state_dict: PackedLoader, ChatRows, PreferencePairs
    eval_sources: list  # hybridlm.data.loader.Source
    tokenizer_dir: Path | None
    vocab_size: int
    chat: Any = None  # sft / dpo: hybridlm.training.posttraining.ChatData


@dataclass
class PackedRows:
    """The pretraining `DataSource`: the packing loader's batches, each made into this rank's micro-batch by
    `prepare`. `tokens()` (consumed so far) is only for the message when the data runs out."""

    loader: Any  # hybridlm.data.loader.PackedLoader
    prepare: Callable[[Batch], Batch]
    tokens: Callable[[], int]

    def next_micro_batches(self, step: int, count: int) -> list[Batch]:
        try:
            return [self.prepare(next(self.loader)) for _ in range(count)]
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at update {step} ({self.tokens():,} tokens): every source reached "
                "its max_epochs; lower train.steps / train.tokens or allow more epochs"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


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


def _saved_record(path: Path) -> dict | None:
    """A checkpoint's train_state.json ({"step", "train_state"}), read before the checkpoint loads for the checks and
    messages that need it; None where it cannot be read (the load then reports what is wrong)."""
    try:
        record = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
        return record if isinstance(record, dict) and isinstance(record.get("train_state"), dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _progress(path: Path) -> tuple[int, int, int] | None:
    """(updates, tokens, data-parallel ranks) of a checkpoint's run; None where they cannot be read."""
    record = _saved_record(path)
    try:
        state = record["train_state"]
        return int(record["step"]), int(state["tokens"]), int(state.get("data_parallel_size", 1))
    except (TypeError, KeyError, ValueError):  # no record, or one without these fields
        return None


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
        self.callbacks = list(callbacks)
        if config.train.device == "cuda" and not torch.cuda.is_available():
            # a setting this machine cannot honour: a configuration error (exit 2), not a failed run
            raise ConfigError("train.device: 'cuda' but CUDA is not available on this machine (no GPU, or a CPU-only "
                              "PyTorch); use train.device=auto (the GPU where there is one) or train.device=cpu")
        self.ctx = D.init_distributed(config, device=config.train.device)
        self.out_dir = Path(config.train.out_dir)
        self.run_dir = RunDirectory(self.out_dir, self.ctx, say=self._print)
        self.checkpoint_dir = self.run_dir.checkpoints
        self._stop = StopRequest(on_signal=lambda name: self._print(
            f"{name}: finishing this update, then saving a checkpoint (send it again to abort at once)"))
        self.history: list[dict] = []  # every update's record (this process), for tests and tools
        # the updates since the last metrics record: saved with checkpoints, so a resumed run logs the same records
        self._interval: list[dict] = []
        try:
            self._check_before_start(config, resume)
            self.run_dir.prepare(resume=resume, overwrite=overwrite, needed=self._needed_files())
            self._build(config, resume, overwrite)
        except BaseException:
            self.run_dir.abandon()  # a directory and lock file created for this run go with it
            raise

    def _check_before_start(self, config: TrainConfig, resume: bool) -> None:
        """The checks that need neither the output directory nor the data's contents, made before the directory is
        created or locked and before any note is printed, so that their ConfigError (exit status 2) leaves no trace:
        the run's length and schedule at this number of data-parallel ranks, the files sft / dpo read
        (`posttraining.check_chat_inputs`) and, with --resume, train.steps against the newest complete checkpoint."""
        latest = latest_checkpoint(self.checkpoint_dir) if resume else None
        if latest is not None:
            self._check_resume_task(latest)
        # sizes and schedule: batch sizes count rows per data-parallel rank; a resumed run plans the updates left at
        # this dp from the updates and tokens done (`plan`'s docstring)
        dp = self.ctx.dp_size
        progress = None if latest is None else _progress(latest)
        done = (0, 0) if progress is None else progress[:2]
        self._saved_dp = dp if progress is None else progress[2]
        self.total_steps, self.total_tokens = plan_steps(config, dp, start=done)
        # ConfigError (the CLI's one-line config error) if the decay does not fit the run at dp; notes for a shortened
        # warmup or a rampup the run outlasts, printed once every check has passed (`_build`)
        self.schedule, self.schedule_total, self._schedule_note = schedule_config(config, dp, start=done)
        if config.train.task != "pretrain":
            from hybridlm.training.posttraining import check_chat_inputs

            check_chat_inputs(config)
        if progress is not None:  # `_resume` checks the loaded checkpoint's own step again
            self._check_resume_length(step_of(latest))

    def _build(self, config: TrainConfig, resume: bool, overwrite: bool) -> None:
        """Everything after the output directory's checks: data, model, optimizer, resume; then (every check
        passed) the schedule's note, --overwrite's removal of the previous run and the first write, config.yaml."""
        self._seed(config.train.seed)

        dp = self.ctx.dp_size
        self.hybrid = build_model_config(config)
        b = config.batch
        self.rows_per_micro = b.micro_batch * dp  # global rows drawn per micro-step
        self.tokens_per_update = self.rows_per_micro * b.grad_accum * b.seq_len  # without rampup

        # data, model, optimizer
        self.data = self._build_data()
        self._check_batch_fits_data()
        if self.data.vocab_size > self.hybrid.vocab_size and config.model.init is not None:
            raise ConfigError(f"model.init: its tokenizer has {self.data.vocab_size} ids but the model's vocabulary is "
                              f"{self.hybrid.vocab_size}; the directory's tokenizer is not the model's")
        if self.data.vocab_size > self.hybrid.vocab_size:
            raise ConfigError(
                f"model.overrides.vocab_size: the data's tokenizer has {self.data.vocab_size} ids but the model's "
                f"vocabulary is {self.hybrid.vocab_size}; set model.overrides.vocab_size >= {self.data.vocab_size}"
            )
        self.loader = self.data.loader

        self.raw_model = self._new_model().to(self.ctx.device)
        # dpo.reference "frozen": the starting model, a frozen copy beside the trained one
        self.reference_model = None
        if config.train.task == "dpo" and config.dpo.reference == "frozen":
            import copy

            self.reference_model = copy.deepcopy(self.raw_model).eval().requires_grad_(False)
        self.raw_model = self._with_lora(self.raw_model)
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
        if config.train.task == "dpo":
            from hybridlm.training.dpo import PreferenceLoss

            self.loss = PreferenceLoss(config.dpo.beta, config.dpo.loss, context=self._forward_context,
                                       reference_model=self.reference_model)
            prepare = self._to_device
        else:
            # SFT: the LM head only where labels score (the assistant's tokens), unless CUDA graphs need fixed shapes
            scored_only = config.train.task == "sft" and not self._cuda_graphs
            self.loss = TokenCrossEntropy(context=self._forward_context, scored_only=scored_only,
                                          chunked=config.train.lm_head_loss == "chunked")
            prepare = self._micro_batch
        max_norm = config.train.grad_clip if config.train.grad_clip is not None else math.inf
        self.loop = TrainLoop(
            self.model, self.optimizer, data=PackedRows(self.loader, prepare, lambda: self.tokens),
            loss=self.loss, plan=self._plan, guard=self.guard, ctx=self.ctx, grads_in_place=self._cuda_graphs,
            clip=lambda model: D.clip_grad_norm(model, max_norm, self.ctx, names=self.param_names),
        )
        self.tokens = 0
        self.checkpoint_format = resolve_checkpoint_format(config, self.ctx.world_size)
        self._sharded = ShardedCheckpointer()
        self.resumed_from: Path | None = None
        self._last_saved_step: int | None = None
        # True when --resume found the run finished (its last checkpoint at the planned length and final/ written):
        # train() then changes nothing
        self.already_complete = False
        if resume:
            self._resume()
        if self._schedule_note and not self.already_complete:
            self._print(self._schedule_note)
        if overwrite:  # only now, every check passed: a bad setting leaves the previous run as it was
            self.run_dir.remove_previous_run()
        if not self.already_complete:
            self.run_dir.write_config(config)

    @property
    def step(self) -> int:
        """Updates done (counting those before a resume)."""
        return self.loop.step

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

    def _needed_files(self) -> list[tuple[str, Path | None]]:
        """What the run reads ((setting, path) pairs), which --overwrite must not delete. The run's own config.yaml
        as --config is read already, and rewritten: not needed."""
        c = self.config.data
        own = self.config_path is not None and same_file(self.config_path, self.out_dir / CONFIG_FILE)
        needed = [("--config", None if own else self.config_path), ("data.tokenizer", c.tokenizer),
                  ("data.demo_dir", c.demo_dir), ("model.init", self.config.model.init), ("data.chat", c.chat),
                  ("data.chat_template", c.chat_template)]
        return (needed + [("data.sources", s.path) for s in c.sources]
                + [("data.eval_sources", s.path) for s in c.eval_sources])

    def _build_data(self) -> _Data:
        from hybridlm.data.errors import DataError
        from hybridlm.data.loader import PackedLoader, Source
        from hybridlm.data.shards import check_tokenizer_matches, load_manifest

        c = self.config
        if c.train.task != "pretrain":
            return self._build_chat_data()
        if c.data.demo:
            from hybridlm.training.demo import prepare_demo

            directory = Path(c.data.demo_dir) if c.data.demo_dir else self.out_dir / "demo_data"
            problem = None  # (a config error?, what): rank 0 prepares, every rank raises its failure
            if self.ctx.is_main:
                self._print(f"preparing the built-in demo corpus (the Python standard library) in {directory}")
                try:
                    demo = prepare_demo(directory, max_bytes=c.data.demo_max_bytes,
                                        heldout_every=c.data.demo_heldout_every)
                    self._print(f"demo corpus: {demo.train_files} training files, {demo.heldout_files} held out")
                except ValueError as err:
                    problem = (True, f"data.demo_max_bytes: {err}")
                except Exception as err:
                    D.broadcast_object((False, f"rank 0 could not prepare the demo corpus in {directory}: {err}"),
                                       self.ctx)
                    raise
            problem = D.broadcast_object(problem, self.ctx)
            if problem:
                raise (ConfigError if problem[0] else RuntimeError)(problem[1])
            sources = [Source("stdlib", directory / "train")]
            eval_sources = [Source("stdlib_heldout", directory / "heldout")]
        else:
            sources = [Source(s.name, s.path, s.weight, s.max_epochs) for s in c.data.sources]
            eval_sources = [Source(s.name, s.path, s.weight, s.max_epochs) for s in c.data.eval_sources]
        tokenizer_dir = run_tokenizer_dir(c, self.out_dir)
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

    def _check_batch_fits_data(self) -> None:
        """ConfigError when one update's global batch (batch.micro_batch x batch.grad_accum x the data-parallel ranks,
        at the rampup's target: its largest) needs more than one pass over the training data holds: every update
        would repeat data, and a batch that large tends to exhaust memory before the first update. Pretraining
        counts tokens (the sources with a positive weight, a max_epochs below 1 counting that share of its source),
        sft the rows an epoch packs, dpo the pairs. Pretraining also refuses a run longer than every source's
        max_epochs allow (`PackedLoader.most_tokens`, when they bound it); data that still runs out (a bound the
        mixture does not reach) stops the run with the loop's "the training data ran out" (exit status 1)."""
        c, b = self.config, self.config.batch
        task = c.train.task
        dp = self.ctx.dp_size
        how = (f"batch.micro_batch {b.micro_batch} x batch.grad_accum {b.grad_accum} x {dp} data-parallel "
               f"rank{'s' if dp > 1 else ''}")
        per_update = self.rows_per_micro * b.grad_accum
        if task == "pretrain":
            need, unit, how = per_update * b.seq_len, "tokens", how + f" x batch.seq_len {b.seq_len}"
            have = int(sum(d.num_tokens * (1.0 if s.max_epochs is None else min(1.0, s.max_epochs))
                           for s, d in zip(self.data.loader.sources, self.data.loader.datasets) if s.weight > 0))
            source = ("the demo corpus's training files; data.demo_max_bytes sets its size" if c.data.demo
                      else "data.sources")
        elif task == "sft":
            need, unit, have = per_update, f"rows of batch.seq_len {b.seq_len}", len(self.data.loader.epoch_rows(0))
            source = f"{len(self.data.loader.samples):,} samples packed"
        else:
            need, unit, have = per_update, "preference pairs", len(self.data.loader.pairs)
            source = "data.chat" if c.data.chat else "the demo pairs"
        if need > have:
            raise ConfigError(
                f"batch: an update takes {need:,} {unit} ({how}), more than the training data holds: {have:,} "
                f"({source}); every update would repeat data (and a batch that large can exhaust memory). Lower "
                "batch.micro_batch / batch.grad_accum, or train on more data"
            )
        most = self.data.loader.most_tokens() if task == "pretrain" else None
        if most is not None and self.total_tokens + 1 > most:  # (the last batch reads one token past its rows)
            raise ConfigError(
                f"train: the run takes {self.total_tokens:,} tokens ({self.total_steps:,} updates) but data.sources "
                f"hold at most {most:,} at their max_epochs, so the data would run out before the end; lower "
                "train.steps / train.tokens, or raise the sources' max_epochs"
            )

    def _build_chat_data(self) -> _Data:
        """sft / dpo: the records tokenized with model.init's tokenizer and chat template, packed (`posttraining`)."""
        from hybridlm.training.posttraining import build_chat_source

        chat = build_chat_source(self.config, rank=self.ctx.dp_rank, world_size=self.ctx.dp_size)
        self._print(f"{self.config.train.task} data: {chat.summary}")
        return _Data(chat.source, [], run_tokenizer_dir(self.config, self.out_dir), len(chat.encoder.tokenizer), chat)

    def _new_model(self) -> torch.nn.Module:
        """A fresh model of the config's preset, or model.init's trained one (in float32: the master weights)."""
        from hybridlm.models.model import HybridForCausalLM

        if self.config.model.init is None:
            return HybridForCausalLM(self.hybrid)
        from hybridlm.models.hf import load_model

        try:
            return load_model(self.config.model.init, dtype=torch.float32).train()
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.init: {err}") from err

    def _with_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """With lora.r > 0: peft LoRA adapters on lora.targets, every other weight frozen (one process)."""
        lora = self.config.lora
        if not lora.r:
            return model
        if self.ctx.world_size > 1:
            raise ConfigError("lora.r: LoRA trains in one process here; run without torchrun, or set lora.r=0")
        from peft import LoraConfig, get_peft_model

        try:
            return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                    target_modules=list(lora.targets)))
        except ValueError as err:  # no module matches a target
            raise ConfigError(f"lora.targets: {err}") from err

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
        named = [(n, p) for n, p in self.raw_model.named_parameters() if p.requires_grad]
        if self.config.lora.r:  # the adapters: one group, at optim.lr and optim.weight_decay
            names, params = zip(*named)
            return [{"params": list(params), "param_names": list(names), "role": "lora", "lr": o.lr,
                     "weight_decay": o.weight_decay, "base_lr": o.lr, "base_weight_decay": o.weight_decay}]
        return build_param_groups(
            named, lr=o.lr, weight_decay=o.weight_decay,
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
            "interval": [{k: r[k] if _finite_or_not_float(r[k]) else None for k in self._interval_keys}
                         for r in self._interval],
            # dpo: the starting model's log-probabilities of every pair (exact in JSON: float64 reprs round-trip)
            **({"reference": self.loader.reference.tolist()} if self._precomputed_reference else {}),
        }

    @property
    def _interval_keys(self) -> tuple[str, ...]:
        """What an update's record holds for the metrics (the loss's own metrics too: DPO's rewards)."""
        if self.config.train.task == "dpo":
            from hybridlm.training.dpo import METRICS

            return _INTERVAL_KEYS + METRICS
        return _INTERVAL_KEYS

    @property
    def _precomputed_reference(self) -> bool:
        return self.config.train.task == "dpo" and self.config.dpo.reference == "precomputed"

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (every rank must call it). The full format: gathered, rank 0 writes
        and gets the path. The dcp format: every rank writes its shards; with train.checkpoint_async the write goes
        on in the background and None is returned (`wait_for_checkpoint` or the next save completes it)."""
        if self.checkpoint_format == "dcp":
            t = self.config.train
            path = self._sharded.save(self.checkpoint_dir, self.step, model=self.model, optimizer=self.optimizer,
                                      groups=self.canonical_groups, train_state=self._train_state(),
                                      keep_last=t.keep_last, async_save=t.checkpoint_async)
            self._last_saved_step = self.step
            return path
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

    def wait_for_checkpoint(self) -> None:
        """Complete a pending asynchronous save (every rank; nothing to do otherwise)."""
        self._sharded.wait()

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
            for name in (METRICS_FILE, EVAL_FILE):
                self.run_dir.truncate(name, 0)
            return
        check_no_damaged_newer(path, "--resume", f"resuming from {path.name} would train their steps again and "
                               "replace them", f"to resume from {path.name}")
        model_state = _ModelState()
        # The config given now wins: every group's hyperparameters (base lr / wd for the schedule, betas, eps and
        # torch's own options) stay those of the fresh groups; the checkpoint gives only the per-parameter state
        # (moments, step counts). `load_full_state_dicts` copies the saved groups' values, as torch's loader does.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        optim_state = _OptimizerState(self.canonical_groups)
        sharded = checkpoint_format(path) == "dcp"
        try:
            if sharded:  # every rank reads its own part, resharded to this mesh, straight into the model
                loaded = load_sharded_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                                 groups=self.canonical_groups)
            else:
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
            if not sharded:
                D.load_full_state_dicts(self.model, self.optimizer, model_state.loaded, optim_state.loaded, self.ctx,
                                        groups=self.canonical_groups)
            self.loader.load_state_dict(loader_state)
        except ValueError as err:
            raise self._misfit(path, err, changes) from err
        for group, values in zip(self.optimizer.param_groups, fresh):
            params = group["params"]
            group.clear()
            group.update(values, params=params)
        self.loop.step, self.tokens = loaded.step, int(state["tokens"])
        if self._precomputed_reference:
            self.loader.reference = torch.tensor(state["reference"], dtype=torch.float64)
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
        ranks = state.get("data_parallel_size")
        if ranks is not None and ranks != self.ctx.dp_size:
            changes.append(f"data-parallel ranks: {ranks} -> {self.ctx.dp_size} (the updates left are planned at "
                           f"{self.ctx.dp_size}: {self.total_steps - self.step} more, to {self.total_tokens:,} tokens)")
        self._print(f"resumed from {path} (step {self.step}, {self.tokens:,} tokens)"
                    + ("; settings changed since: " + "; ".join(changes) if changes else ""))
        # the records after the checkpoint, and a partial one its open interval replaces
        self.run_dir.truncate(METRICS_FILE, self.step - len(self._interval))
        self.run_dir.truncate(EVAL_FILE, self.step)

    def _config_changes(self, train_state: dict) -> list[str]:
        """The settings that differ between a checkpoint's config and this one ("key: old -> new")."""
        import yaml

        changes = diff_configs(yaml.safe_load(train_state.get("config", "{}")) or {}, config_to_dict(self.config))
        return [c for c in changes if not c.startswith("train.out_dir")]

    def _changes_since(self, path: Path) -> list[str]:
        """`_config_changes` of the checkpoint at `path`, read from its train_state.json ([] if unreadable)."""
        record = _saved_record(path)
        try:
            return [] if record is None else self._config_changes(record["train_state"])
        except Exception:  # noqa: BLE001 - only for the message: the load itself reported what is wrong
            return []

    @staticmethod
    def _misfit(path: Path, err: Exception, changes: list[str]) -> ConfigError:
        return ConfigError(
            f"--resume: {path} does not fit this configuration ({err}). Settings changed since it was saved: "
            + ("; ".join(changes) or "none") + ". Resume with the run's own settings, or train into a new --out"
        )

    def _check_resume_task(self, path: Path) -> None:
        """ConfigError when the checkpoint is of another task (a dpo --resume of an sft run): its data, loss and state
        are another command's."""
        import yaml

        record = _saved_record(path)
        try:
            saved = yaml.safe_load(record["train_state"].get("config", "{}")) or {}
        except Exception:  # noqa: BLE001 - unreadable: the load itself reports what is wrong
            return
        task, theirs = self.config.train.task, (saved.get("train") or {}).get("task", "pretrain")
        if theirs != task:
            start = "--model" if task != "pretrain" else "--set model.init="
            raise ConfigError(
                f"--resume: {self.out_dir} holds a `hybridlm {command_of(theirs)}` run ({path.name}), not a "
                f"`hybridlm {command_of(task)}` one; continue it with `hybridlm {command_of(theirs)} --resume --out "
                f"{self.out_dir}`, or start `hybridlm {command_of(task)}` from its model in a new --out ({start} "
                f"{self.out_dir / FINAL_DIR})"
            )

    def _check_resume_length(self, step: int) -> None:
        """ConfigError if the configured run ends before the checkpoint's step: it cannot be shortened after the
        fact (training would do nothing, then overwrite final/ and config.yaml with the shorter length). A token
        budget is measured at the data-parallel ranks the checkpoint was written at: would it have ended the run there
        before this step."""
        t = self.config.train
        ranks = self._saved_dp
        if t.steps is not None and t.steps < step:
            problem = f"train.steps: {t.steps} is below the checkpoint's step {step}"
        elif t.tokens is not None and (ended := plan_steps(self.config, ranks)[0]) < step:
            problem = (f"train.tokens: {t.tokens:,} tokens end the run after {ended} updates (at the checkpoint's "
                       f"{ranks} data-parallel rank{'s' if ranks > 1 else ''}), below the checkpoint's step {step}")
        else:
            return
        raise ConfigError(
            f"{problem} (a run cannot be shortened by resuming it); resume with train.steps >= {step}, or start a "
            "shorter run in another --out"
        )

    # ------------------------------------------------------------------------------------------ stopping
    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop before the next update: save a checkpoint and return status "interrupted"."""
        self._stop.request(reason)

    @property
    def stop_reason(self) -> str | None:
        """Why training stopped early (a signal's name or `request_stop`'s reason), None otherwise."""
        return self._stop.reason

    def _agree_stop(self) -> bool:
        """Whether any rank was asked to stop; a rank that was not takes the reason of those that were (a signal's
        name, SIGTERM first, so every rank exits with 128 + its number; else a request's), as one all-reduce."""
        reason = self._stop.reason
        asked = D.all_reduce_sum(torch.tensor([float(reason is not None), float(reason == "SIGINT"),
                                               float(reason == "SIGTERM")]), self.ctx)
        if reason is None and asked[0] > 0:
            self._stop.request("SIGTERM" if asked[2] > 0 else "SIGINT" if asked[1] > 0 else
                               "stop requested on another rank")
        return bool(asked[0] > 0)

    # ------------------------------------------------------------------------------------------ the loop's parts
    def _plan(self, step: int) -> UpdatePlan:
        """The schedule's factors for update `step` after `self.tokens` tokens, and its micro-batch count."""
        factors = schedule_factors(self.schedule, total=self.schedule_total, step=step, tokens=self.tokens,
                                   batch_tokens=self.tokens_per_update)
        accum = (self.config.batch.grad_accum if factors.batch_size is None
                 else factors.batch_size // self.rows_per_micro)
        return UpdatePlan(factors.lr, factors.wd, accum)

    def _autocast(self):
        enabled = self.config.train.dtype == "bf16"
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=enabled)

    @contextlib.contextmanager
    def _forward_context(self, model: torch.nn.Module) -> Iterator[None]:
        """Around every forward of the loss: a new step of the blocks' CUDA graphs (the previous forward's outputs
        are used up), autocast, and this rank's context-parallel chunk (cp > 1)."""
        if self._cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast(), D.context_parallel(model, self.ctx):
            yield

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

    def _model_inputs(self, batch: dict) -> dict:
        """The model's arguments for a prepared batch, decided on the host from the loader's document offsets, so the
        model need not read position_ids back from the device to find the documents (twice per forward):
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

    def _micro_batch(self, batch: dict) -> Batch:
        """A loader batch as `self.loss` takes it: the model's inputs for this rank and the labels [B, T]."""
        batch = self._prepare(batch)
        return {**self._model_inputs(batch), "labels": batch["labels"]}

    # ------------------------------------------------------------------------------------------ evaluation
    def _eager_without_grad(self) -> contextlib.AbstractContextManager:
        """Forwards under no_grad (evaluation, samples) skip the blocks' CUDA graphs and run eagerly. Without a
        pending backward, CUDA-graph trees start a new generation at every call of a compiled block, and its replay
        may reuse the memory of the previous block's output: its own input."""
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
                    batch = self._micro_batch(next(loader))
                except StopIteration:
                    break
                totals[0] += float(self.loss(self.model, batch))
                totals[1] += self.loss.count(batch)
        self.model.train()
        D.reshard(self.model)  # FSDP2's root stays unsharded after a no_grad forward
        totals = D.row_sum(totals, self.ctx)
        return float(totals[0] / totals[1]) if totals[1] > 0 else None

    # ------------------------------------------------------------------------------------------ samples
    def _write_samples(self) -> list[str]:
        c = self.config.train
        if c.samples == 0:
            return []
        if self.data.tokenizer_dir is None:
            self._print(f"no samples (train.samples={c.samples}): the run has no tokenizer to decode them; set "
                        "data.tokenizer to the one the data was prepared with")
            return []
        if self.data.chat is not None:
            return self._write_chat_samples()
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
        scanned = min(dataset.num_docs, 100 * c.samples)
        for i in range(scanned):
            doc = dataset.doc(i)
            if len(doc) > prompt_len:
                prompts.append(doc[:prompt_len].tolist())
            if len(prompts) == c.samples:
                break
        if not prompts:
            which = "held-out" if self.data.eval_sources else "training"
            self._print(f"no samples (train.samples={c.samples}): a sample continues the first {prompt_len} tokens "
                        f"of a {which} document, and the first {scanned:,} documents of {source.name} ({source.path}) "
                        f"are all {prompt_len} tokens or shorter")
            return []
        from hybridlm.inference import generate

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
            self.run_dir.write_samples(body + "\n")
            how = f"temperature {c.sample_temperature}" if c.sample_temperature > 0 else "greedy"
            self._print(f"samples ({how}) after {self.step} updates:{sep}{body}{sep}")
        return texts

    def _write_chat_samples(self) -> list[str]:
        """sft / dpo: the trained model's greedy answers to the first train.samples records' prompts."""
        from hybridlm.inference.chat import answer

        c = self.config.train
        encoder = self.data.chat.encoder
        model = self.model
        model.eval()
        texts = []
        with self._autocast(), self._eager_without_grad():
            for record in self.data.chat.records[:c.samples]:
                prompt = encoder.encode_text(encoder.prompt_text(record.data))[-self.config.batch.seq_len:]
                reply = answer(model, encoder, prompt, max_new_tokens=c.sample_tokens)
                texts.append(encoder.tokenizer.decode(prompt) + " => " + reply)
        model.train()
        D.reshard(model)
        if self.ctx.is_main:
            sep = "\n" + "-" * 72 + "\n"
            self.run_dir.write_samples(sep.join(texts) + "\n")
            self._print(f"answers (greedy) after {self.step} updates:{sep}{sep.join(texts)}{sep}")
        return texts

    # ------------------------------------------------------------------------------------------ training
    def train(self) -> TrainResult:
        """Train to `total_steps` (or until stopped); see the module docstring. The output directory's lock is
        released when it returns (or raises)."""
        self.run_dir.lock()  # (held since __init__; taken again by a second call)
        try:
            with deterministic_kernels(self.config.train.deterministic):
                return self._train()
        finally:
            self.run_dir.release()

    def _train(self) -> TrainResult:
        from tqdm.auto import tqdm

        c = self.config.train
        if self.already_complete:  # (said so when resuming) the outputs stay as they are
            last_loss, eval_loss = self.run_dir.logged_losses()
            return TrainResult("already complete", self.step, self.tokens, last_loss, eval_loss, self.resumed_from,
                               self.out_dir)
        model = self.config.model
        shape = model.preset + (f" + {len(model.overrides)} overrides" if model.overrides else "")
        self._print(
            f"training {self.parameters / 1e6:.2f}M parameters ({shape}) on {self.ctx.device}"
            f" x {self.ctx.world_size} ({self.ctx.describe()}), "
            f"{self.total_steps} updates, {self.total_tokens:,} tokens, dtype {c.dtype} -> {self.out_dir}"
        )
        if self._precomputed_reference and self.loader.reference is None:
            self._compute_reference()
        self._bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                         disable=not (c.progress and self.ctx.is_main))
        self._last_loss: float | None = None
        self._eval_loss: float | None = None
        self._began = time.perf_counter()
        try:
            with self._stop.handle_signals():
                completed = self.loop.run(self.total_steps, should_stop=self._agree_stop, hooks=[self._after_update])
        finally:
            self._bar.close()
        status = "completed" if completed else "interrupted"
        last_loss, eval_loss = self._last_loss, self._eval_loss
        self.wait_for_checkpoint()
        if self._last_saved_step != self.step or latest_checkpoint(self.checkpoint_dir) is None:
            self.save()  # (with the interval still open: a resumed run completes it)
            self.wait_for_checkpoint()
        checkpoint = latest_checkpoint(self.checkpoint_dir)
        if self._interval:  # stopped between records: this one covers fewer updates; a resumed run replaces it
            last_loss = self._log_interval(self._interval)
        if not self.history:  # no update in this process (resumed at its last step, final/ missing): the logged losses
            last_loss, eval_loss = self.run_dir.logged_losses()
        if status == "interrupted":
            self._print(f"stopped ({self._stop.reason}) at update {self.step}; checkpoint {checkpoint}; continue "
                        f"with `hybridlm {command_of(self.config.train.task)} --resume --out {self.out_dir}`")
            samples: list[str] = []
        else:
            samples = self._write_samples()
            self.export()
        self.run_dir.plot()
        return TrainResult(status, self.step, self.tokens, last_loss, eval_loss,
                           Path(checkpoint) if checkpoint else None, self.out_dir, samples)

    def _compute_reference(self) -> None:
        """dpo: the starting model's log-probabilities of every pair, in one pass before the first update (every rank
        computes all of them: the same forwards on every rank, as FSDP2 needs)."""
        from tqdm.auto import tqdm

        from hybridlm.training.dpo import reference_log_probs

        pairs = self.loader
        with tqdm(total=len(pairs.pairs), desc="reference log-probs", unit="pair", dynamic_ncols=True,
                  disable=not (self.config.train.progress and self.ctx.is_main)) as bar:
            with self._eager_without_grad():
                pairs.reference = reference_log_probs(
                    self.model, pairs.batch, len(pairs.pairs), pairs_per_batch=self.config.batch.micro_batch,
                    context=self._forward_context, to_device=self._to_device, progress=bar.update)
        D.reshard(self.model)

    def _after_update(self, loop: TrainLoop, out: UpdateOutput) -> None:
        """The loop's hook: the update's record, the progress bar, metrics, checkpoints, evaluation, callbacks."""
        c = self.config
        step_tokens = out.plan.micro_batches * self.rows_per_micro * c.batch.seq_len
        self.tokens += step_tokens
        record = {
            "step": self.step, "tokens": self.tokens, "loss": out.loss, "grad_norm": out.grad_norm,
            "lr": c.optim.lr * out.plan.lr, "wd": c.optim.weight_decay * out.plan.wd, "skipped": out.skipped,
            "step_tokens": step_tokens, "seconds": out.seconds,
        }
        pop_metrics = getattr(self.loss, "pop_metrics", None)  # DPO's rewards
        if pop_metrics is not None:
            record.update(pop_metrics(lambda totals: D.row_sum(totals, self.ctx)))
        self.history.append(record)
        self._interval.append(record)
        self._bar.update(1)
        tps = step_tokens / max(out.seconds, 1e-9)
        self._bar.set_postfix(loss=f"{out.loss:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
        t = c.train
        last = self.step == self.total_steps
        if self.step % t.log_every == 0 or last:
            self._last_loss = self._log_interval(self._interval)
            self._interval = []
        if last:  # saved before the final evaluation and samples: a failure there loses no training
            self.save()
        if (t.eval_every and self.step % t.eval_every == 0) or last:
            self._eval_loss = self._log_eval()
        if t.save_every and self.step % t.save_every == 0 and not last:
            self.save()
        for callback in self.callbacks:
            callback(self, record)

    def export(self) -> Path | None:
        """`<out_dir>/final/`: the trained model as a `from_pretrained` directory (safetensors) with the run's
        tokenizer beside it, ready for `hybridlm generate --model <out_dir>/final`. Every rank calls it (FSDP
        gathers); rank 0 writes (`RunDirectory.export`).
        With LoRA, final/ holds the merged weights (and, with lora.save_adapter, the adapter alone in final/adapter/);
        with data.chat_template, that template as final/chat_template.jinja (which transformers' tokenizer loading
        prefers to the tokenizer's own)."""
        from hybridlm.parallel.checkpoint import full_model_state_dict

        extras: dict[str, Callable[[Path], None]] = {}
        template = self.config.data.chat_template
        if template is not None:
            text = Path(template).read_text(encoding="utf-8")
            extras[CHAT_TEMPLATE_FILE] = lambda path: path.write_text(text, encoding="utf-8")
        model = self.raw_model
        if self.config.lora.r:
            if self.config.lora.save_adapter:
                adapter = self.out_dir / "adapter.tmp"
                model.save_pretrained(str(adapter))
                extras["adapter"] = lambda path: Path(adapter).replace(path)
            model = model.merge_and_unload()
            state = model.state_dict()
        else:
            state = full_model_state_dict(self.model)
        return self.run_dir.export(model, state, self.data.tokenizer_dir, extras=extras,
                                   tokenizer_setting=run_tokenizer_setting(self.config))

    def _log_interval(self, interval: list[dict]) -> float | None:
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
            "elapsed_s": time.perf_counter() - self._began,
            **{k: _mean([r[k] for r in interval]) for k in self._interval_keys[len(_INTERVAL_KEYS):]},
        }
        self.run_dir.append(METRICS_FILE, record)
        return record["loss"]

    def _log_eval(self) -> float | None:
        value = self.evaluate()
        if value is not None:
            self.run_dir.append(EVAL_FILE, {"step": self.step, "tokens": self.tokens, "eval_loss": value})
            self._print(f"update {self.step}: held-out loss {value:.4f}")
        return value

    def close(self, *, together: bool = True) -> None:
        """Release the run directory and leave the process group. `together=False` when this rank leaves on an error
        or a stop at once, which its peers may not share (`distributed.destroy_distributed`)."""
        self._sharded.abandon()  # (train() completes its saves; one still pending here stays a .tmp directory)
        self.run_dir.release()
        D.destroy_distributed(self.ctx, together=together)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(together=exc_type is None)
