"""The run config: YAML + --set parsing, typing, errors that name the key, the shipped configs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridlm.training.config import (
    ConfigError,
    build_model_config,
    demo_config,
    load_config,
    parse_override,
    plan_steps,
    save_config,
    schedule_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_demo_yaml_spells_out_the_builtin_demo():
    assert load_config(CONFIGS / "demo.yaml") == demo_config()
    assert load_config(None) == demo_config()
    assert demo_config().data.demo and demo_config().model.preset == "tiny"


def test_every_shipped_config_loads_and_takes_a_short_run():
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = load_config(path, ["train.steps=12"])  # works on any config (the promise)
        steps, _ = plan_steps(config, world_size=1)
        assert steps == 12, path.name
        schedule, total, _ = schedule_config(config, world_size=1)
        assert schedule.warmup + schedule.decay_length(total) <= total


def test_125m_config_is_about_125m():
    from hybridlm.models.commands import count_parameters

    config = load_config(CONFIGS / "hybrid-125m.yaml")
    params = count_parameters(build_model_config(config))
    assert 110e6 < params < 160e6, params
    assert config.train.dtype == "bf16" and config.parallel.dp_shard == -1  # FSDP2 over all ranks


def test_yaml_values_are_typed_and_set_overrides_win(tmp_path):
    path = _write(tmp_path / "run.yaml", """
model:
  preset: tiny
  overrides: {ssm_multiplier_dt: 0.5, time_step_limit: [0, 4]}
data: {demo: true}
optim: {lr: 3e-4, betas: [0.8, 0.9], elr: {ssm_in: 2}}
train: {steps: 20, tokens: 1e6}
""")
    config = load_config(path, ["optim.lr=1e-3", "train.log_every=5", "model.overrides.hidden_size=192",
                                "train.grad_clip=null", "data.shuffle=false"])
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.optim.betas == (0.8, 0.9)
    assert config.optim.elr == {"ssm_in": 2.0}
    assert config.train.tokens == 1_000_000 and isinstance(config.train.tokens, int)  # "1e6" from YAML
    assert config.train.log_every == 5 and config.train.grad_clip is None and config.data.shuffle is False
    hybrid = build_model_config(config)
    assert hybrid.ssm_multiplier_dt == 0.5  # dt attenuation reaches the model
    assert hybrid.time_step_limit == (0.0, 4.0)  # positive-dt clip
    assert hybrid.hidden_size == 192
    # a rule named by a number: YAML reads `1` as an int, the field takes it as the string "1"
    ruled = load_config(None, ["model.overrides.ssm_mixer=fast_weight", "model.overrides.fw_rule=1",
                               "train.out_dir=2024"])
    assert build_model_config(ruled).fw_rule == "1" and ruled.train.out_dir == "2024"


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["model.overrides.time_step_limit=[0.0, .inf]", "train.steps=7",
                                "data.sources=[{name: a, path: /x}]", "data.demo=false"])
    assert math.isinf(config.model.overrides["time_step_limit"][1])
    path = save_config(config, tmp_path / "config.yaml")
    assert load_config(path) == config


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
        ("schedule.decay=5000", ["schedule", "decay"]),  # decay and decay_fraction both set
        ("schedule.rampup=1", ["schedule.rampup", "batch.rampup_start"]),
        ("batch.rampup_start=3", ["batch.rampup_start", "multiple"]),
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


def test_decay_longer_than_the_run_is_an_error_but_a_long_warmup_is_shortened():
    with pytest.raises(ConfigError, match="schedule"):
        load_config(None, ["schedule.decay_fraction=null", "schedule.decay=500"])  # 300 steps
    config = load_config(None, ["train.steps=10"])  # warmup 30 > 10 steps
    schedule, total, note = schedule_config(config, world_size=1)
    assert total == 10 and schedule.warmup == pytest.approx(8.0) and "warmup shortened" in note


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path / "bad.yaml", "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(_write(tmp_path / "typo.yaml", "data: {demo: true}\ntrainer: {steps: 3}\n"))
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: missing required key\(s\): path"):
        load_config(_write(tmp_path / "src.yaml", "data: {sources: [{name: web}]}\n"))


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=runs/x=y") == (["a"], "runs/x=y")


def test_rampup_and_token_budget_plan():
    config = load_config(None, ["batch.micro_batch=2", "batch.grad_accum=4", "batch.rampup_start=2",
                                "batch.rampup_tokens=4096", "batch.seq_len=64", "train.steps=null",
                                "train.tokens=20000"])
    schedule, _, _ = schedule_config(config, world_size=2)
    rampup = schedule.rampup
    assert (rampup.start, rampup.target, rampup.micro_batch) == (4, 16, 4)  # rows, global over 2 ranks
    steps, tokens = plan_steps(config, world_size=2)
    assert tokens >= 20000 and tokens - 16 * 64 < 20000  # stops at the first update past the budget
    assert steps > 20000 // (16 * 64)  # smaller batches at the start need more updates
