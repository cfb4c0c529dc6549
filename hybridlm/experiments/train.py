"""`train_on_task`: a small training loop for synthetic tasks (addition, recall, the allocation sweep).

    result = train_on_task(model, batch_fn, steps=3000, lr=1e-3, device="cuda",
                           eval_fn=val_accuracy, eval_every=250)
    result.best_step, result.best_score       # the model is left holding the best weights

Built from the library's training pieces, not the corpus Trainer: AdamW over
`hybridlm.training.optim.build_param_groups` (matrices decayed, norms / biases / convs / SSM scalars
not), the lr factor from `hybridlm.training.schedules` (linear warmup, cosine down to
`min_lr_ratio`), gradient clipping, bf16 autocast on CUDA. `batch_fn(step)` returns a dict with
`input_ids` and `labels` [B, T] (labels aligned with the inputs, -100 where nothing is scored; the
model shifts them) and optionally `position_ids`; it runs on the CPU and the batch is moved here.

With `eval_fn(model) -> (score, loss)` every `eval_every` steps (and after the last), the weights of the
best evaluation are restored at the end: highest score, ties to the lower loss, then the later step.
Selecting on an in-distribution validation set is what Table 3's "best step" column reports.

`compile=True` runs the training forward through `torch.compile`: inductor with CUDA graphs
("reduce-overhead") on a GPU, where these few-million-parameter models are bound by kernel launches and
elementwise traffic; "aot_eager" on the CPU (traces the same graph, compiles in seconds; for tests).
Evaluation runs the plain module (its shapes vary per width; the compiled one would recompile).

Checkpoints and resuming (`checkpoint=STEM`). Every `checkpoint_every` updates (default 1000: one save of a
6M-parameter model took 0.4 s on an H200, ~30% of 250 compiled Transformer updates at batch 256), when
`should_stop()` turns true, and after the last update, the loop saves
everything that continuing needs, so that an interrupted run that is started again with the same
arguments ends bit for bit where an uninterrupted one would (tested on the CPU in float32):

    STEM.stepNNNNNNNN.safetensors  tensors: the model ("/model/<name>"), AdamW's state ("/optimizer/state/
                                   <i>/exp_avg", ...), the best evaluation's weights so far ("/best/<name>"),
                                   torch's CPU and (on CUDA) device RNG states ("/torch_rng/..."), the
                                   running loss sum since the last log line ("/running_loss")
    STEM.json                      the step reached, `steps`, `lr`, the caller's `fingerprint` (the bench
                                   runners pass task, model, seed and recipe), the TrainResult so far
                                   (losses, evals, best step / score / loss), `batch_state`'s state, the
                                   seconds trained, the tensor file's name, size and sha256, and the layout
                                   of the non-tensor parts (`hybridlm.training.tensor_tree`)

The tensor file is written first (a temporary name, fsync, os.replace: `hybridlm.fileio.write_atomic`),
then the JSON the same way: the JSON marks the checkpoint complete and names its tensor file, and older
tensor files are removed only after it, so a kill at any moment leaves the previous checkpoint or the
new one, never a mix. Nothing is pickled. If STEM.json exists when `train_on_task` starts, it is checked
(format, tensor file size and sha256, `steps`, `lr`, `fingerprint`, parameter names and shapes) and the
loop continues from its step; a corrupt or mismatched checkpoint raises `CheckpointError` naming the file
and saying what to do (delete STEM.* to start the run over). It is never overwritten silently.

`batch_fn` must be a function of the step and of state that `batch_state=(get, set)` captures: the
random generator it draws from (`generator_state(rng)`), or a data loader's `state_dict` /
`load_state_dict`. A finished run leaves its final checkpoint (step == `steps`, a second call returns the
result without training); whoever records the result removes it with `task_checkpoint.remove_checkpoint(STEM)` (the
bench runner does, right after writing runs/<key>.json). When `should_stop()` is true after an update,
the loop saves and raises `TrainingInterrupted` (the bench runner sets it on SIGTERM / SIGINT and at the
`--time-budget`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridlm.eval.scoring import autocast_for
from hybridlm.experiments import task_checkpoint as C
from hybridlm.training.checkpoint import CheckpointError
from hybridlm.training.optim import apply_schedule, build_param_groups
from hybridlm.training.schedules import ScheduleConfig, schedule_factors

Batch = dict[str, torch.Tensor]
StateAccess = tuple[Callable[[], Any], Callable[[Any], None]]  # (get, set) of a JSON-able state

DEFAULT_CHECKPOINT_EVERY = 1000


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
    """`should_stop()` turned true: training stopped after `step` of `steps` updates, its state saved to the
    checkpoint at `checkpoint` (a STEM; None when no checkpoint was asked for). Call again to continue."""

    def __init__(self, step: int, steps: int, checkpoint: Path | None):
        where = f"state saved to {C.json_of(checkpoint)}" if checkpoint is not None else "nothing saved (no checkpoint)"
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

    `checkpoint`: a path STEM (files STEM.json, STEM.stepNNNNNNNN.safetensors) to save to and resume from;
    `checkpoint_every` updates between saves (default 1000; 0: only when stopping and at
    the end); `batch_state`: (get, set) of the state `batch_fn` draws from; `fingerprint`: a JSON-able
    description of the run, compared on resuming; `should_stop()`: checked after every update, true ->
    save and raise `TrainingInterrupted`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = torch.device(device)
    model.to(device).train()
    forward = _compiled(model, device) if compile else model
    groups = build_param_groups(model.named_parameters(), lr=lr, weight_decay=weight_decay)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
    warmup = max(1, steps // 10) if warmup is None else warmup
    schedule = ScheduleConfig(kind="cosine", warmup=min(warmup, steps), min_lr_ratio=min_lr_ratio)
    if checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    result = TrainResult(steps=steps, seconds=0.0)
    best_state = None
    best_key = None
    running, counted = 0.0, 0
    first_step, seconds_before = 0, 0.0
    stem = C.stem_of(checkpoint) if checkpoint is not None else None
    settings = C.jsonable({"steps": steps, "lr": lr, "weight_decay": weight_decay, "betas": betas, "warmup": warmup,
                          "min_lr_ratio": min_lr_ratio, "grad_clip": grad_clip, "eval": eval_fn is not None,
                          "eval_every": eval_every, "log_every": log_every, "compile": compile,
                          "batch_state": batch_state is not None}, "the train settings")
    fingerprint = C.jsonable(fingerprint, "fingerprint")
    last_saved = None
    if stem is not None:
        loaded = C.load(stem, settings=settings, fingerprint=fingerprint, model=model)
        if loaded is not None:
            record, tree = loaded
            model.load_state_dict(tree["model"])
            try:
                optimizer.load_state_dict(tree["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise CheckpointError(f"{C.json_of(stem)}: the saved AdamW state does not fit this model's optimizer "
                                      f"({err}); {C.fix_hint(stem)}") from err
            try:
                C.set_torch_rng(tree.get("torch_rng", {}), device)
                if batch_state is not None:
                    batch_state[1](record["batch_state"])
                saved = record["result"]
                result.losses = [(int(s), float(v)) for s, v in saved["losses"]]
                result.evals = list(saved["evals"])
                result.best_step, result.best_score, result.best_loss = (saved["best_step"], saved["best_score"],
                                                                        saved["best_loss"])
                if "best" in tree:
                    best_state = {k: v.to(device) for k, v in tree["best"].items()}
                    best_key = _best_key(result.best_score, result.best_loss, result.best_step)
                counted = int(record["running_count"])
                running = tree["running_loss"].to(device) if counted else 0.0
                first_step = last_saved = int(record["step"])
                seconds_before = float(record["seconds"])
            except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
                raise CheckpointError(f"{C.json_of(stem)}: its saved training state cannot be restored "
                                      f"({type(err).__name__}: {err}); {C.fix_hint(stem)}") from err
            if log_fn is not None:
                log_fn(f"resumed from {C.json_of(stem)} at step {first_step}/{steps}")
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        nonlocal best_state, best_key
        model.eval()
        score, loss = eval_fn(model)
        model.train()
        result.evals.append({"step": step, "score": score, "loss": loss})
        key = _best_key(score, loss, step)
        if best_key is None or key > best_key:
            best_key = key
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            result.best_step, result.best_score, result.best_loss = step, score, loss
        if log_fn is not None:
            log_fn(f"step {step}: eval score {score:.4f} loss {loss:.4f}")

    def save(step: int) -> None:
        nonlocal last_saved
        tree = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "torch_rng": C.torch_rng(device)}
        if best_state is not None:
            tree["best"] = best_state
        if counted:
            tree["running_loss"] = running
        record = {"step": step, "settings": settings, "fingerprint": fingerprint,
                  "result": {**result.to_dict(), "seconds": None}, "running_count": counted,
                  "batch_state": C.jsonable(batch_state[0](), "batch_state") if batch_state is not None else None,
                  "seconds": seconds_before + time.perf_counter() - start, "device": str(device)}
        C.save(stem, tree, record)
        last_saved = step
        if log_fn is not None:
            log_fn(f"step {step}: checkpoint saved to {C.json_of(stem)}")

    for step in range(first_step, steps):
        factors = schedule_factors(schedule, total=steps, step=step)
        apply_schedule(optimizer, factors.lr, factors.wd)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch_fn(step).items()}
        with autocast_for(device):
            loss = forward(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        running = running + loss.detach()  # summed on the device: no sync per step
        counted += 1
        if (step + 1) % log_every == 0 or step + 1 == steps:
            mean = float(running) / counted
            if not math.isfinite(mean):
                raise FloatingPointError(f"non-finite training loss by step {step + 1}: {mean}")
            result.losses.append((step + 1, mean))
            running, counted = 0.0, 0
            if log_fn is not None:
                log_fn(f"step {step + 1}/{steps}: loss {result.losses[-1][1]:.4f}")
        if eval_fn is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == steps):
            evaluate(step + 1)
        if step + 1 < steps:
            if stem is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
                save(step + 1)
            if should_stop is not None and should_stop():
                if stem is not None and last_saved != step + 1:
                    save(step + 1)
                raise TrainingInterrupted(step + 1, steps, stem)

    if stem is not None and last_saved != steps:
        save(steps)  # kept until the caller has recorded the result (remove_checkpoint)
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    result.seconds = seconds_before + time.perf_counter() - start
    return result


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
