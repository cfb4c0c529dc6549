"""The fused write preparation of rules 1A / 1 (`triton/prepare.py`, the custom op hybridlm::fast_weight_prepare_fwd)
against chunk.py's `prepare_writes` (window 1), outputs and every gradient (k, v, beta, lam, the carried last key),
and the Triton front door with it against backend="chunk" and against the Triton backend on prepare_writes.

Where they run (as the other Triton tests; tests/ops/conftest.py sets TRITON_INTERPRET before any kernel loads):
    GPU:  python -m pytest -q tests/ops/test_triton_prepare.py
    CPU:  HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_triton_prepare.py
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight import op
from hybridlm.ops.fast_weight.chunk import prepare_writes
from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import make_inputs, projection, random_state
from tests.ops.triton_modes import DEVICE, interpret

OFFSETS = torch.tensor([0, 5, 40, 41, 70])  # packed: lengths 5, 35, 1, 29


def fused(k, v, beta, lam, last_k, offsets, **options):
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_prepare_triton

    max_len = k.shape[1] if offsets is None else int((offsets[1:] - offsets[:-1]).max())
    return fast_weight_prepare_triton(k, v, beta, lam, last_k, None if offsets is None else offsets.to(k.device),
                                      max_len=max_len, **options)


def reference(q, k, v, beta, lam, last_k, offsets, **options):
    """prepare_writes' window-1 write events: x, y [N, T, H, *], eta, log_gamma [N, T, H]."""
    S = q.new_zeros(1)  # unused by the preparation
    p = prepare_writes(q, k, v, beta, lam, FastWeightOptions(rule="1A", **options),
                       initial_state=FastWeightState(S=S, last_k=last_k), offsets=offsets)
    return p.X[:, :, :, 0], p.Y[:, :, :, 0], p.weights[..., 0, 0], p.log_gamma[..., 0]


def check(*, pairing, step_size, ridge_scaling, stateful, packed, lam_scale=0.5, eps_gamma=1e-6, inputs=None):
    """The fused preparation against prepare_writes in float32 and in float64 on the same (float32) inputs.

    x and y must match float32 prepare_writes exactly (pure data movement; on rows the fused y is v itself, equal to
    prepare_writes' y where a pair exists, and y enters the loss only there: elsewhere eta = 0 and no scan reads it,
    `triton/prepare.py`); eta, log_gamma and every gradient within
    1e-5 of float32 prepare_writes and of float64 prepare_writes (the exact answer for these inputs) -- or, where
    float32 prepare_writes is itself further than 5e-6 from float64, within twice its error: d log_gamma / d alpha =
    -1 / (1 - alpha) amplifies a 1-ulp difference in |x|^2 (summation order) near the bound. That happens with direct
    steps and ridge scaling (alpha = beta lam |x|^2, mostly clamped): float32 prepare_writes' d beta is 0.7-1.2e-5
    off there, the kernel's 0.7-0.8e-5."""

    B, T, H, K, V = (1, 70, 2, 16, 24) if packed else (2, 37, 3, 20, 12)
    offsets = OFFSETS if packed else None
    n = len(OFFSETS) - 1 if packed else B
    q, k, v, beta, lam = inputs or make_inputs("1A", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32,
                                               lam_scale=lam_scale)
    last_k = random_state(n, H, K, V, window=1, dtype=torch.float32).last_k if stateful else None
    options = {"pairing": pairing, "step_size": step_size, "ridge_scaling": ridge_scaling, "eps": 1e-6,
               "eps_gamma": eps_gamma}
    # float64 clamps at 1 - eps_gamma exactly; match float32's rounded bound so that clamped steps agree
    options64 = dict(options, eps_gamma=1.0 - float(torch.tensor(1.0 - eps_gamma, dtype=torch.float32)))
    tensors = [k, v, beta, lam] + ([last_k] if stateful else [])
    names = ["dk", "dv", "dbeta", "dlam", "dlast_k"][:len(tensors)]

    def outputs_and_grads(fn, device, dtype, opts, *first):
        leaves = [t.detach().to(device, dtype).requires_grad_(True) for t in tensors]
        out = fn(*first, *leaves[:4], leaves[4] if stateful else None, offsets, **opts)
        weights = [projection(o, o, seed=11 + i)[0].to(o.device, o.dtype) for i, o in enumerate(out)]
        weights[1] = weights[1] * (out[2] != 0).unsqueeze(-1).to(weights[1].dtype)     # where a pair exists
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
        return [t.detach().cpu() for t in out], [g.cpu() for g in grads]

    out, grads = outputs_and_grads(fused, DEVICE, torch.float32, options)
    out32, grads32 = outputs_and_grads(reference, "cpu", torch.float32, options, q)
    out64, grads64 = outputs_and_grads(reference, "cpu", torch.float64, options64, q.double())
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(out, out32))
    assert torch.equal(out[0], out32[0])
    if packed:
        assert torch.equal(out[1], out32[1])
    else:
        assert torch.equal(out[1], v) and torch.equal(out[1] * (out32[2] != 0).unsqueeze(-1), out32[1])
    errors = {}
    for name, mine, ref32, ref64 in zip(["eta", "log_gamma"] + names, out[2:] + grads, out32[2:] + grads32,
                                        out64[2:] + grads64):
        errors[name] = (rel_err(mine, ref64), rel_err(mine, ref32), rel_err(ref32, ref64))
    shown = {name: "vs f64 {:.1e}, vs f32 {:.1e} (f32 vs f64 {:.1e})".format(*e) for name, e in errors.items()}
    assert all(max(e64, e32) < max(1e-5, 2 * ref_err) for e64, e32, ref_err in errors.values()), shown
    return out32


