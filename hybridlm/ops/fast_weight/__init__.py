"""Falcon fast-weight attention: the six write rules with the prefix-shifted pair (README.md derives them).

The rule names and options import without torch; the op and its state on first use."""

from __future__ import annotations

from hybridlm.lazy import lazy_exports
from hybridlm.ops.fast_weight.options import (
    PER_COLUMN_RULES,
    REGRESSION_RULES,
    RULES,
    SLIDING_RULES,
    FastWeightOptions,
)

_EXPORTS = {
    "fast_weight_attention": "hybridlm.ops.fast_weight.op",
    "fast_weight_decoding_step": "hybridlm.ops.fast_weight.op",
    "fast_weight_step_fuses": "hybridlm.ops.fast_weight.op",
    "fast_weight_mixer_decoding_step": "hybridlm.ops.fast_weight.op",
    "fast_weight_mixer_step_fuses": "hybridlm.ops.fast_weight.op",
    "seq_idx_in_place": "hybridlm.ops.fast_weight.op",
    "runs_triton": "hybridlm.ops.fast_weight.op",
    "FastWeightState": "hybridlm.ops.fast_weight.state",
}

__all__ = [*_EXPORTS, "FastWeightOptions", "RULES", "PER_COLUMN_RULES", "REGRESSION_RULES", "SLIDING_RULES"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
