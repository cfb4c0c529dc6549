"""StepGuard: non-finite losses / gradient norms skip the update, a streak raises, spikes optionally skip."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hybridlm.training.guard import StepGuard, TrainingDivergedError


def test_nan_loss_skips_the_update_and_leaves_weights_and_moments_alone(caplog) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    guard = StepGuard(3)
    x = torch.randn(5, 4)

    model(x).square().mean().backward()  # a good step first, so AdamW has state
    assert guard.check(model(x).square().mean(), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]

    bad = model(x * float("nan")).square().mean()
    bad.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert math.isnan(norm.item())
    with caplog.at_level(logging.WARNING, logger="hybridlm.training.guard"):
        assert guard.check(bad, norm, optimizer=optimizer, step=7) is False
    assert "step 7: non-finite loss nan" in caplog.text
    assert all(p.grad is None for p in model.parameters())  # zeroed by the guard
    optimizer.step()  # even a stray step changes nothing: no gradients
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))
    assert (guard.consecutive_skips, guard.total_skips) == (1, 1)


def test_streak_raises_and_a_good_step_resets_it() -> None:
    guard = StepGuard(3)
    assert guard.check(float("inf")) is False
    assert guard.check(1.0, float("nan")) is False
    assert guard.check(2.0, 0.5) is True  # resets the streak
    assert guard.consecutive_skips == 0 and guard.total_skips == 2
    assert guard.check(torch.tensor(float("nan"))) is False
    assert guard.check(float("-inf")) is False
    with pytest.raises(TrainingDivergedError, match=r"3 consecutive optimizer updates skipped \(last at step 12: non-finite gradient norm inf\)"):
        guard.check(1.0, torch.tensor(float("inf")), step=12)
    assert guard.total_skips == 5


def test_spike_detection_uses_the_median_of_accepted_losses() -> None:
    guard = StepGuard(2, spike_factor=2.0, spike_window=4)
    assert guard.check(50.0)  # fewer than spike_window losses seen: no spike test yet
    for loss in (3.0, 2.0, 2.2):
        assert guard.check(loss)
    # window now [50, 3, 2, 2.2]: median 2.6, threshold 5.2
    assert guard.check(5.1) is True
    assert guard.check(5.3) is False  # window [3, 2, 2.2, 5.1]: median 2.6
    assert guard.reason_to_skip(5.3, None).startswith("loss spike 5.3 > 2 x median 2.6")
    state = guard.state_dict()
    fresh = StepGuard(2, spike_factor=2.0, spike_window=4)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state == {"consecutive_skips": 1, "total_skips": 1,
                                           "recent_losses": [3.0, 2.0, 2.2, 5.1]}
    with pytest.raises(TrainingDivergedError):
        fresh.check(100.0)


def test_no_spike_check_by_default_and_argument_validation() -> None:
    guard = StepGuard()
    for loss in [1.0] * 200:
        guard.check(loss)
    assert guard.check(1e6) is True
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        StepGuard(0)
    with pytest.raises(ValueError, match="spike_factor"):
        StepGuard(spike_factor=0.5)
