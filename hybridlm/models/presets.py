"""Named model shapes: `tiny` (CPU seconds), the released Falcon-H1 family and `hybrid-1b` (a ~1B Falcon-H1-like
hybrid whose head counts split over 8 tensor-parallel ranks: the long-context scaling runs).

Where each Falcon-H1 value comes from ("verified" means: read from a verbatim copy of the released
`tiiuae/Falcon-H1-*` config.json in a public repository or model page, and consistent with transformers' FalconH1
doc table):
- the doc table of transformers' FalconH1 (huggingface.co/docs/transformers/model_doc/falcon_h1) gives, for
  every size, layers, d_model, attention heads / KV heads, SSM heads, attention / SSM head dims, d_state;
- 0.5B: every field below, muP multipliers included, from a copy of Falcon-H1-0.5B's config.json
  (NVIDIA Megatron-Bridge's FalconH1 bridge test, `FALCON_H1_500M_CONFIG`; the same values on the model
  pages MerlinSafety/HybridIntelligence-0.5B and wmere/falcon_moe_0.5Base_test, which copy that config);
- 1.5B-Deep, 7B, 34B: MLP width, context, vocab, groups, SSM output norm (on) and the muP multipliers from
  Megatron-Bridge's FalconH1 model providers, whose per-size classes copy the released config.json files; the
  lm_head multipliers follow the report's d^-1 rule (1.5B-Deep's 2^-5 at d = 1280 is quoted in the report).
  SSD chunk: 128 (1.5B-Deep, 34B); for 7B the sources disagree (256 there, 128 in a sizing tool's copy of its
  config): 128 here, which changes only the kernels' tiling, not the math. 7B's vocab: 130049 there (130048 in
  the sizing tool's copy, which also drops the +1 of the 65537-token tokenizer for 3B);
- 1.5B: MLP width 4608, vocab 65537, d_ssm 3072, groups 1, d_conv 4 from a copy of Falcon-H1-1.5B's config
  (a memory-planning tool's test fixture `FALCON_H1`), its 128K context from the doc table; no copy gives its
  muP multipliers or SSM output norm (multipliers 1.0, norm off here);
- 3B: chunk 128 and 128K context from a sizing tool's copy of its config; MLP width and vocab unverified; no
  copy gives its multipliers (1.0 here); SSM output norm on, since only with it does the parameter count round to
  the released 3,149.4M;
- eos 11 (`<|end_of_text|>`) in every size: read in the 0.5B config and in a shrunken copy of the 34B one.
A checkpoint loaded with `hybridlm.load_model` always carries its own config; these values only matter when
training from a preset. Attention and MLP biases are off, as released; RoPE base 1e11.

    config = get_preset("falcon-h1-0.5b")                 # a HybridConfig
    config = get_preset("tiny", ssm_mixer="fast_weight")  # with overrides
"""

from __future__ import annotations

from typing import Any

from hybridlm.models.config import HybridConfig

# name -> (nominal parameter count, HybridConfig fields)
_FALCON_COMMON: dict[str, Any] = dict(
    mamba_d_conv=4, mamba_n_groups=1, mamba_rms_norm=False, mamba_norm_before_gate=False, mamba_conv_bias=True,
    mamba_proj_bias=False, rope_theta=1e11, tie_word_embeddings=False, rms_norm_eps=1e-5, block_arrangement="SA_M",
    ssm_mixer="mamba2",
)


def _falcon(layers, d_model, heads, kv_heads, head_dim, ssm_heads, ssm_head_dim, d_state, mlp, vocab, **extra):
    return dict(
        _FALCON_COMMON,
        num_hidden_layers=layers, hidden_size=d_model, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, mamba_n_heads=ssm_heads, mamba_d_head=ssm_head_dim, mamba_d_ssm=ssm_heads * ssm_head_dim,
        mamba_d_state=d_state, intermediate_size=mlp, vocab_size=vocab, **extra,
    )


# Falcon-H1-0.5B's tuned muP multipliers (config.json; see the module docstring for the source).
_FALCON_0_5B_MUP: dict[str, Any] = dict(
    embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, key_multiplier=0.39062499999999994,
    attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.23570226039551587,
    # ssm_multipliers [z, x, B, C, dt]
    ssm_multiplier_z=0.3535533905932738, ssm_multiplier_x=0.25, ssm_multiplier_B=0.3535533905932738,
    ssm_multiplier_C=0.5, ssm_multiplier_dt=0.3535533905932738,
    # mlp_multipliers [gate, down]
    mlp_multiplier_gate=0.8838834764831844, mlp_multiplier_down=0.5859375,
)



