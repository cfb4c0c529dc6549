"""Rule 3A's fused window preparation (`triton/window_prepare.py`, the custom op
hybridlm::fast_weight_window_prepare_fwd) against chunk.py's `prepare_writes` followed by the delayed-write
coefficients of `backend.window_coefficients` (`_delayed_window`'s torch path): the tail-extended pairs, C and the log
decays, and every gradient (k, v, beta, lam, the carried last key and tail); the Triton front door with it against
backend="chunk" and against the Triton backend on prepare_writes; and which calls take it.

Where they run (as the other Triton tests; tests/ops/conftest.py sets TRITON_INTERPRET before any kernel loads):
    GPU:  python -m pytest -q tests/ops/test_triton_window_prepare.py
    CPU:  HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_triton_window_prepare.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight import op
from hybridlm.ops.fast_weight.chunk import prepare_writes
from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import make_inputs, projection, random_state, record_launches
from tests.ops.triton_modes import DEVICE, interpret, skip_bfloat16_interpreted

N, H, K, V = 3, 2, 20, 12
CARRIED = {  # what the initial state carries: the last key, the tail (tail_len 0, partial and full over the rows)
    "fresh": (False, False), "last": (True, False), "tail": (False, True), "both": (True, True)}


def fused(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, **options):
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_window_prepare_triton

    return fast_weight_window_prepare_triton(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, **options)


def reference(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, *, window, **options):
    """prepare_writes' x_ext, y_ext [N, W-1+T, H, *] and log decays [N, T, H], and C [N, T, H, W] from
    `window_coefficients`, as the Triton backend's torch path computes them."""
    from hybridlm.ops.fast_weight.triton.backend import window_coefficients

    state = FastWeightState(S=k.new_zeros(1), last_k=last_k, tail_x=tail_x, tail_v=tail_v, tail_len=tail_len)
    p = prepare_writes(k, k, v, beta, lam, FastWeightOptions(rule="3A", window=window, **options),
                       initial_state=state, offsets=None)
    lg = p.log_gamma[..., 0]
    return p.x_ext, p.y_ext, window_coefficients(p.weights[..., 0], lg), lg


