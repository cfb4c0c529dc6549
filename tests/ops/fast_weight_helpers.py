"""Shared pieces of the fast-weight op tests: random inputs and states, the prepared-write recurrences as float64
step loops, and the checks that the Triton tests of several rules run (kernels against the loops, the Triton front
door against the torch backends)."""

from __future__ import annotations

import torch

from hybridlm.ops import FastWeightState, fast_weight_attention
from hybridlm.ops.fast_weight.triton import (
    fast_weight_1_triton,
    fast_weight_1a_triton,
    fast_weight_2_triton,
    fast_weight_2a_triton,
)
from tests.helpers import rel_err
from tests.ops.triton_modes import DEVICE


RULES = ("1", "2", "3", "1A", "2A", "3A")
SLIDING = ("3", "3A")
PER_COLUMN = ("2", "2A")


def make_inputs(rule, *, B=2, T=63, H=3, K=5, V=7, dtype=torch.float64, seed=0, lam_scale=0.5, requires_grad=False):
    """Random inputs: RMS-normalized keys/queries (as the layer feeds them), gains in (0, 2), ridge >= 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = k / k.pow(2).mean(-1, keepdim=True).sqrt()
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta_shape = (B, T, H, V) if rule in PER_COLUMN else (B, T, H)
    beta = 0.05 + 1.9 * torch.rand(beta_shape, generator=g, dtype=torch.float64)
    lam = lam_scale * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    tensors = [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v, beta, lam)]
    return tensors


def random_state(n, H, K, V, *, window, tail_len=None, dtype=torch.float64, seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    S = (0.3 * torch.randn(n, H, K, V, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(requires_grad)
    last_k = torch.randn(n, H, K, generator=g, dtype=torch.float64).to(dtype)
    state = FastWeightState(S=S, last_k=last_k)
    if window > 1:
        state.tail_x = torch.randn(n, H, window - 1, K, generator=g, dtype=torch.float64).to(dtype)
        state.tail_v = torch.randn(n, H, window - 1, V, generator=g, dtype=torch.float64).to(dtype)
        if tail_len is None:
            tail_len = torch.randint(0, window, (n,), generator=g)
        state.tail_len = torch.as_tensor(tail_len, dtype=torch.int64)
    return state


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
NAMES = ("q", "x", "y", "eta", "log_gamma", "S0")


def reference(q, x, y, eta, log_gamma, S0, *, read_after, rule="1A"):
    """The recurrence as a step loop (float64 inputs in, differentiable by autograd): rule 1A writes eta x y^T,
    rule 1 writes eta x (y - S^T x)^T."""
    S, outs = S0, []
    for t in range(q.shape[1]):
        S_prev = S
        target = y[:, t]
        if rule == "1":
            target = target - torch.einsum("nhk,nhkv->nhv", x[:, t], S_prev)                # residual [N, H, V]
        write = eta[:, t, :, None, None] * x[:, t, :, :, None] * target[:, :, None, :]     # [N, H, K, V]
        S = log_gamma[:, t].exp()[..., None, None] * S + write
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S if read_after else S_prev))
    return torch.stack(outs, dim=1), S


KERNELS = {"1A": fast_weight_1a_triton, "1": fast_weight_1_triton}


def prepared(N, T, H, K, V, *, seed=0):
    """Random prepared writes as the op makes them (float64, CPU): unit-RMS queries, |x|^2 ~ 1, eta in [0, 1.9]
    with no write at t = 0 and some missing pairs, decays down to gamma = 1e-6 (log_gamma ~ -13.8)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, T, H, K, generator=g, dtype=torch.float64)
    x = torch.randn(N, T, H, K, generator=g, dtype=torch.float64) / K ** 0.5
    y = torch.randn(N, T, H, V, generator=g, dtype=torch.float64)
    eta = 1.9 * torch.rand(N, T, H, generator=g, dtype=torch.float64)
    eta = eta * (torch.rand(N, T, H, generator=g, dtype=torch.float64) > 0.1)
    eta[:, 0] = 0.0
    alpha = 0.3 * torch.rand(N, T, H, generator=g, dtype=torch.float64)
    alpha = torch.where(torch.rand(N, T, H, generator=g, dtype=torch.float64) < 0.02, 1 - 1e-6, alpha)
    log_gamma = torch.log1p(-alpha)
    S0 = 0.3 * torch.randn(N, H, K, V, generator=g, dtype=torch.float64)
    return [q, x, y, eta, log_gamma, S0]


def projection(o, S, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=g, dtype=torch.float64),
            torch.randn(S.shape, generator=g, dtype=torch.float64))


