"""The output-keeping RMS normalization's Triton kernels (`hybridlm.ops.rms_norm`) against the float64 reference:
outputs and input gradients, odd widths, several programs, strided slices read in place, what the backward keeps, and
the fast-weight mixer's QK norm on them (its conv output freed after the forward).

Where they run: on a GPU (CUDA + triton) every test; on the CPU under Triton's interpreter with
HYBRIDLM_TRITON_INTERPRET=1 (float16 stands in for bfloat16 there); in CI (no triton) the reference's and the input
checks that need no kernel.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules.norm import rms_normalize
from hybridlm.ops.rms_norm import MAX_DIM, rms_normalize_naive, rms_normalize_triton
from tests.helpers import assert_near_reference
from tests.ops.triton_modes import (
    DEVICE,
    ELEMENTWISE_TOL,
    H200_SHARED_BYTES,
    INTERPRET,
    ON_GPU,
    compile_for_sm90,
    interpret,
    needs_cuda_backend,
    skip_bfloat16_interpreted,
)

TOL = ELEMENTWISE_TOL


def _check(shape, *, dtype, eps=1e-6, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    u = (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).double()
    leaf = u.clone().requires_grad_(True)
    ref = rms_normalize_naive(leaf, eps)
    probe = torch.randn(shape, generator=g, dtype=torch.float64)
    (grad_ref,) = torch.autograd.grad((ref * probe).sum(), leaf)
    u_dev = u.to(DEVICE, dtype).requires_grad_(True)
    out = rms_normalize_triton(u_dev, eps)
    assert out.dtype == dtype and out.shape == u_dev.shape
    (grad,) = torch.autograd.grad((out.double() * probe.to(DEVICE)).sum(), u_dev)
    assert grad.dtype == dtype
    assert_near_reference({"n": (out, ref), "du": (grad, grad_ref)}, TOL[dtype])


def test_reference_matches_the_model_norm():
    """The float64 reference is the spelled-out formula of `rms_normalize`'s torch form."""
    u = torch.randn(3, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(rms_normalize_naive(u, 1e-5), rms_normalize(u, eps=1e-5, backend="torch"))


@interpret
@pytest.mark.parametrize("shape", [(2, 37, 3, 20), (1, 9, 1, 64), (700, 16, 64), (5, 100), (3, 2), (2, 4, 4096),
                                   (40, 64)],
                         ids=["odd", "one-head", "programs", "2d", "two-channel", "widest", "two-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_float64_reference(shape, dtype, walked_blocks):
    skip_bfloat16_interpreted(dtype)
    if INTERPRET and shape[-1] == 4096:
        pytest.skip("the widest rows run on the GPU (slow under the interpreter)")
    _check(shape, dtype=dtype)


@interpret
def test_eps_enters_the_gradient():
    """A large eps against small inputs: the exact gradient, eps included, from the output and 1 / rms alone."""
    _check((4, 6, 2, 16), dtype=torch.float32, eps=0.5, scale=0.3)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reads_a_slice_in_place_and_keeps_only_its_output(dtype):
    """u a [B, T, H, D] view of a slice of a wider row (as a mixer's q of its conv output): read where it lies, the
    reference's numbers, and the backward keeps the output and 1 / rms, nothing sharing the input's storage."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 11, 100, generator=g, dtype=torch.float64).to(dtype)
    B, T, H, D = 2, 11, 3, 16
    leaf = wide.double().requires_grad_(True)
    ref = rms_normalize_naive(leaf[..., 20:20 + H * D].reshape(B, T, H, D), 1e-6)
    probe = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    (grad_ref,) = torch.autograd.grad((ref * probe).sum(), leaf)
    wide_dev = wide.to(DEVICE).requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        out = rms_normalize_triton(wide_dev[..., 20:20 + H * D].reshape(B, T, H, D), 1e-6)
    storages = {t.untyped_storage().data_ptr() for t in kept}
    assert wide_dev.untyped_storage().data_ptr() not in storages
    assert out.untyped_storage().data_ptr() in storages and len(kept) == 2
    (grad,) = torch.autograd.grad((out.double() * probe.to(DEVICE)).sum(), wide_dev)
    assert grad[..., :20].abs().max() == 0 and grad[..., 20 + H * D:].abs().max() == 0
    assert_near_reference({"n": (out, ref), "du": (grad, grad_ref)}, TOL[dtype])


@interpret
def test_fast_weight_mixer_frees_its_conv_output():
    """The fast-weight mixer on the kernels (backend "triton"): its QK norm keeps the normalized q and k, so nothing
    the forward keeps shares the short conv's output storage (the torch form's norm keeps q and k themselves, slices
    of it), and the mixer's output and gradients match the torch form's."""
    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.models.presets import get_preset

    config = get_preset("tiny", ssm_mixer="fast_weight", fw_rule="1A")
    torch.manual_seed(0)
    mixer = FastWeightMixer(config, 0).to(DEVICE)
    hidden = torch.randn(2, 40, config.hidden_size, device=DEVICE)
    conv_out = []
    mixer.conv.register_forward_hook(lambda m, args, out: conv_out.append(out[0]))
    results = {}
    for backend in ("triton", "chunk"):
        mixer.backend = backend
        mixer.conv.backend = "torch"
        conv_out.clear()
        kept = []
        x = hidden.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.untyped_storage().data_ptr()), t)[1],
                                                      lambda t: t):
            y = mixer(x)
        results[backend] = (y, torch.autograd.grad(y.square().sum(), x)[0])
        if backend == "triton":
            assert conv_out[0].untyped_storage().data_ptr() not in kept
        else:
            assert conv_out[0].untyped_storage().data_ptr() in kept
    for a, b in zip(results["triton"], results["chunk"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@interpret
def test_model_norm_keeps_no_copy_of_its_input():
    """`RMSNorm` on the kernels (float32 residual, as under autocast): the torch form's output and every gradient, and
    nothing kept shares x's storage (the scale's backward keeps the normalized tensor, which the kernels keep too)."""
    from hybridlm.modules import RMSNorm

    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 10, 48, generator=g).to(DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        norm.backend = backend
        norm.weight.grad = None
        leaf = x.clone().requires_grad_(True)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.untyped_storage().data_ptr()), t)[1],
                                                      lambda t: t):
            out = norm(leaf)
        (out * torch.arange(48, device=DEVICE)).sum().backward()
        results[backend] = (out, leaf.grad, norm.weight.grad)
        assert (leaf.untyped_storage().data_ptr() in kept) == (backend == "torch")
    for a, b in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@interpret
@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 16), (2, 3, 0, 8)], ids=["no-steps", "no-rows", "no-heads"])
def test_empty_rows(shape):
    """No rows: an empty result of u's shape and an empty gradient, as the torch form gives."""
    u = torch.randn(shape, device=DEVICE).requires_grad_(True)
    out = rms_normalize_triton(u, 1e-6)
    assert out.shape == u.shape
    out.sum().backward()
    assert u.grad.shape == u.shape


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA + triton")
def test_auto_takes_the_kernels_for_the_model_norm_on_cuda():
    """"auto" on CUDA: a float32 RMSNorm (the residual under autocast) on the kernels, keeping no copy of x."""
    from hybridlm.modules import RMSNorm

    norm = RMSNorm(768).cuda()
    x = torch.randn(2, 64, 768, device="cuda", requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.untyped_storage().data_ptr()), t)[1],
                                                  lambda t: t):
        out = norm(x)
    assert x.untyped_storage().data_ptr() not in kept
    norm.backend = "torch"
    torch.testing.assert_close(out, norm(x), rtol=1e-6, atol=1e-6)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rms_normalize_triton(torch.zeros(2, 4, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="exceed the kernels"):
        rms_normalize_triton(torch.zeros(2, MAX_DIM + 1), 1e-6)
    with pytest.raises(ValueError, match="D >= 1"):
        rms_normalize_triton(torch.zeros(2, 0), 1e-6)
    with pytest.raises(ValueError, match="unknown backend"):
        rms_normalize(torch.zeros(2, 4), eps=1e-6, backend="cuda")
    if not (ON_GPU or INTERPRET):
        with pytest.raises(ValueError, match="needs triton and a CUDA tensor"):
            rms_normalize(torch.zeros(2, 4), eps=1e-6, backend="triton")


def test_auto_keeps_the_torch_form_off_cuda():
    """"auto" on a CPU tensor (any dtype) is the torch form: the same numbers, the compute dtype back."""
    u = torch.randn(3, 7, 16).bfloat16()
    out = rms_normalize(u, eps=1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_normalize(u, eps=1e-6, backend="torch"), rtol=0, atol=0)


_SM90_BUILDS = """
from hybridlm.ops.rms_norm import kernels as k

for io in ("*bf16", "*fp32"):
    for D in (16, 64, 100, 4096):
        BD = triton.next_power_of_2(D)
        consts = dict(D=D, BD=BD, BR=max(1, k.ROW_ELEMENTS // BD), STEPS=k.STEPS)
        build(k.rms_normalize_fwd_kernel, consts, io=io, io_names=("u_ptr", "n_ptr"), types={"eps": "fp32"})
        build(k.rms_normalize_bwd_kernel, consts, io=io, io_names=("dn_ptr", "n_ptr", "du_ptr"))
        for residuals in (0, 1, 2):
            build(k.rms_norm_scaled_kernel, {**consts, "RESIDUALS": residuals}, io=io,
                  io_names=("x_ptr", "r1_ptr", "r2_ptr", "w_ptr", "h_ptr", "y_ptr"), types={"eps": "fp32"})
"""


@needs_cuda_backend
def test_kernels_compile_for_sm90():
    """Every kernel builds for sm_90 (bf16 and fp32 rows of 16 to 4096 channels; the inference norm with and without
    its residual): the compiled path the interpreter never runs."""
    report = compile_for_sm90(_SM90_BUILDS, modules=("hybridlm.ops.rms_norm.kernels",))
    assert set(report["built"]) == report["defined"] == {"rms_normalize_fwd_kernel", "rms_normalize_bwd_kernel",
                                                         "rms_norm_scaled_kernel"}
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]


