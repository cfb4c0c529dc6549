"""Validation of the run config: errors that name the key and the way out, settings that would have no effect."""

from __future__ import annotations

import pytest

from hybridlm.training.config import ConfigError, load_config
from hybridlm.training.validate import build_model_config


def test_mup_base_width_transfers_the_multipliers():
    config = load_config(None, ["model.mup_base_width=64"])  # tiny is 128 wide: twice the base
    hybrid = build_model_config(config)
    assert hybrid.lm_head_multiplier == pytest.approx(0.5)
    assert hybrid.mlp_multiplier_down == pytest.approx(0.25)
    assert hybrid.embedding_multiplier == 1.0


@pytest.mark.parametrize(
    "override, names",
    [
        ("train.stepz=3", ["'train.stepz'", "steps", "log_every"]),  # unknown key: valid ones listed
        ("modle.preset=tiny", ["'modle'", "model", "distributed"]),
        ("model.overrides.hiden_size=3", ["model.overrides.hiden_size", "hidden_size"]),
        ("optim.elr.ssm_inn=2", ["optim.elr.ssm_inn", "ssm_in"]),
        ("optim.vector_lr.dt=2", ["optim.vector_lr.dt", "dt_bias"]),
        ("train.steps=ten", ["train.steps", "int"]),
        ("train.steps=2.5", ["train.steps", "int"]),
        ("optim.lr=fast", ["optim.lr", "number"]),
        ("train.compile=3", ["train.compile", "bool"]),
        ("optim.betas=[0.9]", ["optim.betas", "2 values"]),
        ("train.dtype=fp16", ["train.dtype", "bf16"]),
        ("distributed.strategy=fsdp", ["distributed.strategy", "removed", "parallel.dp_shard=-1"]),
        ("batch.seq_len=1", ["batch.seq_len", ">= 2"]),
        ("batch.seq_len=100000", ["batch.seq_len", "max_position_embeddings"]),
        ("model.overrides.hidden_size=0", ["model.overrides", "hidden_size"]),
        ("model.preset=huge", ["model.preset", "tiny"]),
        # the demo's decay_fraction gives way to the decay set here, which is longer than the run
        ("schedule.decay=5000", ["schedule.decay", "longer than the whole run"]),
        ("schedule.rampup=1", ["schedule.rampup", "batch.rampup_start"]),
        ("batch.rampup_start=3", ["batch.rampup_start", "multiple"]),
        # rampup settings that would do nothing
        ("batch.rampup_tokens=-5", ["batch.rampup_tokens", ">= 0"]),
        ("batch.rampup_tokens=100000", ["batch.rampup_tokens", "no effect without batch.rampup_start"]),
        ("batch.rampup_start=8", ["batch.rampup_tokens", "must be > 0 with batch.rampup_start"]),
        # schedule settings the kind ignores (set to other than their defaults)
        ("schedule.power_t0=100", ["schedule", "power_t0=100", "no effect", "'power'"]),
        ("schedule.power_exponent=0.3", ["schedule", "power_exponent=0.3", "no effect"]),
        ("train.steps", ["key=value"]),
        ("train.steps=null", ["train.steps", "train.tokens"]),
        ("data.demo=false", ["data", "sources"]),
        ("train.steps.x=1", ["train.steps", "not a section"]),
    ],
)
def test_errors_name_the_key(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_schedule_errors_name_the_config_key_and_the_way_out(tmp_path):
    """A decay key with a kind that has no decay stage: the message names schedule.<key>, the kind really set, and
    the --set that unsets it."""
    for kind in ("constant", "cosine"):
        path = tmp_path / f"{kind}.yaml"
        path.write_text(f"data: {{demo: true}}\nschedule: {{kind: {kind}, decay_fraction: 0.2}}\n", encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        message = str(info.value)
        assert message.startswith("schedule.decay_fraction=0.2: schedule.kind=" + repr(kind)), message
        assert "--set schedule.decay_fraction=null" in message and "ScheduleConfig" not in message
        assert ("cosine" in message) == (kind == "cosine"), message  # the kind that was set, not another
    with pytest.raises(ConfigError, match=r"schedule\.decay / schedule\.decay_fraction: kind 'wsd' .*needs its length"):
        load_config(None, ["schedule.decay_fraction=null"])
    with pytest.raises(ConfigError, match=r"give only one of them .*--set schedule\.decay_fraction=null"):
        load_config(None, ["schedule.decay=20", "schedule.decay_fraction=0.1"])  # both in one command: a clash
    with pytest.raises(ConfigError, match=r"^schedule\.kind='power' needs power_t0"):
        load_config(None, ["schedule.kind=power"])
    with pytest.raises(ConfigError, match=r"^schedule\.warmup must be"):
        load_config(None, ["schedule.warmup=-1"])


def test_sample_temperature_zero_means_greedy():
    assert load_config(None, ["train.sample_temperature=0"]).train.sample_temperature == 0.0
    with pytest.raises(ConfigError, match="train.sample_temperature: must be >= 0"):
        load_config(None, ["train.sample_temperature=-0.5"])


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["schedule.kind=constant", "schedule.decay_fraction=null", "schedule.min_lr_ratio=0.5"],
         ["min_lr_ratio=0.5", "'constant' has no decay"]),
        (["schedule.kind=constant", "schedule.decay_fraction=null", "schedule.decay_shape=cosine"],
         ["decay_shape='cosine'", "'constant' has no decay"]),
        (["schedule.kind=cosine", "schedule.decay_fraction=null", "schedule.decay_shape=exponential",
          "schedule.min_lr_ratio=0.1"], ["decay_shape='exponential'", "always decays along a cosine"]),
        (["model.overrides.tie_word_embeddings=true", "optim.elr.unembedding=4.0"],
         ["optim.elr.unembedding", "no unembedding group", "optim.elr.embedding"]),
        (["model.overrides.tie_word_embeddings=true", "optim.ewd.unembedding=0.5"],
         ["optim.ewd.unembedding", "tie_word_embeddings"]),
    ],
)
def test_settings_that_would_be_ignored_are_refused(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_ignored_settings_at_their_defaults_are_accepted():
    """What a saved config.yaml spells out (every key, at its default) loads for every kind."""
    constant = load_config(None, ["schedule.kind=constant", "schedule.decay_fraction=null",
                                  "schedule.decay_shape=linear", "schedule.min_lr_ratio=0.0",
                                  "schedule.power_t0=null", "schedule.power_exponent=0.5"])
    assert constant.schedule.kind == "constant"
    load_config(None, ["schedule.kind=cosine", "schedule.decay_fraction=null", "schedule.decay_shape=cosine"])
    load_config(None, ["schedule.kind=power", "schedule.power_t0=100", "schedule.power_exponent=0.3"])
    tied = load_config(None, ["model.overrides.tie_word_embeddings=true", "optim.elr.unembedding=1.0",
                              "optim.elr.embedding=2.0"])
    assert tied.optim.elr == {"unembedding": 1.0, "embedding": 2.0}
    load_config(None, ["optim.elr.unembedding=4.0"])  # untied: the unembedding group exists


def test_the_lm_head_loss_is_one_of_its_forms():
    assert load_config(None, ["train.lm_head_loss=logits"]).train.lm_head_loss == "logits"
    with pytest.raises(ConfigError, match="train.lm_head_loss: must be one of chunked, logits, got 'full'"):
        load_config(None, ["train.lm_head_loss=full"])
