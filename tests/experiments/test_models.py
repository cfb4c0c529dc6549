"""Benchmark model names -> configs, and the small training loop (schedule, best-checkpoint restore)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridlm.experiments.models import describe, model_fields, parse_model_list, task_config
from hybridlm.experiments.train import train_on_task


@pytest.mark.parametrize(
    "name, expected",
    [
        ("transformer", dict(ssm_mixer="none", use_attention=True)),
        ("mamba2", dict(ssm_mixer="mamba2", mamba_init="falcon_h1", use_attention=False)),
        ("mamba2-ref", dict(ssm_mixer="mamba2", mamba_init="mamba2", use_attention=False)),
        ("hybrid-mamba2-ref", dict(ssm_mixer="mamba2", mamba_init="mamba2", use_attention=True)),
        ("fw-1A", dict(ssm_mixer="fast_weight", fw_rule="1A", fw_window=1, fw_pairing="shifted", use_attention=False)),
        ("fw-3A", dict(fw_rule="3A", fw_window=3, fw_pairing="shifted")),
        ("fw-3A-w5-same", dict(fw_rule="3A", fw_window=5, fw_pairing="same_step")),
        ("fw-1A-same", dict(fw_rule="1A", fw_pairing="same_step")),
        ("fw-1-eta", dict(fw_rule="1", fw_step_size="direct")),
        ("hybrid-fw-3A", dict(ssm_mixer="fast_weight", fw_rule="3A", fw_window=3, use_attention=True)),
        ("hybrid:mamba2", dict(ssm_mixer="mamba2", use_attention=True)),
    ],
)
def test_model_names(name, expected):
    fields = model_fields(name)
    assert {k: fields[k] for k in expected} == expected
    config = task_config(name, vocab_size=16, size="tiny")
    assert config.vocab_size == 16 and config.hidden_size == 32
    assert describe(name)


@pytest.mark.parametrize("name", ["fw-4A", "fw-1A-w3", "fw-1A-fast", "hybrid-transformer", "gpt", "fw-3A-w",
                                  "fw-3A-w0", "hybrid-fw-3-w0", "mamba2-fast"])
def test_bad_model_names_raise(name):
    with pytest.raises(ValueError):
        model_fields(name)


def test_mamba2_ref_starts_from_the_reference_init():
    """"mamba2-ref" builds its Mamba-2 mixers with dt = softplus(dt_bias) spread over [1e-3, 1e-1] and A in [1, 16];
    "mamba2" with Falcon-H1's dt_bias = 1 in every head."""
    import torch.nn.functional as F

    from hybridlm.experiments.models import build_model
    from hybridlm.layers.mamba2 import Mamba2Mixer

    def mixers(name):
        model = build_model(task_config(name, vocab_size=16, size="small"), seed=0)
        return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]

    for mixer in mixers("mamba2-ref"):
        dt, a = F.softplus(mixer.dt_bias.detach()), mixer.A_log.detach().exp()
        assert 1e-3 * 0.999 <= dt.min() < dt.max() <= 1e-1 * 1.001
        assert 1.0 <= a.min() < a.max() <= 16.0
    assert all(bool((m.dt_bias == 1).all()) for m in mixers("mamba2"))
    assert describe("mamba2-ref") == "Mamba-2 (reference init)"


def test_model_list_parsing():
    assert parse_model_list("fw-1A, fw-3A\nmamba2") == ["fw-1A", "fw-3A", "mamba2"]
    with pytest.raises(ValueError, match="repeats"):
        parse_model_list("fw-1A,fw-1A")
    with pytest.raises(ValueError, match="repeats a name: hybrid:fw-1A and hybrid-fw-1A"):  # one run name
        parse_model_list("hybrid:fw-1A hybrid-fw-1A")
    assert parse_model_list("hybrid:fw-1A,fw-1A") == ["hybrid:fw-1A", "fw-1A"]


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


def test_medium_size_is_wider_and_deeper_than_small():
    small, medium = task_config("fw-1A", vocab_size=16), task_config("fw-1A", vocab_size=16, size="medium")
    assert (medium.hidden_size, medium.num_hidden_layers) == (2 * small.hidden_size, 2 * small.num_hidden_layers)
    assert medium.mamba_n_heads * medium.mamba_d_head == medium.mamba_d_ssm


@pytest.mark.parametrize("name", ["transformer", "mamba2", "fw-1A", "fw-3A-same", "hybrid-fw-1"])
def test_base_size_has_the_paper_language_models_shape(name):
    """`base` is the fast-weight paper's 124M-130M LM shape (d_model 768, 12 blocks, heads of 64) for every model."""
    config = task_config(name, vocab_size=16, size="base")
    assert (config.hidden_size, config.num_hidden_layers) == (768, 12)
    assert config.num_attention_heads * config.head_dim == config.hidden_size
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_d_ssm == 2 * config.hidden_size


@pytest.mark.parametrize("name", ["hybrid-fw-1A", "mamba2"])
def test_compiled_training_matches_eager(name):
    from hybridlm.experiments.addition import MODEL_VOCAB_SIZE, train_batch
    from hybridlm.experiments.models import build_model

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
    from hybridlm.experiments.addition import MODEL_VOCAB_SIZE, train_batch
    from hybridlm.experiments.models import build_model

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

    from hybridlm.experiments.models import build_model

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
