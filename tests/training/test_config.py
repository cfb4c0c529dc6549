"""The run config: sections, YAML files and --set overrides, the shipped configs, the run's config.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridlm.training.config import (
    ConfigError,
    demo_config,
    diff_configs,
    load_config,
    save_config,
)
from hybridlm.training.plan import plan_steps, schedule_config
from hybridlm.training.validate import build_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_demo_yaml_spells_out_the_builtin_demo():
    assert load_config(CONFIGS / "demo.yaml") == demo_config()
    assert load_config(None) == demo_config()
    assert demo_config().data.demo and demo_config().model.preset == "tiny"


def test_every_shipped_config_loads_and_takes_a_short_run(tmp_path):
    import yaml

    from hybridlm.models.configuration import transformers_config
    from hybridlm.models.presets import get_preset

    # the post-training recipes start from a model directory (its config.json is all that loading reads)
    transformers_config(get_preset("falcon-h1-0.5b"), model="hybridlm").save_pretrained(tmp_path)
    for path in sorted(CONFIGS.glob("*.yaml")):
        task = (yaml.safe_load(path.read_text()).get("train") or {}).get("task", "pretrain")
        extra = [f"model.init={tmp_path}", f"data.chat={tmp_path}"] if task != "pretrain" else []
        config = load_config(path, ["train.steps=12", *extra], task=task)  # any config runs at any length
        steps, _ = plan_steps(config, world_size=1)
        assert steps == 12, path.name
        schedule, total, note = schedule_config(config, world_size=1)
        assert schedule.warmup + schedule.decay_length(total) <= total
        if config.batch.rampup_start is not None:  # a rampup longer than 12 updates: kept, and the note says so
            assert "batch.rampup_tokens" in note and "never reaches" in note, note


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


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path / "bad.yaml", "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(_write(tmp_path / "typo.yaml", "data: {demo: true}\ntrainer: {steps: 3}\n"))
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: missing required key\(s\): path"):
        load_config(_write(tmp_path / "src.yaml", "data: {sources: [{name: web}]}\n"))


def test_a_config_that_is_not_a_utf8_file_says_so(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ConfigError, match=r"bin\.yaml: not a UTF-8 text file"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory") as info:
        load_config(tmp_path)
    assert "no such file" not in str(info.value)


def test_duplicate_yaml_keys_are_refused_with_the_key_named(tmp_path):
    top = _write(tmp_path / "top.yaml", "data: {demo: true}\ntrain: {steps: 10}\nschedule: {warmup: 2}\n"
                                       "train: {log_every: 5}\n")
    with pytest.raises(ConfigError, match=r"top\.yaml: duplicate key 'train' at line 4 \(first at line 2\)"):
        load_config(top)
    nested = _write(tmp_path / "nested.yaml", "data:\n  demo: true\ntrain:\n  steps: 10\n  steps: 20\n")
    with pytest.raises(ConfigError, match="duplicate key 'steps' at line 5"):
        load_config(nested)
    with pytest.raises(ConfigError, match="--set .*duplicate key 'ssm_in'"):
        load_config(None, ["optim.elr={ssm_in: 2, ssm_in: 3}"])
    # a merge key's entries may be overridden: that is what `<<` is for
    assert load_config(None, ["train={<<: {steps: 4, log_every: 2}, steps: 3}"]).train.steps == 3


def test_a_set_that_chooses_the_decay_replaces_the_inherited_one(tmp_path):
    """`--set schedule.kind=cosine` on the demo (which sets a decay_fraction) just works; so does `--set
    schedule.decay=N` on a file with a decay_fraction, and the reverse."""
    for kind in ("cosine", "constant"):
        schedule = load_config(None, [f"schedule.kind={kind}"]).schedule
        assert (schedule.kind, schedule.decay, schedule.decay_fraction) == (kind, None, None)
    schedule = load_config(None, ["schedule.decay=20"]).schedule
    assert (schedule.decay, schedule.decay_fraction) == (20, None)
    by_length = _write(tmp_path / "length.yaml", "data: {demo: true}\nschedule: {kind: wsd, warmup: 5, decay: 30}\n")
    schedule = load_config(by_length, ["schedule.decay_fraction=0.1"]).schedule
    assert (schedule.decay, schedule.decay_fraction, schedule.warmup) == (None, 0.1, 5)
    assert load_config(by_length, ["schedule.kind=cosine"]).schedule.decay is None
    assert load_config(by_length, ["schedule.kind=power", "schedule.power_t0=10"]).schedule.decay == 30  # still decays
    # what the command itself sets is never dropped: the clash is reported
    with pytest.raises(ConfigError, match="schedule.decay_fraction=0.3: schedule.kind='cosine'"):
        load_config(None, ["schedule.kind=cosine", "schedule.decay_fraction=0.3"])
    # a file's power schedule switched: its power_t0, decay_shape, min_lr_ratio go where the new kind reads none
    power = _write(tmp_path / "power.yaml", "data: {demo: true}\nschedule: {kind: effective_power, warmup: 5, "
                   "decay_fraction: 0.1, power_t0: 50, power_exponent: 0.7, decay_shape: cosine, min_lr_ratio: 0.1}\n")
    for kind, kept in (("cosine", dict(min_lr_ratio=0.1)), ("constant", {}), ("wsd", dict(decay_shape="cosine"))):
        schedule = load_config(power, [f"schedule.kind={kind}"]).schedule
        assert (schedule.kind, schedule.power_t0, schedule.power_exponent, schedule.warmup) == (kind, None, 0.5, 5)
        assert schedule.min_lr_ratio == kept.get("min_lr_ratio", 0.1 if kind != "constant" else 0.0)
        assert schedule.decay_shape == kept.get("decay_shape", "linear")
    with pytest.raises(ConfigError, match="power_t0=50"):  # set in the same command: kept, and refused
        load_config(power, ["schedule.kind=cosine", "schedule.power_t0=50"])


def test_diff_configs_names_each_changed_key_with_both_values():
    old = load_config(None).to_dict()
    new = load_config(None, ["optim.lr=1e-3", "model.overrides.hidden_size=192", "train.grad_clip=null"]).to_dict()
    assert diff_configs(old, new) == ["model.overrides.hidden_size: None -> 192", "optim.lr: 0.003 -> 0.001",
                                      "train.grad_clip: 1.0 -> None"]  # sorted; an absent key reads as None
    assert diff_configs(new, new) == []
