"""Rules 3 and 3A in Triton (the sliding windows).

Rule 3 (sliding-window regression): rule 1's kernels over write events, `slots` per step, in which the events of one
step do not see each other's writes (`fast_weight_3_triton`; backend.py lays each step's window out on a power of two
of slots, the step's decay on slot 0).

- The op against a float64 loop over events where every residual of a step reads the state before the step, with a
  decay on every event (so d log_gamma is checked on every slot, not only slot 0): one step and odd numbers of steps,
  several chunks, read after / before, with and without S0.
- The front door `fast_weight_attention(rule="3", window=W, backend="triton")` against backend="chunk" (and the naive
  step loop on a small case): outputs, the whole final state (S, last key, sliding tail) and the gradients of q, k, v,
  beta, lam and of every tensor of the initial state; windows 1-5 (3 and 5 padded to 4 and 8 slots), shifted and
  same-step pairing, read after / before, nlms and direct steps, with and without a carried state, packed sequences,
  T = 1, carry-over.
- `tinv_kernel`'s blocked (I + A)^-1 against float64 at chunks of 16, 32 and 64 events, one slot and several.
- The custom ops (`torch.library.opcheck`) and torch.compile of the front door.

Rule 3A (sliding-window inner product): rule 1A's scan over delayed writes plus the band of the pairs still being
written (the delayed op): against a float64 loop of the scan and the band, and the front door against the chunk
backend (windows up to 9, longer than some packed documents; calls shorter than the window).

Where they run: as tests/ops/test_triton_rule1.py (the `interpret` tests on the CPU under
HYBRIDLM_TRITON_INTERPRET=1; everything on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight.state import FastWeightState
from hybridlm.ops.fast_weight.triton import (
    auto_takes,
    fast_weight_1_triton,
    fast_weight_3_triton,
    supports,
)
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import (
    NAMES,
    OPCHECKS,
    TOL,
    front_door_errors,
    make_inputs,
    prepared,
    projection,
    random_state,
)
from tests.ops.triton_modes import DEVICE, ON_GPU, gpu_only, interpret


def reference(q, x, y, eta, log_gamma, S0, *, read_after, slots):
    """The event recurrence as a loop (float64, differentiable by autograd): event t of step s = t // slots writes
    S <- exp(log_gamma_t) S + eta_t x_t (y_t - S_before^T x_t)^T, S_before the state before the step's first event;
    o_t reads S after (or before) event t."""
    S, outs = S0, []
    for t in range(q.shape[1]):
        if t % slots == 0:
            S_step = S
        residual = y[:, t] - torch.einsum("nhk,nhkv->nhv", x[:, t], S_step)                  # [N, H, V]
        S_prev = S
        S = log_gamma[:, t].exp()[..., None, None] * S \
            + eta[:, t, :, None, None] * x[:, t, :, :, None] * residual[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S if read_after else S_prev))
    return torch.stack(outs, dim=1), S


def check_op(N, steps, H, K, V, *, slots, chunk_size, read_after, with_S0=True, dtype=torch.float32, seed=0):
    """`fast_weight_3_triton` on random prepared events (every event decays and writes) against `reference`:
    outputs, final state and the gradients of a random projection of both, for every input."""
    base = prepared(N, steps * slots, H, K, V, seed=seed)
    base[:3] = [t.to(dtype).double() for t in base[:3]]  # the reference sees the rounded q, x, y
    ref_in = [t.clone().requires_grad_(True) for t in base]
    if not with_S0:
        ref_in[5] = torch.zeros_like(base[5])
    o_ref, S_ref = reference(*ref_in, read_after=read_after, slots=slots)
    w_o, w_S = projection(o_ref, S_ref)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), ref_in if with_S0 else ref_in[:5])

    dtypes = (dtype, dtype, dtype, torch.float32, torch.float32, torch.float32)
    ins = [t.to(DEVICE, d).requires_grad_(True) for t, d in zip(base, dtypes)]
    o, S = fast_weight_3_triton(*ins[:5], ins[5] if with_S0 else None, read_after=read_after, chunk_size=chunk_size,
                                slots=slots)
    assert o.dtype == dtype and S.dtype == torch.float32
    loss = (o.double() * w_o.to(DEVICE)).sum() + (S.double() * w_S.to(DEVICE)).sum()
    grads = torch.autograd.grad(loss, ins if with_S0 else ins[:5])
    errors = {"o": rel_err(o.cpu(), o_ref), "S": rel_err(S.cpu(), S_ref)}
    for name, grad, grad_ref in zip(NAMES, grads, grads_ref):
        errors["d" + name] = rel_err(grad.cpu(), grad_ref)
    assert_small(errors, TOL[dtype])


def assert_small(errors: dict[str, float], tol: float) -> None:
    """Every error below tol (a NaN fails, which max() would hide)."""
    assert all(error < tol for error in errors.values()), {k: f"{v:.2e}" for k, v in errors.items()}


OP_CASES = [  # slots, steps, chunk_size, read_after, with S0
    (2, 1, 16, True, True), (2, 13, 16, False, True), (4, 1, 16, False, True), (4, 13, 16, True, True),
    (4, 37, 32, False, False), (8, 9, 16, True, False), (16, 5, 16, False, True),
]


@interpret
@pytest.mark.parametrize("slots,steps,chunk_size,read_after,with_S0", OP_CASES,
                         ids=[f"P{p}-steps{s}-C{c}-{'after' if a else 'before'}{'' if i else '-fresh'}"
                              for p, s, c, a, i in OP_CASES])
def test_op_matches_reference(slots, steps, chunk_size, read_after, with_S0):
    check_op(2, steps, 2, 16, 24, slots=slots, chunk_size=chunk_size, read_after=read_after, with_S0=with_S0)


WIDE_CASES = [  # slots, steps, K, V, read_after, dtype
    (4, 9, 100, 40, True, torch.float32), (2, 13, 72, 24, False, torch.float32), (1, 40, 80, 20, False, torch.float32),
    (4, 9, 100, 40, False, torch.float16),
]


@interpret
@pytest.mark.parametrize("slots,steps,K,V,read_after,dtype", WIDE_CASES,
                         ids=[f"P{p}-K{k}-V{v}-{'after' if a else 'before'}-{str(d)[6:]}"
                              for p, _, k, v, a, d in WIDE_CASES])
def test_op_wide_heads(slots, steps, K, V, read_after, dtype):
    """K > 64: the gradient kernels split the states into 64-column blocks (the last one partial here) whose parts
    delta_grad_kernel sums; several rows and heads, rule 1 (one slot) and rule 3, 16-bit inputs."""
    if dtype == torch.float16 and ON_GPU:
        dtype = torch.bfloat16
    check_op(2, steps, 2, K, V, slots=slots, chunk_size=16, read_after=read_after, dtype=dtype)


@interpret
def test_op_float16():
    """The 16-bit path (float16 under the interpreter; bfloat16 on a GPU in `test_large_shape`)."""
    check_op(1, 11, 2, 16, 24, slots=4, chunk_size=16, read_after=True, dtype=torch.float16)


def long_16bit_errors(rule: str, window: int) -> dict[str, float]:
    """Relative errors of the Triton front door on 16-bit inputs against the float64 chunk backend on the same
    rounded values: one row of T = 640 (ten chunks of 64), K = V = 128, the layer's RMS-normalised keys."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    cpu = make_inputs(rule, B=1, T=640, H=1, K=128, V=128, dtype=torch.float64)
    cpu = [t.to(dtype).double() if i < 3 else t for i, t in enumerate(cpu)]  # q, k, v as the 16-bit run sees them
    options = {"rule": rule, "read": "after", "output_final_state": True, "chunk_size": 64}
    if rule == "3":
        options["window"] = window
    ref = [t.clone().requires_grad_(True) for t in cpu]
    o_ref, s_ref = fast_weight_attention(*ref, backend="chunk", **options)
    w_o, w_S = projection(o_ref, s_ref.S)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_S).sum(), ref)
    dev = [t.to(DEVICE, dtype if i < 3 else torch.float32).requires_grad_(True) for i, t in enumerate(cpu)]
    o, s = fast_weight_attention(*dev, backend="triton", **options)
    grads = torch.autograd.grad((o.double() * w_o.to(DEVICE)).sum() + (s.S.double() * w_S.to(DEVICE)).sum(), dev)
    errors = {"o": rel_err(o.cpu().double(), o_ref), "S": rel_err(s.S.cpu().double(), s_ref.S)}
    errors.update({f"d{n}": rel_err(g.cpu().double(), r)
                   for n, g, r in zip(("q", "k", "v", "beta", "lam"), grads, grads_ref)})
    return errors


