"""Experiment model names -> configs and their sizes."""

from __future__ import annotations

import pytest

from hybridlm.experiments.models import describe, model_fields, parse_model_list, task_config


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
