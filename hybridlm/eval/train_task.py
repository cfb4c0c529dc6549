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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from hybridlm.training.optim import apply_schedule, build_param_groups
from hybridlm.training.schedules import ScheduleConfig, schedule_factors

Batch = dict[str, torch.Tensor]


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


def autocast_for(device: torch.device | str):
    """bf16 autocast on CUDA, nothing on CPU (float32 there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
) -> TrainResult:
    """Train `model` in place for `steps` updates; see the module docstring. `warmup` defaults to 10%."""
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
    result = TrainResult(steps=steps, seconds=0.0)
    best_state = None
    best_key = None
    running, counted = 0.0, 0
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        nonlocal best_state, best_key
        model.eval()
        score, loss = eval_fn(model)
        model.train()
        result.evals.append({"step": step, "score": score, "loss": loss})
        key = (score, -loss if math.isfinite(loss) else -math.inf, step)
        if best_key is None or key > best_key:
            best_key = key
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            result.best_step, result.best_score, result.best_loss = step, score, loss
        if log_fn is not None:
            log_fn(f"step {step}: eval score {score:.4f} loss {loss:.4f}")

    for step in range(steps):
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

    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    result.seconds = time.perf_counter() - start
    return result


def _compiled(model: nn.Module, device: torch.device) -> Callable:
    """The training forward under torch.compile (see the module docstring for the choice of backend)."""
    if device.type == "cuda":
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend="aot_eager")