def test_row_steps_spread_the_rows_before_walking_blocks():
    """A program walks one row block while the rows' blocks make fewer than 2 x SPREAD_PROGRAMS programs (a decoding
    step's rows spread over the SMs), then twice as many each time the blocks double, up to `most`."""
    pytest.importorskip("triton")
    from hybridlm.ops.triton_utils import SPREAD_PROGRAMS, row_steps

    blocks = [0, 1, 32, 2 * SPREAD_PROGRAMS - 1, 2 * SPREAD_PROGRAMS, 4 * SPREAD_PROGRAMS - 1, 4 * SPREAD_PROGRAMS,
              8 * SPREAD_PROGRAMS, 16 * SPREAD_PROGRAMS, 10**6]
    assert [row_steps(32 * b, 32, 8) for b in blocks] == [1, 1, 1, 1, 2, 2, 4, 8, 8, 8]
    assert row_steps(32 * 8 * SPREAD_PROGRAMS + 1, 32, 4) == 4  # capped at `most`
    assert row_steps(64, 2, 8) == 1  # a decoding step's 64 rows of 768 channels: 32 programs of one block


def _apart(x, weight, eps, residuals=()):
    """What the one-launch norm stands for, run apart: torch's adds, the normalization's kernel, then the scale."""
    h = x
    for residual in residuals:
        h = h + residual
    return h, weight * rms_normalize_triton(h, eps).to(h.dtype)


