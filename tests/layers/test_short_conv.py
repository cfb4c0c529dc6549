"""Short causal conv: reference conv, exact state passing, packed documents == each alone."""

import pytest
import torch
import torch.nn.functional as F

from hybridlm.modules import ShortConvolution, causal_conv1d, cu_seqlens_from_position_ids


def _reference(x, weight, bias):
    """Left-zero-padded depthwise conv1d + SiLU, as transformers' falcon_h1 torch path computes it."""
    channels, kernel = weight.shape
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=kernel - 1, groups=channels)
    return F.silu(out[..., : x.shape[1]]).transpose(1, 2)


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_matches_reference_conv(kernel):
    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel, bias=True, activation="silu")
    x = torch.randn(2, 11, 6)
    y, _ = conv(x)
    torch.testing.assert_close(y, _reference(x, conv.weight, conv.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [1, 2, 5, 10])
def test_state_passing_is_exact(split):
    torch.manual_seed(1)
    conv = ShortConvolution(5, 4, bias=True)
    x = torch.randn(3, 11, 5)
    full, full_state = conv(x, output_final_state=True)
    first, state = conv(x[:, :split], output_final_state=True)
    second, final = conv(x[:, split:], initial_state=state, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, full_state)
    torch.testing.assert_close(full_state, x[:, -3:])  # the state is the last K-1 inputs


def test_step_by_step_equals_full():
    torch.manual_seed(2)
    conv = ShortConvolution(4, 4, bias=False)
    x = torch.randn(2, 9, 4)
    full, _ = conv(x)
    state, steps = None, []
    for t in range(9):
        y, state = conv(x[:, t : t + 1], initial_state=state, output_final_state=True)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_documents_equal_each_alone(with_state):
    torch.manual_seed(3)
    conv = ShortConvolution(5, 4, bias=True)
    lengths = [5, 1, 2, 7]  # some shorter than K - 1
    cu = torch.tensor([0, 5, 6, 8, 15])
    x = torch.randn(1, 15, 5)
    states = torch.randn(4, 3, 5) if with_state else None
    packed, finals = conv(x, cu_seqlens=cu, initial_state=states, output_final_state=True)
    for n in range(len(lengths)):
        start, end = int(cu[n]), int(cu[n + 1])
        alone, final = conv(x[:, start:end], initial_state=None if states is None else states[n : n + 1],
                            output_final_state=True)
        torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(finals[n : n + 1], final, rtol=0, atol=0)
    # Without the boundaries the second document would see the first one's tail.
    unpacked, _ = conv(x)
    assert not torch.allclose(unpacked[:, 5:6], packed[:, 5:6], atol=1e-4)


def test_position_ids_mark_the_same_boundaries():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 5, 6, 10, 12]


def test_bad_state_shape_is_rejected():
    x = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, torch.randn(4, 4), initial_state=torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, torch.randn(4, 4), initial_state=torch.zeros(1, 3, 4), cu_seqlens=torch.tensor([0, 2, 6]))
