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


def test_decay_longer_than_the_run_is_an_error_but_a_long_warmup_is_shortened():
    with pytest.raises(ConfigError, match=r"schedule\.decay: .*300 steps: train\.steps"):
        load_config(None, ["schedule.decay_fraction=null", "schedule.decay=500"])  # 300 steps at any number of ranks
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


def test_schedule_errors_name_the_config_key_and_the_way_out(tmp_path):
    """A decay key with a kind that has no decay stage: the message names schedule.<key>, the kind really set, and
    the --set that unsets it (it once said `cosine` for kind constant and named no key)."""
    for kind in ("constant", "cosine"):
        path = _write(tmp_path / f"{kind}.yaml", f"data: {{demo: true}}\nschedule: {{kind: {kind}, decay_fraction: 0.2}}\n")
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


def test_a_set_that_chooses_the_decay_replaces_the_inherited_one(tmp_path):
    """`--set schedule.kind=cosine` on the demo (whose decay_fraction is 0.2) just works; so does `--set
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


def test_sample_temperature_zero_means_greedy():
    assert load_config(None, ["train.sample_temperature=0"]).train.sample_temperature == 0.0
    with pytest.raises(ConfigError, match="train.sample_temperature: must be >= 0"):
        load_config(None, ["train.sample_temperature=-0.5"])


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


def test_rampup_longer_than_the_run_runs_with_a_note():
    """A rampup that outlasts the run is kept (a short test run of a long config is legitimate), and the trainer's
    note says the batch never reaches its target; the run's tokens, so the note, depend on the ranks."""
    rampup = ["batch.micro_batch=2", "batch.grad_accum=4", "batch.rampup_start=2", "batch.seq_len=64"]
    budget = load_config(None, [*rampup, "batch.rampup_tokens=20000", "train.steps=null", "train.tokens=20000"])
    note = schedule_config(budget, world_size=1)[2]
    assert "batch.rampup_tokens 20,000 is not shorter than the run's 20,000 tokens" in note, note
    config = load_config(None, [*rampup, "batch.rampup_tokens=2000", "train.steps=10"])
    steps, tokens = plan_steps(config, world_size=1)  # 10 updates of 2 rows (ramping to 4): < 2000 tokens
    assert steps == 10 and tokens < 2000 < plan_steps(config, world_size=2)[1]
    schedule, _, note = schedule_config(config, world_size=1)
    assert schedule.rampup.rampup_tokens == 2000 and "10 updates at 1 data-parallel rank" in note, note
    assert "batch.rampup_tokens" not in (schedule_config(config, world_size=2)[2] or "")


def test_run_length_checks_that_depend_on_the_ranks_wait_for_the_trainer():
    """A decay in tokens under train.steps, or in steps under train.tokens: whether it fits depends on the number
    of data-parallel ranks, so load_config accepts it and schedule_config (called by the trainer with its own
    number) refuses it with a ConfigError (the CLI's one-line config error), not a bare ValueError."""
    sizes = ["batch.micro_batch=8", "batch.seq_len=256", "schedule.decay_fraction=null"]  # 2048 tokens per rank
    # 100 updates: 204,800 tokens at 1 rank, 409,600 at 2; a 300,000-token decay fits only the second
    config = load_config(None, [*sizes, "train.steps=100", "schedule.unit=tokens", "schedule.warmup=1000",
                                "schedule.decay=300000"])
    schedule, total, _ = schedule_config(config, world_size=2)
    assert total == 409_600 and schedule.decay == 300_000
    with pytest.raises(ConfigError, match=r"schedule\.decay: .*204800 tokens: 100 updates at 1 data-parallel rank\)"):
        schedule_config(config, world_size=1)
    # 204,800 tokens: 100 updates at 1 rank, 50 at 2; a 60-update decay fits only the first
    config = load_config(None, [*sizes, "train.steps=null", "train.tokens=204800", "schedule.decay=60"])
    assert schedule_config(config, world_size=1)[1] == 100
    with pytest.raises(ConfigError, match=r"schedule\.decay: .*\(50 steps at 2 data-parallel ranks\)"):
        schedule_config(config, world_size=2)