@interpret
@pytest.mark.parametrize("case", [
    dict(shape=(3, 5, 40), x=torch.float32, w=torch.float32),
    dict(shape=(1, 1, 768), x=torch.float16, w=torch.float16),
    dict(shape=(2, 7, 33), x=torch.float32, w=torch.float32, r=(torch.float16,)),  # the stream under autocast
    dict(shape=(2, 7, 33), x=torch.float16, w=torch.float16, r=(torch.float16,)),
    dict(shape=(2, 7, 33), x=torch.float32, w=torch.float32, r=(torch.float16, torch.float16)),  # two mixers' outputs
    dict(shape=(1, 2, 64), x=torch.float16, w=torch.float16, r=(torch.float16, torch.float16)),
    dict(shape=(700, 48), x=torch.float16, w=torch.float32, r=(torch.float16, torch.float16)),  # programs; f32 weight
    dict(shape=(4, 3, 20), x=torch.float16, w=torch.float16, r=(torch.float16, torch.float16), strided=True),
], ids=["fp32", "fp16-one-row", "fp32+fp16", "fp16", "fp32+2fp16", "fp16+2", "programs", "strided"])
def test_scaled_norm_equals_the_norm_apart_bit_for_bit(case, walked_blocks):
    """`rms_norm_scaled_triton`: h = x + r1 + r2 and y = weight * normalize(h) in one launch are the values, dtypes
    and shapes of the adds, the normalization's kernel and the scale run apart, bit for bit (rows read at their
    strides), and near the float64 formula."""
    from hybridlm.ops.rms_norm import rms_norm_scaled_triton

    g = torch.Generator().manual_seed(5)
    shape, D = case["shape"], case["shape"][-1]

    def make(dtype):
        if case.get("strided"):  # rows of a wider tensor (a fused projection's slice)
            return (2 * torch.randn(*shape[:-1], D + 9, generator=g)).to(dtype)[..., 3:3 + D].to(DEVICE)
        return (2 * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)
    x, weight = make(case["x"]), torch.randn(D, generator=g).to(case["w"]).to(DEVICE)
    residuals = tuple(make(dtype) for dtype in case.get("r", ()))
    with torch.no_grad():
        h, y = rms_norm_scaled_triton(x, weight, 1e-6, residuals)
        h_apart, y_apart = _apart(x, weight, 1e-6, residuals)
    assert (h.dtype, y.dtype, h.shape, y.shape) == (h_apart.dtype, y_apart.dtype, h_apart.shape, y_apart.shape)
    assert torch.equal(h, h_apart) and torch.equal(y, y_apart)
    reference = weight.double().cpu() * rms_normalize_naive(h.double().cpu(), 1e-6)
    assert_near_reference({"y": (y, reference)}, TOL[case["x"]])


