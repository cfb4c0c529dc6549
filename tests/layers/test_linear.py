"""AlignedLinear / padded_linear: the same function, gradients and state dict as nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.modules import linear as linear_module
from hybridlm.modules.linear import MIN_PADDED_ROWS, AlignedLinear, padded_linear, pads
from tests.helpers import rel_err


@pytest.mark.parametrize("out_features,bias", [(37, True), (37, False), (40, True), (2580, False)])
def test_padded_linear_matches_linear_float64(out_features, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(out_features, 24, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(out_features, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    weight_y = torch.randn(3, 5, out_features, generator=g, dtype=torch.float64)
    inputs = [t for t in (x, w, b) if t is not None]

    y = padded_linear(x, w, b, multiple=8)
    y_ref = F.linear(x, w, b)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad((y * weight_y).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * weight_y).sum(), inputs)
    for got, want in zip(grads, grads_ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_aligned_linear_keeps_nn_linear_parameters_and_state_dict():
    torch.manual_seed(0)
    plain = nn.Linear(16, 37, bias=True)
    aligned = AlignedLinear(16, 37, bias=True)
    assert isinstance(aligned, nn.Linear)  # tensor parallelism's ColwiseParallel and the init see a Linear
    assert aligned.state_dict().keys() == plain.state_dict().keys()
    aligned.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(aligned(x), plain(x), rtol=0, atol=0)  # CPU: the plain path


def test_pads_only_plain_cuda_weights_of_odd_width_with_many_rows():
    """The padding's conditions, on stand-ins for a CUDA input (CPU tests cannot make one): odd width, enough rows,
    a plain weight; a DTensor weight (tensor parallelism: anything with `to_local`) and CPU inputs take the plain
    path."""
    from types import SimpleNamespace

    weight = torch.zeros(2580, 768)
    sharded = SimpleNamespace(to_local=lambda: weight)

    def cuda_input(rows):
        return SimpleNamespace(is_cuda=True, numel=lambda: rows * 768)

    assert pads(2580, 768, weight, cuda_input(MIN_PADDED_ROWS))
    assert not pads(2580, 768, weight, cuda_input(MIN_PADDED_ROWS - 1))  # decoding: few rows
    assert not pads(2560, 768, weight, cuda_input(4 * MIN_PADDED_ROWS))  # aligned already
    assert not pads(2580, 768, sharded, cuda_input(4 * MIN_PADDED_ROWS))
    assert not pads(2580, 768, weight, torch.zeros(4 * MIN_PADDED_ROWS, 768))  # CPU


def test_mixers_project_through_aligned_linear():
    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from hybridlm.models.presets import get_preset

    config = get_preset("tiny", ssm_mixer="fast_weight", fw_rule="1A")
    assert isinstance(FastWeightMixer(config, layer_idx=0).in_proj, AlignedLinear)
    assert isinstance(Mamba2Mixer(get_preset("tiny"), layer_idx=0).in_proj, AlignedLinear)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [MIN_PADDED_ROWS - 1, 2 * MIN_PADDED_ROWS])
def test_aligned_linear_cuda_pads_many_rows_and_matches(rows, monkeypatch):
    calls = []
    real = linear_module.padded_linear
    monkeypatch.setattr(linear_module, "padded_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    aligned = AlignedLinear(256, 1546, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight_y = torch.randn(rows, 1546, device="cuda", dtype=torch.bfloat16)
    y = aligned(x)
    grads = torch.autograd.grad((y.float() * weight_y).sum(), (x, aligned.weight, aligned.bias))
    assert len(calls) == (rows >= MIN_PADDED_ROWS)
    x64, w64, b64 = (t.detach().double() for t in (x, aligned.weight, aligned.bias))
    inputs = [t.requires_grad_(True) for t in (x64, w64, b64)]
    y_ref = F.linear(*inputs)
    grads_ref = torch.autograd.grad((y_ref * weight_y.double()).sum(), inputs)
    assert rel_err(y, y_ref) < 2e-2
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) < 2e-2