CASES = [case for case in itertools.product(("shifted", "same_step"), ("nlms", "direct"), (True, False),
                                            (True, False), (False, True))
         if not (case[0] == "same_step" and case[3])]  # same-step pairing carries no key


@interpret
@pytest.mark.parametrize("pairing,step_size,ridge_scaling,stateful,packed", CASES,
                         ids=["-".join([c[0], c[1], "scaled" if c[2] else "plain", "state" if c[3] else "fresh",
                                        "packed" if c[4] else "rows"]) for c in CASES])
def test_matches_prepare_writes(pairing, step_size, ridge_scaling, stateful, packed):
    check(pairing=pairing, step_size=step_size, ridge_scaling=ridge_scaling, stateful=stateful, packed=packed)


@interpret
@pytest.mark.parametrize("step_size", ["nlms", "direct"])
def test_clamp_active(step_size):
    """A large ridge and eps_gamma = 0.05 put alpha = min(eta lam, 1 - eps_gamma) on its bound for many steps: no
    gradient through the clamped steps' eta lam, as torch.clamp."""
    out_ref = check(pairing="shifted", step_size=step_size, ridge_scaling=step_size == "nlms", stateful=True,
                    packed=False, lam_scale=40.0, eps_gamma=0.05)
    clamped = (out_ref[3] == torch.log1p(torch.tensor(-0.95))).float().mean()
    assert 0.1 < clamped < 0.95


@interpret
def test_clamp_at_equality():
    """eta lam == 1 - eps_gamma exactly (direct steps beta = 1, unscaled lam = 0.75 = 1 - eps_gamma): torch.clamp's
    gradient passes at equality (its mask is a <= max), and so does the kernel's."""
    B, T, H, K, V = 1, 9, 1, 16, 16
    q, k, v, beta, lam = make_inputs("1A", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)
    beta, lam = torch.ones_like(beta), torch.full_like(lam, 0.75)
    check(pairing="same_step", step_size="direct", ridge_scaling=False, stateful=False, packed=False,
          eps_gamma=0.25, inputs=(q, k, v, beta, lam))


@interpret
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_backward_keeps_its_outputs_not_k_and_v(packed):
    """The autograd formula keeps the forward's x and y (which the scan keeps as well) in place of k and v: no saved
    tensor shares k's or v's storage, and x's and (packed) y's are among them. On rows y is v itself, which the scan
    keeps in place of a copy."""
    B, T, H, K, V = (1, 70, 2, 16, 24) if packed else (2, 37, 3, 20, 12)
    _, k, v, beta, lam = make_inputs("1A", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)
    k, v, beta, lam = (t.to(DEVICE).requires_grad_(True) for t in (k, v, beta, lam))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.untyped_storage().data_ptr()), t)[1],
                                                  lambda t: t):
        x, y, eta, log_gamma = fused(k, v, beta, lam, None, OFFSETS if packed else None, pairing="shifted",
                                     step_size="nlms", ridge_scaling=True, eps=1e-6, eps_gamma=1e-6)
    storages = {name: t.untyped_storage().data_ptr() for name, t in (("k", k), ("v", v), ("x", x), ("y", y))}
    assert storages["k"] not in kept and storages["v"] not in kept
    assert storages["x"] in kept and (storages["y"] in kept if packed else y is v)


