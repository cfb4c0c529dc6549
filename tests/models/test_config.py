"""HybridConfig validation and (de)serialization, the transformers config wrapper, channel allocation."""

import math
import warnings

import pytest

from hybridlm.models import config as config_module
from hybridlm.models.allocation import channel_allocation
from hybridlm.models.config import HybridConfig
from hybridlm.models.configuration import HybridTransformersConfig


def test_defaults_resolve_derived_sizes():
    config = HybridConfig(hidden_size=64, num_attention_heads=4, mamba_n_heads=8, mamba_expand=2)
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.mamba_d_ssm == 128 and config.mamba_d_head == 16
    assert HybridConfig(hidden_size=64, mamba_n_heads=8, mamba_d_head="auto").mamba_d_head == 16


def test_derived_ssm_heads_stay_within_the_triton_kernels():
    """Left unset, the SSM heads are 8 (Mamba-2) or mamba_n_heads (fast weight) wide heads while those fit the
    kernels' 128, else the fewest multiple of that count whose heads do; given sizes are kept as they are."""
    def heads(**changes):
        config = HybridConfig(**changes)
        return (config.mamba_n_heads, config.mamba_d_head), config.fast_weight_heads

    assert heads() == ((8, 64), (8, 64))  # hidden 256: d_ssm 512
    assert heads(hidden_size=512) == ((8, 128), (8, 128))
    assert heads(hidden_size=640) == ((16, 80), (16, 80))  # 8 x 160 would not fit
    assert heads(hidden_size=768) == ((16, 96), (16, 96))  # 8 x 192 would not fit
    assert heads(hidden_size=1280) == ((32, 80), (32, 80))  # 16 x 160 (and 24 x 106.7) would not
    assert heads(hidden_size=2048) == ((32, 128), (32, 128))
    # given: a Mamba-2 width (its head count follows), a head count, fast-weight sizes
    assert heads(hidden_size=768, mamba_d_head=64) == ((24, 64), (24, 64))
    assert heads(hidden_size=768, mamba_n_heads=8) == ((8, 192), (16, 96))  # the fast-weight heads split further
    assert heads(hidden_size=768, mamba_n_heads=6, mamba_d_head="auto") == ((6, 256), (12, 128))
    fast_weight = dict(hidden_size=768, ssm_mixer="fast_weight")
    assert heads(**fast_weight, fw_heads=8)[1] == (8, 192)
    assert heads(**fast_weight, fw_head_dim=192)[1] == (16, 192)  # mamba_n_heads heads of the given width
    assert heads(**fast_weight, mamba_n_heads=8, fw_head_dim=192)[1] == (8, 192)
    assert HybridConfig.from_dict(HybridConfig(hidden_size=768).to_dict()).mamba_n_heads == 16


def test_dict_round_trip():
    config = HybridConfig(ssm_multiplier_B=0.25, time_step_limit=(0.0, 0.5), eos_token_id=[2, 3],
                          ssm_mixer="fast_weight", fw_rule="3A", fw_window=4, fw_qk_norm="l2", fw_lam_scale=0.5,
                          fw_chunk_size=32)
    again = HybridConfig.from_dict(config.to_dict())
    assert again == config and isinstance(again.time_step_limit, tuple)
    assert config.ssm_multipliers == [1.0, 1.0, 0.25, 1.0, 1.0]
    assert config.to_dict()["time_step_limit"] == [0.0, 0.5]


