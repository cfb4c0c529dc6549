"""Rule 1 in Triton (regression / delta rule, scalar decay, window 1) against a float64 step loop of the same prepared
recurrence,

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T,   o_t = S_t^T q_t (after) or S_{t-1}^T q_t,

and the Triton backend (rule 1 from raw inputs) against the torch chunk backend. The forward runs the Triton kernels
(`chunk_1.py`); the backward recomputes through the torch chunk path, so the gradient checks test that wiring.

Where they run (as tests/ops/test_fast_weight_triton.py):
- GPU machine (CUDA + triton): every test, on CUDA tensors (float32, bfloat16, float16).
- CPU with triton and HYBRIDLM_TRITON_INTERPRET=1: the `interpret` tests under Triton's interpreter:
      HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_fast_weight_triton_rule1.py
  (float16 stands in for the 16-bit path; bfloat16 runs on the GPU only).
- CPU without the flag: skipped.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

INTERPRET = os.environ.get("HYBRIDLM_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton's kernels
os.environ.setdefault("HYBRIDLM_TRITON_AUTOTUNE", "0")

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight.triton import (
    fast_weight_1_triton,
    fast_weight_triton,
    is_available,
    supports,
)
from tests.helpers import rel_err
from tests.ops.test_fast_weight import make_inputs, random_state
from tests.ops.test_fast_weight_triton import TOL, prepared, projection

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = not INTERPRET and is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
interpret = pytest.mark.skipif(not (ON_GPU or (INTERPRET and HAS_TRITON)),
                               reason="needs CUDA + triton, or HYBRIDLM_TRITON_INTERPRET=1 with triton installed")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA + triton (too slow or unsupported in the interpreter)")

NAMES = ("q", "x", "y", "eta", "log_gamma", "S0")


def reference(q, x, y, eta, log_gamma, S0, *, read_after):
    """The rule-1 recurrence as a step loop (float64 inputs in, differentiable by autograd)."""
    S, outs = S0, []
    for t in range(q.shape[1]):
        S_prev = S
        r = y[:, t] - torch.einsum("nhk,nhkv->nhv", x[:, t], S_prev)                       # residual [N, H, V]
        write = eta[:, t, :, None, None] * x[:, t, :, :, None] * r[:, :, None, :]          # [N, H, K, V]
        S = log_gamma[:, t].exp()[..., None, None] * S + write
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S if read_after else S_prev))
    return torch.stack(outs, dim=1), S


def check_against_reference(N, T, H, K, V, *, dtype, chunk_size, read_after, with_S0=True, seed=0,
                            grad_o=True, grad_S=True):
    """Outputs, final state and the gradients of a random projection of (either or both of) them, against the
    float64 loop on the same (rounded) inputs."""
    base = prepared(N, T, H, K, V, seed=seed)
    base[:3] = [t.to(dtype).double() for t in base[:3]]
    ref_in = [t.clone().requires_grad_(True) for t in base]
    if not with_S0:
        ref_in[5] = torch.zeros_like(base[5])
    o_ref, S_ref = reference(*ref_in, read_after=read_after)
    w_o, w_S = projection(o_ref, S_ref)
    w_o, w_S = w_o * grad_o, w_S * grad_S
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), ref_in if with_S0 else ref_in[:5],
                                    materialize_grads=True)  # q is unused when only the final state is

    dtypes = (dtype, dtype, dtype, torch.float32, torch.float32, torch.float32)
    ins = [t.to(DEVICE, d).requires_grad_(True) for t, d in zip(base, dtypes)]
    S0 = ins[5] if with_S0 else None
    o, S = fast_weight_1_triton(*ins[:5], S0, read_after=read_after, chunk_size=chunk_size)
    assert o.dtype == dtype and o.shape == (N, T, H, V) and S.dtype == torch.float32 and S.shape == (N, H, K, V)
    loss = 0.0
    if grad_o:
        loss = loss + (o.double() * w_o.to(DEVICE)).sum()
    if grad_S:
        loss = loss + (S.double() * w_S.to(DEVICE)).sum()
    grads = torch.autograd.grad(loss, ins if with_S0 else ins[:5], materialize_grads=True)
    tol = TOL[dtype]
    errors = {"o": rel_err(o.cpu(), o_ref), "S": rel_err(S.cpu(), S_ref)}
    for name, grad, grad_ref, leaf in zip(NAMES, grads, grads_ref, ins):
        assert grad.dtype == leaf.dtype, name
        errors["d" + name] = rel_err(grad.cpu(), grad_ref)
    assert max(errors.values()) < tol, {k: f"{v:.2e}" for k, v in errors.items()}


CASES = list(itertools.product((torch.float32, torch.float16, torch.bfloat16), (1, 63, 130), (16, 64), (True, False)))


@interpret
@pytest.mark.parametrize("dtype,T,chunk_size,read_after", CASES,
                         ids=[f"{str(d)[6:]}-T{T}-C{c}-{'after' if a else 'before'}" for d, T, c, a in CASES])
def test_matches_reference(dtype, T, chunk_size, read_after):
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("the interpreter's tl.dot is wrong for bfloat16; float16 covers the 16-bit path on the CPU")
    check_against_reference(2, T, 2, 16, 24, dtype=dtype, chunk_size=chunk_size, read_after=read_after)


@interpret
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (100, 40)])
def test_head_dims(K, V):
    """All of K in the WY and pass kernels (up to 128), several V blocks, non-powers of two."""
    check_against_reference(1, 70, 1, K, V, dtype=torch.float32, chunk_size=64, read_after=True)


@interpret
def test_no_initial_state_and_chunk_128():
    check_against_reference(1, 150, 2, 16, 16, dtype=torch.float32, chunk_size=128, read_after=False, with_S0=False)


@interpret
@pytest.mark.parametrize("grad_o,grad_S", [(True, False), (False, True)])
def test_one_output_used(grad_o, grad_S):
    """Only o or only the final state reaches the loss (the other gradient arrives as None)."""
    check_against_reference(1, 40, 2, 16, 16, dtype=torch.float32, chunk_size=16, read_after=True,
                            grad_o=grad_o, grad_S=grad_S)


@interpret
def test_state_carry_over():
    """Running [0:T] equals running [0:t] and then [t:T] from the returned state (t not on a chunk edge)."""
    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in prepared(1, 100, 2, 16, 16, seed=3))
    o, S = fast_weight_1_triton(q, x, y, eta, log_gamma, S0, read_after=True, chunk_size=16)
    o1, S1 = fast_weight_1_triton(*(t[:, :37] for t in (q, x, y, eta, log_gamma)), S0, read_after=True,
                                  chunk_size=16)
    o2, S2 = fast_weight_1_triton(*(t[:, 37:] for t in (q, x, y, eta, log_gamma)), S1, read_after=True,
                                  chunk_size=16)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-5
    assert rel_err(S2, S) < 1e-5


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_shape(dtype):
    check_against_reference(2, 1000, 4, 128, 128, dtype=dtype, chunk_size=64, read_after=True)


CONTRACT_CASES = [  # window, pairing, read, step_size, packed
    ("shifted", "after", "nlms", False), ("shifted", "before", "direct", True), ("same_step", "after", "nlms", True),
]


@interpret
@pytest.mark.parametrize("pairing,read,step_size,packed", CONTRACT_CASES,
                         ids=["-".join(map(str, case)).replace("True", "packed").replace("-False", "")
                              for case in CONTRACT_CASES])
def test_backend_contract_matches_chunk(pairing, read, step_size, packed):
    """`fast_weight_triton(rule="1")` against the torch chunk backend, with a carried state, ridge scaling and packed
    sequences: outputs, the final state and all gradients."""
    B, T, H, K, V = (1, 70, 2, 16, 24) if packed else (2, 70, 2, 16, 24)
    offsets = torch.tensor([0, 5, 40, 41, 70]) if packed else None
    n = 4 if packed else B
    cpu = make_inputs("1", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, requires_grad=True)
    state = random_state(n, H, K, V, window=1, dtype=torch.float32, requires_grad=True)
    if pairing == "same_step":
        state.last_k = None
    options = {"rule": "1", "window": 1, "pairing": pairing, "read": read, "step_size": step_size,
               "ridge_scaling": True, "eps": 1e-6, "eps_gamma": 1e-6}
    o_ref, s_ref = fast_weight_attention(*cpu, backend="chunk", initial_state=state, output_final_state=True,
                                         cu_seqlens=offsets, **options)
    dev = [t.detach().to(DEVICE).requires_grad_(True) for t in cpu]
    dev_state = state.detach().to(DEVICE)
    dev_state.S.requires_grad_(True)
    o, s = fast_weight_triton(*dev, initial_state=dev_state, offsets=offsets, chunk_size=64, **options)
    assert rel_err(o.cpu(), o_ref) < 1e-4 and rel_err(s.S.cpu(), s_ref.S) < 1e-4
    assert (s.last_k is None and s_ref.last_k is None) or torch.equal(s.last_k.cpu(), s_ref.last_k)
    w_o, w_S = projection(o_ref, s_ref.S)
    grads_ref = torch.autograd.grad((o_ref * w_o.float()).sum() + (s_ref.S * w_S.float()).sum(), cpu + [state.S])
    grads = torch.autograd.grad((o * w_o.float().to(DEVICE)).sum() + (s.S * w_S.float().to(DEVICE)).sum(),
                                dev + [dev_state.S])
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad.cpu(), grad_ref) < 1e-4


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_front_door(dtype):
    """`fast_weight_attention(rule="1", backend="triton")` on the GPU against the float64 chunk backend on the CPU."""
    cpu = make_inputs("1", B=2, T=150, H=4, K=32, V=48, requires_grad=True)
    state = random_state(2, 4, 32, 48, window=1)
    o_ref, s_ref = fast_weight_attention(*cpu, rule="1", backend="chunk", initial_state=state,
                                         output_final_state=True)
    gpu = [t.detach().to("cuda", dtype).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*gpu, rule="1", backend="triton", initial_state=state.to("cuda"),
                                 output_final_state=True)
    assert o.dtype == dtype and s.S.dtype == torch.float32
    assert rel_err(o.cpu(), o_ref) < TOL[dtype] and rel_err(s.S.cpu(), s_ref.S) < TOL[dtype]
    w_o, w_S = projection(o_ref, s_ref.S)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_S).sum(), cpu)
    grads = torch.autograd.grad((o.double() * w_o.cuda()).sum() + (s.S.double() * w_S.cuda()).sum(), gpu)
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad.cpu(), grad_ref) < TOL[dtype]


def test_supports_rule_1_window_1_only():
    assert supports(rule="1", window=1, K=64, V=64, dtype=torch.float32)
    assert not supports(rule="1", window=2, K=64, V=64, dtype=torch.float32)
    assert supports(rule="1A", window=1, K=64, V=64, dtype=torch.bfloat16)
    assert supports(rule="3A", window=3, K=64, V=64, dtype=torch.bfloat16)
    assert not supports(rule="2", window=1, K=64, V=64, dtype=torch.float32)
