"""The gated RMSNorm's Triton kernels (`hybridlm.ops.gated_norm`) against the float64 reference: outputs and the
gradients of x, the weight and the gate, both gate placements, groups, odd widths and row counts, several programs.

They run where the other Triton tests run (`tests/ops/triton_modes.py`: a GPU, or the interpreter, where float16
stands in for bfloat16); CI runs only the reference's test and the input checks.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules.gated_norm import GatedRMSNorm, gated_rms_norm
from hybridlm.ops.gated_norm import MAX_GROUP, gated_norm_naive, gated_norm_triton
from hybridlm.ops.utils import SlowPathWarning
from tests.helpers import assert_near_reference, rel_err
from tests.ops.triton_modes import (
    DEVICE,
    ELEMENTWISE_TOL,
    H200_SHARED_BYTES,
    HAS_TRITON,
    ON_GPU,
    compile_for_sm90,
    gpu_only,
    interpret,
    needs_cuda_backend,
)

TOL = ELEMENTWISE_TOL


def _inputs(shape, *, gate=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    weight = 1 + torch.randn(shape[-1], generator=g, dtype=torch.float64) / 4
    z = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 if gate else None
    return x, weight, z


def _check(shape, groups, *, gate, before, dtype, seed=0):
    x, weight, z = _inputs(shape, gate=gate, seed=seed)
    x = x.to(dtype).double()  # the reference sees the rounded inputs
    z = None if z is None else z.to(dtype).double()
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, z) if t is not None]
    options = dict(groups=groups, norm_before_gate=before)
    y_ref = gated_norm_naive(leaves[0], leaves[1], leaves[2] if gate else None, **options)
    probe = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), leaves)

    ins = [x.to(DEVICE, dtype), weight.to(DEVICE, torch.float32)] + ([z.to(DEVICE, dtype)] if gate else [])
    ins = [t.requires_grad_(True) for t in ins]
    y = gated_norm_triton(ins[0], ins[1], ins[2] if gate else None, **options)
    assert y.dtype == dtype and y.shape == tuple(shape)
    grads = torch.autograd.grad((y.double() * probe.to(DEVICE)).sum(), ins)
    pairs = {"y": (y, y_ref)}
    for name, grad, grad_ref, leaf in zip(("dx", "dw", "dz"), grads, grads_ref, ins):
        assert grad.dtype == leaf.dtype, name
        pairs[name] = (grad, grad_ref)
    assert_near_reference(pairs, TOL[dtype])


CASES = [  # shape, groups, gate, norm_before_gate
    ((2, 37, 96), 2, True, True),  # the fast-weight / Mamba-2 placement, odd rows, two groups of 48 (padded to 64)
    ((2, 37, 96), 2, True, False),  # the gate before the norm
    ((5, 70), 1, False, True),  # no gate, one group
    ((3, 11, 4, 24), 3, True, True),  # four leading dims' worth of rows, groups of 8
    ((1, 1100, 40), 4, True, False),  # several programs along the rows (1100 > 8 x 128), groups of 10
    ((50, 96), 2, True, True),  # rows for two blocks: one program walks two (`row_steps`)
    ((3, 1000), 1, True, True),  # a wide group: blocks of two rows
    ((2, 2500), 1, True, False),  # a group wider than a row block's 2048: one row per block
]


@interpret
@pytest.mark.parametrize("shape,groups,gate,before", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_float64_reference(shape, groups, gate, before, dtype, walked_blocks):
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("bfloat16 is checked on the GPU; float16 covers the 16-bit path under the interpreter")
    _check(shape, groups, gate=gate, before=before, dtype=dtype)


@interpret
def test_groups_never_see_each_other():
    """Scaling one group's inputs leaves the other groups' outputs as they were (and its own, up to eps)."""
    x, weight, z = (t.float().to(DEVICE) for t in _inputs((4, 64), seed=1))
    changed = x.clone()
    changed[:, :16] *= 100.0
    y, y_changed = (gated_norm_triton(t, weight, z, groups=4) for t in (x, changed))
    assert torch.equal(y[:, 16:], y_changed[:, 16:])
    assert rel_err(y_changed[:, :16].cpu(), y[:, :16].cpu()) < 1e-5


@interpret
def test_strided_inputs_and_empty_rows():
    """x and the gate as strided views: the same as the reference on those values; zero rows give empty outputs and
    zero weight gradients."""
    x, weight, z = _inputs((6, 80), seed=2)
    xs, zs = x[::2, ::2], z[1::2, ::2]  # [3, 40], not contiguous
    y_ref = gated_norm_naive(xs, weight[:40], zs, groups=2)
    y = gated_norm_triton(xs.float().to(DEVICE), weight[:40].float().to(DEVICE), zs.float().to(DEVICE), groups=2)
    assert rel_err(y.cpu(), y_ref) < 1e-5
    empty = torch.zeros(0, 40, device=DEVICE, requires_grad=True)
    w = weight[:40].float().to(DEVICE).requires_grad_(True)
    out = gated_norm_triton(empty, w, groups=2)
    out.sum().backward()
    assert out.shape == (0, 40) and w.grad.abs().max() == 0


@interpret
@pytest.mark.parametrize("before", [True, False])
def test_gate_sliced_from_a_wider_projection(before):
    """The gate as columns of a fused projection's output ([B, T, W], rows W apart: read in place, no copy): output
    and gradients as for the same gate made contiguous, and the gradient lands in the slice's columns alone."""
    x, weight, _ = _inputs((2, 13, 48), gate=False, seed=5)
    x, weight = x.float().to(DEVICE), weight.float().to(DEVICE)
    fused = torch.randn(2, 13, 48 + 40, generator=torch.Generator().manual_seed(6)).to(DEVICE).requires_grad_(True)
    probe = torch.randn(2, 13, 48).to(DEVICE)
    results = []
    for gate_of in (lambda f: f[..., 16:64], lambda f: f[..., 16:64].contiguous()):
        if fused.grad is not None:
            fused.grad = None
        y = gated_norm_triton(x, weight, gate_of(fused), groups=3, norm_before_gate=before)
        (y * probe).sum().backward()
        results.append((y.detach().clone(), fused.grad.clone()))
    (y_view, g_view), (y_copy, g_copy) = results
    if HAS_TRITON:  # the kernels read the slice where it lies
        from hybridlm.ops.gated_norm.kernels import _rows_of

        view = fused[..., 16:64].reshape(-1, 48)
        assert _rows_of(view).data_ptr() == view.data_ptr()
    assert torch.equal(y_view, y_copy) and torch.equal(g_view, g_copy)
    assert g_view[..., :16].abs().max() == 0 and g_view[..., 64:].abs().max() == 0
    assert g_view[..., 16:64].abs().max() > 0


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("groups", [1, 3])
def test_reference_matches_the_module_norm(before, groups):
    """The reference is the same function as `hybridlm.modules.gated_rms_norm` (float64), with and without a gate."""
    x, weight, z = _inputs((2, 5, 24), seed=3)
    for gate in (z, None):
        torch.testing.assert_close(gated_norm_naive(x, weight, gate, groups=groups, norm_before_gate=before),
                                   gated_rms_norm(x, weight, gate, groups=groups, norm_before_gate=before),
                                   rtol=1e-12, atol=1e-12)


