"""Channel allocation (Falcon-H1 report, section "Channel Allocation"): widths from (alpha_S, alpha_A, alpha_M).

The report cuts the inner channels of a block into 8 chunks shared by the SSM, attention and MLP.
With every chunk given to one module, the inner widths at the reference width d = 1280 would be
4096 (SSM), 6144 (attention: query/output channels) and 4864 (MLP), a 2 : 3 : 2.375 ratio chosen so
that one chunk costs about the same number of parameters in each module (3 d_ssm d, 2 d_attn d,
3 d_mlp d), slightly favouring the MLP. A fraction alpha of the chunks gives alpha times that width:

    d_ssm = alpha_S * 3.2 d      d_attn = alpha_A * 4.8 d      d_mlp = alpha_M * 3.8 d

with alpha_S + alpha_A + alpha_M = 1. The optimum found for SA_M blocks is (2/8, 1/8, 5/8).
"""

from __future__ import annotations

import math
from typing import Any

REFERENCE_HIDDEN_SIZE = 1280
REFERENCE_WIDTHS = {"ssm": 4096, "attention": 6144, "mlp": 4864}  # all 8 chunks, at d = 1280


def channel_allocation(
    *,
    hidden_size: int,
    alpha_S: float,
    alpha_A: float,
    alpha_M: float,
    mamba_d_head: int = 64,
    head_dim: int = 64,
    num_key_value_heads: int = 1,
    mlp_multiple: int = 64,
) -> dict[str, Any]:
    """HybridConfig fields for one allocation: SSM/attention widths in whole heads, MLP width in
    multiples of `mlp_multiple` (each rounded to the nearest, at least one unit when its alpha > 0).

    A module whose alpha is 0 is switched off (`ssm_mixer="none"` / `use_attention=False`; an MLP
    share of 0 gives `intermediate_size=0`). The attention heads are rounded up to a multiple of
    `num_key_value_heads`.
    """
    alphas = {"alpha_S": alpha_S, "alpha_A": alpha_A, "alpha_M": alpha_M}
    for name, value in alphas.items():
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    if not math.isclose(alpha_S + alpha_A + alpha_M, 1.0, abs_tol=1e-9):
        raise ValueError(f"alpha_S + alpha_A + alpha_M must be 1, got {alpha_S + alpha_A + alpha_M}")
    for name, value in (("hidden_size", hidden_size), ("mamba_d_head", mamba_d_head), ("head_dim", head_dim),
                        ("num_key_value_heads", num_key_value_heads), ("mlp_multiple", mlp_multiple)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = hidden_size / REFERENCE_HIDDEN_SIZE
    fields: dict[str, Any] = {}
    ssm_heads = _units(alpha_S * REFERENCE_WIDTHS["ssm"] * scale, mamba_d_head)
    if ssm_heads == 0:
        fields["ssm_mixer"] = "none"
    else:
        fields.update(mamba_n_heads=ssm_heads, mamba_d_head=mamba_d_head, mamba_d_ssm=ssm_heads * mamba_d_head)
    attn_heads = _units(alpha_A * REFERENCE_WIDTHS["attention"] * scale, head_dim)
    if attn_heads == 0:
        fields["use_attention"] = False
    else:
        attn_heads = math.ceil(attn_heads / num_key_value_heads) * num_key_value_heads
        fields.update(num_attention_heads=attn_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim)
    fields["intermediate_size"] = _units(alpha_M * REFERENCE_WIDTHS["mlp"] * scale, mlp_multiple) * mlp_multiple
    return fields


def _units(width: float, unit: int) -> int:
    """Nearest whole number of `unit`s, at least 1 when width > 0."""
    if width <= 0:
        return 0
    return max(1, round(width / unit))