FRONT_CASES = [  # rule, pairing, read, step_size, ridge_scaling, packed, stateful
    ("1A", "shifted", "after", "nlms", True, False, True), ("1A", "shifted", "before", "direct", False, True, True),
    ("1A", "same_step", "after", "nlms", False, True, False), ("1A", "shifted", "after", "nlms", True, True, False),
    ("1", "shifted", "after", "nlms", True, True, True), ("1", "same_step", "before", "direct", False, False, False),
]


@interpret
@pytest.mark.parametrize("rule,pairing,read,step_size,ridge_scaling,packed,stateful", FRONT_CASES,
                         ids=["-".join(map(str, c[:4])) + ("-scaled" if c[4] else "") + ("-packed" if c[5] else "")
                              + ("" if c[6] else "-fresh") for c in FRONT_CASES])
def test_front_door_fused_matches_chunk(monkeypatch, rule, pairing, read, step_size, ridge_scaling, packed, stateful):
    """backend="triton" with the fused preparation against backend="chunk" (rel. < 1e-4) and against the Triton
    backend on prepare_writes (the same scan kernels; rel. < 1e-5): outputs, the final state (S, last key) and every
    gradient (q, k, v, beta, lam, S0, the carried last key)."""
    from hybridlm.ops.fast_weight.triton import backend as triton_backend

    B, T, H, K, V = (1, 70, 2, 16, 24) if packed else (2, 45, 2, 16, 24)
    offsets = OFFSETS if packed else None
    n = len(OFFSETS) - 1 if packed else B
    inputs = make_inputs(rule, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)
    state = random_state(n, H, K, V, window=1, dtype=torch.float32) if stateful else None
    if stateful and pairing == "same_step":
        state.last_k = None
    options = {"rule": rule, "window": 1, "pairing": pairing, "read": read, "step_size": step_size,
               "ridge_scaling": ridge_scaling, "eps": 1e-6, "eps_gamma": 1e-6, "output_final_state": True,
               "cu_seqlens": offsets}

    def run(backend, device, fused_preparation):
        monkeypatch.setattr(op, "fast_weight_triton", functools.partial(triton_backend.fast_weight_triton,
                                                                        fused_preparation=fused_preparation))
        leaves = [t.to(device).requires_grad_(True) for t in inputs]
        init = None
        if stateful:
            init = FastWeightState(*(None if t is None else t.to(device).requires_grad_(True)
                                     for t in (state.S, state.last_k)))
            leaves += [t for t in (init.S, init.last_k) if t is not None]
        o, s = fast_weight_attention(*leaves[:5], backend=backend, initial_state=init, **options)
        w_o, w_S = projection(o.detach().cpu().double(), s.S.detach().cpu().double())
        loss = (o * w_o.to(device, o.dtype)).sum() + (s.S * w_S.to(device, s.S.dtype)).sum()
        if s.last_k is not None:  # the final last key feeds the loss too (k's gradient covers it)
            loss = loss + (s.last_k * projection(o, s.last_k.detach().cpu(), seed=5)[1].to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        final = [s.S] + ([] if s.last_k is None else [s.last_k])
        return [t.detach().cpu() for t in [o] + final], [g.cpu() for g in grads]

    (o_ref, *final_ref), grads_ref = run("chunk", "cpu", False)
    (o_pw, *final_pw), grads_pw = run("triton", DEVICE, False)
    (o, *final), grads = run("triton", DEVICE, True)
    assert len(final) == len(final_ref)
    if len(final) == 2:
        assert torch.equal(final[1], final_ref[1]) and final[1].dtype == final_ref[1].dtype
    names = ["o", "S", "dq", "dk", "dv", "dbeta", "dlam", "dS0", "dlast_k"]
    names = names[:2] + names[2:2 + len(grads)]
    errors = {name: (rel_err(mine, ref), rel_err(mine, pw)) for name, mine, ref, pw in
              zip(names, [o, final[0]] + grads, [o_ref, final_ref[0]] + grads_ref, [o_pw, final_pw[0]] + grads_pw)}
    shown = {name: "vs chunk {:.1e}, vs prepare_writes {:.1e}".format(*e) for name, e in errors.items()}
    assert all(e_chunk < 1e-4 and e_pw < 1e-5 for e_chunk, e_pw in errors.values()), shown
