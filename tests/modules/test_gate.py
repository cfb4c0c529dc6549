"""`silu_gate`'s torch form: x * SiLU(z) with float32 math, keeping only x and z for the backward (the Triton kernels:
tests/ops/test_silu_gate_triton.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm.modules.gate import silu_gate


def _spelled_out(x, z):
    dtype = torch.float64 if torch.float64 in (x.dtype, z.dtype) else torch.float32
    return (x.to(dtype) * F.silu(z.to(dtype))).to(x.dtype)


def test_float64_gradients_are_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 10, generator=g, dtype=torch.float64, requires_grad=True)
    z = (3 * torch.randn(3, 7, 10, generator=g, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: silu_gate(a, b, backend="torch"), (x, z))
    probe = torch.randn(3, 7, 10, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad((silu_gate(x, z, backend="torch") * probe).sum(), (x, z))
    ref = torch.autograd.grad((_spelled_out(x, z) * probe).sum(), (x, z))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_bf16_matches_the_spelled_out_form_and_keeps_no_float32_copy():
    """bf16 x and a strided bf16 z (a slice of a wider projection output): the forward equals the spelled-out form bit
    for bit, the gradients agree within one bf16 rounding, and the backward keeps x and z only."""
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(2, 9, 40, generator=g).bfloat16().requires_grad_(True)
    x = torch.randn(2, 9, 24, generator=g).bfloat16().requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        out = silu_gate(x, proj[..., 8:32], backend="torch")
    assert out.dtype == torch.bfloat16
    assert len(kept) == 2 and all(t.dtype == torch.bfloat16 for t in kept)
    assert {t.untyped_storage().data_ptr() for t in kept} == {x.untyped_storage().data_ptr(),
                                                            proj.untyped_storage().data_ptr()}
    ref = _spelled_out(x, proj[..., 8:32])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    probe = torch.randn(2, 9, 24, generator=g).bfloat16()
    ours = torch.autograd.grad((out * probe).sum(), (x, proj))
    theirs = torch.autograd.grad((ref * probe).sum(), (x, proj))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7)
    assert ours[1][..., :8].abs().max() == 0 and ours[1][..., 32:].abs().max() == 0


def test_one_input_frozen():
    x = torch.randn(4, 6, dtype=torch.float64)
    z = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    (dz,) = torch.autograd.grad(silu_gate(x, z, backend="torch").sum(), (z,))
    s = torch.sigmoid(z.detach())
    torch.testing.assert_close(dz, x * s * (1 + z.detach() * (1 - s)))


def test_auto_is_the_torch_form_on_the_cpu():
    x, z = torch.randn(4, 6).bfloat16(), torch.randn(4, 6).bfloat16()
    torch.testing.assert_close(silu_gate(x, z), _spelled_out(x, z), rtol=0, atol=0)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="must have one shape"):
        silu_gate(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="unknown backend"):
        silu_gate(torch.zeros(2, 3), torch.zeros(2, 3), backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_gradients_equal_eager(dtype):
    """Traced by torch.compile (as a compiled block traces it), the gate keeps its gradients: x and z from one
    projection, in float32 and float64, where the forward's result needs no cast."""
    import torch._dynamo

    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 16, generator=g, dtype=dtype, requires_grad=True)
    u = torch.randn(3, 5, 8, generator=g, dtype=dtype, requires_grad=True)

    def gate(inp):
        x, z = (inp @ w).split([8, 8], dim=-1)
        return silu_gate(x, z, backend="torch")

    torch._dynamo.reset()
    try:
        got = torch.compile(gate, backend="aot_eager")(u)
        got_grads = torch.autograd.grad(got.square().sum(), (u, w))
    finally:
        torch._dynamo.reset()
    want = gate(u)
    want_grads = torch.autograd.grad(want.square().sum(), (u, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b)
