"""Gated SiLU MLP with Falcon-H1's muP multipliers: out = m_down W_down (W_up h * SiLU(m_gate W_gate h))."""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.modules.gate import silu_gate
from hybridlm.modules.multiplier import scaled
from hybridlm.modules.recomputed_linear import recomputed_linear


class GatedMLP(nn.Module):
    def __init__(self, config) -> None:  # config: HybridConfig
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_multiplier = config.mlp_multiplier_gate
        self.down_multiplier = config.mlp_multiplier_down

    def forward(self, x: torch.Tensor, *, projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; `projected`: (up_proj(x), gate_proj(x)) computed by the caller (a fused GEMM)."""
        # up * SiLU(gate) with float32 math, rounded once [B, T, d_mlp]; only up and gate are kept for the backward
        # (`silu_gate`), and down_proj recomputes the product there rather than keeping it (`recomputed_linear`)
        up, gate = projected if projected is not None else (self.up_proj(x), self.gate_proj(x))
        gate = scaled(gate, self.gate_multiplier)
        return scaled(recomputed_linear(silu_gate, (up, gate), self.down_proj), self.down_multiplier)
