"""Presets build on the meta device with the parameter counts of the released models, and their SSM heads (and
those of the defaults) fit the Triton kernels that `backend="auto"` takes on CUDA."""

import pytest
import torch

from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models.commands import count_parameters
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset, list_presets, nominal_parameters
from hybridlm.ops.fast_weight import triton as fw_triton
from hybridlm.ops.ssd import triton as ssd_triton

# Parameter counts of the released Falcon-H1 checkpoints (untied embeddings).
RELEASED = {
    "falcon-h1-0.5b": 0.52e9,
    "falcon-h1-1.5b": 1.55e9,
    "falcon-h1-1.5b-deep": 1.55e9,
    "falcon-h1-3b": 3.15e9,
    "falcon-h1-7b": 7.59e9,
    "falcon-h1-34b": 33.6e9,
}


# hybrid-1b: ~1B without its embeddings (1.14B with them; tests/models/test_hybrid_1b.py holds it to 15%)
@pytest.mark.parametrize("name", [name for name in list_presets() if name not in ("falcon-h1-7b", "hybrid-1b")])
def test_parameter_count_within_5_percent_of_the_name(name):
    count = count_parameters(get_preset(name))
    assert abs(count / nominal_parameters(name) - 1) < 0.05, f"{name}: {count / 1e9:.3f}B"


def test_7b_has_the_released_count_not_its_name():
    """The released Falcon-H1-7B has 7.59B parameters, 8.4% above its name: hold the preset to the release."""
    count = count_parameters(get_preset("falcon-h1-7b"))
    assert abs(count / 7.59e9 - 1) < 0.01, f"{count / 1e9:.3f}B"
    assert abs(count / nominal_parameters("falcon-h1-7b") - 1) > 0.05


def test_0_5b_carries_the_released_mup_multipliers():
    """The multipliers of Falcon-H1-0.5B's released config.json, in falcon_h1 spelling after export."""
    from hybridlm.models.falcon_h1 import config_to_falcon_h1

    falcon = config_to_falcon_h1(get_preset("falcon-h1-0.5b"))
    assert falcon.embedding_multiplier == 5.656854249492381 and falcon.lm_head_multiplier == 0.0390625
    assert falcon.key_multiplier == 0.39062499999999994 and falcon.attention_out_multiplier == 0.9375
    assert falcon.ssm_in_multiplier == 1.25 and falcon.ssm_out_multiplier == 0.23570226039551587
    assert list(falcon.ssm_multipliers) == [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]
    assert list(falcon.mlp_multipliers) == [0.8838834764831844, 0.5859375]
    assert (falcon.mamba_d_ssm, falcon.intermediate_size, falcon.mamba_d_head, falcon.mamba_n_heads) == (1536, 2048, 64, 24)
    assert (falcon.mamba_d_state, falcon.mamba_chunk_size, falcon.vocab_size) == (128, 128, 32784)
    assert falcon.rope_parameters["rope_theta"] == 1e11 and falcon.max_position_embeddings == 16384


@pytest.mark.parametrize("name", list(RELEASED))
def test_parameter_count_matches_the_release(name):
    count = count_parameters(get_preset(name))
    assert abs(count / RELEASED[name] - 1) < 0.01, f"{name}: {count / 1e9:.3f}B"


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = HybridForCausalLM(get_preset("falcon-h1-34b"))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.layers[0].ssm.groups == 2


def test_tiny_runs_on_cpu():
    torch.manual_seed(0)
    model = HybridForCausalLM(get_preset("tiny")).eval()
    ids = torch.randint(0, 512, (2, 33))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 33, 512) and torch.isfinite(out.loss)


def test_overrides_and_unknown_names():
    assert get_preset("tiny", ssm_mixer="none").ssm_mixer == "none"
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("falcon-h1-2b")
    with pytest.raises(ValueError, match="not_a_field"):
        get_preset("tiny", not_a_field=1)


def test_tuned_falcon_presets_follow_the_report_mup_rules():
    """The presets with tuned muP multipliers (0.5B, 1.5B-Deep, 7B, 34B, copied from the released configs) agree
    with the report's rules: embeddings x 2^2.5 and an unembedding multiplier proportional to 1 / d_model (40 / d);
    every size above 0.5B whose config has a known copy has the SSM output norm on."""
    for name in ("falcon-h1-0.5b", "falcon-h1-1.5b-deep", "falcon-h1-7b", "falcon-h1-34b"):
        config = get_preset(name)
        assert config.embedding_multiplier == pytest.approx(2 ** 2.5), name
        assert config.lm_head_multiplier * config.hidden_size == pytest.approx(40.0), name
        assert config.mamba_rms_norm == (name != "falcon-h1-0.5b"), name
        assert config.eos_token_id == 11, name


# The defaults at the widths a config most often changes (d_ssm = 2 x hidden_size, the heads derived).
DEFAULT_WIDTHS = (64, 128, 256, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120)


def preset_or_defaults(name: str, **changes) -> HybridConfig:
    """A preset by name, or the defaults at `hidden_size=<width>`."""
    if name in list_presets():
        return get_preset(name, **changes)
    return HybridConfig(hidden_size=int(name.removeprefix("hidden_size=")), **changes)


@pytest.mark.parametrize("name", list_presets() + [f"hidden_size={width}" for width in DEFAULT_WIDTHS])
def test_ssm_heads_fit_the_triton_kernels(name):
    """Every preset and the defaults: the Mamba-2 heads and state and the fast-weight heads (with the mixer swapped
    in, every rule that "auto" takes) are shapes the Triton kernels take, so "auto" never leaves them on the torch
    chunk path for their size; a preset's fast-weight heads are its Mamba-2 heads (the same allocation)."""
    with torch.device("meta"):
        mamba = Mamba2Mixer(preset_or_defaults(name), 0)
        fast_weight = {rule: FastWeightMixer(preset_or_defaults(name, ssm_mixer="fast_weight", fw_rule=rule,
                                                                fw_window=4 if rule in ("3A", "3") else 1), 0)
                       for rule in fw_triton.SUPPORTED_RULES}
    for dtype in ssd_triton.AUTO_DTYPES:
        assert ssd_triton.auto_takes(P=mamba.head_dim, N=mamba.d_state, dtype=dtype), (mamba.head_dim, mamba.d_state)
    for rule, mixer in fast_weight.items():
        K = mixer.head_dim
        for dtype in fw_triton.DTYPES:
            assert fw_triton.auto_takes(rule=rule, window=mixer.window, K=K, V=K, dtype=dtype), (rule, K)
        if name in list_presets():
            assert (mixer.num_heads, mixer.head_dim) == (mamba.num_heads, mamba.head_dim)
    for rule in ("2A", "2", "3"):  # the rules "triton" runs when asked for take them too
        assert fw_triton.supports(rule=rule, window=4 if rule == "3" else 1, K=K, V=K, dtype=torch.bfloat16)