def projected_loss(o, S, w_o, w_S, *, grad_o=True, grad_S=True):
    """<o, w_o> + <S, w_S> in float64 over the outputs asked for: one left out is not in the graph, so its gradient
    reaches the op's backward as None (not as zeros)."""
    terms = [(o.double() * w_o.to(o.device)).sum()] * grad_o + [(S.double() * w_S.to(S.device)).sum()] * grad_S
    return sum(terms)


def check_against_reference(N, T, H, K, V, *, dtype, chunk_size, read_after, with_S0=True, seed=0, rule="1A",
                            grad_o=True, grad_S=True):
    """Outputs, final state and the gradients of a random projection of (either or both of) them, against the
    float64 loop on the same (rounded) inputs."""
    base = prepared(N, T, H, K, V, seed=seed)
    base[:3] = [t.to(dtype).double() for t in base[:3]]  # the reference sees the rounded q, x, y
    ref_in = [t.clone().requires_grad_(True) for t in base]
    if not with_S0:
        ref_in[5] = torch.zeros_like(base[5])
    o_ref, S_ref = reference(*ref_in, read_after=read_after, rule=rule)
    w_o, w_S = projection(o_ref, S_ref)
    used = {"grad_o": grad_o, "grad_S": grad_S}
    grads_ref = torch.autograd.grad(projected_loss(o_ref, S_ref, w_o, w_S, **used), ref_in if with_S0 else ref_in[:5],
                                    materialize_grads=True)  # q is unused when only the final state is

    dtypes = (dtype, dtype, dtype, torch.float32, torch.float32, torch.float32)
    ins = [t.to(DEVICE, d).requires_grad_(True) for t, d in zip(base, dtypes)]
    S0 = ins[5] if with_S0 else None
    o, S = KERNELS[rule](*ins[:5], S0, read_after=read_after, chunk_size=chunk_size)
    assert o.dtype == dtype and o.shape == (N, T, H, V) and S.dtype == torch.float32 and S.shape == (N, H, K, V)
    grads = torch.autograd.grad(projected_loss(o, S, w_o, w_S, **used), ins if with_S0 else ins[:5],
                                materialize_grads=True)
    tol = TOL[dtype]
    errors = {"o": rel_err(o.cpu(), o_ref), "S": rel_err(S.cpu(), S_ref)}
    for name, grad, grad_ref, leaf in zip(NAMES, grads, grads_ref, ins):
        assert grad.dtype == leaf.dtype, name
        errors["d" + name] = rel_err(grad.cpu(), grad_ref)
    assert max(errors.values()) < tol, {k: f"{v:.2e}" for k, v in errors.items()}


def front_door_errors(rule, window, pairing, read, step_size, packed, stateful) -> dict[str, float]:
    """The Triton front door against the chunk backend on one contract case: the relative error of the output, the
    final S and every gradient, and 0 / 1 for the carried last key and window tail (1: they differ)."""
    B, T, H, K, V = (1, 70, 2, 16, 24) if packed else (2, 70, 2, 16, 24)
    offsets = torch.tensor([0, 5, 40, 41, 70]) if packed else None
    n = 4 if packed else B
    cpu = make_inputs(rule, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, requires_grad=True)
    state = dev_state = None
    if stateful:
        state = random_state(n, H, K, V, window=window, dtype=torch.float32, requires_grad=True)
        if pairing == "same_step":
            state.last_k = None
        dev_state = state.detach().to(DEVICE)
        dev_state.S.requires_grad_(True)
    options = {"rule": rule, "window": window, "pairing": pairing, "read": read, "step_size": step_size,
               "ridge_scaling": True, "eps": 1e-6, "eps_gamma": 1e-6, "output_final_state": True,
               "cu_seqlens": offsets}
    o_ref, s_ref = fast_weight_attention(*cpu, backend="chunk", initial_state=state, **options)
    dev = [t.detach().to(DEVICE).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*dev, backend="triton", initial_state=dev_state, **options)
    errors = {"o": rel_err(o.cpu(), o_ref), "S": rel_err(s.S.cpu(), s_ref.S)}
    for name in ("last_k", "tail_x", "tail_v", "tail_len"):
        mine, ref = getattr(s, name), getattr(s_ref, name)
        errors[name] = float(not ((mine is None and ref is None) or torch.equal(mine.cpu(), ref)))
    w_o, w_S = projection(o_ref, s_ref.S)
    leaves_ref, leaves = (cpu + [state.S], dev + [dev_state.S]) if stateful else (cpu, dev)
    grads_ref = torch.autograd.grad((o_ref * w_o.float()).sum() + (s_ref.S * w_S.float()).sum(), leaves_ref)
    grads = torch.autograd.grad((o * w_o.float().to(DEVICE)).sum() + (s.S * w_S.float().to(DEVICE)).sum(), leaves)
    for name, grad, grad_ref in zip(("dq", "dk", "dv", "dbeta", "dlam", "dS0"), grads, grads_ref):
        errors[name] = rel_err(grad.cpu(), grad_ref)
    return errors