@interpret
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("rule,window", [("1", 1), ("3", 3)])
def test_long_16bit_rows_match_float64(rule, window, wide, monkeypatch):
    """The passes' float32 factors keep 16-bit inputs far inside the 16-bit tolerance over ten chunks: the kernels'
    own error, the inputs' rounding taken out (bfloat16 factors would reach the 2e-2 tolerance here: r is a small
    difference of two large terms); under both launches of the passes (`regression.pass_launch`)."""
    from hybridlm.ops.fast_weight.triton import regression  # (imports triton: not at the module's import)

    monkeypatch.setattr(regression, "WIDE_PASS_MIN_PROGRAMS", 1 if wide else 10**6)
    errors = long_16bit_errors(rule, window)
    assert set(errors) == {"o", "S", "dq", "dk", "dv", "dbeta", "dlam"}
    assert all(error < 5e-3 for error in errors.values()), errors  # a NaN fails too


def wy_inverse_reference(x, eta, log_gamma, chunk_size, slots):
    """(I + A)^-1 of every chunk (float64, [N * H, T_pad, chunk_size], the layout of `tinv_kernel`'s buffer), A as
    wy.py's F1: A[s, s'] = [st(s') < st(s)] exp(Lp_s - L_s') eta_s' (x_s . x_s'), st(s) = s // slots."""
    N, T, H, _ = x.shape
    T_pad = -(-T // chunk_size) * chunk_size
    x, eta, log_gamma = (torch.nn.functional.pad(t.double().transpose(1, 2), (0, 0) * (t.dim() - 3) + (0, T_pad - T))
                         for t in (x, eta, log_gamma))                                      # [N, H, T_pad, ...]
    x = x.reshape(N * H, T_pad // chunk_size, chunk_size, -1)
    eta, log_gamma = (t.reshape(N * H, T_pad // chunk_size, chunk_size) for t in (eta, log_gamma))
    L = log_gamma.cumsum(-1)
    first = torch.arange(chunk_size) // slots * slots                                      # slot 0 of each step
    Lp = torch.where(first > 0, L[..., (first - 1).clamp(min=0)], 0.0)
    earlier = first[:, None] > first[None, :]
    A = torch.where(earlier, (Lp[..., :, None] - L[..., None, :]).exp(), 0.0) * eta[..., None, :] * (x @ x.mT)
    return torch.linalg.inv(torch.eye(chunk_size, dtype=torch.float64) + A).reshape(N * H, T_pad, chunk_size)


WY_CASES = [(16, 1), (16, 4), (16, 16), (32, 2), (32, 8), (32, 32), (64, 1), (64, 4), (64, 16), (64, 32)]


@interpret
@pytest.mark.parametrize("chunk_size,slots", WY_CASES, ids=[f"C{c}-P{p}" for c, p in WY_CASES])
def test_wy_inverse_matches_float64(chunk_size, slots):
    """`tinv_kernel`'s blocked (I + A)^-1 (16 x 16 diagonal blocks by substitution, then block products) against
    torch.linalg.inv in float64, in every chunk (2 to 5 per row; the last one padded where T is not a multiple of
    the chunk): chunks of 16, 32 and 64 events; one slot (rule 1), steps of 2 to 8 slots (inside a 16-event block),
    of 16 (a whole block: no substitution) and of 32 (two blocks: no first doubling)."""
    from hybridlm.ops.fast_weight.triton.decays import chunk_cumsum  # (imports triton: not at the module's import)
    from hybridlm.ops.fast_weight.triton.regression import EventPlan

    q, x, y, eta, log_gamma, _ = (t.to(DEVICE, torch.float32)
                                  for t in prepared(2, 2 * chunk_size + 3 * slots, 2, 16, 8, seed=chunk_size + slots))
    plan = EventPlan(q, y, chunk_size, True, slots)
    tinv = plan.scan(x, y, eta, chunk_cumsum(plan, log_gamma), None)[3]
    assert rel_err(tinv.cpu(), wy_inverse_reference(x.cpu(), eta.cpu(), log_gamma.cpu(), chunk_size, slots)) < 2e-6


@interpret
@pytest.mark.parametrize("read_after", [True, False], ids=["after", "before"])
def test_rule_3_ops_with_one_slot_are_rule_1s(read_after):
    """The rule-3 ops with slots = 1 give the rule-1 ops' results bitwise, forward and backward: the wiring (op
    schema, options, autograd) of the new ops. Both run the same kernels, so this cannot check their arithmetic;
    the reference tests above do."""
    ins = [t.to(DEVICE, torch.float32).requires_grad_(True) for t in prepared(1, 40, 2, 16, 8, seed=2)]
    results = []
    for run in (fast_weight_1_triton, lambda *a, **kw: fast_weight_3_triton(*a, **kw, slots=1)):
        o, S = run(*ins, read_after=read_after, chunk_size=16)
        grads = torch.autograd.grad(o.square().sum() + S.square().sum(), ins)
        results.append((o, S, *grads))
    for mine, ref in zip(*results):
        assert torch.equal(mine, ref)


FRONT_DOOR_CASES = [  # window, pairing, read, step_size, packed, with a carried state
    (2, "shifted", "after", "nlms", False, True), (3, "shifted", "before", "nlms", False, True),
    (4, "same_step", "after", "direct", False, True), (3, "same_step", "before", "direct", True, True),
    (3, "shifted", "after", "nlms", True, False), (2, "shifted", "before", "direct", False, False),
    (4, "shifted", "after", "nlms", True, True), (5, "shifted", "before", "nlms", False, True),
    (1, "shifted", "after", "nlms", False, True),
]


def front_door_pair(window, pairing, read, step_size, *, T, packed, stateful, chunk_size=64):
    """The chunk backend and the Triton backend on the same inputs (float32): o, the final state and the gradients
    of a random projection of (o, S) for q, k, v, beta, lam and every tensor of the initial state, as two dicts."""
    B, H, K, V = (1, 2, 16, 24) if packed else (2, 2, 16, 24)
    offsets = torch.tensor([0, 5, T - 12, T - 11, T]) if packed else None
    n = 4 if packed else B
    cpu = make_inputs("3", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, requires_grad=True)
    if step_size == "direct":  # eta = beta: keep eta |k|^2 = eta K below 2, where the recurrence does not blow up
        cpu[3] = (cpu[3].detach() / K).requires_grad_(True)
    options = {"rule": "3", "window": window, "pairing": pairing, "read": read, "step_size": step_size,
               "ridge_scaling": True, "eps": 1e-6, "eps_gamma": 1e-6, "output_final_state": True,
               "cu_seqlens": offsets, "chunk_size": chunk_size}
    results = []
    for backend, device in (("chunk", "cpu"), ("triton", DEVICE)):
        inputs = [t.detach().to(device).requires_grad_(True) for t in cpu]
        leaves = dict(zip(("q", "k", "v", "beta", "lam"), inputs))
        state = None
        if stateful:
            state = random_state(n, H, K, V, window=window, dtype=torch.float32).to(device)
            if pairing == "same_step":
                state.last_k = None
            leaves.update((name, t.requires_grad_(True)) for name, t in (
                ("S0", state.S), ("last_k", state.last_k), ("tail_x", state.tail_x), ("tail_v", state.tail_v))
                if t is not None)
        o, s = fast_weight_attention(*inputs, backend=backend, initial_state=state, **options)
        w_o, w_S = projection(o, s.S)
        loss = (o * w_o.float().to(device)).sum() + (s.S * w_S.float().to(device)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)
        result = {"o": o, "S": s.S, "last_k": s.last_k, "tail_x": s.tail_x, "tail_v": s.tail_v,
                  "tail_len": s.tail_len}
        result.update(("d" + name, grad) for name, grad in zip(leaves, grads))
        results.append({name: t if t is None else t.detach().cpu() for name, t in result.items()})
    return results


def assert_close(mine, ref, tol):
    """o, S and the gradients within tol; the carried last key and window tail (copies of inputs) bitwise equal."""
    assert mine.keys() == ref.keys()
    errors = {}
    for name in mine:
        assert (mine[name] is None) == (ref[name] is None), name
        if name in ("last_k", "tail_x", "tail_v", "tail_len"):
            assert mine[name] is None or torch.equal(mine[name], ref[name]), name
        else:
            errors[name] = rel_err(mine[name], ref[name])
    assert_small(errors, tol)


@interpret
@pytest.mark.parametrize("window,pairing,read,step_size,packed,stateful", FRONT_DOOR_CASES,
                         ids=[f"W{c[0]}-" + "-".join(c[1:4]) + ("-packed" if c[4] else "") + ("" if c[5] else "-fresh")
                              for c in FRONT_DOOR_CASES])
def test_front_door_matches_chunk(window, pairing, read, step_size, packed, stateful):
    """T = 37 (not a multiple of any chunk), events in chunks of 64 (several per row)."""
    triton_side, chunk_side = front_door_pair(window, pairing, read, step_size, T=37, packed=packed,
                                              stateful=stateful)[::-1]
    assert_close(triton_side, chunk_side, 1e-4)


@interpret
@pytest.mark.parametrize("window,read", [(2, "after"), (3, "before"), (4, "after")])
def test_front_door_one_step(window, read):
    """T = 1 from a carried state (the window reaches into the tail)."""
    triton_side, chunk_side = front_door_pair(window, "shifted", read, "nlms", T=1, packed=False,
                                              stateful=True)[::-1]
    assert_close(triton_side, chunk_side, 1e-4)


@interpret
def test_front_door_small_chunks():
    """Chunks of 16 events (4 steps of 4 slots) and a step per chunk of 16 slots (window 9): many chunk edges."""
    for window in (3, 9):
        triton_side, chunk_side = front_door_pair(window, "shifted", "after", "nlms", T=21, packed=False,
                                                  stateful=True, chunk_size=16)[::-1]
        assert_close(triton_side, chunk_side, 1e-4)


@interpret
def test_matches_naive_spec():
    """Against the step loop of the paper's rule (float64) on a small case with a carried state."""
    cpu = make_inputs("3", B=2, T=11, H=2, K=16, V=8, dtype=torch.float64, requires_grad=True)
    state = random_state(2, 2, 16, 8, window=3, tail_len=[1, 2])
    options = {"rule": "3", "window": 3, "read": "after", "output_final_state": True}
    o_ref, s_ref = fast_weight_attention(*cpu, backend="naive", initial_state=state, **options)
    dev = [t.detach().to(DEVICE, torch.float32).requires_grad_(True) for t in cpu]
    o, s = fast_weight_attention(*dev, backend="triton", initial_state=state.to(DEVICE, torch.float32), **options)
    assert rel_err(o.cpu().double(), o_ref) < 1e-4 and rel_err(s.S.cpu().double(), s_ref.S) < 1e-4
    for mine, ref in ((s.last_k, s_ref.last_k), (s.tail_x, s_ref.tail_x), (s.tail_v, s_ref.tail_v)):
        assert rel_err(mine.cpu().double(), ref) < 1e-6
    assert torch.equal(s.tail_len.cpu(), s_ref.tail_len)
    w_o, w_S = projection(o_ref, s_ref.S)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_S).sum(), cpu)
    grads = torch.autograd.grad((o.double() * w_o.to(DEVICE)).sum() + (s.S.double() * w_S.to(DEVICE)).sum(), dev)
    for name, grad, grad_ref in zip(("q", "k", "v", "beta", "lam"), grads, grads_ref):
        assert rel_err(grad.cpu().double(), grad_ref) < 1e-4, name


@interpret
@pytest.mark.parametrize("pairing", ["shifted", "same_step"])
def test_state_carry_over(pairing):
    """Running [0:T] equals running [0:t] and then [t:T] from the returned state (S, last key, window tail)."""
    inputs = [t.to(DEVICE) for t in make_inputs("3", B=2, T=40, H=2, K=16, V=8, dtype=torch.float32)]
    options = {"rule": "3", "window": 3, "pairing": pairing, "backend": "triton", "output_final_state": True,
               "chunk_size": 16}
    o, s = fast_weight_attention(*inputs, **options)
    o1, s1 = fast_weight_attention(*(t[:, :17] for t in inputs), **options)
    o2, s2 = fast_weight_attention(*(t[:, 17:] for t in inputs), initial_state=s1, **options)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-5
    assert rel_err(s2.S, s.S) < 1e-5
    for mine, ref in ((s2.last_k, s.last_k), (s2.tail_x, s.tail_x), (s2.tail_v, s.tail_v), (s2.tail_len, s.tail_len)):
        assert (mine is None and ref is None) or torch.equal(mine, ref)


@interpret
def test_opcheck():
    """The rule-3 ops (`hybridlm::fast_weight_3_{fwd,bwd}`): schema, fake tensors, autograd, AOT dispatch."""
    import hybridlm.ops.fast_weight.triton.custom_ops  # noqa: F401  (registers the ops)

    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32).requires_grad_(True) for t in prepared(1, 24, 2, 16, 8))
    torch.library.opcheck(torch.ops.hybridlm.fast_weight_3_fwd, (q, x, y, eta, log_gamma, S0, True, 16, 4),
                          test_utils=OPCHECKS)
    do = torch.randn(1, 24, 2, 8, device=DEVICE)
    detached = [t.detach() for t in (q, x, y, eta, log_gamma)]
    torch.library.opcheck(torch.ops.hybridlm.fast_weight_3_bwd, (do, None, *detached, None, False, 16, 2),
                          test_utils=OPCHECKS)


