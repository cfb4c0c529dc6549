"""Schedules: values at hand-computed points for every kind, stage invariants, rampup, validation, plotting."""

from __future__ import annotations

import math
import os
import sys

import pytest

from hybridlm.training.schedules import (
    BatchRampup,
    ScheduleConfig,
    lr_wd_factors,
    plot_schedule,
    schedule_factors,
    simulate_schedule,
)

# warmup 10, decay over the last 20 of 100 steps, floor 0.1
WSD = dict(kind="wsd", warmup=10, decay=20, min_lr_ratio=0.1)


def lr_at(config: ScheduleConfig, t: float, total: float = 100) -> float:
    return lr_wd_factors(config, t, total)[0]


@pytest.mark.parametrize(
    "shape, t, expected",
    [
        ("linear", 5, 0.5),  # warmup midpoint
        ("linear", 10, 1.0),  # warmup end
        ("linear", 50, 1.0),  # stable
        ("linear", 80, 1.0),  # decay start, u = 0
        ("linear", 90, 1 - 0.9 * 0.5),  # u = 1/2
        ("linear", 100, 0.1),  # decay end = floor
        ("cosine", 85, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # u = 1/4
        ("cosine", 90, 0.55),
        ("cosine", 100, 0.1),
        ("exponential", 90, 0.125**0.5),  # lr / 8 over the decay, geometric
        ("exponential", 100, 0.125),
    ],
)
def test_wsd_values(shape: str, t: float, expected: float) -> None:
    ratio = 0.125 if shape == "exponential" else 0.1
    config = ScheduleConfig(**{**WSD, "decay_shape": shape, "min_lr_ratio": ratio})
    lr, wd = lr_wd_factors(config, t, 100)
    assert lr == pytest.approx(expected, rel=1e-12)
    assert wd == 1.0


def test_wsd_decay_fraction_equals_decay_length_and_clamps_past_total() -> None:
    by_length = ScheduleConfig(**WSD)
    by_fraction = ScheduleConfig(kind="wsd", warmup=10, decay_fraction=0.2, min_lr_ratio=0.1)
    for t in (1, 10, 79, 80, 87.5, 100):
        assert lr_wd_factors(by_length, t, 100) == pytest.approx(lr_wd_factors(by_fraction, t, 100))
    assert lr_at(by_length, 150) == pytest.approx(0.1)
    # no decay stage: stays at the peak to the end
    assert lr_at(ScheduleConfig(kind="wsd", warmup=10, decay=0), 100) == 1.0


def test_cosine_and_constant() -> None:
    cosine = ScheduleConfig(kind="cosine", warmup=10, min_lr_ratio=0.0)
    assert lr_wd_factors(cosine, 5, 110) == (0.5, 1.0)
    assert lr_at(cosine, 10, 110) == 1.0
    assert lr_at(cosine, 60, 110) == pytest.approx(0.5, abs=1e-12)  # halfway through [10, 110]
    assert lr_at(cosine, 110, 110) == pytest.approx(0.0, abs=1e-12)
    floored = ScheduleConfig(kind="cosine", warmup=0, min_lr_ratio=0.2)
    assert lr_at(floored, 50, 100) == pytest.approx(0.6)
    constant = ScheduleConfig(kind="constant", warmup=4)
    assert lr_wd_factors(constant, 1, 100) == (0.25, 1.0)
    assert lr_wd_factors(constant, 100, 100) == (1.0, 1.0)


POWER = dict(warmup=10, decay=200, power_t0=100, min_lr_ratio=0.1)  # total 1000: decay starts at 800


def test_power_stage() -> None:
    config = ScheduleConfig(kind="power", **POWER)
    assert lr_wd_factors(config, 10, 1000) == (1.0, 1.0)  # warmup end, t <= t0
    assert lr_wd_factors(config, 100, 1000) == (1.0, 1.0)
    lr, wd = lr_wd_factors(config, 400, 1000)
    assert (lr, wd) == (pytest.approx(0.5), 1.0)  # sqrt(100 / 400)
    assert lr_at(config, 400, 1000) / lr_at(config, 200, 1000) == pytest.approx(math.sqrt(200 / 400))
    s_end = math.sqrt(100 / 800)
    assert lr_wd_factors(config, 900, 1000) == (pytest.approx(s_end * 0.55), 1.0)  # linear decay, u = 1/2
    assert lr_at(config, 1000, 1000) == pytest.approx(0.1 * s_end)  # floor relative to the decay start


def test_effective_power_keeps_lr_over_wd_constant() -> None:
    config = ScheduleConfig(kind="effective_power", **POWER)
    lr, wd = lr_wd_factors(config, 400, 1000)
    assert lr == pytest.approx(0.5**0.5) and wd == pytest.approx(0.5**0.5)  # (t0 / t)^(1/4)
    for t in (10, 50, 100, 150, 333, 500, 799):
        lr, wd = lr_wd_factors(config, t, 1000)
        assert lr / wd == pytest.approx(1.0, rel=1e-12)
    assert lr_at(config, 700, 1000) / lr_at(config, 175, 1000) == pytest.approx((175 / 700) ** 0.25)
    # decay: lr anneals from the value at decay start, wd keeps that value
    s_end = (100 / 800) ** 0.25
    lr, wd = lr_wd_factors(config, 900, 1000)
    assert lr == pytest.approx(s_end * 0.55) and wd == pytest.approx(s_end)
    assert lr_wd_factors(config, 1000, 1000) == (pytest.approx(0.1 * s_end), pytest.approx(s_end))


def test_power_and_effective_power_share_the_effective_lr() -> None:
    power = ScheduleConfig(kind="power", **POWER)
    eps = ScheduleConfig(kind="effective_power", **POWER)
    for t in (120, 300, 640):
        lr_p, wd_p = lr_wd_factors(power, t, 1000)
        lr_e, wd_e = lr_wd_factors(eps, t, 1000)
        assert math.sqrt(lr_p * wd_p) == pytest.approx(math.sqrt(lr_e * wd_e))  # eta_eff = sqrt(eta lambda)
        assert math.sqrt(wd_e / lr_e) == pytest.approx(1.0)  # lambda_eff constant under EPS
        assert math.sqrt(wd_p / lr_p) == pytest.approx((t / 100) ** 0.25)  # ... and growing under PS


def test_warmup_is_continuous_when_t0_is_inside_it() -> None:
    config = ScheduleConfig(kind="power", warmup=10, decay=0, power_t0=5)
    assert lr_at(config, 10) == pytest.approx(math.sqrt(0.5))
    assert lr_at(config, 9.999) == pytest.approx(math.sqrt(0.5), rel=1e-3)
    assert lr_at(config, 5) == pytest.approx(0.5)  # (5/10) * s(5) with s(5) = 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="wsd", warmup=10), "exactly one of decay"),
        (dict(kind="wsd", decay=5, decay_fraction=0.1), "exactly one of decay"),
        (dict(kind="cosine", decay=5), "no separate decay stage"),
        (dict(kind="wsd", decay=5, decay_shape="exponential", min_lr_ratio=0.0), "min_lr_ratio > 0"),
        (dict(kind="power", decay=5), "power_t0"),
        (dict(kind="linear"), "kind must be one of"),
        (dict(kind="wsd", decay=5, decay_shape="step"), "decay_shape"),
        (dict(kind="wsd", decay=5, min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(kind="wsd", decay=-1), "decay must be"),
        (dict(kind="wsd", decay=1, unit="epochs"), "unit"),
        # settings the kind ignores, set to other than their defaults
        (dict(kind="wsd", decay=5, power_t0=100), r"power_t0=100 has no effect"),
        (dict(kind="cosine", power_exponent=0.25), r"power_exponent=0.25 has no effect"),
        (dict(kind="constant", min_lr_ratio=0.1), r"min_lr_ratio=0.1 has no effect \('constant' has no decay\)"),
        (dict(kind="constant", decay_shape="cosine"), r"decay_shape='cosine' has no effect"),
        (dict(kind="cosine", decay_shape="exponential", min_lr_ratio=0.1), r"decay_shape='exponential' has no effect"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**kwargs)


def test_stages_must_fit_the_total() -> None:
    with pytest.raises(ValueError, match="exceed the total"):
        lr_wd_factors(ScheduleConfig(kind="wsd", warmup=60, decay=50), 1, 100)


def test_rampup_batch_sizes_and_lr_scaling() -> None:
    ramp = BatchRampup(start=4, target=16, rampup_tokens=1000, micro_batch=4)
    # start + floor(12 * tokens / 1000 / 4) * 4
    tokens = [0, 333, 334, 666, 667, 999, 1000, 10**6]
    assert [ramp.batch_size(x) for x in tokens] == [4, 4, 8, 8, 12, 12, 16, 16]
    assert ramp.lr_scale(0) == pytest.approx(0.5)  # sqrt(4 / 16)
    assert ramp.lr_scale(500) == pytest.approx(math.sqrt(8 / 16))
    assert ramp.lr_scale(2000) == 1.0
    assert BatchRampup(4, 16, 1000, 4, ref_batch=8).lr_scale(2000) == pytest.approx(math.sqrt(2))
    assert BatchRampup(4, 16, 0, 4).batch_size(0) == 16
    with pytest.raises(ValueError, match="multiple of micro_batch"):
        BatchRampup(start=6, target=16, rampup_tokens=10, micro_batch=4)
    with pytest.raises(ValueError, match="<= target"):
        BatchRampup(start=32, target=16, rampup_tokens=10, micro_batch=4)


def test_schedule_factors_combine_schedule_rampup_and_units() -> None:
    ramp = BatchRampup(start=2, target=8, rampup_tokens=600, micro_batch=2, tokens_per_sample=10)
    steps = ScheduleConfig(kind="wsd", warmup=4, decay=0, rampup=ramp)
    first = schedule_factors(steps, total=100, step=0, tokens=0)
    assert first.batch_size == 2
    assert first.lr == pytest.approx(0.25 * math.sqrt(2 / 8))  # t = 1 of warmup 4, batch 2 of ref 8
    assert first.wd == 1.0
    later = schedule_factors(steps, total=100, step=10, tokens=300)
    assert later.batch_size == 4 and later.lr == pytest.approx(math.sqrt(4 / 8))
    tokens = ScheduleConfig(kind="wsd", unit="tokens", warmup=80, decay=0, rampup=ramp)
    assert schedule_factors(tokens, total=10_000, step=0, tokens=0).lr == pytest.approx(20 / 80 * 0.5)
    plain = ScheduleConfig(kind="wsd", unit="tokens", warmup=100, decay=0)
    assert schedule_factors(plain, total=1000, step=0, tokens=0, batch_tokens=25).lr == pytest.approx(0.25)
    with pytest.raises(ValueError, match="batch_tokens"):
        schedule_factors(plain, total=1000, step=0, tokens=0)


def test_simulate_schedule_accumulates_rampup_tokens() -> None:
    ramp = BatchRampup(start=2, target=4, rampup_tokens=40, micro_batch=2, tokens_per_sample=10)
    config = ScheduleConfig(kind="wsd", unit="tokens", warmup=0, decay_fraction=0.5, rampup=ramp)
    rows = simulate_schedule(config, 4)
    assert [(step, tokens, f.batch_size) for step, tokens, f in rows] == [(0, 0, 2), (1, 20, 2), (2, 40, 4), (3, 80, 4)]
    # total = 120 tokens; decay over the last 60: the last update (t = 120) ends at the floor 0
    assert rows[-1][2].lr == pytest.approx(0.0, abs=1e-12)
    assert rows[1][2].lr == pytest.approx(math.sqrt(2 / 4))  # t = 40 < 60: stable, half batch


def test_config_dict_round_trip() -> None:
    ramp = BatchRampup(start=2, target=8, rampup_tokens=600, micro_batch=2)
    config = ScheduleConfig(kind="effective_power", warmup=3, decay_fraction=0.1, power_t0=50, rampup=ramp)
    assert ScheduleConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown ScheduleConfig"):
        ScheduleConfig.from_dict({"kind": "wsd", "decay": 1, "warmup_steps": 3})


def test_plot_schedule_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_schedule(ScheduleConfig(**WSD), 100, tmp_path / "s.png")


def test_plot_schedule_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    ramp = BatchRampup(start=2, target=8, rampup_tokens=600, micro_batch=2)
    config = ScheduleConfig(kind="effective_power", warmup=10, decay=20, power_t0=30, min_lr_ratio=0.125,
                            decay_shape="exponential", rampup=ramp)
    path = plot_schedule(config, 100, tmp_path / "schedule.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind, why", [("constant", "the lr stays at its peak"), ("cosine", "decays along a cosine")])
def test_a_decay_on_a_kind_without_a_decay_stage_names_the_kind_and_the_setting(kind: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        ScheduleConfig(kind=kind, decay_fraction=0.2)
    message = str(info.value)
    assert f"kind={kind!r}" in message and why in message and "decay_fraction=0.2 is set" in message, message
    if kind == "constant":
        assert "cosine" not in message, message  # the message explains the kind that was set, not cosine's decay


def test_plot_schedule_keeps_the_previous_png_when_the_write_fails(monkeypatch, tmp_path) -> None:
    """Written through a temporary name: a write that fails (here fsync, as on a full disk) leaves the old plot."""
    pytest.importorskip("matplotlib")
    path = plot_schedule(ScheduleConfig(**WSD), 100, tmp_path / "schedule.png")
    before = path.read_bytes()

    def failing_fsync(fd):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="no space"):
        plot_schedule(ScheduleConfig(kind="cosine", warmup=50), 100, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]  # no temporary file left