@interpret
@pytest.mark.parametrize("before", [True, False])
def test_module_backends_agree(before):
    """`GatedRMSNorm` with backend "triton" (and "auto" on a GPU, where it takes the kernels) gives the torch form's
    output and gradients to float32 rounding, in a bf16 model's dtypes (fp16 under the interpreter)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    x, weight, z = (t.to(DEVICE) for t in _inputs((3, 29, 64), seed=4))
    results = {}
    for backend in ("torch", "triton", *(["auto"] if ON_GPU else [])):
        norm = GatedRMSNorm(64, groups=4, norm_before_gate=before).to(DEVICE)
        norm.backend = backend
        with torch.no_grad():
            norm.weight.copy_(weight)
        xs, zs = (t.to(dtype).requires_grad_(True) for t in (x, z))
        y = norm(xs, zs)
        y.float().pow(2).sum().backward()
        results[backend] = [y, xs.grad, zs.grad, norm.weight.grad]
    for backend, got in results.items():
        for a, b in zip(got, results["torch"]):
            assert a.dtype == b.dtype
            assert rel_err(a.double().cpu(), b.double().cpu()) < 1e-2, backend


@gpu_only
def test_auto_takes_the_kernels_on_cuda(monkeypatch):
    """backend="auto" runs the kernels for a bf16 CUDA tensor; the torch form for float64 (x or gate), a gate that
    broadcasts, or under compile; and the torch form with a SlowPathWarning for groups wider than the kernels take."""
    import hybridlm.modules.gated_norm as module

    calls = []
    monkeypatch.setattr(module, "gated_norm_triton", lambda *a, **k: calls.append(a[0].dtype) or a[0])
    x, ones = torch.randn(4, 64, device="cuda"), torch.ones(64, device="cuda")
    module.gated_rms_norm(x.bfloat16(), ones, x.bfloat16(), groups=2)
    module.gated_rms_norm(x.double(), ones, groups=2)
    module.gated_rms_norm(x.bfloat16(), ones, x.double(), groups=2)
    module.gated_rms_norm(x.bfloat16(), ones, x[:1].bfloat16(), groups=2)  # [1, 64] against [4, 64]
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        module.gated_rms_norm(x.bfloat16(), ones, groups=2)
    assert calls == [torch.bfloat16]
    wide = torch.randn(2, MAX_GROUP * 2, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(SlowPathWarning, match="wider than the Triton kernels take"):
        module.gated_rms_norm(wide, torch.ones(MAX_GROUP * 2, device="cuda"))
    assert calls == [torch.bfloat16]


@interpret
def test_explicit_triton_backend_names_what_it_does_not_take():
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 x and gate.*use backend='torch' or 'auto'"):
        gated_rms_norm(x.double(), torch.ones(64, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match=f"groups of at most {MAX_GROUP} channels.*use backend='torch' or 'auto'"):
        gated_rms_norm(torch.zeros(1, 2 * MAX_GROUP, device=DEVICE), torch.ones(2 * MAX_GROUP, device=DEVICE),
                       backend="triton")


@pytest.mark.skipif(not HAS_TRITON, reason="imports the kernels (needs triton)")
def test_rejects_bad_inputs():
    x = torch.zeros(2, 12)
    with pytest.raises(ValueError, match="must divide the channel count"):
        gated_norm_triton(x, torch.ones(12), groups=5)
    with pytest.raises(ValueError, match="weight must be"):
        gated_norm_triton(x, torch.ones(10))
    with pytest.raises(ValueError, match="gate must have x's shape"):
        gated_norm_triton(x, torch.ones(12), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="run float64 on"):
        gated_norm_triton(x.double(), torch.ones(12))
    with pytest.raises(ValueError, match="exceed the kernels"):
        gated_norm_triton(torch.zeros(1, 1).expand(1, 8192), torch.ones(8192))
    with pytest.raises(ValueError, match="got a scalar"):
        gated_norm_triton(torch.zeros(()), torch.ones(1))


_SM90_BUILDS = """
from hybridlm.ops.gated_norm import kernels as k

for io in ("*bf16", "*fp32"):
    for DG, gate, before in ((64, True, True), (512, True, False), (1000, False, True), (4096, True, True)):
        BD = triton.next_power_of_2(DG)
        flags = dict(DG=DG, BD=BD, BM=max(1, k.ROW_ELEMENTS // BD), STEPS=k.STEPS, HAS_GATE=gate, BEFORE=before)
        build(k.gated_norm_fwd_kernel, flags, io=io, io_names=("x_ptr", "z_ptr", "y_ptr"), types={"eps": "fp32"})
        build(k.gated_norm_bwd_kernel, flags, io=io, io_names=("x_ptr", "z_ptr", "dy_ptr", "dx_ptr", "dz_ptr"))
"""


@needs_cuda_backend
def test_kernels_compile_for_sm90():
    """Both kernels build for sm_90 (bf16 and fp32 activations, with and without a gate, either placement, groups
    of 64 to 4096 channels): the compiled path the interpreter never runs."""
    report = compile_for_sm90(_SM90_BUILDS, modules=("hybridlm.ops.gated_norm.kernels",))
    assert set(report["built"]) == report["defined"] == {"gated_norm_fwd_kernel", "gated_norm_bwd_kernel"}, report
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