@interpret
def test_compiled_front_door_matches_eager():
    """torch.compile(fullgraph=True, backend="aot_eager") of the front door: no graph break, the same results."""
    H, K, V = 2, 16, 8

    def fn(q, k, v, beta, lam, S):
        o, state = fast_weight_attention(q, k, v, beta, lam, rule="3", window=3, backend="triton", chunk_size=16,
                                         initial_state=FastWeightState(S=S), output_final_state=True)
        return o, state.S

    inputs = [t.to(DEVICE).detach().requires_grad_(True)
              for t in make_inputs("3", B=2, T=13, H=H, K=K, V=V, dtype=torch.float32)]
    S = (0.3 * torch.randn(2, H, K, V, device=DEVICE)).requires_grad_(True)
    leaves = inputs + [S]
    o, S_final = fn(*inputs, S)
    grads = torch.autograd.grad(o.square().sum() + S_final.square().sum(), leaves)
    o_c, S_c = torch.compile(fn, fullgraph=True, backend="aot_eager")(*inputs, S)
    grads_c = torch.autograd.grad(o_c.square().sum() + S_c.square().sum(), leaves)
    assert rel_err(o_c, o) < 1e-5 and rel_err(S_c, S_final) < 1e-5
    for name, grad, grad_c in zip(("q", "k", "v", "beta", "lam", "S0"), grads, grads_c):
        assert rel_err(grad_c, grad) < 1e-5, name


