"""The one-kernel rotation of queries and keys (`hybridlm.ops.rotary`) against the torch form
(`hybridlm.modules.rotary.apply_rotary`), bit for bit: dtypes, odd head dims, strided inputs, per-row and shared
tables; and where `rotate_qk` takes it.

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
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, T, HK, D, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 5000, (table_rows, T), generator=g).to(DEVICE)
    cos, sin = (t.to(dtype) for t in rotary_cos_sin(positions, head_dim=D, base=10000.0))
    return q, k, cos, sin


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("B, T, HQ, HK, D, table_rows", [
    (2, 5, 3, 1, 16, 1),  # shared table, grouped keys
    (1, 1, 12, 4, 64, 1),  # a decoding step of the 125m shape
    (3, 4, 5, 2, 80, 3),  # a table per row, a head dim that is no power of two
    (2, 3, 8, 8, 128, 2),
])
def test_equals_the_torch_form_bit_for_bit(B, T, HQ, HK, D, table_rows, dtype):
    skip_bfloat16_interpreted(dtype)
    q, k, cos, sin = _inputs(B, T, HQ, HK, D, table_rows=table_rows, dtype=dtype)
    q_out, k_out = rotary_qk_triton(q, k, cos, sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, apply_rotary(q, cos, sin))
    assert torch.equal(k_out, apply_rotary(k, cos, sin))


@interpret
def test_reads_slices_of_a_wider_row():
    """q and k as row slices of one projection output (unit stride along D only)."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(2, 3, 6 * 16 + 2 * 16 + 5, generator=g).to(DEVICE)
    q = row[..., :6 * 16].unflatten(-1, (6, 16))
    k = row[..., 6 * 16:8 * 16].unflatten(-1, (2, 16))
    _, _, cos, sin = _inputs(2, 3, 1, 1, 16, table_rows=1, dtype=torch.float32)
    q_out, k_out = rotary_qk_triton(q, k, cos, sin)
    assert torch.equal(q_out, apply_rotary(q, cos, sin)) and torch.equal(k_out, apply_rotary(k, cos, sin))


def test_rotate_qk_takes_the_kernel_only_without_a_gradient_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(rotary, "rotary_qk_triton", lambda *a: calls.append(1) or rotary_qk_triton(*a))
    q, k, cos, sin = _inputs(1, 2, 2, 1, 16, table_rows=1, dtype=torch.float32)
    want = (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    for q_in in (q, q.clone().requires_grad_()):
        got = rotate_qk(q_in, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == ([1] if ON_GPU else [])  # the CPU (and a recorded gradient) keep the torch form


def test_refuses_bad_inputs():
    q, k, cos, sin = (torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="share one dtype"):
        rotary_qk_triton(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match=r"\[B or 1, T, D\]"):
        rotary_qk_triton(q, k, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="must be even"):
        rotary_qk_triton(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])


_SM90 = """
from hybridlm.ops.rotary import kernels as k

for io, HQ, HK, D in (("*bf16", 12, 4, 64), ("*fp32", 5, 2, 80), ("*fp16", 16, 16, 128)):
    build(k.rotary_qk_kernel, dict(D=D, BHQ=triton.next_power_of_2(HQ), BHK=triton.next_power_of_2(HK),
                                   BD=triton.next_power_of_2(D)), io=io, io_names=("q_ptr", "k_ptr", "cos_ptr",
                                   "sin_ptr", "q_out_ptr", "k_out_ptr"), warps=k.NUM_WARPS)
"""


@needs_cuda_backend
def test_kernel_compiles_for_sm90():
    report = compile_for_sm90(_SM90, modules=("hybridlm.ops.rotary.kernels",))
    assert set(report["built"]) == report["defined"] == {"rotary_qk_kernel"}, report
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