def _mup(lm_head, key, attention_out, ssm_in, ssm_out, mlp_gate, mlp_down) -> dict[str, Any]:
    """Falcon-H1's tuned muP multipliers of one size (the values shared by the 1.5B-Deep, 7B and 34B configs fixed)."""
    return dict(
        embedding_multiplier=5.656854249492381, lm_head_multiplier=lm_head, key_multiplier=key,
        attention_in_multiplier=1.0, attention_out_multiplier=attention_out, ssm_in_multiplier=ssm_in,
        ssm_out_multiplier=ssm_out, mlp_multiplier_gate=mlp_gate, mlp_multiplier_down=mlp_down,
        ssm_multiplier_z=0.3535533905932738, ssm_multiplier_x=0.25, ssm_multiplier_B=0.1767766952966369,
        ssm_multiplier_C=0.5, ssm_multiplier_dt=0.3535533905932738,
    )


_RELEASED = dict(eos_token_id=11, mamba_rms_norm=True)  # every size above 0.5B whose config has a known copy

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
    # verified: every field (muP included)
    "falcon-h1-0.5b": (0.5e9, _falcon(36, 1024, 8, 2, 64, 24, 64, 128, 2048, 32784, mamba_chunk_size=128,
                                      max_position_embeddings=16384, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=11, **_FALCON_0_5B_MUP)),
    # verified: shapes; unverified: muP multipliers (1.0), SSM output norm (off)
    "falcon-h1-1.5b": (1.5e9, _falcon(24, 2048, 8, 2, 128, 48, 64, 256, 4608, 65537, eos_token_id=11,
                                      max_position_embeddings=131072)),
    # verified: every field (muP included)
    "falcon-h1-1.5b-deep": (1.5e9, _falcon(66, 1280, 6, 2, 128, 24, 64, 256, 3072, 65537, mamba_chunk_size=128,
                                           max_position_embeddings=131072, **_RELEASED,
                                           **_mup(0.03125, 0.17677669529663687, 0.5, 1.0, 0.23570226039551587,
                                                  0.7071067811865476, 0.3125))),
    # verified: the doc-table shapes; unverified: MLP width, vocab, muP multipliers (1.0); norm from the count
    "falcon-h1-3b": (3e9, _falcon(32, 2560, 10, 2, 128, 32, 128, 256, 6144, 65537, mamba_chunk_size=128,
                                  max_position_embeddings=131072, **_RELEASED)),
    # verified: every field (muP included; chunk: sources disagree). 7.59B parameters as released.
    "falcon-h1-7b": (7e9, _falcon(44, 3072, 12, 2, 128, 24, 128, 256, 12288, 130049, mamba_chunk_size=128,
                                  max_position_embeddings=262144, **_RELEASED,
                                  **_mup(0.013020833333333334, 0.030690398488999456, 0.10416666666666667,
                                         0.4166666666666667, 0.11785113019775793, 0.2946278254943948,
                                         0.032552083333333336))),
    # verified: every field (muP included)
    "falcon-h1-34b": (34e9, _falcon(72, 5120, 20, 4, 128, 32, 128, 256, 21504, 261120, mamba_n_groups=2,
                                    mamba_chunk_size=128, max_position_embeddings=262144, **_RELEASED,
                                    **_mup(0.0078125, 0.011048543456039804, 0.0375, 0.25, 0.08838834764831845,
                                           0.1767766952966369, 0.011160714285714284))),
    # Not a release: the ~1B hybrid of the long-context scaling runs (Falcon-H1-1.5B's trunk, d_model 2048 x 24 SA_M
    # blocks, resized so that tp=8 and mixer parallelism over tp=8 split every head count: 16 query / 8 KV
    # heads of 128, 32 Mamba-2 heads of 64 (d_ssm 2048) in 8 B/C groups, MLP 2048). 1.14B parameters, 1.01B
    # without the (untied) embeddings; 32K context, SSD chunk 128.
    "hybrid-1b": (1e9, _falcon(24, 2048, 16, 8, 128, 32, 64, 128, 2048, 32768, mamba_n_groups=8,
                               mamba_chunk_size=128, max_position_embeddings=32768)),
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
