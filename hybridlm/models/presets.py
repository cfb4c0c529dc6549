"""Named model shapes: `tiny` (CPU seconds) and the released Falcon-H1 family.

Falcon-H1 shapes follow the report's Table 1 (layers, d_model, attention heads Q/KV, attention and SSM
head dims, SSM heads, d_state; groups = 2 for 34B only) and the released config.json files (MLP width,
vocabulary, untied embeddings, SSM d_conv 4). The muP multipliers of the released checkpoints differ per
size and are not repeated here (they are all 1.0): load an official checkpoint to get them, or set
them for training. Attention biases, MLP biases and the SSM output norm are off, as released.

    config = get_preset("falcon-h1-0.5b")                 # a HybridConfig
    config = get_preset("tiny", ssm_mixer="fast_weight")  # with overrides
"""

from __future__ import annotations

from typing import Any

from hybridlm.models.config import HybridConfig

# name -> (nominal parameter count, HybridConfig fields)
_FALCON_COMMON: dict[str, Any] = dict(
    mamba_d_conv=4, mamba_n_groups=1, mamba_rms_norm=False, mamba_norm_before_gate=False, rope_theta=1e11,
    tie_word_embeddings=False, rms_norm_eps=1e-5, block_arrangement="SA_M", ssm_mixer="mamba2",
)


def _falcon(layers, d_model, heads, kv_heads, head_dim, ssm_heads, ssm_head_dim, d_state, mlp, vocab, **extra):
    return dict(
        _FALCON_COMMON,
        num_hidden_layers=layers, hidden_size=d_model, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, mamba_n_heads=ssm_heads, mamba_d_head=ssm_head_dim, mamba_d_ssm=ssm_heads * ssm_head_dim,
        mamba_d_state=d_state, intermediate_size=mlp, vocab_size=vocab, **extra,
    )


PRESETS: dict[str, tuple[float, dict[str, Any]]] = {
    "tiny": (
        1.25e6,
        dict(
            vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, mamba_d_ssm=256, mamba_n_heads=4, mamba_d_head=64,
            mamba_d_state=32, mamba_chunk_size=64, max_position_embeddings=2048,
        ),
    ),
    #                                  L   d     Q   KV  hd   SSMh  ssm_hd  d_state  MLP    vocab
    "falcon-h1-0.5b": (0.5e9, _falcon(36, 1024, 8, 2, 64, 24, 64, 128, 2048, 32784, mamba_chunk_size=128)),
    "falcon-h1-1.5b": (1.5e9, _falcon(24, 2048, 8, 2, 128, 48, 64, 256, 4608, 65537)),
    "falcon-h1-1.5b-deep": (1.5e9, _falcon(66, 1280, 6, 2, 128, 24, 64, 256, 3072, 65537)),
    "falcon-h1-3b": (3e9, _falcon(32, 2560, 10, 2, 128, 32, 128, 256, 6144, 65537)),
    "falcon-h1-7b": (7e9, _falcon(44, 3072, 12, 2, 128, 24, 128, 256, 12288, 130048)),
    "falcon-h1-34b": (34e9, _falcon(72, 5120, 20, 4, 128, 32, 128, 256, 21504, 261120, mamba_n_groups=2)),
}


def list_presets() -> list[str]:
    return list(PRESETS)


def nominal_parameters(name: str) -> float:
    """The parameter count the preset's name promises (e.g. 0.5e9 for "falcon-h1-0.5b")."""
    return _lookup(name)[0]


def get_preset(name: str, **overrides: Any) -> HybridConfig:
    """The preset's HybridConfig, with `overrides` applied (unknown field names raise)."""
    fields = dict(_lookup(name)[1])
    fields.update(overrides)
    return HybridConfig.from_dict(fields)


def _lookup(name: str) -> tuple[float, dict[str, Any]]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
