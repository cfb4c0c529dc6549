"""Small reusable nn pieces shared by the mixers: norms, rotary embedding, short causal conv, packing helpers."""

from hybridlm.modules.boundaries import (
    cu_seqlens_from_position_ids,
    has_restarts,
    left_padding_mask,
    local_positions,
    pack_rows,
    padding_mask,
    sequence_ids,
)
from hybridlm.modules.fused_linear import FusedLinear
from hybridlm.modules.gated_norm import GatedRMSNorm, gated_rms_norm
from hybridlm.modules.norm import RMSNorm, rms_norm
from hybridlm.modules.rotary import RotaryEmbedding, apply_rotary, rotary_cos_sin
from hybridlm.modules.short_conv import ShortConvolution, causal_conv1d

__all__ = [
    "FusedLinear",
    "GatedRMSNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "ShortConvolution",
    "apply_rotary",
    "causal_conv1d",
    "cu_seqlens_from_position_ids",
    "gated_rms_norm",
    "has_restarts",
    "left_padding_mask",
    "local_positions",
    "pack_rows",
    "padding_mask",
    "rms_norm",
    "rotary_cos_sin",
    "sequence_ids",
]