def test_supports_rule_3():
    """Every window up to 64 (a step's slots must fit in a chunk every head size can use: at chunk 128 with
    K = V = 128 rule 1's gradient kernel needs more shared memory than an H200 has); "auto" sends those here."""
    for window in (1, 2, 3, 4, 5, 64):
        assert supports(rule="3", window=window, K=128, V=128, dtype=torch.bfloat16)
    assert not supports(rule="3", window=65, K=64, V=64, dtype=torch.float32)
    assert not supports(rule="3", window=3, K=256, V=64, dtype=torch.float32)
    assert auto_takes(rule="3", window=64, K=128, V=128, dtype=torch.bfloat16)


@interpret
def test_rejects_bad_slots():
    ins = [t.to(DEVICE, torch.float32) for t in prepared(1, 12, 1, 16, 8)]
    with pytest.raises(ValueError, match="slots"):
        fast_weight_3_triton(*ins, read_after=True, chunk_size=16, slots=3)   # not a power of two
    with pytest.raises(ValueError, match="slots"):
        fast_weight_3_triton(*ins, read_after=True, chunk_size=16, slots=8)   # does not divide T = 12
    ins = [t.to(DEVICE, torch.float32) for t in prepared(1, 64, 1, 16, 8)]
    with pytest.raises(ValueError, match="slots"):
        fast_weight_3_triton(*ins, read_after=True, chunk_size=16, slots=32)  # more than a chunk


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_shape(dtype):
    """A model-sized head (K = V = 128), window 3 (4 slots) over many chunks, several rows and heads."""
    check_op(2, 250, 4, 128, 128, slots=4, chunk_size=64, read_after=True, dtype=dtype)


