"""The training stack.

Model-independent pieces (exported here):
- `schedules`: lr / wd factors (warmup, WSD, cosine, power, effective power) and batch rampup
- `optim`: AdamW parameter groups by role with ELR / EWD multipliers; muP width transfer of multipliers
- `checkpoint`: atomic, checksummed, pickle-free training checkpoints (`rng`, `tensor_tree` underneath)
- `guard`: skip non-finite (or spiking) updates, stop after a streak
Runs (import them from their modules; they pull in the model classes):
- `config`: the run config's sections, loaded from YAML + `--set` overrides (`typed_yaml`: the generic typing
  underneath), checked by `validate`; `plan`: what the run is at a world size (mesh sizes, length, schedule,
  batch rampup); `loop`: `TrainLoop`, the one training loop (its data source and loss are parts); `trainer`:
  `Trainer`, pretraining through it; `run_dir`: the run's output directory; `distributed`: torchrun, the device
  mesh and `hybridlm.parallel` (FSDP2 / HSDP, tp, cp, mixer parallelism), full checkpoints; `demo`: the built-in
  Python-stdlib byte corpus; `mup_check`: the coordinate check; `commands`: `hybridlm train` and
  `hybridlm mup-check`
"""

from __future__ import annotations

from hybridlm.training.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hybridlm.training.guard import StepGuard, TrainingDivergedError
from hybridlm.training.optim import (
    DEFAULT_ROLE_PATTERNS,
    MATRIX_ROLES,
    MUP_WIDTH_EXPONENTS,
    VECTOR_ROLES,
    MatrixMultipliers,
    apply_schedule,
    build_param_groups,
    classify_parameters,
    matrix_lr_wd,
    regex_classifier,
    scale_multipliers,
)
from hybridlm.training.schedules import (
    BatchRampup,
    ScheduleConfig,
    ScheduleFactors,
    lr_wd_factors,
    plot_schedule,
    schedule_factors,
    simulate_schedule,
)

__all__ = [
    "DEFAULT_ROLE_PATTERNS",
    "MATRIX_ROLES",
    "MUP_WIDTH_EXPONENTS",
    "VECTOR_ROLES",
    "BatchRampup",
    "CheckpointError",
    "LoadedCheckpoint",
    "MatrixMultipliers",
    "ScheduleConfig",
    "ScheduleFactors",
    "StepGuard",
    "TrainingDivergedError",
    "apply_schedule",
    "build_param_groups",
    "classify_parameters",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_wd_factors",
    "matrix_lr_wd",
    "plot_schedule",
    "regex_classifier",
    "save_checkpoint",
    "scale_multipliers",
    "schedule_factors",
    "simulate_schedule",
    "verify_checkpoint",
]