def test_float_fields_given_as_ints_become_floats():
    # (transformers' strict FalconH1Config refuses ints in these fields; a saved config is typed one way)
    config = HybridConfig(embedding_multiplier=5, ssm_multiplier_B=2, rms_norm_eps=1, rope_theta=10000,
                          time_step_limit=[0, 10], ssm_mixer="fast_weight", fw_lam_scale=3)
    for name in ("embedding_multiplier", "ssm_multiplier_B", "rms_norm_eps", "rope_theta", "fw_lam_scale"):
        assert type(getattr(config, name)) is float, name
    assert config.time_step_limit == (0.0, 10.0) and all(type(v) is float for v in config.time_step_limit)
    assert all(type(v) is float for v in config.ssm_multipliers + config.mlp_multipliers)
    assert type(HybridTransformersConfig.from_hybrid(config).to_dict()["embedding_multiplier"]) is float
    with pytest.raises(ValueError, match="key_multiplier"):
        HybridConfig(key_multiplier=True)  # a bool is not a number here
    with pytest.raises(ValueError, match="rms_norm_eps"):
        HybridConfig(rms_norm_eps=10**400)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match="ssm_multipliers, typo_field"):
        HybridConfig.from_dict({"typo_field": 1, "ssm_multipliers": [1, 1, 1, 1, 1]})
    with pytest.raises(ValueError, match="hidden"):
        HybridConfig().replace(hidden=3)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(mamba_d_ssm=96, mamba_n_heads=4, mamba_d_head=16), "mamba_d_ssm"),
        (dict(mamba_n_heads=6, mamba_d_ssm=96, mamba_n_groups=4), "mamba_n_groups"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (dict(head_dim=7), "head_dim"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size=10.5), "vocab_size"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(mamba_d_state=0), "mamba_d_state"),
        (dict(ssm_mixer="mamba3"), "ssm_mixer"),
        (dict(block_arrangement="SA-M"), "block_arrangement"),
        (dict(use_attention=False, ssm_mixer="none"), "use_attention"),
        (dict(time_step_limit=(0.5, 0.1)), "time_step_limit"),
        (dict(time_step_limit=(0.1,)), "time_step_limit"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(key_multiplier=math.nan), "key_multiplier"),
        (dict(ssm_multiplier_dt="1"), "ssm_multiplier_dt"),
        (dict(mamba_rms_norm=1), "mamba_rms_norm"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_dropout=1.0), "attention_dropout"),
        (dict(fw_rule="4"), "fw_rule"),
        (dict(fw_pairing="next"), "fw_pairing"),
        (dict(fw_window=0), "fw_window"),
        (dict(fw_heads=0), "fw_heads"),
        (dict(fw_window=2), "fw_window=2 needs a sliding rule"),  # the default rule "1" has no window
        (dict(fw_rule="1A", fw_window=3), "fw_rule='1A'"),
        (dict(fw_qk_norm="cos"), "fw_qk_norm"),
        (dict(fw_lam_scale=0.0), "fw_lam_scale"),
        (dict(fw_lam_scale="1"), "fw_lam_scale"),
        (dict(fw_chunk_size=0), "fw_chunk_size"),
        (dict(ssm_mixer="fast_weight", mamba_d_ssm=30, mamba_n_heads=4, mamba_d_head=8), "multiple of the head"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(eos_token_id=[]), "eos_token_id"),
        (dict(eos_token_id=[2, "3"]), "eos_token_id"),
        # wrong types of the sizes other sizes derive from: named, not a TypeError from the derivation
        (dict(hidden_size="128"), "hidden_size"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(num_attention_heads="4"), "num_attention_heads"),
        (dict(mamba_expand="2"), "mamba_expand"),
        (dict(mamba_d_ssm="96"), "mamba_d_ssm"),
    ],
)
def test_inconsistent_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        HybridConfig(**changes)


def test_fast_weight_defaults_and_the_boolean_qk_norm():
    config = HybridConfig()
    assert (config.fw_qk_norm, config.fw_lam_scale, config.fw_chunk_size) == ("rms", None, 64)
    fast_weight = HybridConfig(ssm_mixer="fast_weight")
    assert fast_weight.replace(fw_qk_norm=False).fw_qk_norm == "none"
    assert fast_weight.replace(fw_qk_norm=True).fw_qk_norm == "rms"
    assert fast_weight.replace(fw_rule="3", fw_window=5).fw_window == 5