RULE_3A_CASES = [  # window, pairing, read, step_size, packed, with an initial state
    (3, "shifted", "after", "nlms", True, True), (3, "shifted", "before", "nlms", False, True),
    (2, "same_step", "after", "direct", False, True), (5, "shifted", "before", "nlms", True, True),
    (4, "same_step", "before", "direct", False, False), (3, "shifted", "after", "nlms", True, False),
    (9, "shifted", "after", "nlms", True, True),
    (1, "shifted", "before", "nlms", True, True),  # window 1: rule 1A's scan alone, no band
]


@interpret
@pytest.mark.parametrize("window,pairing,read,step_size,packed,stateful", RULE_3A_CASES,
                         ids=[f"W{c[0]}-" + "-".join(c[1:4]) + ("-packed" if c[4] else "") + ("" if c[5] else "-fresh")
                              for c in RULE_3A_CASES])
def test_rule_3a_front_door_matches_chunk(window, pairing, read, step_size, packed, stateful):
    """`fast_weight_attention(rule="3A", backend="triton")` (delayed writes plus the band kernel, windows up to 9,
    longer than some packed documents) against the torch chunk backend, with or without a carried state (S, last key,
    window tail), ridge scaling and packed sequences: outputs, the whole final state and all gradients."""
    errors = front_door_errors("3A", window, pairing, read, step_size, packed, stateful)
    assert max(errors.values()) < 1e-4, errors


