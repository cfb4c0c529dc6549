"""`train_on_task`: the training run of the papers' experiments (addition, recall, the allocation sweep), on
`hybridlm.training`'s loop and checkpoint format.

    result = train_on_task(model, batch_fn, steps=3000, lr=1e-3, device="cuda", eval_fn=val_accuracy,
                           eval_every=250, checkpoint="runs/fw-3A_seed0.ckpt")
    result.best_step, result.best_score       # the model is left holding the best weights

The update is `hybridlm.training.loop.TrainLoop`'s with the parts of a small model on a synthetic task: `batch_fn(step)`
as the data source (`BatchFunction`: a dict with `input_ids` and `labels` [B, T], labels aligned with the inputs,
-100 where nothing is scored, the model shifts them; optionally `position_ids`; made on the CPU, moved to the device
there), the model's own mean loss (`ModelLoss`) under bf16 autocast on CUDA, one micro-batch per update, AdamW over
`hybridlm.training.optim.build_param_groups` (matrices decayed; norms, biases, convs and SSM scalars not), linear
warmup then cosine down to `min_lr_ratio` (`hybridlm.training.schedules`), gradient clipping to `grad_clip`.

With `eval_fn(model) -> (score, loss)` every `eval_every` updates (and after the last), the weights of the best
evaluation are restored at the end: highest score, ties to the lower loss, then the later step. The mean training
loss since the last line is recorded every `log_every` updates (a non-finite one raises FloatingPointError).

`compile=True` runs the training forward through `torch.compile`: inductor with CUDA graphs ("reduce-overhead") on a
GPU, where these few-million-parameter models are bound by kernel launches and elementwise traffic; "aot_eager" on
the CPU (traces the same graph, compiles in seconds; for tests). Evaluation runs the plain module (its shapes vary;
the compiled one would recompile).

Checkpoints (`checkpoint=DIR`) are `hybridlm.training.checkpoint`'s step directories, `DIR/step_XXXXXXXX/`, saved
every `checkpoint_every` updates, when `should_stop()` turns true after an update, and after the last update. A save
is atomic and removes the previous checkpoint once it is complete (`keep_last=1`), so a kill at any moment leaves the
previous checkpoint or the new one. Besides the optimizer and the global random generators, a step directory holds

    model.safetensors    the model under "model." and, once there is one, the best evaluation's weights under "best."
    train_state.json     the run's settings and the caller's `fingerprint` (the bench runners pass task, model, seed
                         and recipe), the TrainResult so far, the running loss sum since the last loss line, the
                         state `batch_state` gives, the seconds trained, the training device's CUDA generator state

If DIR holds a checkpoint when `train_on_task` starts, its newest is verified (checksums; settings and fingerprint
equal to this call's; parameter names and shapes) and training continues from its step, ending bit for bit where an
uninterrupted run would (same batches, AdamW state, evaluations and best step; tested on the CPU in float32). A
corrupt or mismatched checkpoint raises `CheckpointError` naming the file and saying what to do; it is never
overwritten. A finished run leaves its final checkpoint (a second call returns the result without training); whoever
records the result removes it with `remove_checkpoint(DIR)` (the bench runner does, right after writing
runs/<key>.json). When `should_stop()` is true after an update, the run saves and raises `TrainingInterrupted` (the
bench runner sets it on SIGTERM / SIGINT and at `--time-budget`).

`batch_fn` must be a function of the step and of state that `batch_state=(get, set)` captures: the random generator
it draws from (`generator_state(rng)`), or a data loader's `state_dict` / `load_state_dict`.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridlm.eval.scoring import autocast_for
from hybridlm.fileio import diff_nested
from hybridlm.training.checkpoint import (
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointMismatchError,
    checkpoint_dir_name,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hybridlm.training.loop import BatchFunction, ModelLoss, TrainLoop, UpdateOutput, local_grad_clip, schedule_plan
from hybridlm.training.optim import build_param_groups
from hybridlm.training.schedules import ScheduleConfig

Batch = dict[str, torch.Tensor]
StateAccess = tuple[Callable[[], Any], Callable[[Any], None]]  # (get, set) of a JSON-able state

DEFAULT_CHECKPOINT_EVERY = 1000
STATE_KIND = "hybridlm-train-on-task"  # train_state.json's "kind": a checkpoint that `train_on_task` saved


@dataclass(frozen=True)
class TrainRecipe:
    """The optimizer part every benchmark recipe shares (subclasses change defaults and add their fields)."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    compile: bool = False

    def train_options(self) -> dict:
        """Keyword arguments of `train_on_task`."""
        return {"steps": self.steps, "lr": self.lr, "weight_decay": self.weight_decay, "warmup": self.warmup,
                "min_lr_ratio": self.min_lr_ratio, "grad_clip": self.grad_clip, "compile": self.compile}

    def to_dict(self) -> dict:
        return asdict(self)


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def check_train_recipe(recipe: TrainRecipe, *counts: str) -> None:
    """ValueError, named as the command-line option, for an optimizer setting that cannot train (checked before any
    run starts: inside a run it would surface only as "run failed", the cause in that run's log) or a count field
    below 1. `warmup` must end before the last step, or the cosine decay never happens."""
    for name in ("steps", *counts):
        if getattr(recipe, name) < 1:
            raise ValueError(f"{_option(name)} must be >= 1, got {getattr(recipe, name)}")
    if not (math.isfinite(recipe.lr) and recipe.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {recipe.lr}")
    if not (math.isfinite(recipe.weight_decay) and recipe.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {recipe.weight_decay}")
    if not 0 <= recipe.warmup < recipe.steps:
        raise ValueError(f"--warmup must be >= 0 and below --steps ({recipe.steps}), got {recipe.warmup}")
    if not 0 <= recipe.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {recipe.min_lr_ratio}")
    if not (math.isfinite(recipe.grad_clip) and recipe.grad_clip >= 0):
        raise ValueError(f"--grad-clip must be a finite number >= 0 (0: no clipping), got {recipe.grad_clip}")


def check_non_negative(recipe: TrainRecipe, *names: str) -> None:
    """ValueError, named as the command-line option, for a field below 0 (step counts where 0 turns a feature off)."""
    for name in names:
        if getattr(recipe, name) < 0:
            raise ValueError(f"{_option(name)} must be >= 0, got {getattr(recipe, name)}")


def check_counts_and_size(recipe: TrainRecipe, *counts: str) -> None:
    """`check_train_recipe`, then a ValueError for an unknown `recipe.size`."""
    from hybridlm.experiments.models import SIZES

    check_train_recipe(recipe, *counts)
    if recipe.size not in SIZES:
        raise ValueError(f"unknown size {recipe.size!r}; choose one of {', '.join(SIZES)}")


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean train loss since last log)
    evals: list[dict] = field(default_factory=list)  # {"step", "score", "loss"}
    best_step: int | None = None
    best_score: float | None = None
    best_loss: float | None = None

    def to_dict(self) -> dict:
        return {"steps": self.steps, "seconds": self.seconds, "losses": self.losses, "evals": self.evals,
                "best_step": self.best_step, "best_score": self.best_score, "best_loss": self.best_loss}


class TrainingInterrupted(Exception):
    """`should_stop()` turned true: training stopped after `step` of `steps` updates, its state saved to the step
    directory `checkpoint` (None when no checkpoint was asked for). Call again to continue."""

    def __init__(self, step: int, steps: int, checkpoint: Path | None):
        where = f"state saved to {checkpoint}" if checkpoint is not None else "nothing saved (no checkpoint)"
        super().__init__(f"stopped after {step}/{steps} updates; {where}")
        self.step, self.steps, self.checkpoint = step, steps, checkpoint


def generator_state(rng) -> StateAccess:
    """`batch_state` for a batch function drawing from the numpy Generator `rng`: (get, set) of its
    bit generator's state (a JSON-able dict)."""

    def get() -> dict:
        return rng.bit_generator.state

    def set_(state: dict) -> None:
        rng.bit_generator.state = state

    return get, set_


def train_on_task(
    model: nn.Module,
    batch_fn: Callable[[int], Batch],
    *,
    steps: int,
    lr: float,
    device: torch.device | str = "cpu",
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    warmup: int | None = None,
    min_lr_ratio: float = 0.1,
    grad_clip: float = 1.0,
    eval_fn: Callable[[nn.Module], tuple[float, float]] | None = None,
    eval_every: int = 0,
    log_every: int = 50,
    log_fn: Callable[[str], None] | None = None,
    compile: bool = False,  # noqa: A002 - the recipe field's name
    checkpoint: str | Path | None = None,
    checkpoint_every: int | None = None,
    batch_state: StateAccess | None = None,
    fingerprint: Any = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train `model` in place for `steps` updates; see the module docstring. `warmup` defaults to 10%.

    `checkpoint`: a directory to save step directories to and resume from; `checkpoint_every` updates between saves
    (default 1000; 0: only when stopping and at the end); `batch_state`: (get, set) of the state `batch_fn` draws
    from; `fingerprint`: a JSON-able description of the run, compared on resuming; `should_stop()`: checked after
    every update but the last, true -> save and raise `TrainingInterrupted`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    checkpoint_every = DEFAULT_CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    device = torch.device(device)
    model.to(device).train()
    forward = _compiled(model, device) if compile else None
    groups = build_param_groups(model.named_parameters(), lr=lr, weight_decay=weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=device.type == "cuda")
    warmup = max(1, steps // 10) if warmup is None else warmup
    schedule = ScheduleConfig(kind="cosine", warmup=min(warmup, steps), min_lr_ratio=min_lr_ratio)
    settings = _jsonable({"steps": steps, "lr": lr, "weight_decay": weight_decay, "betas": betas, "warmup": warmup,
                          "min_lr_ratio": min_lr_ratio, "grad_clip": grad_clip, "eval": eval_fn is not None,
                          "eval_every": eval_every, "log_every": log_every, "compile": compile,
                          "batch_state": batch_state is not None}, "the train settings")
    run = _Run(model, optimizer, BatchFunction(batch_fn, device, state=batch_state), TrainResult(steps, 0.0),
               settings, _jsonable(fingerprint, "fingerprint"), device, eval_fn, log_fn,
               Path(checkpoint) if checkpoint is not None else None)
    first_step = run.resume()
    run.start = time.perf_counter()
    loop = TrainLoop(model, optimizer, data=run.data, loss=ModelLoss(forward, lambda _: autocast_for(device)),
                     plan=schedule_plan(schedule, steps), clip=local_grad_clip(grad_clip), step=first_step)

    def after_update(loop: TrainLoop, out: UpdateOutput) -> None:
        step = loop.step
        run.running = run.running + out.losses[0]  # summed on the device: no sync per update
        run.counted += 1
        if step % log_every == 0 or step == steps:
            run.log_loss(step)
        if eval_fn is not None and ((eval_every and step % eval_every == 0) or step == steps):
            run.evaluate(step)
        if step < steps:
            if run.directory is not None and checkpoint_every and step % checkpoint_every == 0:
                run.save(step)
            if should_stop is not None and should_stop():
                if run.directory is not None and run.last_saved != step:
                    run.save(step)
                raise TrainingInterrupted(step, steps, run.saved_path(step))

    loop.run(steps, hooks=[after_update])
    if run.directory is not None and run.last_saved != steps:
        run.save(steps)  # kept until the caller has recorded the result (remove_checkpoint)
    if run.best is not None:
        model.load_state_dict(run.best.state_dict())
    model.eval()
    run.result.seconds = run.seconds()
    return run.result


@dataclass
class _Run:
    """What `train_on_task` carries from update to update besides the model and AdamW (the result so far, the best
    weights, the running loss sum), and its checkpoints of all of it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: BatchFunction
    result: TrainResult
    settings: dict
    fingerprint: Any
    device: torch.device
    eval_fn: Callable[[nn.Module], tuple[float, float]] | None
    log_fn: Callable[[str], None] | None
    directory: Path | None
    best: nn.Module | None = None  # a copy of the model holding the best evaluation's weights
    best_key: tuple | None = None
    running: float | torch.Tensor = 0.0  # the training losses summed since the last loss line (on the device)
    counted: int = 0
    seconds_before: float = 0.0  # trained before this call (a resumed run)
    last_saved: int | None = None
    start: float = 0.0  # time.perf_counter() when this call's training began

    def log(self, line: str) -> None:
        if self.log_fn is not None:
            self.log_fn(line)

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.start

    def log_loss(self, step: int) -> None:
        mean = float(self.running) / self.counted
        if not math.isfinite(mean):
            raise FloatingPointError(f"non-finite training loss by step {step}: {mean}")
        self.result.losses.append((step, mean))
        self.running, self.counted = 0.0, 0
        self.log(f"step {step}/{self.result.steps}: loss {mean:.4f}")

    def evaluate(self, step: int) -> None:
        self.model.eval()
        score, loss = self.eval_fn(self.model)
        self.model.train()
        self.result.evals.append({"step": step, "score": score, "loss": loss})
        key = _best_key(score, loss, step)
        if self.best_key is None or key > self.best_key:
            self.best_key = key
            if self.best is None:
                self.best = _detached_copy(self.model)
            else:
                self.best.load_state_dict(self.model.state_dict())
            self.result.best_step, self.result.best_score, self.result.best_loss = step, score, loss
        self.log(f"step {step}: eval score {score:.4f} loss {loss:.4f}")

    def saved_path(self, step: int) -> Path | None:
        """The step directory of this run's checkpoint at `step` (None without a checkpoint directory)."""
        return self.directory / checkpoint_dir_name(step) if self.directory is not None else None

    def save(self, step: int) -> None:
        running = None
        if self.counted:
            running = {"sum": float(self.running).hex(), "dtype": str(self.running.dtype).removeprefix("torch."),
                       "count": self.counted}
        state = {
            "kind": STATE_KIND, "settings": self.settings, "fingerprint": self.fingerprint,
            "result": _finite_json({**self.result.to_dict(), "seconds": None}), "running": running,
            "data": self.data.state_dict(), "seconds": self.seconds(), "device": str(self.device),
            "device_rng": torch.cuda.get_rng_state(self.device).tolist() if self.device.type == "cuda" else None,
            "best": self.best is not None,
        }
        path = save_checkpoint(self.directory, step, model=_weights(self.model, self.best), optimizer=self.optimizer,
                               train_state=state, keep_last=1)
        self.last_saved = step
        self.log(f"step {step}: checkpoint saved to {path}")

    def resume(self) -> int:
        """Load the newest checkpoint in `directory`, verified against this run: the step to continue from (0 when
        there is none)."""
        found = list_checkpoints(self.directory) if self.directory is not None else []
        if not found:
            return 0
        path = found[-1]
        state = _train_state(path)
        if state is None:
            verify_checkpoint(path)  # a corrupt file: its own error
            raise CheckpointError(f"{path / TRAIN_STATE_FILE} is not a train_on_task checkpoint's state; "
                                  + fix_hint(self.directory))
        mismatches = _mismatches(state.get("settings"), self.settings) + _mismatches(
            state.get("fingerprint"), self.fingerprint, "fingerprint")
        if mismatches:
            raise CheckpointError(f"{path} was saved by a different run ({'; '.join(mismatches[:8])}): resume with the "
                                  "settings it was saved with, or " + fix_hint(self.directory))
        if state.get("best"):
            self.best = _detached_copy(self.model)
        try:
            loaded = load_checkpoint(path, model=_weights(self.model, self.best), optimizer=self.optimizer)
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(f"{err}; the checkpoint was saved for another model: "
                                          + fix_hint(self.directory)) from err
        try:
            self._restore(loaded.train_state)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
            raise CheckpointError(f"{path / TRAIN_STATE_FILE}: its saved training state cannot be restored "
                                  f"({type(err).__name__}: {err}); {fix_hint(self.directory)}") from err
        self.last_saved = loaded.step
        self.log(f"resumed from {path} at step {loaded.step}/{self.result.steps}")
        return loaded.step

    def _restore(self, state: dict) -> None:
        saved = state["result"]
        self.result.losses = [(int(s), float(v)) for s, v in saved["losses"]]
        self.result.evals = [{**e, "score": float(e["score"]), "loss": float(e["loss"])} for e in saved["evals"]]
        best = saved["best_step"]
        if best is not None:
            self.result.best_step, self.result.best_score, self.result.best_loss = (
                int(best), float(saved["best_score"]), float(saved["best_loss"]))
            self.best_key = _best_key(self.result.best_score, self.result.best_loss, self.result.best_step)
        running = state["running"]
        if running is not None:
            self.running = torch.tensor(float.fromhex(running["sum"]), dtype=getattr(torch, running["dtype"]),
                                        device=self.device)
            self.counted = int(running["count"])
        self.data.load_state_dict(state["data"])
        if self.device.type == "cuda" and state["device_rng"] is not None:
            torch.cuda.set_rng_state(torch.tensor(state["device_rng"], dtype=torch.uint8), self.device)
        self.seconds_before = float(state["seconds"])


def fix_hint(directory: Path) -> str:
    return f"delete {directory} (the run's checkpoint) to start this run over"


def remove_checkpoint(checkpoint: str | Path) -> bool:
    """Delete the checkpoint directory of a run (its step directories and the temporaries of interrupted saves).
    Returns whether there was one."""
    directory = Path(checkpoint)
    if not directory.is_dir():
        return False
    shutil.rmtree(directory)
    return True


def saved_fingerprint(checkpoint: str | Path) -> Any:
    """The fingerprint the newest checkpoint in `checkpoint` records (None when it has no readable one)."""
    found = list_checkpoints(checkpoint)
    state = _train_state(found[-1]) if found else None
    return state.get("fingerprint") if state is not None else None


def _train_state(path: Path) -> dict | None:
    """The `train_on_task` state in a step directory's train_state.json, unverified (None when unreadable)."""
    try:
        state = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))["train_state"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if isinstance(state, dict) and state.get("kind") == STATE_KIND else None


def _weights(model: nn.Module, best: nn.Module | None) -> nn.Module:
    """What a checkpoint's model.safetensors holds: the model under "model.", the best weights under "best."."""
    return nn.ModuleDict({"model": model} if best is None else {"model": model, "best": best})


def _detached_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` to hold weights: no gradients, nothing trains it."""
    copied = copy.deepcopy(model)
    for param in copied.parameters():
        param.grad = None
        param.requires_grad_(False)
    return copied


def _mismatches(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """"key: saved X, now Y" for every differing leaf of two nested dicts ("(absent)" for a missing key)."""
    return [f"{'.'.join(filter(None, (prefix, d.key))) or 'value'}: saved {d.old!r}, now {d.new!r}"
            for d in diff_nested(saved, now, missing="(absent)", sort_keys=False)]


def _jsonable(value: Any, what: str) -> Any:
    """`value` as it comes back from JSON (tuples -> lists); TypeError when it is not JSON-able."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what} must be JSON-serializable: {err}") from err


def _finite_json(value: Any) -> Any:
    """`value` with every non-finite float written as its name ("nan", "inf", "-inf"; float() reads them back):
    checkpoint JSON holds finite numbers only, and an evaluation may score NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def _best_key(score: float, loss: float, step: int) -> tuple:
    """Highest score, then the lower loss, then the later step."""
    return (score, -loss if math.isfinite(loss) else -math.inf, step)


def _compiled(model: nn.Module, device: torch.device) -> Callable:
    """The training forward under torch.compile (see the module docstring for the choice of backend). Dynamo's caches
    are reset first: a worker process trains run after run (33 allocations of different widths in one sweep), and
    past torch's recompile limit (8 per function) a new model's forward would silently run uncompiled."""
    torch._dynamo.reset()
    if device.type == "cuda":
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend="aot_eager")
