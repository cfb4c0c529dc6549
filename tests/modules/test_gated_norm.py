"""Grouped, gated RMSNorm: its dtype promise (math in float32, or float64 for float64 inputs; the result in the
input dtype) against a float64 reference written from the definition of transformers' FalconH1RMSNormGated."""

import pytest
import torch
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

from hybridlm.modules.gated_norm import GatedRMSNorm, gated_rms_norm
from hybridlm.ops.utils import triton_interpreting

DIM = 24


def reference_gated_rms_norm(x, weight, gate, *, groups, eps, norm_before_gate):
    """The definition, in float64: channels cut into `groups` groups of DIM / groups, each divided by its own root
    mean square, times the weight; the gate multiplies by SiLU(z) = z / (1 + exp(-z)) after the norm
    (norm_before_gate) or before it."""
    x, weight = x.double(), weight.double()
    silu = None if gate is None else gate.double() / (1 + torch.exp(-gate.double()))
    if silu is not None and not norm_before_gate:
        x = x * silu
    grouped = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)  # [..., G, D/G]
    mean_square = (grouped * grouped).sum(-1, keepdim=True) / grouped.shape[-1]
    y = (grouped / torch.sqrt(mean_square + eps)).reshape(x.shape) * weight
    return y * silu if silu is not None and norm_before_gate else y


# Rounding the float32 (or float64) result to the output dtype costs at most half a unit in the last place (the unit
# roundoff u: 2^-8 bfloat16, 2^-11 float16, 2^-24 float32); the float32 math adds ~1e-6 relative. Math in bfloat16 or
# float16 would miss by several units, math in float32 for a float64 input by ~1e-7: these tolerances catch both.
# float16's atol covers outputs that land among its subnormals (spacing 2^-24).
TOLERANCES = {
    torch.bfloat16: dict(rtol=2**-8 + 2e-6, atol=0.0),
    torch.float16: dict(rtol=2**-11 + 2e-6, atol=2**-24),
    torch.float32: dict(rtol=4e-6, atol=1e-7),
    torch.float64: dict(rtol=1e-12, atol=1e-14),
}


def inputs(dtype, *, scale=1.0, seed=0):
    """x, gate [2, 5, DIM] and weight [DIM] in `dtype` (the reference reads the rounded values, exactly)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, DIM, generator=generator, dtype=torch.float64) * scale
    gate = torch.randn(2, 5, DIM, generator=generator, dtype=torch.float64) * 2
    weight = torch.rand(DIM, generator=generator, dtype=torch.float64) + 0.5
    return x.to(dtype), gate.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("gate_mode", ["after-norm", "before-norm", "no-gate"])
def test_module_against_float64_reference(dtype, groups, gate_mode):
    """The module cast to the input dtype (as in a bfloat16 model): result in that dtype, within rounding of it."""
    x, gate, weight = inputs(dtype)
    norm_before_gate = gate_mode != "before-norm"
    gate = None if gate_mode == "no-gate" else gate
    # eps comparable to the groups' mean squares (~1), so adding it elsewhere than under the root would show.
    norm = GatedRMSNorm(DIM, groups=groups, eps=0.1, norm_before_gate=norm_before_gate).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    out = norm(x, gate)
    assert out.dtype == dtype
    expected = reference_gated_rms_norm(x, weight, gate, groups=groups, eps=0.1, norm_before_gate=norm_before_gate)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_float32_weight_with_half_precision_input(dtype):
    """The function with a float32 weight (a module kept in float32, mixed precision) still returns `x.dtype`."""
    x, gate, _ = inputs(dtype, seed=1)
    weight = torch.rand(DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float32) + 0.5
    out = gated_rms_norm(x, weight, gate, groups=2, eps=1e-6)
    assert out.dtype == dtype
    expected = reference_gated_rms_norm(x, weight, gate, groups=2, eps=1e-6, norm_before_gate=True)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def test_float16_input_whose_squares_overflow_float16():
    """Entries near 1000 square to ~1e6, past float16's largest 65504: the mean square must be taken in float32
    (in float16 it is inf, and the output 0 or NaN), and the normalized result fits float16 again."""
    x, gate, weight = inputs(torch.float16, scale=1000.0, seed=2)
    assert torch.isinf(x.pow(2)).any()  # the case is real: float16 squares overflow
    for norm_before_gate in (True, False):
        out = gated_rms_norm(x, weight, gate, groups=3, eps=1e-6, norm_before_gate=norm_before_gate)
        assert out.dtype == torch.float16
        expected = reference_gated_rms_norm(x, weight, gate, groups=3, eps=1e-6, norm_before_gate=norm_before_gate)
        torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_reference_is_falcon_h1s_definition(norm_before_gate):
    """Our float64 reference agrees with transformers' FalconH1RMSNormGated (which computes in float32) on float32
    inputs, so the tests above check the Falcon-H1 definition."""
    x, gate, weight = inputs(torch.float32, seed=3)
    falcon = FalconH1RMSNormGated(DIM, eps=0.1, n_groups=4, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        falcon.weight.copy_(weight)
        got = falcon(x, gate)
    expected = reference_gated_rms_norm(x, weight, gate, groups=4, eps=0.1, norm_before_gate=norm_before_gate)
    torch.testing.assert_close(got.double(), expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("shape", [(DIM,), (7, DIM), (2, 3, 4, DIM)], ids=["D", "ND", "ABCD"])
def test_any_leading_dims(shape):
    """x [..., D]: one vector, a stack of them, or several leading dims normalize the same (float64)."""
    generator = torch.Generator().manual_seed(4)
    x, gate = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2))
    weight = torch.rand(DIM, generator=generator, dtype=torch.float64) + 0.5
    out = gated_rms_norm(x, weight, gate, groups=6, eps=1e-6, norm_before_gate=False)
    expected = reference_gated_rms_norm(x, weight, gate, groups=6, eps=1e-6, norm_before_gate=False)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float64])


def test_groups_that_do_not_divide_the_channels_raise():
    with pytest.raises(ValueError, match="groups=5 must divide the channel count 24"):
        gated_rms_norm(torch.randn(2, DIM), torch.ones(DIM), groups=5)
    with pytest.raises(ValueError, match="groups=5 must divide hidden_size=24"):
        GatedRMSNorm(DIM, groups=5)


def test_backend_choice_and_errors():
    """"auto" on the CPU is the torch form itself; an unknown backend, or "triton" on a CPU tensor, is refused with
    what to use instead; the module shows its backend."""
    x, gate, weight = inputs(torch.float32, seed=5)
    expected = gated_rms_norm(x, weight, gate, groups=2, backend="torch")
    assert torch.equal(gated_rms_norm(x, weight, gate, groups=2), expected)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        gated_rms_norm(x, weight, gate, backend="fast")
    if not triton_interpreting():
        with pytest.raises(ValueError, match="backend='triton' needs triton and a CUDA tensor"):
            gated_rms_norm(x, weight, gate, backend="triton")
    assert "backend=auto" in repr(GatedRMSNorm(DIM))
