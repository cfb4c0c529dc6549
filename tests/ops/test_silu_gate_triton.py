"""The SiLU gate's Triton kernels (`hybridlm.ops.silu_gate`) against the float64 reference: outputs and both
gradients, odd sizes, several programs, strided inputs read in place, one input frozen, what the backward keeps.

Where they run: on a GPU (CUDA + triton) every test; on the CPU under Triton's interpreter with
HYBRIDLM_TRITON_INTERPRET=1 (float16 stands in for bfloat16 there); in CI (no triton) the reference's and the input
checks that need no kernel.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules.gate import silu_gate
from hybridlm.ops.silu_gate import silu_gate_naive, silu_gate_triton
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


def test_reference_is_the_torch_form():
    g = torch.Generator().manual_seed(0)
    x, z = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(silu_gate_naive(x, z), silu_gate(x, z, backend="torch"))


@interpret
@pytest.mark.parametrize("shape", [(2, 37, 20), (700, 300), (3, 1), (1, 5, 129), (30, 8)],
                         ids=["odd", "programs", "one", "wide", "two-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_float64_reference(shape, dtype, walked_blocks):
    skip_bfloat16_interpreted(dtype)
    g = torch.Generator().manual_seed(1)
    x, z = ((3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).double() for _ in range(2))
    leaves = [t.clone().requires_grad_(True) for t in (x, z)]
    ref = silu_gate_naive(*leaves)
    probe = torch.randn(shape, generator=g, dtype=torch.float64)
    grads_ref = torch.autograd.grad((ref * probe).sum(), leaves)
    ins = [t.to(DEVICE, dtype).requires_grad_(True) for t in (x, z)]
    out = silu_gate_triton(*ins)
    assert out.dtype == dtype and out.shape == ins[0].shape
    grads = torch.autograd.grad((out.double() * probe.to(DEVICE)).sum(), ins)
    assert all(grad.dtype == dtype for grad in grads)
    assert_near_reference({"y": (out, ref), "dx": (grads[0], grads_ref[0]), "dz": (grads[1], grads_ref[1])},
                          TOL[dtype])


@interpret
@pytest.mark.parametrize("frozen", ["x", "z"])
def test_strided_gate_in_place_and_one_input_frozen(frozen):
    """z a slice of a wider projection output (rows 50 apart): read where it lies and kept for the backward as that
    view (nothing else of its size kept); one input frozen gets no gradient, the other the reference's."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 9, 50, generator=g, dtype=torch.float64)
    x = torch.randn(2, 9, 24, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(frozen != "x"), wide.clone().requires_grad_(frozen != "z")]
    ref = silu_gate_naive(leaves[0], leaves[1][..., 10:34])
    probe = torch.randn(2, 9, 24, generator=g, dtype=torch.float64)
    live = [t for t in leaves if t.requires_grad]
    (grad_ref,) = torch.autograd.grad((ref * probe).sum(), live)
    ins = [x.to(DEVICE, torch.float32).requires_grad_(frozen != "x"),
           wide.to(DEVICE, torch.float32).requires_grad_(frozen != "z")]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        out = silu_gate_triton(ins[0], ins[1][..., 10:34])
    assert len(kept) == 2
    assert {t.untyped_storage().data_ptr() for t in kept} == {t.untyped_storage().data_ptr() for t in ins}
    (grad,) = torch.autograd.grad((out.double() * probe.to(DEVICE)).sum(), [t for t in ins if t.requires_grad])
    assert_near_reference({"y": (out, ref), "grad": (grad, grad_ref)}, TOL[torch.float32])


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        silu_gate_triton(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one shape"):
        silu_gate_triton(torch.zeros(2, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="D >= 1"):
        silu_gate_triton(torch.zeros(2, 0), torch.zeros(2, 0))
    if not (ON_GPU or INTERPRET):
        with pytest.raises(ValueError, match="needs triton and a CUDA tensor"):
            silu_gate(torch.zeros(2, 4), torch.zeros(2, 4), backend="triton")


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA + triton")
def test_auto_takes_the_kernels_on_cuda():
    """"auto" on bf16 CUDA tensors: the kernels' result (equal to "triton"), within one rounding of the torch form."""
    g = torch.Generator().manual_seed(3)
    x, z = (torch.randn(64, 96, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    out = silu_gate(x, z)
    torch.testing.assert_close(out, silu_gate(x, z, backend="triton"), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), silu_gate(x, z, backend="torch").float(), rtol=2**-7, atol=2**-7)


_SM90_BUILDS = """
from hybridlm.ops.silu_gate import kernels as k

sizes = dict(BM=k.BM, BD=k.BD, STEPS=k.STEPS)
for io in ("*bf16", "*fp32"):
    build(k.silu_gate_fwd_kernel, sizes, io=io, io_names=("x_ptr", "z_ptr", "y_ptr"))
    for has_dx, has_dz in ((True, True), (True, False), (False, True)):
        build(k.silu_gate_bwd_kernel, dict(sizes, HAS_DX=has_dx, HAS_DZ=has_dz), io=io,
              io_names=("dy_ptr", "x_ptr", "z_ptr", "dx_ptr", "dz_ptr"))
"""


@needs_cuda_backend
def test_kernels_compile_for_sm90():
    report = compile_for_sm90(_SM90_BUILDS, modules=("hybridlm.ops.silu_gate.kernels",))
    assert set(report["built"]) == report["defined"] == {"silu_gate_fwd_kernel", "silu_gate_bwd_kernel"}
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