@pytest.mark.parametrize("mixer", ["mamba2", "none"])
def test_fast_weight_options_without_the_fast_weight_mixer_warn_once(monkeypatch, mixer):
    """fw_* values away from their defaults mean nothing without ssm_mixer="fast_weight": a warning names them and
    what to do, once per process (not an error: switching only ssm_mixer, as `channel_allocation` does for an SSM
    share of 0, is legitimate). Defaults, and fw_* with the fast-weight mixer, are silent."""
    monkeypatch.setattr(config_module, "_UNREAD_FW_WARNED", set())
    expected = (rf"fw_rule='3A', fw_window=4, fw_qk_norm='none': ignored with ssm_mixer='{mixer}' \(only the "
                r"fast-weight mixer reads fw_\* options\); set ssm_mixer='fast_weight' to use them, or drop them")
    with pytest.warns(UserWarning, match=expected):
        HybridConfig(ssm_mixer=mixer, fw_rule="3A", fw_window=4, fw_qk_norm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = HybridConfig(ssm_mixer=mixer, fw_rule="3A", fw_window=4, fw_qk_norm=False)  # warned already
        assert config.fw_rule == "3A"  # kept as given: a saved config round-trips
        HybridConfig(ssm_mixer=mixer, fw_qk_norm=True)  # True reads as the default "rms"
        HybridConfig(ssm_mixer="fast_weight", fw_rule="3A", fw_window=4, fw_qk_norm=False)
    with pytest.warns(UserWarning, match=r"fw_chunk_size=8: ignored"):  # another setting: its own warning
        HybridConfig(ssm_mixer=mixer, fw_chunk_size=8)


@pytest.mark.parametrize("build", ["direct", "preset", "replace", "from_dict"])
def test_fast_weight_options_warning_points_at_the_users_line(monkeypatch, build):
    """The warning names the line outside hybridlm that built the config, however it was built."""
    from hybridlm.models.presets import get_preset

    monkeypatch.setattr(config_module, "_UNREAD_FW_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if build == "direct":
            HybridConfig(ssm_mixer="mamba2", fw_chunk_size=24)
        elif build == "preset":
            get_preset("tiny", ssm_mixer="mamba2", fw_chunk_size=24)
        elif build == "replace":
            HybridConfig(ssm_mixer="mamba2").replace(fw_chunk_size=24)
        else:
            HybridConfig.from_dict({"ssm_mixer": "mamba2", "fw_chunk_size": 24})
    [warning] = [w for w in caught if "fw_chunk_size=24" in str(w.message)]
    assert warning.filename == __file__, warning.filename


def test_mamba_sizes_are_free_without_mamba():
    config = HybridConfig(ssm_mixer="none", mamba_d_ssm=96, mamba_n_heads=4, mamba_d_head=16)  # no error
    assert config.ssm_mixer == "none" and config.mamba_d_ssm == 96


def test_transformers_config_round_trip(tmp_path):
    config = HybridTransformersConfig.from_hybrid(HybridConfig(hidden_size=64, num_attention_heads=2,
                                                               ssm_multiplier_x=0.5))
    config.save_pretrained(tmp_path)
    loaded = HybridTransformersConfig.from_pretrained(tmp_path)
    assert loaded.to_hybrid() == config.to_hybrid()
    assert math.isinf(loaded.time_step_limit[1])
    with pytest.raises(ValueError, match="mamba_d_state"):
        HybridTransformersConfig(mamba_d_state=-1)


def test_channel_allocation_follows_the_report():
    # The 1.2B proxy of the report: d = 1280, SA_M optimum (2/8, 1/8, 5/8).
    fields = channel_allocation(hidden_size=1280, alpha_S=2 / 8, alpha_A=1 / 8, alpha_M=5 / 8, num_key_value_heads=2)
    assert fields["mamba_d_ssm"] == 1024 and fields["mamba_n_heads"] == 16  # 2/8 * 4096
    assert fields["num_attention_heads"] * fields["head_dim"] == 768  # 1/8 * 6144
    assert fields["intermediate_size"] == 3072  # 5/8 * 4864 = 3040, to a multiple of 64
    config = HybridConfig(hidden_size=1280, **fields)
    assert config.mamba_d_ssm == 1024
    # Widths scale with d; a zero share switches the module off.
    wide = channel_allocation(hidden_size=2560, alpha_S=0.5, alpha_A=0.0, alpha_M=0.5)
    assert wide["mamba_d_ssm"] == 4096 and wide["use_attention"] is False
    no_ssm = channel_allocation(hidden_size=256, alpha_S=0.0, alpha_A=0.5, alpha_M=0.5)
    assert no_ssm["ssm_mixer"] == "none"
    with pytest.raises(ValueError, match="must be 1"):
        channel_allocation(hidden_size=256, alpha_S=0.5, alpha_A=0.5, alpha_M=0.5)
    with pytest.raises(ValueError, match="alpha_A"):
        channel_allocation(hidden_size=256, alpha_S=0.75, alpha_A=-0.25, alpha_M=0.5)
