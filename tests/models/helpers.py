"""The small seeded model the model and generation tests share."""

from __future__ import annotations

import torch

from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM
from tests.models.falcon_reference import randomize_

VOCAB = 61


def make_model(seed: int = 0, **changes) -> HybridForCausalLM:
    """Vocab 61, 2 layers, GQA, grouped Mamba-2 with its RMS norm, muP multipliers; seeded random weights (away from
    the structured init), in eval mode. `changes` override HybridConfig fields."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=6, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_rms_norm=True, rope_theta=1e4, embedding_multiplier=2.0, key_multiplier=0.5,
        ssm_out_multiplier=0.5, lm_head_multiplier=0.5,
    )
    fields.update(changes)
    torch.manual_seed(seed)
    model = HybridForCausalLM(HybridConfig(**fields)).eval()
    randomize_(model, seed)
    return model
