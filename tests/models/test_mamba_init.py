"""`HybridConfig.mamba_init`: Falcon-H1's Mamba-2 initialisation (the default) or Mamba-2's reference one."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM

HEADS = 64  # per layer: enough draws to see the ranges filled, not just respected


def new_model(seed: int = 0, **changes) -> HybridForCausalLM:
    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  head_dim=8, mamba_d_ssm=256, mamba_n_heads=HEADS, mamba_d_state=4, mamba_n_groups=1)
    fields.update(changes)
    torch.manual_seed(seed)
    return HybridForCausalLM(HybridConfig(**fields))


def mixers(model: HybridForCausalLM) -> list[Mamba2Mixer]:
    return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]


def test_falcon_h1_init_is_the_default():
    for mixer in mixers(new_model()):
        assert torch.equal(mixer.A_log.detach(), torch.log(torch.arange(1, HEADS + 1, dtype=torch.float32)))
        assert torch.equal(mixer.dt_bias.detach(), torch.ones(HEADS))
        assert torch.equal(mixer.D.detach(), torch.ones(HEADS))


def test_mamba2_init_draws_a_and_dt_in_the_reference_ranges():
    """A = -U[1, 16], dt log-uniform in [1e-3, 1e-1] through softplus(dt_bias), D = 1; every layer its own draw,
    and the same seed the same draw."""
    model = new_model(mamba_init="mamba2")
    layers = mixers(model)
    assert len(layers) == 2
    for mixer in layers:
        a = mixer.A_log.detach().exp()
        dt = F.softplus(mixer.dt_bias.detach().double())
        assert a.min() >= 1.0 and a.max() <= 16.0 and a.max() - a.min() > 10.0
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
        log_dt = dt.log()
        assert log_dt.max() - log_dt.min() > 0.7 * (math.log(1e-1) - math.log(1e-3))  # spread, not one value
        assert torch.equal(mixer.D.detach(), torch.ones(HEADS))
    assert not torch.equal(layers[0].A_log, layers[1].A_log)
    again = mixers(new_model(mamba_init="mamba2"))
    assert all(torch.equal(a.dt_bias, b.dt_bias) and torch.equal(a.A_log, b.A_log) for a, b in zip(layers, again))


def test_mamba2_init_leaves_loaded_weights_alone(tmp_path):
    model = new_model(mamba_init="mamba2")
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.A_log.fill_(0.25)
            mixer.dt_bias.fill_(-2.0)
    model.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.mamba_init == "mamba2"
    for mixer in mixers(loaded):
        assert torch.equal(mixer.A_log.detach(), torch.full((HEADS,), 0.25))
        assert torch.equal(mixer.dt_bias.detach(), torch.full((HEADS,), -2.0))


def test_unknown_mamba_init_is_refused():
    with pytest.raises(ValueError, match="mamba_init"):
        HybridConfig(mamba_init="xavier")
