"""Learning-rate and weight-decay schedules (Falcon-H1 report: WSD, power, effective power) and batch rampup.

Everything here is a pure function of the training progress; nothing holds state, so resuming a run needs
only the step and token counters (saved by `hybridlm.training.checkpoint`).

Factors, not values: a schedule returns `(lr_factor, wd_factor)`, dimensionless multipliers of every
parameter group's *base* lr and weight decay (`hybridlm.training.optim.apply_schedule` applies them).
Weight decay follows torch's AdamW convention, `p <- p - lr * wd * p`, which is the report's
`x <- x - eta A - eta lambda x`: (lr, wd) here are the report's (eta, lambda).

Progress `t` counts in `ScheduleConfig.unit` ("steps" or "tokens") and *includes* the update being made:
the first update runs at t = 1 step (or at the tokens of the first batch), so warmup never spends an
update at lr = 0. Let W = warmup, T = total, Td = decay length (`decay`, or `decay_fraction * T`),
D0 = T - Td the start of the decay, r = min_lr_ratio, and u = (t - D0) / Td in [0, 1] the decay progress.
t > T is clamped to T (the schedule holds its final value).

Stable-stage curves s_lr(t), s_wd(t) (b = power_exponent, default 1/2; t0 = power_t0):

    kind               s_lr(t)                  s_wd(t)                   lr / wd in the stable stage
    "constant"         1                        1                         constant
    "wsd"              1                        1                         constant
    "power"            min(1, t0/t)^b           1                         falls as t^-b
    "effective_power"  min(1, t0/t)^(b/2)       min(1, t0/t)^(b/2)        constant (= 1)
    "cosine"           (no stable stage: cosine from 1 to r over [W, T]; wd factor 1 throughout)

"power" is the power scheduler (eta ~ t^-b with wd fixed, so eta_eff = sqrt(eta lambda) ~ t^-b/2 and
lambda_eff = sqrt(lambda / eta) ~ t^+b/2: parameter norms ~ 1/lambda_eff shrink). "effective_power" (EPS)
gives the same eta_eff ~ t^-b/2 but scales lr and wd together, so lambda_eff, and with it the parameter
norms, stays constant through the stable stage. With the report's b = 1/2: PS lr ~ t^-1/2, EPS lr, wd ~ t^-1/4.

Full schedule (kinds with a stable stage):

    warmup   t <  W:          lr = (t / W) * s_lr(t)          wd = s_wd(t)
    stable   W <= t < D0:     lr = s_lr(t)                    wd = s_wd(t)
    decay    D0 <= t <= T:    lr = s_lr(D0) * g(u)            wd = s_wd(D0)

    g(u): "linear" 1 - (1 - r) u;  "cosine" r + (1 - r)(1 + cos(pi u)) / 2;  "exponential" r^u
    (geometric; r > 0), e.g. r = 1/8 for the report's SFT decay to eta / 8.

    The last update runs at t = T, u = 1: at lr = r x s_lr(D0). With r = 0 (linear or cosine decay, and the
    "cosine" kind) that update has lr 0 and changes nothing but AdamW's moments: one update of the run is
    spent. Kept as written (the report's curves end at r); a small r > 0 makes every update count.

Choices the report leaves open (it prescribes only the stable stage), made here:
- wd is not warmed up: AdamW's per-step decay lr * wd already ramps with lr; ramping wd too would make the
  effective decay quadratic in t. During warmup wd follows the stable curve (= 1 unless t0 < W).
- During the decay wd stays at its stable-stage value at decay start, s_wd(D0): the decay anneals the noise
  (lr) and does not pull the norms anywhere new (for EPS, lr / wd then falls with g(u) like any WSD decay).
- min_lr_ratio is relative to the lr at decay start, s_lr(D0) (the peak lr for "wsd"/"cosine"), so the
  decay never rises and "exponential to lr/8" means lr_end = s_lr(D0) / 8 for the power kinds too.
- Warmup multiplies the stable curve, so lr is continuous at W even when t0 < W.
- A zero-length decay (decay=0) means no decay stage: the stable stage runs to T.

Batch-size rampup (`BatchRampup`): the global batch grows linearly in consumed tokens from `start` to
`target` over `rampup_tokens`, floored to a multiple of `micro_batch`; the lr is scaled by
sqrt(batch / ref_batch) (square-root scaling for Adam; ref_batch defaults to target, so the factor is 1
after the rampup). Weight decay is not batch-scaled (the report scales only the lr).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hybridlm.fileio import save_figure_atomic

KINDS = ("constant", "wsd", "cosine", "power", "effective_power")
DECAY_SHAPES = ("linear", "cosine", "exponential")
UNITS = ("steps", "tokens")
_POWER_KINDS = ("power", "effective_power")
_DECAYING_KINDS = ("wsd", "power", "effective_power")
# why the other kinds take no decay length (their error messages say it)
_NO_DECAY_STAGE = {
    "constant": "the lr stays at its peak after the warmup",
    "cosine": "it decays along a cosine over the whole post-warmup range",
}


def has_decay_stage(kind: str) -> bool:
    """Whether `kind` ends with a separate decay stage, whose length is `decay` or `decay_fraction`."""
    return kind in _DECAYING_KINDS


def unused_settings(kind: str) -> tuple[str, ...]:
    """The `ScheduleConfig` fields `kind` does not read (a value away from the default is refused for it)."""
    unused = [] if kind in _POWER_KINDS else ["power_t0", "power_exponent"]
    if not has_decay_stage(kind):
        unused += ["decay", "decay_fraction"]
    if kind == "constant":
        unused += ["decay_shape", "min_lr_ratio"]
    if kind == "cosine":  # always a cosine
        unused += ["decay_shape"]
    return tuple(unused)


_DEFAULT_POWER_EXPONENT = 0.5  # the report's b = 1/2


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BatchRampup:
    """Global batch size linear in consumed tokens, with square-root lr scaling.

    Batch sizes (`start`, `target`, `micro_batch`, `ref_batch`) share one unit, samples by default;
    `tokens_per_sample` converts a batch to tokens (set it to the sequence length; 1 if batches are
    counted in tokens). `micro_batch` is the granularity of a global batch: micro-batch size times the
    data-parallel world size (times nothing else: gradient accumulation steps = batch / micro_batch).
    """

    start: int
    target: int
    rampup_tokens: int
    micro_batch: int
    ref_batch: int | None = None  # the batch the base lr was tuned at; None -> target
    tokens_per_sample: int = 1

    def __post_init__(self) -> None:
        for name in ("start", "target", "micro_batch", "tokens_per_sample"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"BatchRampup.{name} must be an int >= 1, got {value!r}")
        if not _is_int(self.rampup_tokens) or self.rampup_tokens < 0:
            raise ValueError(f"BatchRampup.rampup_tokens must be an int >= 0, got {self.rampup_tokens!r}")
        if self.ref_batch is not None and (not _is_int(self.ref_batch) or self.ref_batch < 1):
            raise ValueError(f"BatchRampup.ref_batch must be None or an int >= 1, got {self.ref_batch!r}")
        if self.start > self.target:
            raise ValueError(f"BatchRampup.start={self.start} must be <= target={self.target}")
        for name in ("start", "target"):
            if getattr(self, name) % self.micro_batch != 0:
                raise ValueError(
                    f"BatchRampup.{name}={getattr(self, name)} must be a multiple of micro_batch={self.micro_batch}"
                )

    def batch_size(self, tokens: int) -> int:
        """Global batch for the update drawn after `tokens` consumed tokens.

        `start + floor((target - start) * min(tokens, R) / R / micro_batch) * micro_batch` (exact integer
        arithmetic; R = rampup_tokens, R = 0 gives `target` from the start).
        """
        if not _is_int(tokens) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        if self.rampup_tokens == 0:
            return self.target
        done = min(tokens, self.rampup_tokens)
        steps = ((self.target - self.start) * done) // (self.rampup_tokens * self.micro_batch)
        return self.start + steps * self.micro_batch

    def lr_scale(self, tokens: int) -> float:
        """sqrt(batch_size(tokens) / ref_batch): the lr factor of square-root batch scaling."""
        ref = self.target if self.ref_batch is None else self.ref_batch
        return math.sqrt(self.batch_size(tokens) / ref)


@dataclass(frozen=True)
class ScheduleConfig:
    """Shape of the lr / wd schedule; the training length `total` is given when it is evaluated.

    Durations (`warmup`, `decay`, `power_t0`) count in `unit`. For "wsd", "power" and "effective_power"
    give exactly one of `decay` (a length) or `decay_fraction` (of total); "constant" and "cosine" take
    neither. See the module docstring for the exact formulas.

    Settings a kind does not use are refused when they differ from their defaults (a value that would be
    silently ignored): `power_t0` / `power_exponent` outside "power" / "effective_power", `decay_shape` /
    `min_lr_ratio` with "constant", `decay_shape` "exponential" with "cosine" (always a cosine).

    `min_lr_ratio` r: the decay ends at r x its starting lr, and the last update runs at that lr; r = 0 makes
    the last update one at lr 0 (a spent update, see the module docstring).
    """

    kind: str = "wsd"
    unit: str = "steps"
    warmup: float = 0
    decay: float | None = None
    decay_fraction: float | None = None
    decay_shape: str = "linear"
    min_lr_ratio: float = 0.0  # lr at the end of the decay / at its start; 0: the last update runs at lr 0
    power_t0: float | None = None
    power_exponent: float = _DEFAULT_POWER_EXPONENT  # b of eta ~ t^-b ("power"); "effective_power": b/2 on lr and wd
    rampup: BatchRampup | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ScheduleConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.unit not in UNITS:
            raise ValueError(f"ScheduleConfig.unit must be one of {UNITS}, got {self.unit!r}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"ScheduleConfig.decay_shape must be one of {DECAY_SHAPES}, got {self.decay_shape!r}")
        if not _is_number(self.warmup) or self.warmup < 0:
            raise ValueError(f"ScheduleConfig.warmup must be a finite number >= 0, got {self.warmup!r}")
        if not _is_number(self.min_lr_ratio) or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"ScheduleConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.kind in _DECAYING_KINDS:
            if (self.decay is None) == (self.decay_fraction is None):
                raise ValueError(
                    f"ScheduleConfig(kind={self.kind!r}) needs exactly one of decay (a length in {self.unit}) "
                    f"or decay_fraction (of total), got decay={self.decay!r}, decay_fraction={self.decay_fraction!r}"
                )
            if self.decay is not None and (not _is_number(self.decay) or self.decay < 0):
                raise ValueError(f"ScheduleConfig.decay must be a finite number >= 0, got {self.decay!r}")
            if self.decay_fraction is not None and (
                not _is_number(self.decay_fraction) or not 0.0 <= self.decay_fraction <= 1.0
            ):
                raise ValueError(f"ScheduleConfig.decay_fraction must be in [0, 1], got {self.decay_fraction!r}")
            if self.decay_shape == "exponential" and self.min_lr_ratio <= 0.0:
                raise ValueError(
                    "ScheduleConfig(decay_shape='exponential') needs min_lr_ratio > 0 (the decay is geometric "
                    "from 1 to min_lr_ratio), e.g. 0.125 for a decay to lr / 8"
                )
        elif self.decay is not None or self.decay_fraction is not None:
            given = ", ".join(f"{k}={v!r}" for k, v in (("decay", self.decay), ("decay_fraction", self.decay_fraction))
                              if v is not None)
            raise ValueError(
                f"ScheduleConfig(kind={self.kind!r}) has no separate decay stage ({_NO_DECAY_STAGE[self.kind]}), "
                f"but {given} is set; set decay and decay_fraction to None, or choose a kind with a decay stage "
                f"({', '.join(_DECAYING_KINDS)})"
            )
        if self.kind in _POWER_KINDS:
            if self.power_t0 is None or not _is_number(self.power_t0) or self.power_t0 <= 0:
                raise ValueError(
                    f"ScheduleConfig(kind={self.kind!r}) needs power_t0 > 0 (in {self.unit}), got {self.power_t0!r}"
                )
        if not _is_number(self.power_exponent) or self.power_exponent < 0:
            raise ValueError(f"ScheduleConfig.power_exponent must be a finite number >= 0, got {self.power_exponent!r}")
        self._refuse_unused()
        if self.rampup is not None and not isinstance(self.rampup, BatchRampup):
            raise ValueError(f"ScheduleConfig.rampup must be a BatchRampup or None, got {type(self.rampup).__name__}")

    def _refuse_unused(self) -> None:
        """ValueError naming a setting this kind ignores, when it differs from its default."""
        ignored: list[tuple[str, str]] = []  # (setting, why it has no effect)
        if self.kind not in _POWER_KINDS:
            why = "it shapes only the stable stage of the kinds 'power' and 'effective_power'"
            if self.power_t0 is not None:
                ignored.append((f"power_t0={self.power_t0!r}", why))
            if self.power_exponent != _DEFAULT_POWER_EXPONENT:
                ignored.append((f"power_exponent={self.power_exponent!r}", why))
        if self.kind == "constant":
            why = "'constant' has no decay"
            if self.decay_shape != "linear":
                ignored.append((f"decay_shape={self.decay_shape!r}", why))
            if self.min_lr_ratio != 0.0:
                ignored.append((f"min_lr_ratio={self.min_lr_ratio!r}", why))
        if self.kind == "cosine" and self.decay_shape == "exponential":
            ignored.append(("decay_shape='exponential'", "'cosine' always decays along a cosine, to min_lr_ratio"))
        if ignored:
            setting, why = ignored[0]
            raise ValueError(f"ScheduleConfig(kind={self.kind!r}): {setting} has no effect ({why}); leave it at its "
                             "default, or choose a kind that uses it")

    def decay_length(self, total: float) -> float:
        """Td: the length of the final decay stage for a run of `total` (0 for "constant"/"cosine")."""
        if self.decay is not None:
            return float(self.decay)
        if self.decay_fraction is not None:
            return float(self.decay_fraction) * total
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (what a checkpoint records); `from_dict` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ScheduleConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ScheduleConfig field(s): {', '.join(unknown)}")
        values = dict(values)
        if isinstance(values.get("rampup"), dict):
            values["rampup"] = BatchRampup(**values["rampup"])
        return cls(**values)


class ScheduleFactors(NamedTuple):
    """What one update uses: base lr x `lr`, base wd x `wd`, and the global batch (None without rampup)."""

    lr: float
    wd: float
    batch_size: int | None


def _stable_curves(config: ScheduleConfig, t: float) -> tuple[float, float]:
    """(s_lr(t), s_wd(t)) of the stable stage."""
    if config.kind not in _POWER_KINDS:
        return 1.0, 1.0
    ratio = min(1.0, config.power_t0 / t) if t > 0 else 1.0
    if config.kind == "power":
        return ratio**config.power_exponent, 1.0
    s = ratio ** (config.power_exponent / 2.0)
    return s, s


def _decay_shape(shape: str, u: float, floor: float) -> float:
    """g(u) on u in [0, 1]: 1 at u = 0, `floor` at u = 1."""
    if shape == "linear":
        return 1.0 - (1.0 - floor) * u
    if shape == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * u))
    return floor**u  # exponential (geometric), floor > 0 checked by ScheduleConfig


def lr_wd_factors(config: ScheduleConfig, t: float, total: float) -> tuple[float, float]:
    """(lr_factor, wd_factor) at progress `t` (in `config.unit`, counting the current update) of `total`.

    Raises ValueError when the stages do not fit: warmup + decay length must be <= total.
    """
    if not _is_number(total) or total <= 0:
        raise ValueError(f"total must be a finite number > 0, got {total!r}")
    if not _is_number(t) or t < 0:
        raise ValueError(f"t must be a finite number >= 0, got {t!r}")
    warmup = float(config.warmup)
    decay = config.decay_length(total)
    if warmup + decay > total:
        raise ValueError(
            f"warmup ({warmup:g}) + decay ({decay:g}) exceed the total of {total:g} {config.unit}; "
            "shorten them or train longer"
        )
    t = min(float(t), float(total))
    warm = min(1.0, t / warmup) if warmup > 0 else 1.0
    r = float(config.min_lr_ratio)

    if config.kind == "cosine":
        if t <= warmup:
            return warm, 1.0
        u = (t - warmup) / (total - warmup)
        return _decay_shape("cosine", u, r), 1.0

    decay_start = total - decay
    if decay == 0 or t < decay_start:
        s_lr, s_wd = _stable_curves(config, t)
        return warm * s_lr, s_wd
    s_lr, s_wd = _stable_curves(config, decay_start)
    u = (t - decay_start) / decay  # t >= decay_start >= warmup: the warmup is over
    return s_lr * _decay_shape(config.decay_shape, u, r), s_wd


def schedule_factors(
    config: ScheduleConfig, *, total: float, step: int, tokens: int = 0, batch_tokens: int | None = None
) -> ScheduleFactors:
    """Factors for the update with 0-based index `step`, drawn after `tokens` consumed tokens.

    The global batch is `config.rampup.batch_size(tokens)` (None without rampup) and the lr factor is
    multiplied by `config.rampup.lr_scale(tokens)`. Progress t is `step + 1` for unit "steps"; for unit
    "tokens" it is `tokens` plus this update's batch in tokens (from the rampup, or `batch_tokens`, which
    is then required).
    """
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    batch = config.rampup.batch_size(tokens) if config.rampup is not None else None
    if config.unit == "steps":
        t: float = step + 1
    else:
        if batch is not None:
            this_batch = batch * config.rampup.tokens_per_sample
        elif batch_tokens is not None:
            this_batch = batch_tokens
        else:
            raise ValueError("a schedule in tokens without rampup needs batch_tokens (tokens per update)")
        t = tokens + this_batch
    lr, wd = lr_wd_factors(config, t, total)
    if config.rampup is not None:
        lr *= config.rampup.lr_scale(tokens)
    return ScheduleFactors(lr, wd, batch)


def simulate_schedule(
    config: ScheduleConfig, total_steps: int, *, batch_tokens: int | None = None
) -> list[tuple[int, int, ScheduleFactors]]:
    """Every update of a run of `total_steps`: `(step, tokens consumed before it, factors)`.

    Tokens advance by the rampup batch (or by `batch_tokens` per update); for unit "tokens" the schedule's
    total is the tokens consumed after `total_steps` updates.
    """
    if not _is_int(total_steps) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if config.rampup is None and batch_tokens is None and config.unit == "tokens":
        raise ValueError("a schedule in tokens without rampup needs batch_tokens (tokens per update)")
    per_update = batch_tokens or 0
    starts: list[int] = []
    tokens = 0
    for _ in range(total_steps):
        starts.append(tokens)
        if config.rampup is not None:
            tokens += config.rampup.batch_size(tokens) * config.rampup.tokens_per_sample
        else:
            tokens += per_update
    total = total_steps if config.unit == "steps" else tokens
    return [
        (step, start, schedule_factors(config, total=total, step=step, tokens=start, batch_tokens=batch_tokens))
        for step, start in enumerate(starts)
    ]


def plot_schedule(
    config: ScheduleConfig, total_steps: int, path: str | Path, *, batch_tokens: int | None = None
) -> Path:
    """Write a PNG of the lr factor, wd factor and lr/wd (and the batch size with rampup) against steps.

    Needs matplotlib (a dependency of hybridlm, imported here only); raises ImportError saying how to
    install it when it is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "plot_schedule needs matplotlib; run `pip install matplotlib`"
        ) from err
    rows = simulate_schedule(config, total_steps, batch_tokens=batch_tokens)
    steps = [step + 1 for step, _, _ in rows]
    lr = [f.lr for _, _, f in rows]
    wd = [f.wd for _, _, f in rows]
    ratio = [a / b if b > 0 else float("nan") for a, b in zip(lr, wd)]
    panels = 3 if config.rampup is not None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7, 2.4 * panels), sharex=True)
    axes[0].plot(steps, lr, label="lr factor")
    axes[0].plot(steps, wd, label="wd factor")
    axes[0].set_ylabel("factor")
    axes[0].legend()
    axes[0].set_title(f"{config.kind} schedule ({config.unit}), decay {config.decay_shape}")
    axes[1].plot(steps, ratio, color="tab:green")
    axes[1].set_ylabel("lr / wd factor")
    if config.rampup is not None:
        axes[2].plot(steps, [f.batch_size for _, _, f in rows], color="tab:red")
        axes[2].set_ylabel("global batch")
    axes[-1].set_xlabel("update")
    fig.tight_layout()
    path = Path(path)
    try:
        save_figure_atomic(fig, path, dpi=100)  # a crash mid-write keeps the previous plot
    finally:
        plt.close(fig)
    return path