@interpret
def test_model_norm_and_residual_adds_take_one_launch_without_a_gradient():
    """`rms_norm` and `add_rms_norm` on the kernels: without a gradient to record, one launch each (two residuals
    included), the values of the recorded path; with one, the differentiable path (the one-launch kernel records
    nothing); partial sums of another dtype than the whole sum's are added apart first."""
    import hybridlm.modules.norm as norm_module
    from hybridlm.modules.norm import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 32, generator=g).to(DEVICE)
    residuals = tuple(torch.randn(3, 4, 32, generator=g).half().to(DEVICE) for _ in range(2))
    weight = torch.randn(32, generator=g).to(DEVICE).requires_grad_(True)
    launches = []
    run = norm_module.rms_norm_scaled_triton
    norm_module.rms_norm_scaled_triton = lambda *args: launches.append(len(args[3]) if len(args) > 3 else 0) or run(
        *args)
    try:
        with torch.no_grad():
            y = rms_norm(x, weight, eps=1e-5, backend="triton")
            h, y2 = add_rms_norm(x, residuals, weight, eps=1e-5, backend="triton")
            assert launches == [0, 2]
            half = x.half()  # half + half stays half, + float32 would not: the first add runs apart
            mixed = (residuals[0], x)
            h3, _ = add_rms_norm(half, mixed, weight.detach(), eps=1e-5, backend="triton")
            assert launches == [0, 2, 0] and h3.dtype == torch.float32  # the adds apart, then the norm's one launch
        recorded = rms_norm(x, weight, eps=1e-5, backend="triton")
        h_recorded, y2_recorded = add_rms_norm(x, residuals, weight, eps=1e-5, backend="triton")
        assert launches == [0, 2, 0] and recorded.requires_grad and y2_recorded.requires_grad
    finally:
        norm_module.rms_norm_scaled_triton = run
    assert torch.equal(y, recorded.detach()) and torch.equal(h, h_recorded) and torch.equal(y2, y2_recorded.detach())
    assert torch.equal(h3, (half + residuals[0]) + x)


def test_scaled_norm_rejects_bad_inputs():
    from hybridlm.ops.rms_norm import rms_norm_scaled_triton

    with pytest.raises(ValueError, match="weight \\[D\\]"):
        rms_norm_scaled_triton(torch.zeros(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="shaped like x"):
        rms_norm_scaled_triton(torch.zeros(2, 4), torch.ones(4), 1e-6, (torch.zeros(3, 4),))
    with pytest.raises(ValueError, match="up to two residuals"):
        rms_norm_scaled_triton(torch.zeros(2, 4), torch.ones(4), 1e-6, (torch.zeros(2, 4),) * 3)
    with pytest.raises(ValueError, match="add the first apart"):
        rms_norm_scaled_triton(torch.zeros(2, 4).half(), torch.ones(4), 1e-6, (torch.zeros(2, 4).half(),
                                                                                torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rms_norm_scaled_triton(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="records no gradient"):
        rms_norm_scaled_triton(torch.zeros(2, 4), torch.ones(4, requires_grad=True), 1e-6)