@interpret
@pytest.mark.parametrize("T,window,read", [(1, 3, "after"), (2, 5, "before"), (1, 2, "before")])
def test_rule_3a_on_sequences_shorter_than_the_window(T, window, read):
    """Rule 3A's delayed-write form when a call holds fewer steps than the window (a prompt's tail, one-token steps):
    the carried tail supplies the band's pairs; outputs, final state and gradients as the chunk backend's."""
    cpu = make_inputs("3A", B=2, T=T, H=2, K=16, V=8, dtype=torch.float32, requires_grad=True)
    options = dict(rule="3A", window=window, read=read, output_final_state=True,
                   initial_state=random_state(2, 2, 16, 8, window=window, dtype=torch.float32))
    o_ref, s_ref = fast_weight_attention(*cpu, backend="chunk", **options)
    dev = [t.detach().to(DEVICE).requires_grad_(True) for t in cpu]
    options["initial_state"] = options["initial_state"].to(DEVICE)
    o, s = fast_weight_attention(*dev, backend="triton", **options)
    assert rel_err(o.cpu(), o_ref) < 1e-4 and rel_err(s.S.cpu(), s_ref.S) < 1e-4
    grads_ref = torch.autograd.grad(o_ref.sum() + s_ref.S.sum(), cpu)
    grads = torch.autograd.grad(o.sum() + s.S.sum(), dev)
    for name, grad, grad_ref in zip(("q", "k", "v", "beta", "lam"), grads, grads_ref):
        assert rel_err(grad.cpu(), grad_ref) < 1e-4, name