def check(W, T, *, pairing, step_size, ridge_scaling, carried, lam_scale=0.5, eps_gamma=1e-6, gains=None):
    """The fused preparation against `reference` in float32 and in float64 on the same (float32) inputs.

    x_ext and y_ext must match float32 `reference` exactly (data movement); C, the log decays and the gradients of two
    random projections (of all four outputs, and of C and the log decays alone, whose gradients reach k only through
    the window statistic) within 1e-5 of float32 and float64 `reference`, or within twice float32's own error where
    that is larger (as tests/ops/test_triton_prepare.py: d log1p(-alpha) near the clamp amplifies rounding).
    gains: (beta, lam) in place of random ones. Returns the float32 reference's outputs."""
    with_last, with_tail = CARRIED[carried]
    _, k, v, beta, lam = make_inputs("3A", B=N, T=T, H=H, K=K, V=V, dtype=torch.float32, seed=W * 100 + T,
                                     lam_scale=lam_scale)
    beta, lam = gains or (beta, lam)
    state = random_state(N, H, K, V, window=W, dtype=torch.float32, tail_len=[0, max(1, (W - 1) // 2), W - 1])
    tensors = {"k": k, "v": v, "beta": beta, "lam": lam}
    if with_last and pairing == "shifted":
        tensors["last_k"] = state.last_k
    if with_tail:
        tensors.update(tail_x=state.tail_x, tail_v=state.tail_v)
    tail_len = state.tail_len if with_tail else None
    options = {"window": W, "pairing": pairing, "step_size": step_size, "ridge_scaling": ridge_scaling,
               "eps": 1e-6, "eps_gamma": eps_gamma}
    # float64 clamps at 1 - eps_gamma exactly; match float32's rounded bound so that clamped steps agree
    options64 = dict(options, eps_gamma=1.0 - float(torch.tensor(1.0 - eps_gamma, dtype=torch.float32)))

    def outputs_and_grads(fn, device, dtype, opts):
        leaves = {name: t.detach().to(device, dtype).requires_grad_(True) for name, t in tensors.items()}
        args = [leaves.get(name) for name in ("k", "v", "beta", "lam", "last_k", "tail_x", "tail_v")]
        out = fn(*args, None if tail_len is None else tail_len.to(device), **opts)
        weights = [projection(o, o, seed=11 + i)[0].to(device, o.dtype) for i, o in enumerate(out)]
        terms = [(o * w).sum() for o, w in zip(out, weights)]
        grads = [torch.autograd.grad(loss, list(leaves.values()), retain_graph=True, allow_unused=True,
                                     materialize_grads=True) for loss in (sum(terms), terms[2] + terms[3])]
        return [t.detach().cpu() for t in out], [{name: g.cpu() for name, g in zip(leaves, gs)} for gs in grads]

    out, grads = outputs_and_grads(fused, DEVICE, torch.float32, options)
    out32, grads32 = outputs_and_grads(reference, "cpu", torch.float32, options)
    out64, grads64 = outputs_and_grads(reference, "cpu", torch.float64, options64)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(out, out32))
    assert torch.equal(out[0], out32[0]) and torch.equal(out[1], out32[1])
    errors = {name: (rel_err(mine, ref64), rel_err(mine, ref32), rel_err(ref32, ref64))
              for name, mine, ref32, ref64 in zip(("C", "log_gamma"), out[2:], out32[2:], out64[2:])}
    for loss, mine, ref32, ref64 in zip(("all", "C+lg"), grads, grads32, grads64):
        errors.update((f"d{name} ({loss})", (rel_err(mine[name], ref64[name]), rel_err(mine[name], ref32[name]),
                                             rel_err(ref32[name], ref64[name]))) for name in mine)
    shown = {name: "vs f64 {:.1e}, vs f32 {:.1e} (f32 vs f64 {:.1e})".format(*e) for name, e in errors.items()}
    assert all(max(e64, e32) < max(1e-5, 2 * ref_err) for e64, e32, ref_err in errors.values()), shown
    return out32


def _cases():
    """Every window and length (one step, two, W - 1, several blocks of 16 steps) with every pairing and carried state
    (same-step pairing carries no key), the step sizes and ridge scaling taking turns."""
    cases = []
    for W in (2, 3, 5):
        for T in sorted({1, 2, W - 1, 37}):
            for pairing, carried in (("shifted", "fresh"), ("shifted", "last"), ("shifted", "both"),
                                     ("same_step", "fresh"), ("same_step", "tail")):
                i = len(cases)
                cases.append((W, T, pairing, ("nlms", "direct")[i % 2], i % 3 != 0, carried))
    return cases


CASES = _cases()


@pytest.fixture
def small_blocks(monkeypatch):
    """16 steps per program in the step kernels (their gathers cross program boundaries at T = 37)."""
    from hybridlm.ops.fast_weight.triton import window_prepare

    monkeypatch.setattr(window_prepare, "STEP_TILE", 1)


@interpret
@pytest.mark.parametrize("W,T,pairing,step_size,ridge_scaling,carried", CASES,
                         ids=[f"W{c[0]}-T{c[1]}-{c[2]}-{c[3]}-{'scaled' if c[4] else 'plain'}-{c[5]}" for c in CASES])
def test_matches_prepare_writes(small_blocks, W, T, pairing, step_size, ridge_scaling, carried):
    check(W, T, pairing=pairing, step_size=step_size, ridge_scaling=ridge_scaling, carried=carried)


@interpret
@pytest.mark.parametrize("step_size", ["nlms", "direct"])
def test_clamp_active(small_blocks, step_size):
    """A large ridge and eps_gamma = 0.05 put alpha = min(eta lam, 1 - eps_gamma) on its bound for many steps: no
    gradient through the clamped steps' eta lam, as torch.clamp."""
    lam_scale = 40.0 if step_size == "nlms" else 1.2
    out32 = check(3, 37, pairing="shifted", step_size=step_size, ridge_scaling=step_size == "nlms", carried="both",
                  lam_scale=lam_scale, eps_gamma=0.05)
    clamped = (out32[3] == torch.log1p(torch.tensor(-0.95))).float().mean()
    assert 0.1 < clamped < 0.95


@interpret
def test_clamp_at_equality(small_blocks):
    """eta lam == 1 - eps_gamma exactly (direct steps beta = 1, unscaled lam = 0.75 = 1 - eps_gamma): torch.clamp's
    gradient passes at equality (its mask is a <= max), and so does the kernel's."""
    shape = (N, 21, H)
    check(3, 21, pairing="same_step", step_size="direct", ridge_scaling=False, carried="tail", eps_gamma=0.25,
          gains=(torch.ones(shape), torch.full(shape, 0.75)))


@interpret
@pytest.mark.parametrize("W,T", [(3, 600), (64, 100)])
def test_launch_blocks(W, T):
    """The launch's own blocks: 256 steps per program at W = 3 (three programs per row), 32 at W = 64, the window
    longer than the blocks."""
    check(W, T, pairing="shifted", step_size="nlms", ridge_scaling=True, carried="both")


@interpret
def test_backward_keeps_its_outputs_not_k_and_v():
    """The autograd formula keeps the forward's x_ext and y_ext (which the scan and the band keep as well) in place of
    k and v: no saved tensor shares k's or v's storage."""
    _, k, v, beta, lam = make_inputs("3A", B=N, T=37, H=H, K=K, V=V, dtype=torch.float32)
    k, v, beta, lam = (t.to(DEVICE).requires_grad_(True) for t in (k, v, beta, lam))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.untyped_storage().data_ptr()), t)[1],
                                                  lambda t: t):
        x_ext, y_ext, _, _ = fused(k, v, beta, lam, None, None, None, None, window=3, pairing="shifted",
                                   step_size="nlms", ridge_scaling=True, eps=1e-6, eps_gamma=1e-6)
    storages = {name: t.untyped_storage().data_ptr() for name, t in (("k", k), ("v", v), ("x", x_ext), ("y", y_ext))}
    assert storages["k"] not in kept and storages["v"] not in kept
    assert storages["x"] in kept and storages["y"] in kept


