"""Falcon fast-weight attention: the six write rules with the prefix-shifted pair (README.md derives them)."""

from hybridlm.ops.fast_weight.op import fast_weight_attention, seq_idx_in_place
from hybridlm.ops.fast_weight.options import (
    PER_COLUMN_RULES,
    REGRESSION_RULES,
    RULES,
    SLIDING_RULES,
    FastWeightOptions,
)
from hybridlm.ops.fast_weight.state import FastWeightState

__all__ = ["fast_weight_attention", "FastWeightOptions", "FastWeightState", "RULES", "PER_COLUMN_RULES",
           "REGRESSION_RULES", "SLIDING_RULES", "seq_idx_in_place"]
