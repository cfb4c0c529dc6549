"""Mamba-2 mixer: parity with transformers' FalconH1Mixer, packed documents == alone, cached decoding == full."""

import pytest
import torch
from transformers import FalconH1Config
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

from hybridlm.layers import LayerCache, Mamba2Mixer
from hybridlm.models.config import HybridConfig
from tests.layers.packed_prefill import check_packed_prefill_matches_alone

ATOL = 1e-5
MULTIPLIERS = dict(ssm_multiplier_z=0.5, ssm_multiplier_x=1.5, ssm_multiplier_B=0.7, ssm_multiplier_C=1.3,
                   ssm_multiplier_dt=0.6)


def make_config(**changes) -> HybridConfig:
    fields = dict(hidden_size=24, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6,
                  mamba_n_groups=2, mamba_chunk_size=4, num_attention_heads=2, **MULTIPLIERS)
    fields.update(changes)
    return HybridConfig(**fields)


def make_mixer(config: HybridConfig, seed: int = 0) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():  # move the SSM scalars off their (structured) init
        mixer.A_log.copy_(torch.randn(config.mamba_n_heads) * 0.5)
        mixer.dt_bias.copy_(torch.randn(config.mamba_n_heads))
        mixer.D.copy_(torch.randn(config.mamba_n_heads))
        if mixer.norm is not None:
            mixer.norm.weight.copy_(1 + 0.3 * torch.randn(config.mamba_d_ssm))
    return mixer


@pytest.mark.parametrize(
    "changes",
    [
        dict(mamba_rms_norm=False, mamba_n_groups=1),
        dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
        dict(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_conv_bias=False, mamba_proj_bias=True),
        dict(time_step_limit=(0.05, 0.4), projectors_bias=True),
    ],
    ids=["plain-gate", "norm-after-gate", "norm-before-gate-biases", "dt-limit"],
)
def test_matches_falcon_h1_mixer(changes):
    config = make_config(**changes)
    ours = make_mixer(config)
    ref_config = FalconH1Config(
        hidden_size=24, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6,
        mamba_n_groups=config.mamba_n_groups, mamba_chunk_size=4, num_attention_heads=2,
        mamba_rms_norm=config.mamba_rms_norm, mamba_norm_before_gate=config.mamba_norm_before_gate,
        mamba_conv_bias=config.mamba_conv_bias, mamba_proj_bias=config.mamba_proj_bias,
        projectors_bias=config.projectors_bias, time_step_limit=config.time_step_limit,
        ssm_multipliers=config.ssm_multipliers, ssm_in_multiplier=1.0,
    )
    ref = FalconH1Mixer(ref_config, layer_idx=0).eval()
    ref.register_buffer("mup_vector", compute_mup_vector(ref_config), persistent=False)
    state = {k.replace("conv.weight", "conv1d.weight").replace("conv.bias", "conv1d.bias"): v
             for k, v in ours.state_dict().items()}
    state["conv1d.weight"] = state["conv1d.weight"].unsqueeze(1)
    ref.load_state_dict(state, strict=True)
    x = torch.randn(2, 11, 24)
    torch.testing.assert_close(ours(x), ref(x), rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("marker", ["cu_seqlens", "position_ids"])
def test_packed_documents_equal_each_alone(marker):
    mixer = make_mixer(make_config(mamba_rms_norm=True))
    cu = torch.tensor([0, 6, 7, 9, 17])
    x = torch.randn(1, 17, 24)
    if marker == "cu_seqlens":
        packed = mixer(x, cu_seqlens=cu)
    else:
        packed = mixer(x, position_ids=torch.cat([torch.arange(n) for n in (6, 1, 2, 8)])[None])
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(packed[:, start:end], mixer(x[:, start:end]), rtol=ATOL, atol=ATOL)
    assert not torch.allclose(packed[:, 6:], mixer(x)[:, 6:], atol=1e-3)  # boundaries matter


def test_cached_decoding_equals_full_forward():
    mixer = make_mixer(make_config())
    x = torch.randn(2, 12, 24)
    full = mixer(x)
    cache = LayerCache()
    outs = [mixer(x[:, :5], cache=cache)]
    for t in range(5, 9):
        outs.append(mixer(x[:, t : t + 1], cache=cache))
    outs.append(mixer(x[:, 9:], cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=ATOL, atol=ATOL)
    assert cache.ssm["conv"].shape == (2, 3, 32 + 2 * 2 * 6)
    assert cache.ssm["ssm"].shape == (2, 4, 8, 6) and cache.ssm["ssm"].dtype == torch.float32


def test_multipliers_change_the_output():
    x = torch.randn(1, 5, 24)
    base = make_mixer(make_config())(x)
    for name in MULTIPLIERS:
        other = make_mixer(make_config(**{name: 2.0}))(x)
        assert not torch.allclose(base, other, atol=1e-4), name


@pytest.mark.parametrize("rms_norm", [False, True])
def test_packed_prefill_states_equal_each_sequence_alone(rms_norm):
    """A padded batch's prefill: the packed prompts leave each cache row the conv tail and SSD state of
    its prompt alone; the next one-token steps (the recurrent path) continue each row exactly."""
    mixer = make_mixer(make_config(mamba_rms_norm=rms_norm)).double()
    g = torch.Generator().manual_seed(3)
    docs = [torch.randn(1, n + 2, 24, generator=g, dtype=torch.float64) for n in (7, 1, 2, 10)]
    check_packed_prefill_matches_alone(mixer, docs)


def test_one_token_step_uses_the_recurrence(monkeypatch):
    """A prefill runs the chunked scan, a one-token step the recurrence itself (on the CPU its torch loop; on CUDA
    "auto" takes its one-kernel form: tests/ops/test_decoding_steps.py)."""
    from hybridlm.ops import ssd as ssd_op

    ran = []
    for name in ("chunk_ssd", "naive_ssd"):
        real = getattr(ssd_op, name)
        monkeypatch.setattr(ssd_op, name, lambda *a, real=real, name=name, **k: ran.append(name) or real(*a, **k))
    mixer = make_mixer(make_config())
    cache = LayerCache()
    mixer(torch.randn(1, 5, 24), cache=cache)
    mixer(torch.randn(1, 1, 24), cache=cache)
    assert ran == ["chunk_ssd", "naive_ssd"]