FRONT_CASES = [  # window, pairing, read, step_size, ridge_scaling, carried, T
    (2, "shifted", "after", "nlms", True, "both", 45), (3, "shifted", "before", "direct", False, "last", 45),
    (3, "same_step", "after", "nlms", False, "tail", 45), (5, "shifted", "after", "nlms", True, "fresh", 45),
    (5, "same_step", "before", "direct", True, "tail", 45), (4, "shifted", "before", "nlms", False, "both", 45),
    (5, "shifted", "after", "nlms", True, "tail", 2), (4, "shifted", "before", "direct", False, "both", 1),
]


@interpret
@pytest.mark.parametrize("window,pairing,read,step_size,ridge_scaling,carried,T", FRONT_CASES,
                         ids=[f"W{c[0]}-" + "-".join(c[1:4]) + ("-scaled" if c[4] else "") + f"-{c[5]}-T{c[6]}"
                              for c in FRONT_CASES])
def test_front_door_fused_matches_chunk(monkeypatch, window, pairing, read, step_size, ridge_scaling, carried, T):
    """backend="triton" with the fused preparation against backend="chunk" (rel. < 1e-4) and against the Triton
    backend on prepare_writes (the same scan and band kernels; rel. < 1e-5): outputs, the final state (S, last key and
    tail bitwise, the tail's length included: calls shorter than the window keep part of the carried tail) and every
    gradient (q, k, v, beta, lam and every tensor of the initial state), with a loss on o and the whole final state;
    the fused run launches the preparation kernels (forward and backward), the other not."""
    from hybridlm.ops.fast_weight.triton import backend as triton_backend
    from hybridlm.ops.fast_weight.triton import window_prepare

    with_last, with_tail = CARRIED[carried]
    inputs = make_inputs("3A", B=N, T=T, H=H, K=K, V=V, dtype=torch.float32)
    if step_size == "direct":  # eta = beta: keep eta |k|^2 = eta K below 2, where the recurrence does not blow up
        inputs[3] = inputs[3] / K
    state = random_state(N, H, K, V, window=window, dtype=torch.float32, tail_len=[0, 1, window - 1])
    options = {"rule": "3A", "window": window, "pairing": pairing, "read": read, "step_size": step_size,
               "ridge_scaling": ridge_scaling, "eps": 1e-6, "eps_gamma": 1e-6, "output_final_state": True}
    launches = {name: record_launches(monkeypatch, window_prepare, name, lambda grid, kwargs: grid)
                for name in ("rows_fwd_kernel", "rows_bwd_kernel")}

    def run(backend, device, fused_preparation):
        monkeypatch.setattr(op, "fast_weight_triton", functools.partial(triton_backend.fast_weight_triton,
                                                                        fused_preparation=fused_preparation))
        leaves = [t.to(device).requires_grad_(True) for t in inputs]
        init = FastWeightState(S=state.S.to(device).requires_grad_(True))
        if with_last and pairing == "shifted":
            init.last_k = state.last_k.to(device).requires_grad_(True)
        if with_tail:
            init.tail_x, init.tail_v = (t.to(device).requires_grad_(True) for t in (state.tail_x, state.tail_v))
            init.tail_len = state.tail_len.to(device)
        named = {"S0": init.S, "last_k": init.last_k, "tail_x": init.tail_x, "tail_v": init.tail_v}
        names = ["q", "k", "v", "beta", "lam"] + [name for name, t in named.items() if t is not None]
        leaves += [t for t in named.values() if t is not None]
        o, s = fast_weight_attention(*leaves[:5], backend=backend, initial_state=init, **options)
        final = [t for t in (s.S, s.last_k, s.tail_x, s.tail_v) if t is not None]
        loss = sum((t * projection(t, t, seed=5 + i)[0].to(device, t.dtype)).sum() for i, t in enumerate([o] + final))
        grads = torch.autograd.grad(loss, leaves)
        outputs = [t.detach().cpu() for t in [o] + final + [s.tail_len]]
        return outputs, {"d" + name: g.cpu() for name, g in zip(names, grads)}

    (o_ref, *final_ref), grads_ref = run("chunk", "cpu", False)
    (o_pw, *final_pw), grads_pw = run("triton", DEVICE, False)
    assert all(not launched for launched in launches.values())
    (o, *final), grads = run("triton", DEVICE, True)
    assert all(len(launched) == 1 for launched in launches.values())
    assert len(final) == len(final_ref) == (5 if pairing == "shifted" else 4)  # S, last_k, tail_x, tail_v, tail_len
    for mine, ref in zip(final[1:], final_ref[1:]):  # the last key and the tail: copies of inputs, and tail_len
        assert torch.equal(mine, ref) and mine.dtype == ref.dtype
    errors = {"o": (rel_err(o, o_ref), rel_err(o, o_pw)), "S": (rel_err(final[0], final_ref[0]),
                                                                rel_err(final[0], final_pw[0]))}
    errors.update((name, (rel_err(grad, grads_ref[name]), rel_err(grad, grads_pw[name])))
                  for name, grad in grads.items())
    assert ("dtail_x" in errors) == with_tail and ("dlast_k" in errors) == (with_last and pairing == "shifted")
    shown = {name: "vs chunk {:.1e}, vs prepare_writes {:.1e}".format(*e) for name, e in errors.items()}
    assert all(e_chunk < 1e-4 and e_pw < 1e-5 for e_chunk, e_pw in errors.values()), shown


