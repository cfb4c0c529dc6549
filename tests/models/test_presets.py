"""Presets build on the meta device with the parameter counts of the released models."""

import pytest
import torch

from hybridlm.models.commands import count_parameters
from hybridlm.models.configuration import HybridLMConfig
from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset, list_presets, nominal_parameters

# Parameter counts of the released Falcon-H1 checkpoints (untied embeddings).
RELEASED = {
    "falcon-h1-0.5b": 0.52e9,
    "falcon-h1-1.5b": 1.55e9,
    "falcon-h1-1.5b-deep": 1.55e9,
    "falcon-h1-3b": 3.15e9,
    "falcon-h1-7b": 7.59e9,
    "falcon-h1-34b": 33.6e9,
}


def _name_cases():
    for name in list_presets():
        marks = []
        if name == "falcon-h1-7b":  # as released: 7.59B parameters, 8.4% above the name
            marks = [pytest.mark.xfail(strict=True, reason="the released 7B has 7.59B parameters")]
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_name_cases()))
def test_parameter_count_within_5_percent_of_the_name(name):
    count = count_parameters(get_preset(name))
    assert abs(count / nominal_parameters(name) - 1) < 0.05, f"{name}: {count / 1e9:.3f}B"


@pytest.mark.parametrize("name", list(RELEASED))
def test_parameter_count_matches_the_release(name):
    count = count_parameters(get_preset(name))
    assert abs(count / RELEASED[name] - 1) < 0.01, f"{name}: {count / 1e9:.3f}B"


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = HybridForCausalLM(HybridLMConfig.from_hybrid(get_preset("falcon-h1-34b")))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.layers[0].ssm.groups == 2


def test_tiny_runs_on_cpu():
    torch.manual_seed(0)
    model = HybridForCausalLM(HybridLMConfig.from_hybrid(get_preset("tiny"))).eval()
    ids = torch.randint(0, 512, (2, 33))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 33, 512) and torch.isfinite(out.loss)


def test_overrides_and_unknown_names():
    assert get_preset("tiny", ssm_mixer="none").ssm_mixer == "none"
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("falcon-h1-2b")
    with pytest.raises(ValueError, match="not_a_field"):
        get_preset("tiny", not_a_field=1)