def band_reference(q, x_ext, y_ext, c, *, read_after):
    """o_t = sum_{j=1..W-1} c_(t,j) (q_t . x_e) y_e, e = t + j (- 1 reading before), as a float64 loop over j."""
    T, W = q.shape[1], c.shape[-1] + 1
    o = 0
    for j in range(1, W):
        e = torch.arange(T) + j - (0 if read_after else 1)
        x, y = x_ext[:, e].double(), y_ext[:, e].double()
        o = o + (c[..., j - 1].double() * (q.double() * x).sum(-1))[..., None] * y
    return o


@interpret
@pytest.mark.parametrize("W,read_after,dtype,with_S0,sizes", [
    (2, True, torch.float32, True, (2, 45, 3, 24, 40, 16)), (3, False, torch.float32, True, (2, 45, 3, 24, 40, 16)),
    (5, True, torch.float16, False, (2, 45, 3, 24, 40, 16)), (3, True, torch.float32, False, (2, 45, 3, 24, 40, 16)),
    (3, True, torch.float16, True, (3, 70, 2, 20, 12, 64))])  # the 16-bit window-prepare test's sizes
def test_delayed_op_matches_a_loop(W, read_after, dtype, with_S0, sizes):
    """Rule 3A's delayed op (`fast_weight_delayed_triton`: the 1A scan over the first T ext rows, read in place,
    plus the band kernel) against a float64 step loop of the scan plus a loop over the band: outputs, final state
    and the gradients of all seven inputs (dx_ext and dy_ext sum the scan's rows and the band's, which the band's
    kernels add in place); odd sizes (T = 45 over chunks of 16, K = 24, V = 40; T = 70 over chunks of 64, K = 20,
    V = 12), several rows and heads."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_delayed_triton
    from tests.ops.fast_weight_helpers import reference as scan_reference

    g = torch.Generator().manual_seed(W)
    N, T, H, K, V, chunk_size = sizes
    q, x, y, eta, log_gamma, S0 = prepared(N, T + W - 1, H, K, V, seed=W)
    inputs = [q[:, :T], x, y, eta[:, :T], log_gamma[:, :T],
              torch.rand(N, T, H, W - 1, generator=g, dtype=torch.float64), S0]
    ref = [t.clone().requires_grad_(True) for t in inputs]
    o_scan, S_ref = scan_reference(ref[0], ref[1][:, :T], ref[2][:, :T], ref[3], ref[4],
                                   ref[6] if with_S0 else torch.zeros_like(S0), read_after=read_after)
    o_ref = o_scan + band_reference(ref[0], ref[1], ref[2], ref[5], read_after=read_after)
    dtypes = (dtype, dtype, dtype, torch.float32, torch.float32, torch.float32, torch.float32)
    dev = [t.to(DEVICE, d).requires_grad_(True) for t, d in zip(inputs, dtypes)]
    o, S = fast_weight_delayed_triton(*dev[:6], dev[6] if with_S0 else None, read_after=read_after,
                                      chunk_size=chunk_size)
    assert o.dtype == dtype and rel_err(o.cpu(), o_ref) < TOL[dtype] and rel_err(S.cpu(), S_ref) < TOL[dtype]
    w_o, w_S = torch.randn(o_ref.shape, generator=g, dtype=torch.float64), torch.randn(S_ref.shape, generator=g,
                                                                                      dtype=torch.float64)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), ref if with_S0 else ref[:6])
    grads = torch.autograd.grad((o * w_o.to(DEVICE, dtype)).sum() + (S * w_S.to(DEVICE)).sum(),
                                dev if with_S0 else dev[:6])
    for name, grad, grad_ref in zip(NAMES_DELAYED, grads, grads_ref):
        assert grad.dtype == dev[NAMES_DELAYED.index(name)].dtype and rel_err(grad.cpu(), grad_ref) < TOL[dtype], name


def test_delayed_op_rejects_mismatched_band():
    """The band's coefficients must match the ext rows (W - 1 columns for W - 1 + T rows) and be float32."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_delayed_triton

    q, x_ext, y_ext = torch.randn(1, 5, 2, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 4)
    eta, lg = torch.rand(1, 5, 2), -torch.rand(1, 5, 2)
    with pytest.raises(ValueError, match="W-1"):
        fast_weight_delayed_triton(q, x_ext, y_ext, eta, lg, torch.rand(1, 5, 2, 3), None, read_after=True)
    with pytest.raises(ValueError, match="float32"):
        fast_weight_delayed_triton(q, x_ext, y_ext, eta, lg, torch.rand(1, 5, 2, 2).double(), None, read_after=True)
    with pytest.raises(ValueError, match="W-1\\+T rows"):
        fast_weight_delayed_triton(q, x_ext[:, :6], y_ext[:, :6], eta, lg, torch.rand(1, 5, 2, 2), None,
                                   read_after=True)
    with pytest.raises(ValueError, match="y \\[N, T_xy >= T, H, V\\]"):
        fast_weight_delayed_triton(q, x_ext, y_ext[:, :6], eta, lg, torch.rand(1, 5, 2, 2), None, read_after=True)


NAMES_DELAYED = ("q", "x_ext", "y_ext", "eta", "log_gamma", "c", "S0")
