"""The fast-weight op on CUDA: the chunk path on the GPU against the naive spec in float64 on the CPU.

Skipped where there is no GPU (CI); run on a GPU machine with `python -m pytest -q tests/ops/test_fast_weight_cuda.py`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import RULES, SLIDING, make_inputs, random_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _grads(inputs, o, S):
    g = torch.Generator().manual_seed(7)
    weight_o = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
    weight_s = torch.randn(S.shape, generator=g, dtype=torch.float64).to(S.device, S.dtype)
    loss = (o * weight_o).sum() + (S * weight_s).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("rule,dtype", list(itertools.product(RULES, (torch.float32, torch.bfloat16))))
def test_cuda_chunk_matches_cpu_naive(rule, dtype):
    window = 3 if rule in SLIDING else 1
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    cpu = make_inputs(rule, B=2, T=150, H=4, K=32, V=48, requires_grad=True)
    state = random_state(2, 4, 32, 48, window=window)
    o_ref, s_ref = fast_weight_attention(*cpu, rule=rule, window=window, backend="naive", initial_state=state,
                                         output_final_state=True)
    gpu = [t.detach().to("cuda", dtype).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*gpu, rule=rule, window=window, backend="chunk", output_final_state=True,
                                 initial_state=state.to("cuda"))
    assert o.device.type == "cuda" and o.dtype == dtype and s.S.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < tol
    assert rel_err(s.S.cpu(), s_ref.S) < tol
    for g, g_ref in zip(_grads(gpu, o, s.S), _grads(cpu, o_ref, s_ref.S)):
        assert rel_err(g.cpu(), g_ref) < (5e-4 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("rule", RULES)
def test_cuda_packed_sequences(rule):
    window = 3 if rule in SLIDING else 1
    offsets = torch.tensor([0, 5, 70, 71, 130])
    cpu = make_inputs(rule, B=1, T=130, H=2, K=16, V=16)
    o_ref, s_ref = fast_weight_attention(*cpu, rule=rule, window=window, backend="naive", cu_seqlens=offsets,
                                         output_final_state=True)
    gpu = [t.to("cuda", torch.float32) for t in cpu]
    o, s = fast_weight_attention(*gpu, rule=rule, window=window, cu_seqlens=offsets.cuda(), output_final_state=True)
    assert rel_err(o.cpu(), o_ref) < 1e-4
    assert s.S.shape[0] == 4 and s.S.dtype == torch.float32
    assert rel_err(s.S.cpu(), s_ref.S.float()) < 1e-4  # one final state per packed sequence
