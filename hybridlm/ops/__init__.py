"""Pure tensor functions (no module state): the fast-weight rules and the Mamba-2 SSD scan."""

from hybridlm.ops.fast_weight import FastWeightState, fast_weight_attention
from hybridlm.ops.ssd import ssd

__all__ = ["fast_weight_attention", "FastWeightState", "ssd"]
