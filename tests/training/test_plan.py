"""World-size planning: the run's length, schedule and batch rampup at a number of data-parallel ranks."""

from __future__ import annotations

import pytest

from hybridlm.training.config import ConfigError, load_config
from hybridlm.training.plan import plan_steps, schedule_config


def test_decay_longer_than_the_run_is_an_error_but_a_long_warmup_is_shortened():
    with pytest.raises(ConfigError, match=r"schedule\.decay: .*300 steps: train\.steps"):
        load_config(None, ["schedule.decay_fraction=null", "schedule.decay=500"])  # 300 steps at any number of ranks
    config = load_config(None, ["train.steps=10"])  # warmup 30 > 10 steps
    schedule, total, note = schedule_config(config, world_size=1)
    assert total == 10 and schedule.warmup == pytest.approx(1.0) and "warmup shortened" in note  # 10 - decay 9


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


@pytest.mark.parametrize("rampup", [False, True])
def test_a_resumed_run_plans_the_rest_at_its_own_ranks(rampup):
    """`start=(updates, tokens)` done at 2 ranks, planned on at 1: a token budget ends at the same token count (the
    updates left are those of the smaller batch), a token-unit schedule's total is those tokens, and resuming at the
    ranks the run was started with plans exactly the uninterrupted run. A train.steps below the updates done is
    returned as it is, for the trainer to refuse."""
    sizes = ["batch.micro_batch=2", "batch.grad_accum=2", "batch.seq_len=64", "schedule.unit=tokens",
             "schedule.warmup=512", "train.steps=null", "train.tokens=20480"]
    if rampup:
        sizes += ["batch.rampup_start=2", "batch.rampup_tokens=4096"]
    config = load_config(None, sizes)
    whole = plan_steps(config, world_size=2)
    if not rampup:
        assert whole == (40, 20480)  # 512 tokens an update at 2 ranks
    done = plan_steps(load_config(None, [*sizes, "train.steps=10"]), world_size=2)  # the first 10 updates at 2 ranks
    assert plan_steps(config, world_size=2, start=done) == whole
    steps, tokens = plan_steps(config, world_size=1, start=done)
    assert tokens >= 20480 and tokens - 256 < 20480  # the budget, to one update of 256 tokens at 1 rank
    assert steps - done[0] > whole[0] - done[0]  # smaller batches: more updates
    if not rampup:
        assert steps - done[0] == -(-(20480 - done[1]) // 256)
    assert schedule_config(config, world_size=1, start=done)[1] == tokens
    shorter = load_config(None, [*sizes, "train.steps=4"])
    assert plan_steps(shorter, world_size=1, start=done)[0] == 4
