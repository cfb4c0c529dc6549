"""The one-kernel rotation of queries and keys (`hybridlm.ops.rotary`) against the torch form
(`hybridlm.modules.rotary.apply_rotary`), bit for bit and signed zeros included: dtypes, head dims and head counts
that are no powers of two, strided inputs, per-row and shared tables, float32 tables rounded by the kernel; and
where `rotate_qk` takes it.

- On a GPU, or under the interpreter (HYBRIDLM_TRITON_INTERPRET=1): everything marked `interpret`.
- CPU, no GPU (CI): the choice of form, the input checks and the sm_90 build.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules import rotary
from hybridlm.modules.rotary import apply_rotary, rotary_cos_sin, rotate_qk
from hybridlm.ops.rotary import rotary_qk_triton
from tests.ops.triton_modes import (
    DEVICE,
    H200_SHARED_BYTES,
    ON_GPU,
    compile_for_sm90,
    interpret,
    needs_cuda_backend,
    skip_bfloat16_interpreted,
)


def _inputs(B, T, HQ, HK, D, *, table_rows, dtype, seed=0):
    """q, k (with some entries +0 and -0) and float32 tables."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g)
    k = torch.randn(B, T, HK, D, generator=g)
    for t in (q, k):
        t.view(-1)[::7] = 0.0
        t.view(-1)[3::7] = -0.0
    positions = torch.randint(0, 5000, (table_rows, T), generator=g)
    cos, sin = rotary_cos_sin(positions, head_dim=D, base=10000.0)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), cos.to(DEVICE), sin.to(DEVICE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("tables", ["float32", "activations"])
@pytest.mark.parametrize("B, T, HQ, HK, D, table_rows", [
    (2, 5, 3, 1, 16, 1),  # shared table, grouped keys
    (1, 1, 12, 4, 64, 1),  # a decoding step of the 125m shape
    (3, 4, 5, 2, 80, 3),  # a table per row, a head dim that is no power of two
    (2, 3, 8, 8, 128, 2),
])
def test_equals_the_torch_form_bit_for_bit(B, T, HQ, HK, D, table_rows, tables, dtype):
    skip_bfloat16_interpreted(dtype)
    q, k, cos, sin = _inputs(B, T, HQ, HK, D, table_rows=table_rows, dtype=dtype)
    rounded = cos.to(dtype), sin.to(dtype)  # what the torch form multiplies by
    q_out, k_out = rotary_qk_triton(q, k, *(rounded if tables == "activations" else (cos, sin)))
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert _same(q_out, apply_rotary(q, *rounded)) and _same(k_out, apply_rotary(k, *rounded))


@interpret
def test_reads_slices_of_a_wider_row():
    """q and k as row slices of one projection output (unit stride along D only)."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(2, 3, 6 * 16 + 2 * 16 + 5, generator=g).to(DEVICE)
    q = row[..., :6 * 16].unflatten(-1, (6, 16))
    k = row[..., 6 * 16:8 * 16].unflatten(-1, (2, 16))
    _, _, cos, sin = _inputs(2, 3, 1, 1, 16, table_rows=1, dtype=torch.float32)
    q_out, k_out = rotary_qk_triton(q, k, cos, sin)
    assert _same(q_out, apply_rotary(q, cos, sin)) and _same(k_out, apply_rotary(k, cos, sin))


def test_rotate_qk_takes_the_kernel_only_without_a_gradient_on_cuda(monkeypatch):
    """The kernel for a CUDA call that records no gradient with [B or 1, T, D] tables; the torch form for a recorded
    gradient, 2-D tables (1-D position_ids) and on the CPU: the same values every time."""
    calls = []
    monkeypatch.setattr(rotary, "rotary_qk_triton", lambda *a: calls.append(1) or rotary_qk_triton(*a))
    q, k, cos, sin = _inputs(1, 2, 2, 1, 16, table_rows=1, dtype=torch.float16)
    rounded = cos.half(), sin.half()
    want = (apply_rotary(q, *rounded), apply_rotary(k, *rounded))
    for q_in, tables in ((q, (cos, sin)), (q.clone().requires_grad_(), (cos, sin)), (q, (cos[0], sin[0]))):
        got = rotate_qk(q_in, k, *tables)
        assert all(_same(a.detach(), b) for a, b in zip(got, want))
    assert calls == ([1] if ON_GPU else [])


def test_refuses_bad_inputs():
    q, k, cos, sin = (torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="share one dtype"):
        rotary_qk_triton(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="float32 or that dtype"):
        rotary_qk_triton(q.half(), k.half(), cos.double(), sin.double())
    with pytest.raises(ValueError, match=r"\[B or 1, T, D\]"):
        rotary_qk_triton(q, k, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="must be even"):
        rotary_qk_triton(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])


_SM90 = """
from hybridlm.ops.rotary import kernels as k

options = dict(k.LAUNCH, num_stages=3)
for io, table, HQ, HK, D in (("*bf16", "*fp32", 12, 4, 64), ("*fp32", "*fp32", 5, 2, 80), ("*fp16", "*fp16", 16, 16,
                                                                                              128)):
    consts = dict(D=D, BHQ=triton.next_power_of_2(HQ), BHK=triton.next_power_of_2(HK), BD=triton.next_power_of_2(D))
    fn = k.rotary_qk_kernel
    sig = {n: "constexpr" if n in consts else table if n in ("cos_ptr", "sin_ptr") else io if n.endswith("_ptr")
           else "i32" for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    assert "fma." not in compiled.asm["ptx"], "a fused multiply-add would round differently from the torch form"
    print("built", fn.__name__, compiled.metadata.shared)
"""


@needs_cuda_backend
def test_kernel_compiles_for_sm90_without_fused_multiply_adds():
    """Built with the launch's options (`kernels.LAUNCH`): no fused multiply-add in the PTX, whose single rounding
    would differ from the torch form's two."""
    report = compile_for_sm90(_SM90, modules=("hybridlm.ops.rotary.kernels",))
    assert set(report["built"]) == report["defined"] == {"rotary_qk_kernel"}, report
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
