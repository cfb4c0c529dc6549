"""Small random transformers FalconH1ForCausalLM models for the parity tests."""

from __future__ import annotations

import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

VOCAB = 97

BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
    mamba_n_groups=1, mamba_chunk_size=8, rope_theta=1e11,
)
MUP = dict(
    ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.6], mlp_multipliers=[0.8, 1.2], key_multiplier=0.4,
    attention_in_multiplier=1.1, attention_out_multiplier=0.9, ssm_in_multiplier=1.25, ssm_out_multiplier=0.3,
    embedding_multiplier=5.0, lm_head_multiplier=0.05,
)

# id -> FalconH1Config changes
CASES = {
    "plain-gqa-g1": dict(),
    "rmsnorm-g2-mup": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=2, **MUP),
    "rmsnorm-before-gate-g2-mha-tied": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_n_groups=2,
                                            num_key_value_heads=4, tie_word_embeddings=True, **MUP),
    "biases-mqa-rope1e4": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                               projectors_bias=True, mamba_conv_bias=False, rope_theta=1e4, **MUP),
}


def falcon_config(**changes) -> FalconH1Config:
    return FalconH1Config(**{**BASE, **changes})


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights away from the structured init: matrices ~ N(0, 0.3^2), vectors ~ 1 + N(0, 0.5^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.copy_(noise * 0.3 if param.dim() > 1 else 1.0 + 0.5 * noise)


def random_falcon(seed: int = 0, **changes) -> FalconH1ForCausalLM:
    torch.manual_seed(seed)
    model = FalconH1ForCausalLM(falcon_config(**changes)).eval()
    randomize_(model, seed)
    return model