@interpret
@pytest.mark.parametrize("call", ["rows", "unfused", "seq_idx", "cu_seqlens", "window_65"])
def test_which_calls_take_it(monkeypatch, call):
    """Rule 3A on rows takes the fused preparation (one launch of each row kernel, forward and backward); with
    fused_preparation=False, documents in place (seq_idx), packed sequences (cu_seqlens) or a window above
    MAX_PREPARED_WINDOW it runs prepare_writes (no launch)."""
    from hybridlm.ops.fast_weight.triton import backend as triton_backend
    from hybridlm.ops.fast_weight.triton import window_prepare
    from hybridlm.ops.fast_weight.triton.limits import MAX_PREPARED_WINDOW

    launches = {name: record_launches(monkeypatch, window_prepare, name, lambda grid, kwargs: grid)
                for name in ("rows_fwd_kernel", "rows_bwd_kernel")}
    monkeypatch.setattr(op, "fast_weight_triton", functools.partial(triton_backend.fast_weight_triton,
                                                                    fused_preparation=call != "unfused"))
    B, T = 2, 20
    inputs = [t.to(DEVICE).requires_grad_(True) for t in make_inputs("3A", B=B, T=T, H=H, K=K, V=V,
                                                                       dtype=torch.float32)]
    options = {"rule": "3A", "window": MAX_PREPARED_WINDOW + 1 if call == "window_65" else 3, "backend": "triton"}
    if call == "seq_idx":
        options["seq_idx"] = torch.tensor([[0] * 7 + [1] * 13, [2] * 20], device=DEVICE)
    if call == "cu_seqlens":
        inputs = [t.detach().reshape(1, B * T, *t.shape[2:]).requires_grad_(True) for t in inputs]
        options["cu_seqlens"] = torch.tensor([0, 9, B * T])
    o, _ = fast_weight_attention(*inputs, **options)
    o.square().sum().backward()
    assert [len(launched) for launched in launches.values()] == ([1, 1] if call == "rows" else [0, 0])


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_front_door_matches_prepare_writes(monkeypatch, dtype):
    """16-bit inputs (a model's bf16 / fp16 q, k, v): the fused preparation keeps k's and v's dtype for the pairs
    (bitwise prepare_writes' x_ext and y_ext) and computes its statistics in float32 as prepare_writes does, so the
    outputs, the final state and every gradient match the Triton backend on prepare_writes in the same dtype to
    within the 16-bit scan's rounding (shifted pairing, NLMS, ridge scaling, a carried last key and tail)."""
    skip_bfloat16_interpreted(dtype)
    from hybridlm.ops.fast_weight.triton import backend as triton_backend

    window, T = 3, 70
    inputs = make_inputs("3A", B=N, T=T, H=H, K=K, V=V, dtype=torch.float32)
    state = random_state(N, H, K, V, window=window, dtype=torch.float32, tail_len=[0, 1, window - 1])
    options = {"rule": "3A", "window": window, "output_final_state": True}

    def run(fused_preparation):
        monkeypatch.setattr(op, "fast_weight_triton", functools.partial(triton_backend.fast_weight_triton,
                                                                        fused_preparation=fused_preparation))
        leaves = [t.to(DEVICE, dtype).requires_grad_(True) for t in inputs]
        init = FastWeightState(S=state.S.to(DEVICE), last_k=state.last_k.to(DEVICE),
                               tail_x=state.tail_x.to(DEVICE), tail_v=state.tail_v.to(DEVICE),
                               tail_len=state.tail_len.to(DEVICE))
        o, s = fast_weight_attention(*leaves, backend="triton", initial_state=init, **options)
        loss = (o.float() * projection(o, o, seed=5)[0].to(DEVICE)).sum() + (s.S * s.S).sum()
        return [o.float().cpu(), s.S.cpu(), *(g.float().cpu() for g in torch.autograd.grad(loss, leaves))]

    fused_run, torch_run = run(True), run(False)
    errors = [rel_err(a, b) for a, b in zip(fused_run, torch_run)]
    assert fused_run[0].dtype == torch.float32 and max(errors) < 5e-3, [f"{e:.1e}" for e in errors]
