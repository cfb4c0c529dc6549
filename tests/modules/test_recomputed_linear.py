"""`recomputed_linear`: linear(fn(*inputs)) with fn's output recomputed in the backward, against the plain path."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hybridlm.modules.gate import silu_gate
from hybridlm.modules.gated_norm import gated_rms_norm
from hybridlm.modules.recomputed_linear import recomputed_linear

GATED_NORM = functools.partial(gated_rms_norm, groups=3, eps=1e-6, norm_before_gate=True, backend="torch")


def _gated_norm(x, gate, weight):
    return GATED_NORM(x, weight, gate)


def _case(dtype, *, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(12, 7, bias=bias, dtype=dtype)
    with torch.no_grad():
        for p in linear.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    x = torch.randn(2, 5, 12, generator=g, dtype=dtype, requires_grad=True)
    z = torch.randn(2, 5, 12, generator=g, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(12, generator=g, dtype=dtype)).requires_grad_(True)
    dout = torch.randn(2, 5, 7, generator=g, dtype=dtype)
    return linear, x, z, w, dout


def _run(fused, fn, inputs, linear, dout, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = recomputed_linear(fn, inputs, linear) if fused else linear(fn(*inputs))
    wrt = [t for t in [*inputs, *linear.parameters()] if t.requires_grad]
    return out, torch.autograd.grad(out, wrt, dout.to(out.dtype))


@pytest.mark.parametrize("which", ["silu_gate", "gated_norm"])
@pytest.mark.parametrize("bias", [True, False])
def test_float64_equals_the_plain_path(which, bias):
    """Outputs and the gradients of every input (the norm's weight too), the weight and the bias."""
    linear, x, z, w, dout = _case(torch.float64, bias=bias)
    fn, inputs = (silu_gate, (x, z)) if which == "silu_gate" else (_gated_norm, (x, z, w))
    out, grads = _run(True, fn, inputs, linear, dout)
    ref, want = _run(False, fn, inputs, linear, dout)
    assert out.grad_fn is not None and "RecomputedLinear" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    assert len(grads) == len(want) == len(inputs) + (2 if bias else 1)
    for a, b in zip(grads, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("which", ["silu_gate", "gated_norm"])
def test_bf16_autocast_equals_the_plain_path_bit_for_bit(which):
    """CPU bf16 autocast over float32 parameters and bf16 activations (as a projection's output): the same GEMMs on
    the same bf16 operands, so the same bits."""
    linear, x, z, w, dout = _case(torch.float32, bias=False, seed=1)
    x, z = (t.detach().bfloat16().requires_grad_(True) for t in (x, z))
    fn, inputs = (silu_gate, (x, z)) if which == "silu_gate" else (_gated_norm, (x, z, w))
    out, grads = _run(True, fn, inputs, linear, dout, autocast=True)
    ref, want = _run(False, fn, inputs, linear, dout, autocast=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_float64_under_autocast_stays_float64(autocast_dtype):
    """Autocast leaves float64 GEMMs in float64: the backward's GEMMs must too."""
    linear, x, z, w, dout = _case(torch.float64)
    fn, inputs = _gated_norm, (x, z, w)
    with torch.autocast("cpu", dtype=autocast_dtype):
        out = recomputed_linear(fn, inputs, linear)
    wrt = [*inputs, *linear.parameters()]
    ref = linear(fn(*inputs))
    assert out.dtype == torch.float64
    for a, b in zip(torch.autograd.grad(out, wrt, dout), torch.autograd.grad(ref, wrt, dout)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_keeps_the_inputs_not_the_output_of_fn():
    """The plain path keeps up * SiLU(gate) for the weight's gradient; the recomputed one keeps up, gate and the
    weight only."""
    linear, x, z, _, _ = _case(torch.float32, bias=False)

    def kept_bytes(fused):
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            recomputed_linear(silu_gate, (x, z), linear) if fused else linear(silu_gate(x, z))
        return sum(kept.values())

    y_bytes = x.numel() * x.element_size()
    assert kept_bytes(True) == kept_bytes(False) - y_bytes
    assert kept_bytes(True) == 2 * y_bytes + linear.weight.numel() * 4


def test_frozen_parts_get_no_gradient():
    linear, x, z, w, dout = _case(torch.float64)
    linear.weight.requires_grad_(False)
    x = x.detach()
    out, grads = _run(True, _gated_norm, (x, z, w), linear, dout)
    ref, want = _run(False, _gated_norm, (x, z, w), linear, dout)
    assert len(grads) == 3  # z, the norm's weight, the bias
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


class _Wrapped(nn.Linear):
    """A subclass, as an adapter or a parallel plan's wrapper would be: its forward may differ from F.linear."""

    def forward(self, x):
        return super().forward(x) * 2


def test_plain_path_where_the_fused_one_would_be_wrong():
    linear, x, z, _, _ = _case(torch.float64)
    with torch.no_grad():  # nothing to keep
        assert recomputed_linear(silu_gate, (x, z), linear).grad_fn is None
    wrapped = _Wrapped(12, 7, dtype=torch.float64)
    torch.testing.assert_close(recomputed_linear(silu_gate, (x, z), wrapped), wrapped(silu_gate(x, z)))
    hooked = nn.Linear(12, 7, dtype=torch.float64)
    hooked.register_forward_hook(lambda module, args, out: out + 1)
    out = recomputed_linear(silu_gate, (x, z), hooked)
    torch.testing.assert_close(out, hooked(silu_gate(x, z)))
    assert "RecomputedLinear" not in type(out.grad_fn).__name__
    replaced = nn.Linear(12, 7, dtype=torch.float64)  # a forward swapped on the instance (accelerate's hooks)
    replaced.forward = lambda t: nn.Linear.forward(replaced, t) - 3
    out = recomputed_linear(silu_gate, (x, z), replaced)
    torch.testing.assert_close(out, replaced(silu_gate(x, z)))
    assert "RecomputedLinear" not in type(out.grad_fn).__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the gate's and the norm's Triton kernels)")
@pytest.mark.parametrize("which", ["silu_gate", "gated_norm"])
def test_cuda_kernels_under_autocast_equal_the_plain_path(which):
    """On a GPU the recomputed fn is the Triton kernels' autograd (backend "auto"), called again inside the backward."""
    linear, x, z, w, dout = (t.cuda() for t in _case(torch.float32, bias=False, seed=2))
    x, z = (t.detach().bfloat16().requires_grad_(True) for t in (x, z))
    w = w.detach().requires_grad_(True)
    auto_norm = functools.partial(gated_rms_norm, groups=3, eps=1e-6, norm_before_gate=True, backend="auto")
    fn, inputs = (silu_gate, (x, z)) if which == "silu_gate" else ((lambda a, b, c: auto_norm(a, c, b)), (x, z, w))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = recomputed_linear(fn, inputs, linear)
        ref = linear(fn(*inputs))
    assert "RecomputedLinear" in type(out.grad_fn).__name__ and torch.equal(out, ref)
    wrt = [t for t in [*inputs, *linear.parameters()] if t.requires_grad]
    for a, b in zip(torch.autograd.grad(out, wrt, dout.to(out.dtype)), torch.autograd.grad(ref, wrt, dout.to(ref.dtype))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
