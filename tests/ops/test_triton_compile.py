"""The Triton scans, the fused rule-1A/1 and rule-3A preparations and rule 3A's band as torch.library custom ops
(`hybridlm::fast_weight_{1a,1,prepare,window_prepare,band}_{fwd,bwd}`): `torch.library.opcheck`
(schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes) and `torch.compile(fullgraph=True)`
of the front door with backend="triton" against eager.

Runs where the other Triton tests' `interpret` tests run (a GPU, or the CPU interpreter with
HYBRIDLM_TRITON_INTERPRET=1). torch.compile uses the "aot_eager" backend everywhere (dynamo + AOT
autograd, the part that must see through the custom ops; no C compiler needed) and also "inductor" on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight.state import FastWeightState
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import OPCHECKS, make_inputs, opcheck_scan, prepared
from tests.ops.triton_modes import DEVICE, gpu_only, interpret


def _ops(name):
    import hybridlm.ops.fast_weight.triton.custom_ops  # noqa: F401  (registers the ops)

    return getattr(torch.ops.hybridlm, f"fast_weight_{name}_fwd"), getattr(torch.ops.hybridlm, f"fast_weight_{name}_bwd")


@interpret
@pytest.mark.parametrize("name", ["1a", "1"])
def test_opcheck(name):
    """The forward op with an initial state, the backward op without one (and without dL/dS_final)."""
    _ops(name)
    opcheck_scan(name, [t.to(DEVICE, torch.float32).requires_grad_(True) for t in prepared(1, 20, 2, 16, 8)])


@interpret
def test_opcheck_prepare():
    """The fused preparation op (`hybridlm::fast_weight_prepare_fwd`, rules 1A / 1): shifted with a carried key and
    packed rows, same-step over plain rows with direct steps, and shifted with documents restarted in place
    (`seq_idx`); the backward op without a carried key, with and without `seq_idx`."""
    fwd, bwd = _ops("prepare")
    k = torch.randn(1, 20, 2, 16, device=DEVICE)
    v = torch.randn(1, 20, 2, 8, device=DEVICE)
    beta, lam = torch.rand(1, 20, 2, device=DEVICE), torch.rand(1, 20, 2, device=DEVICE)
    last_k = torch.randn(3, 2, 16, device=DEVICE)
    offsets = torch.tensor([0, 4, 15, 20], device=DEVICE)
    leaves = [t.requires_grad_(True) for t in (k, v, beta, lam, last_k)]
    torch.library.opcheck(fwd, (*leaves, offsets, None, 11, True, True, True, 1e-6, 1e-6), test_utils=OPCHECKS)
    torch.library.opcheck(fwd, (*leaves[:4], None, None, None, 20, False, False, False, 1e-6, 1e-6),
                          test_utils=OPCHECKS)
    seq_idx = torch.tensor([[0] * 7 + [1] * 9 + [5] * 4], device=DEVICE)  # documents restarted in place
    torch.library.opcheck(fwd, (*leaves[:4], None, None, seq_idx, 20, True, True, False, 1e-6, 1e-6),
                          test_utils=OPCHECKS)
    grads = (torch.randn(1, 20, 2, 16, device=DEVICE), torch.randn(1, 20, 2, 8, device=DEVICE),
             torch.randn(1, 20, 2, device=DEVICE), torch.randn(1, 20, 2, device=DEVICE))
    detached = [t.detach() for t in (k, v, beta, lam)]
    torch.library.opcheck(bwd, (*grads, *detached, None, None, None, 20, True, True, False, 1e-6, 0.05),
                          test_utils=OPCHECKS)
    torch.library.opcheck(bwd, (*grads, *detached, None, None, seq_idx, 20, True, True, False, 1e-6, 0.05),
                          test_utils=OPCHECKS)


@interpret
def test_opcheck_window_prepare():
    """Rule 3A's fused window preparation (`hybridlm::fast_weight_window_prepare_fwd` / `_bwd`), window 3: shifted
    with a carried key and tail (NLMS, ridge scaling), same-step without a carried state (direct steps); the backward
    op with and without the tail."""
    fwd, bwd = _ops("window_prepare")
    N, T, H, K, V, W = 2, 19, 2, 16, 8, 3
    k, v = torch.randn(N, T, H, K, device=DEVICE), torch.randn(N, T, H, V, device=DEVICE)
    beta, lam = torch.rand(N, T, H, device=DEVICE), torch.rand(N, T, H, device=DEVICE)
    last_k = torch.randn(N, H, K, device=DEVICE)
    tail_x, tail_v = torch.randn(N, H, W - 1, K, device=DEVICE), torch.randn(N, H, W - 1, V, device=DEVICE)
    tail_len = torch.tensor([1, 2], device=DEVICE)
    leaves = [t.requires_grad_(True) for t in (k, v, beta, lam, last_k, tail_x, tail_v)]
    torch.library.opcheck(fwd, (*leaves, tail_len, W, True, True, True, 1e-6, 1e-6), test_utils=OPCHECKS)
    torch.library.opcheck(fwd, (*leaves[:4], None, None, None, None, W, False, False, False, 1e-6, 1e-6),
                          test_utils=OPCHECKS)
    x_ext, y_ext, C, log_gamma, E = (t.detach() for t in fwd(*leaves, tail_len, W, True, True, True, 1e-6, 0.05))
    grads = [torch.randn(t.shape, device=DEVICE) for t in (x_ext, y_ext, C, log_gamma)]
    saved = (x_ext, y_ext, C, log_gamma, E, beta.detach(), lam.detach())
    torch.library.opcheck(bwd, (*grads, *saved, last_k.detach(), tail_x.detach(), tail_v.detach(), tail_len, W, True,
                                True, True, 1e-6, 0.05), test_utils=OPCHECKS)
    torch.library.opcheck(bwd, (*grads, *saved, None, None, None, None, W, False, True, False, 1e-6, 0.05),
                          test_utils=OPCHECKS)


@interpret
@pytest.mark.parametrize("read_after,dtype,with_S0", [(True, torch.float32, True), (False, torch.float32, False),
                                                      (True, torch.float16, True)])
def test_opcheck_delayed(read_after, dtype, with_S0):
    """Rule 3A's delayed op (`hybridlm::fast_weight_delayed_fwd` / `_bwd`: the 1A scan over the first T ext rows plus
    the band), window 3; in float16 the fake outputs must take q's dtype as the kernels' do."""
    fwd, bwd = _ops("delayed")
    N, T, H, K, V = 2, 19, 2, 16, 8
    q = torch.randn(N, T, H, K, device=DEVICE, dtype=dtype)
    x_ext, y_ext = (torch.randn(N, T + 2, H, D, device=DEVICE, dtype=dtype) for D in (K, V))
    eta, log_gamma = torch.rand(N, T, H, device=DEVICE), -torch.rand(N, T, H, device=DEVICE)
    c = torch.rand(N, T, H, 2, device=DEVICE)
    S0 = torch.randn(N, H, K, V, device=DEVICE) if with_S0 else None
    leaves = [t.requires_grad_(True) for t in (q, x_ext, y_ext, eta, log_gamma, c)]
    options = (read_after, 16)
    torch.library.opcheck(fwd, (*leaves, S0, *options), test_utils=OPCHECKS)
    detached = [t.detach() for t in leaves]
    grads = (torch.randn(N, T, H, V, device=DEVICE, dtype=dtype), torch.randn(N, H, K, V, device=DEVICE))
    torch.library.opcheck(bwd, (*grads, *detached, S0, *options), test_utils=OPCHECKS)


COMPILE_CASES = [("3A", "aot_eager"), ("1", "aot_eager"),  # 3A runs its preparation op and the delayed op
                 ("2A", "aot_eager"),
                 pytest.param("1", "inductor", marks=gpu_only), pytest.param("3A", "inductor", marks=gpu_only),
                 pytest.param("2A", "inductor", marks=gpu_only)]


@interpret
@pytest.mark.parametrize("rule,compile_backend", COMPILE_CASES)
def test_compiled_front_door_matches_eager(rule, compile_backend):
    """torch.compile(fullgraph=True) of `fast_weight_attention(backend="triton")`: no graph break, outputs, final
    state and all gradients (q, k, v, beta, lam, S0) equal to eager's (the same kernels run); rule 3A with window 3."""
    window = 3 if rule == "3A" else 1
    H, K, V = 2, 16, 8

    def fn(q, k, v, beta, lam, S, last_k):
        o, state = fast_weight_attention(q, k, v, beta, lam, rule=rule, window=window, backend="triton",
                                         chunk_size=16, initial_state=FastWeightState(S=S, last_k=last_k),
                                         output_final_state=True)
        return o, state.S

    inputs = [t.to(DEVICE).detach().requires_grad_(True)
              for t in make_inputs(rule, B=2, T=37, H=H, K=K, V=V, dtype=torch.float32)]
    S = (0.3 * torch.randn(2, H, K, V, device=DEVICE)).requires_grad_(True)
    last_k = torch.randn(2, H, K, device=DEVICE)
    leaves = inputs + [S]
    o, S_final = fn(*inputs, S, last_k)
    grads = torch.autograd.grad(o.square().sum() + S_final.square().sum(), leaves)
    compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)
    o_c, S_c = compiled(*inputs, S, last_k)
    grads_c = torch.autograd.grad(o_c.square().sum() + S_c.square().sum(), leaves)
    assert rel_err(o_c, o) < 1e-5 and rel_err(S_c, S_final) < 1e-5
    for name, grad, grad_c in zip(("q", "k", "v", "beta", "lam", "S0"), grads, grads_c):
        assert rel_err(grad_c, grad) < 1e-5, name
