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

from hybridlm.lazy import lazy_exports

_EXPORTS = {
    "CheckpointError": "hybridlm.training.checkpoint",
    "LoadedCheckpoint": "hybridlm.training.checkpoint",
    "latest_checkpoint": "hybridlm.training.checkpoint",
    "list_checkpoints": "hybridlm.training.checkpoint",
    "load_checkpoint": "hybridlm.training.checkpoint",
    "save_checkpoint": "hybridlm.training.checkpoint",
    "verify_checkpoint": "hybridlm.training.checkpoint",
    "StepGuard": "hybridlm.training.guard",
    "TrainingDivergedError": "hybridlm.training.guard",
    "DEFAULT_ROLE_PATTERNS": "hybridlm.training.optim",
    "MATRIX_ROLES": "hybridlm.training.optim",
    "MUP_WIDTH_EXPONENTS": "hybridlm.training.optim",
    "VECTOR_ROLES": "hybridlm.training.optim",
    "MatrixMultipliers": "hybridlm.training.optim",
    "apply_schedule": "hybridlm.training.optim",
    "build_param_groups": "hybridlm.training.optim",
    "classify_parameters": "hybridlm.training.optim",
    "matrix_lr_wd": "hybridlm.training.optim",
    "regex_classifier": "hybridlm.training.optim",
    "scale_multipliers": "hybridlm.training.optim",
    "BatchRampup": "hybridlm.training.schedules",
    "ScheduleConfig": "hybridlm.training.schedules",
    "ScheduleFactors": "hybridlm.training.schedules",
    "lr_wd_factors": "hybridlm.training.schedules",
    "plot_schedule": "hybridlm.training.schedules",
    "schedule_factors": "hybridlm.training.schedules",
    "simulate_schedule": "hybridlm.training.schedules",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
