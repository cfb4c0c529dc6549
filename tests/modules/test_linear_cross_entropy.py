"""`linear_cross_entropy`: the LM head and its summed cross entropy over row chunks, against the spelled-out form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm.modules.linear_cross_entropy import linear_cross_entropy


def _spelled_out(hidden, weight, targets, multiplier=1.0):
    logits = F.linear(hidden, weight)
    logits = logits if multiplier == 1.0 else logits * multiplier
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def _inputs(n, d, v, dtype, seed=0, ignored=(1, 5)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, generator=g, dtype=dtype) / d**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[list(ignored)] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, None])
@pytest.mark.parametrize("multiplier", [1.0, 0.37])
def test_float64_matches_the_spelled_out_form(chunk_rows, multiplier):
    """Odd sizes (37 rows in chunks of 8: a short last chunk), ignored targets, a muP multiplier: the loss and both
    gradients equal the spelled-out form's, with an incoming gradient other than 1."""
    hidden, weight, targets = _inputs(37, 12, 29, torch.float64)
    ours = linear_cross_entropy(hidden, weight, targets, multiplier=multiplier, chunk_rows=chunk_rows)
    ref = _spelled_out(hidden, weight, targets, multiplier)
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=1e-13)
    got = torch.autograd.grad(2.5 * ours, (hidden, weight))
    want = torch.autograd.grad(2.5 * ref, (hidden, weight))
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ours.dtype == torch.float64


def test_gradcheck():
    hidden, weight, targets = _inputs(7, 5, 11, torch.float64, ignored=(2,))
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, targets, multiplier=1.7, chunk_rows=3), (hidden, weight))


def test_bf16_autocast_keeps_no_logits():
    """Under CPU bf16 autocast the loss equals the spelled-out form (the same bf16 logits, float32 after) and the
    gradients agree within bf16 rounding; the backward keeps dh [N, D], dW [V, D] and the scored count, no [N, V]
    tensor."""
    hidden, weight, targets = _inputs(40, 16, 64, torch.float32, seed=3)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.shape), t)[1], lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets, multiplier=0.5, chunk_rows=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _spelled_out(hidden, weight, targets, 0.5)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    assert sorted(kept) == sorted([torch.Size([]), hidden.shape, weight.shape])  # the scored count, dh, dW
    got = torch.autograd.grad(ours, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_without_grad_nothing_is_computed_or_kept():
    hidden, weight, targets = _inputs(9, 4, 6, torch.float32)
    with torch.no_grad():
        value = linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    assert value.grad_fn is None
    torch.testing.assert_close(value, _spelled_out(hidden, weight, targets).detach())
    frozen = linear_cross_entropy(hidden.detach(), weight.detach(), targets)
    assert frozen.grad_fn is None


def test_one_input_frozen_and_all_ignored():
    hidden, weight, targets = _inputs(6, 4, 5, torch.float64)
    (dh,) = torch.autograd.grad(linear_cross_entropy(hidden, weight.detach(), targets), (hidden,))
    (ref,) = torch.autograd.grad(_spelled_out(hidden, weight.detach(), targets), (hidden,))
    torch.testing.assert_close(dh, ref)
    none = torch.full_like(targets, -100)
    total = linear_cross_entropy(hidden, weight, none)
    assert total.item() == 0
    assert all(g.abs().max() == 0 for g in torch.autograd.grad(total, (hidden, weight)))


def test_bad_input():
    hidden, weight, targets = _inputs(6, 4, 5, torch.float32)
    with pytest.raises(ValueError, match=r"hidden \[N, D\] and weight \[V, D\]"):
        linear_cross_entropy(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets must be integer"):
        linear_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="targets must be integer"):
        linear_cross_entropy(hidden, weight, targets[:4])
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, targets, chunk_rows=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA bf16 autocast)")
def test_cuda_bf16_autocast_matches_the_spelled_out_form():
    """On a GPU under bf16 autocast, a 32K vocabulary in several chunks: the loss equals the spelled-out form's and the
    gradients agree within bf16 rounding."""
    hidden, weight, targets = (t.cuda() for t in _inputs(3000, 256, 32768, torch.float32, seed=4))
    hidden, weight = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets, multiplier=0.5)
        ref = _spelled_out(hidden, weight, targets, 0.5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-3)
    got = torch.autograd.grad(ours, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_a_mean_over_no_targets_has_zero_gradients():
    """The model's mean loss divides the sum by the count of scored targets: with none, the loss is NaN (as
    F.cross_entropy's mean) and the gradients stay zero, not 0 * inf."""
    hidden, weight, targets = _inputs(6, 4, 5, torch.float64)
    none = torch.full_like(targets, -100)
    mean = linear_cross_entropy(hidden, weight, none) / (none != -100).sum()
    assert mean.isnan()
    assert all(g.abs().max() == 0 for g in torch.autograd.grad(mean, (hidden, weight)))


def test_no_second_order_gradients():
    hidden, weight, targets = _inputs(6, 4, 5, torch.float64)
    (dh,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, targets), (hidden,), create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dh.square().sum(), (weight,))


def test_a_bf16_hidden_gradient_is_scaled_before_its_rounding():
    """hidden in bf16 without autocast: the incoming gradient (1/3 here) scales the float32 value before the one bf16
    rounding, so the result is the spelled-out one's to that rounding, with no common scale error."""
    hidden, weight, targets = _inputs(64, 16, 32, torch.float32, seed=5)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(True), weight.detach().bfloat16().requires_grad_(True)
    (ours,) = torch.autograd.grad(linear_cross_entropy(h16, w16, targets) / 3, (h16,))
    (exact,) = torch.autograd.grad(_spelled_out(h16.double(), w16.double(), targets) / 3, (h16,))
    scale = (ours.double() * exact).sum() / exact.square().sum()
    assert abs(scale.item() - 1) < 2e-4
    torch.testing.assert_close(ours.double(), exact.bfloat16().double(), rtol=2**-7,
                               atol=2**-7 * exact.abs().max().item())
