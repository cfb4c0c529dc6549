"""`train_on_task`: the plain update bit for bit, the best evaluation restored, compiled training, a NaN score
through a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridlm.experiments.addition import MODEL_VOCAB_SIZE, train_batch
from hybridlm.experiments.models import build_model, task_config
from hybridlm.experiments.train import TrainingInterrupted, generator_state, train_on_task
from hybridlm.training.optim import build_param_groups
from hybridlm.training.schedules import ScheduleConfig, schedule_factors


@pytest.mark.parametrize("name", ["hybrid-fw-1A", "transformer"])
def test_train_on_task_is_the_plain_update_bit_for_bit(name):
    """float32 on the CPU: `train_on_task` against the update written out here (schedule, AdamW over the library's
    parameter groups, clipping), the same batches: every loss and every final weight exactly equal."""
    steps, lr, warmup, clip = 6, 3e-3, 2, 0.5
    model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
    rng = np.random.default_rng([0, 7])
    result = train_on_task(model, lambda step: train_batch(rng, 4, max_width=3), steps=steps, lr=lr, warmup=warmup,
                           grad_clip=clip, log_every=1, batch_state=generator_state(rng))

    reference = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0).train()
    rng = np.random.default_rng([0, 7])
    optimizer = torch.optim.AdamW(build_param_groups(reference.named_parameters(), lr=lr, weight_decay=0.1), lr=lr,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    schedule = ScheduleConfig(kind="cosine", warmup=warmup, min_lr_ratio=0.1)
    losses = []
    for step in range(steps):
        factors = schedule_factors(schedule, total=steps, step=step)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * factors.lr
            group["weight_decay"] = group["base_weight_decay"] * factors.wd
        loss = reference(**train_batch(rng, 4, max_width=3)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        optimizer.step()
        losses.append((step + 1, loss.item()))

    assert result.losses == losses
    trained = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(trained[key], value), key


def test_a_nan_score_goes_through_a_checkpoint(tmp_path):
    """Evaluations may score NaN (a diverged model): the checkpoint keeps them and the resumed run reports them."""
    def run(stop_at=None):
        model = build_model(task_config("transformer", vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
        rng = np.random.default_rng(1)
        return train_on_task(model, lambda step: train_batch(rng, 2, max_width=2), steps=4, lr=1e-3, warmup=1,
                             eval_fn=lambda m: (math.nan, math.inf), eval_every=1, checkpoint=tmp_path / "run.ckpt",
                             batch_state=generator_state(rng), should_stop=lambda: stop_at is not None)

    with pytest.raises(TrainingInterrupted):
        run(stop_at=1)
    result = run()
    assert [e["step"] for e in result.evals] == [1, 2, 3, 4]
    assert all(math.isnan(e["score"]) and e["loss"] == math.inf for e in result.evals)
    assert math.isnan(result.best_score) and result.best_loss == math.inf


class _Toy(torch.nn.Module):
    """Regress a constant: loss = (w - 3)^2, so training moves w towards 3."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
            {"up_proj": torch.nn.Linear(1, 1, bias=False)})})})

    def forward(self, input_ids, labels):
        w = self.layers["0"]["mlp"]["up_proj"].weight.sum()
        return type("Out", (), {"loss": (w - 3.0) ** 2})()


def test_train_on_task_learns_and_restores_the_best_evaluation():
    torch.manual_seed(0)
    model = _Toy()
    seen = []
    scores = iter([0.2, 0.9, 0.9, 0.5, 0.1])  # steps 2, 4, 6, 8, 10: best 0.9, tie -> lower loss (step 6)
    losses = iter([1.0, 0.7, 0.6, 0.1, 0.1])

    def eval_fn(m):
        seen.append(m.layers["0"]["mlp"]["up_proj"].weight.item())
        return next(scores), next(losses)

    def batch_fn(step):
        return {"input_ids": torch.zeros(1, 1, dtype=torch.long), "labels": torch.zeros(1, 1, dtype=torch.long)}

    start = model.layers["0"]["mlp"]["up_proj"].weight.item()
    result = train_on_task(model, batch_fn, steps=10, lr=0.3, weight_decay=0.0, warmup=2, eval_fn=eval_fn,
                           eval_every=2, log_every=5)
    assert [e["step"] for e in result.evals] == [2, 4, 6, 8, 10]
    assert result.best_step == 6 and result.best_score == 0.9
    assert model.layers["0"]["mlp"]["up_proj"].weight.item() == pytest.approx(seen[2])
    assert abs(seen[-1] - 3.0) < abs(start - 3.0)  # it did train towards the target
    assert [s for s, _ in result.losses] == [5, 10]


@pytest.mark.parametrize("name", ["hybrid-fw-1A", "mamba2"])
def test_compiled_training_matches_eager(name):
    batches = [train_batch(np.random.default_rng(s), 4, max_width=5) for s in range(3)]
    losses = {}
    for compile in (False, True):
        model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
        result = train_on_task(model, lambda step: batches[step], steps=3, lr=1e-2, warmup=1, log_every=1,
                               compile=compile)
        losses[compile] = [loss for _, loss in result.losses]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[False][2] != losses[False][0]  # it trained


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor with CUDA graphs)")
def test_compiled_training_on_cuda_follows_eager():
    batches = [train_batch(np.random.default_rng(s), 64, max_width=8) for s in range(20)]
    losses = {}
    for compile in (False, True):
        model = build_model(task_config("hybrid-fw-3A", vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
        result = train_on_task(model, lambda step: batches[step], steps=20, lr=3e-3, warmup=2, log_every=5,
                               device="cuda", compile=compile)
        losses[compile] = [loss for _, loss in result.losses]
    # bf16 autocast on both sides, different kernels (inductor's fused ones): close, not equal
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_every_run_of_a_worker_trains_compiled():
    """A worker process trains run after run: each run's model compiles afresh, also past dynamo's recompile limit
    (set to 1 here; 8 in torch), where a new model's forward would otherwise fall back to eager silently. (The
    limit through dynamo's own `config.patch`: pytest's monkeypatch of the old alias `cache_size_limit` is never
    undone, and the limit of 1 leaked into every later test.)"""
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=1):
        for name in ("transformer", "fw-1A", "mamba2"):
            before = counters["stats"]["unique_graphs"]
            model = build_model(task_config(name, vocab_size=16, size="tiny"), seed=0)
            ids = torch.randint(3, 16, (2, 12))
            train_on_task(model, lambda step: {"input_ids": ids, "labels": ids}, steps=1, lr=1e-3, warmup=0,
                          device="cpu", compile=True)
            assert counters["stats"]["unique_graphs"] > before, name
    assert torch._dynamo.config.recompile_limit == limit
