"""The Triton backend of the fast-weight op across its rules: every rule through the front door on a GPU against
the float64 chunk backend, the kernels launching on the tensors' GPU, which rules "auto" takes, and the package
importing where triton is missing.

    GPU:  python -m pytest -q tests/ops/test_triton_backend.py
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight.triton import SUPPORTED_RULES, auto_takes
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import TOL, make_inputs, prepared, projection, random_state
from tests.ops.triton_modes import DEVICE, ON_GPU, gpu_only, interpret


@gpu_only
@pytest.mark.parametrize("rule,dtype", list(itertools.product(("1A", "3A", "1", "2A", "3", "2"),
                                                              (torch.float32, torch.bfloat16))))
def test_front_door(rule, dtype):
    """`fast_weight_attention(backend="triton")` on the GPU against the chunk backend in float64 on the CPU (rules 3A
    and 3 with window 3)."""
    window = 3 if rule in ("3A", "3") else 1
    cpu = make_inputs(rule, B=2, T=150, H=4, K=32, V=48, requires_grad=True)
    state = random_state(2, 4, 32, 48, window=window)
    o_ref, s_ref = fast_weight_attention(*cpu, rule=rule, window=window, backend="chunk", initial_state=state,
                                         output_final_state=True)
    gpu = [t.detach().to("cuda", dtype).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*gpu, rule=rule, window=window, backend="triton", initial_state=state.to("cuda"),
                                 output_final_state=True)
    assert o.dtype == dtype and s.S.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < TOL[dtype] and rel_err(s.S.cpu(), s_ref.S) < TOL[dtype]
    w_o, w_S = projection(o_ref, s_ref.S)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_S).sum(), cpu)
    grads = torch.autograd.grad((o.double() * w_o.cuda()).sum() + (s.S.double() * w_S.cuda()).sum(), gpu)
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad.cpu(), grad_ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("rule,window,packed", [("1A", 1, False), ("1A", 1, True), ("1", 1, False), ("3A", 3, False),
                                                ("3A", 3, True), ("2A", 1, False)])
def test_without_final_state(rule, window, packed):
    """output_final_state=False (a training step: the backend then skips assembling the final state) gives the same
    outputs and gradients as output_final_state=True, bit for bit, and no state; from a carried state (rule 3A's
    with its tail), through the fused preparations (rows) and prepare_writes (packed 3A)."""
    B, T, H, K, V = (1, 40, 2, 16, 24) if packed else (2, 23, 2, 16, 24)
    cu_seqlens = torch.tensor([0, 9, 31, 40]) if packed else None
    n = 3 if packed else B
    inputs = [t.to(DEVICE) for t in make_inputs(rule, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)]
    state = random_state(n, H, K, V, window=window, dtype=torch.float32).to(DEVICE)
    w_o = projection(inputs[2].cpu(), inputs[2].cpu())[0].to(DEVICE, torch.float32)  # o has v's shape
    results = []
    for final_state in (True, False):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        o, s = fast_weight_attention(*leaves, rule=rule, window=window, backend="triton", initial_state=state,
                                     output_final_state=final_state, cu_seqlens=cu_seqlens)
        results.append((o, s, torch.autograd.grad((o * w_o).sum(), leaves)))
    (o1, s1, g1), (o0, s0, g0) = results
    assert s1 is not None and s0 is None
    assert torch.equal(o0, o1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("rule", ["1A", "1", "2A"])
def test_kernels_run_on_the_tensors_gpu(rule):
    """Tensors on cuda:1 while cuda:0 is the current device (a model moved to the second GPU): the kernels launch
    on the tensors' GPU and give cuda:0's results. Through the front door for the forward (autograd runs a
    backward on its own thread of the tensors' device), and the backward op called directly."""
    import hybridlm.ops.fast_weight.triton.custom_ops  # noqa: F401  (registers the ops)

    cpu = make_inputs(rule, B=2, T=70, H=2, K=32, V=32)
    prep = prepared(2, 70, 2, 32, 32, seed=5)
    if rule == "2A":  # eta and log_gamma per value column
        prep[3:5] = [t[..., None].expand(-1, -1, -1, 32).contiguous() for t in prep[3:5]]
    backward = getattr(torch.ops.hybridlm, f"fast_weight_{rule.lower()}_bwd")
    results = []
    for device in ("cuda:0", "cuda:1"):
        inputs = [t.to(device, torch.float32) for t in cpu]
        q, x, y, eta, log_gamma, S0 = (t.to(device, torch.float32) for t in prep)
        do = torch.ones_like(y)
        with torch.cuda.device(0):
            o, s = fast_weight_attention(*inputs, rule=rule, backend="triton", output_final_state=True)
            grads = backward(do, None, q, x, y, eta, log_gamma, S0, True, 16)
        results.append([t.cpu() for t in (o, s.S, *grads)])
    for mine, ref in zip(*results):
        assert rel_err(mine, ref) < 1e-6


def test_auto_takes_every_rule():
    """backend="auto" on CUDA sends every rule to the kernels (each timed faster than the chunk path,
    benchmarks/RESULTS.md); rule 3 up to window 64."""
    for rule in SUPPORTED_RULES:
        assert auto_takes(rule=rule, window=1, K=128, V=128, dtype=torch.bfloat16), rule
    assert auto_takes(rule="3", window=64, K=64, V=64, dtype=torch.float32)
    assert not auto_takes(rule="3", window=65, K=64, V=64, dtype=torch.float32)
    assert not auto_takes(rule="1", window=1, K=64, V=256, dtype=torch.float32)


def test_import_without_triton():
    """The package imports (and reports unavailable) where triton is missing; the custom ops register there too."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import hybridlm.ops.fast_weight.triton as t\n"
            "import hybridlm.ops.fast_weight.triton.custom_ops\n"
            "import torch; torch.ops.hybridlm.fast_weight_1_fwd; torch.ops.hybridlm.fast_weight_2a_bwd\n"
            "assert not t.is_available()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
