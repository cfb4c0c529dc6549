"""The muP multiplier helper: a multiplier of 1 costs nothing and changes nothing; any other scales."""

import torch

from hybridlm.modules.multiplier import scaled


def test_scaled_skips_a_unit_multiplier_and_scales_otherwise():
    t = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert scaled(t, 1.0) is t and scaled(t, 1) is t
    out = scaled(t, 0.37)
    assert torch.equal(out, t * 0.37)
    out.sum().backward()
    assert torch.equal(t.grad, torch.full_like(t, 0.37))