def reference_2a(q, x, y, eta, log_gamma, S0, *, read_after):
    """The rule-2A recurrence as a step loop (float64, differentiable by autograd); eta, log_gamma [N, T, H, V]."""
    S, outs = S0, []
    for t in range(q.shape[1]):
        S_prev = S
        S = S * log_gamma[:, t].exp()[:, :, None, :] + x[:, t, :, :, None] * (eta[:, t] * y[:, t])[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S if read_after else S_prev))
    return torch.stack(outs, dim=1), S


def prepared_2a(N, T, H, K, V, *, seed=0):
    """`prepared`'s q, x, y, S0 with eta in [0, 1.9] and log decays drawn per value column (some missing pairs, no
    write at t = 0, decays down to gamma = 1e-6 in a few columns)."""
    q, x, y, _, _, S0 = prepared(N, T, H, K, V, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    f64 = {"generator": g, "dtype": torch.float64}
    eta = 1.9 * torch.rand(N, T, H, V, **f64) * (torch.rand(N, T, H, 1, **f64) > 0.1)
    eta[:, 0] = 0.0
    alpha = 0.3 * torch.rand(N, T, H, V, **f64)
    alpha = torch.where(torch.rand(N, T, H, V, **f64) < 0.02, 1 - 1e-6, alpha)
    return [q, x, y, eta, torch.log1p(-alpha), S0]


def reference_2(q, x, y, eta, log_gamma, S0, *, read_after):
    """The rule-2 recurrence as a step loop (float64, differentiable by autograd); eta, log_gamma [N, T, H, V]."""
    S, outs = S0, []
    for t in range(q.shape[1]):
        S_prev = S
        residual = y[:, t] - torch.einsum("nhk,nhkv->nhv", x[:, t], S_prev)                  # [N, H, V]
        S = S * log_gamma[:, t].exp()[:, :, None, :] + x[:, t, :, :, None] * (eta[:, t] * residual)[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S if read_after else S_prev))
    return torch.stack(outs, dim=1), S


PER_COLUMN_KERNELS = {"2A": (fast_weight_2a_triton, reference_2a), "2": (fast_weight_2_triton, reference_2)}


def check_kernels(N, T, H, K, V, *, dtype=torch.float32, chunk_size=16, read_after=True, with_S0=True, seed=0,
                  grad_o=True, grad_S=True, rule="2A"):
    """Outputs, final state and every gradient (of a random projection of o and/or S) of rule 2A's (or 2's) kernels
    against its float64 step loop on the same (rounded) inputs; returns the errors."""
    kernel, reference = PER_COLUMN_KERNELS[rule]
    base = prepared_2a(N, T, H, K, V, seed=seed)
    base[:3] = [t.to(dtype).double() for t in base[:3]]
    ref_in = [t.clone().requires_grad_(True) for t in base]
    if not with_S0:
        ref_in[5] = torch.zeros_like(base[5])
    o_ref, S_ref = reference(*ref_in, read_after=read_after)
    w_o, w_S = projection(o_ref, S_ref)
    used = {"grad_o": grad_o, "grad_S": grad_S}
    leaves_ref = ref_in if with_S0 else ref_in[:5]
    grads_ref = torch.autograd.grad(projected_loss(o_ref, S_ref, w_o, w_S, **used), leaves_ref, materialize_grads=True)

    dtypes = (dtype, dtype, dtype, torch.float32, torch.float32, torch.float32)
    ins = [t.to(DEVICE, d).requires_grad_(True) for t, d in zip(base, dtypes)]
    o, S = kernel(*ins[:5], ins[5] if with_S0 else None, read_after=read_after, chunk_size=chunk_size)
    assert o.dtype == dtype and o.shape == (N, T, H, V) and S.dtype == torch.float32 and S.shape == (N, H, K, V)
    grads = torch.autograd.grad(projected_loss(o, S, w_o, w_S, **used), ins if with_S0 else ins[:5],
                                materialize_grads=True)
    errors = {"o": rel_err(o.cpu(), o_ref), "S": rel_err(S.cpu(), S_ref)}
    for name, grad, grad_ref, leaf in zip(NAMES, grads, grads_ref, ins):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        errors["d" + name] = rel_err(grad.cpu(), grad_ref)
    assert max(errors.values()) < TOL[dtype], {k: f"{v:.2e}" for k, v in errors.items()}
    return errors


def check_front_door(rule, pairing, read, step_size, packed, stateful, *, references):
    """`fast_weight_attention(rule=rule, backend="triton")` (a per-column rule, 2A or 2) from raw q, k, v,
    beta [B, T, H, V], lam (ridge scaling on) against each backend of `references`: outputs, the whole final state and
    all gradients (q, k, v, beta, lam and the initial S), float32, K != V, T not a multiple of the chunk, packed
    sequences (`cu_seqlens`)."""
    B, T, H, K, V = (1, 45, 2, 16, 24) if packed else (2, 45, 2, 16, 24)
    offsets = torch.tensor([0, 5, 22, 23, 45]) if packed else None
    n = 4 if packed else B
    cpu = make_inputs(rule, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, requires_grad=True)
    state = dev_state = None
    if stateful:
        state = random_state(n, H, K, V, window=1, dtype=torch.float32, requires_grad=True)
        if pairing == "same_step":
            state.last_k = None
        dev_state = state.detach().to(DEVICE)
        dev_state.S.requires_grad_(True)
    options = {"rule": rule, "pairing": pairing, "read": read, "step_size": step_size, "ridge_scaling": True,
               "output_final_state": True, "cu_seqlens": offsets}
    dev = [t.detach().to(DEVICE).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*dev, backend="triton", initial_state=dev_state, **options)
    w_o, w_S = (w.float() for w in projection(o, s.S))
    leaves = dev + [dev_state.S] if stateful else dev
    grads = torch.autograd.grad((o * w_o.to(DEVICE)).sum() + (s.S * w_S.to(DEVICE)).sum(), leaves)
    for backend in references:
        ref_leaves = [t.detach().clone().requires_grad_(True) for t in cpu]
        ref_state = None
        if stateful:
            ref_state = FastWeightState(S=state.S.detach().clone().requires_grad_(True), last_k=state.last_k)
        o_ref, s_ref = fast_weight_attention(*ref_leaves, backend=backend, initial_state=ref_state, **options)
        assert rel_err(o.cpu(), o_ref) < 1e-4 and rel_err(s.S.cpu(), s_ref.S) < 1e-4, backend
        assert (s.last_k is None and s_ref.last_k is None) or torch.equal(s.last_k.cpu(), s_ref.last_k)
        grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_S).sum(),
                                        ref_leaves + [ref_state.S] if stateful else ref_leaves)
        for name, grad, grad_ref in zip(("q", "k", "v", "beta", "lam", "S0"), grads, grads_ref):
            assert rel_err(grad.cpu(), grad_ref) < 1e-4, (backend, name)


def opcheck_scan(name: str, inputs: list[torch.Tensor], *, final_state_grad: bool = False) -> None:
    """`torch.library.opcheck` of hybridlm::fast_weight_{name}_fwd with an initial state (read after, chunks of 16),
    and of its backward op without one and without dL/dS_final (read before); with `final_state_grad` the backward
    also with both (read after). inputs: prepared (q, x, y, eta, log_gamma, S0) on DEVICE, float32, requiring grad."""
    from hybridlm.ops.fast_weight.triton import custom_ops  # noqa: F401  (registers the ops on import)

    fwd, bwd = (getattr(torch.ops.hybridlm, f"fast_weight_{name}_{op}") for op in ("fwd", "bwd"))
    q, x, y, eta, log_gamma, S0 = inputs
    torch.library.opcheck(fwd, (q, x, y, eta, log_gamma, S0, True, 16), test_utils=OPCHECKS)
    do = torch.randn(y.shape, device=DEVICE)
    detached = [t.detach() for t in (q, x, y, eta, log_gamma)]
    torch.library.opcheck(bwd, (do, None, *detached, None, False, 16), test_utils=OPCHECKS)
    if final_state_grad:
        dS = torch.randn(S0.shape, device=DEVICE)
        torch.library.opcheck(bwd, (do, dS, *detached, S0.detach(), True, 16), test_utils=OPCHECKS)


def record_launches(monkeypatch, module, name: str, describe) -> list:
    """Replace the Triton kernel `name` of `module` (for the test) by one that appends describe(grid, kwargs) of every
    launch to the returned list, then launches."""
    launched, kernel = [], getattr(module, name)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(describe(grid, kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Recorder())
    return launched
