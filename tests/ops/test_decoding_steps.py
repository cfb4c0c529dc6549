"""The one-kernel decoding steps (`hybridlm/ops/fast_weight/triton/step.py`, `hybridlm/ops/ssd/triton/step.py`)
against the float64 step loops (naive.py's specs), from carried states, over several steps, and where they must not
run: with a gradient to record, with packed sequences, on the CPU without the interpreter.

- On a GPU, or under the interpreter (HYBRIDLM_TRITON_INTERPRET=1): everything marked `interpret`.
- CPU, no GPU (CI): the backend choice on CPU tensors only.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hybridlm.modules.norm import rms_normalize
from hybridlm.ops import FastWeightState, fast_weight_attention
from hybridlm.ops.fast_weight import op as fast_weight_op
from hybridlm.ops.fast_weight.triton import step_takes
from hybridlm.ops.ssd import _backend as ssd_backend
from hybridlm.ops.ssd import ssd
from tests.helpers import rel_err
from tests.ops import fast_weight_helpers as fw
from tests.ops import ssd_helpers
from tests.ops.triton_modes import DEVICE, INTERPRET, ON_GPU, interpret, skip_bfloat16_interpreted

STEP_RULES = ("1A", "1", "2A", "2")
OPTIONS = list(itertools.product(("shifted", "same_step"), ("after", "before"), ("nlms", "direct"), (False, True)))
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _counting(monkeypatch, module) -> list:
    """Count the calls of `module.forward` (a step kernel's launcher)."""
    calls = []
    launch = module.forward
    monkeypatch.setattr(module, "forward", lambda *args, **kwargs: (calls.append(1), launch(*args, **kwargs))[1])
    return calls


def _fast_weight_step(inputs, state, *, backend, **options):
    return fast_weight_attention(*inputs, **options, initial_state=state, output_final_state=True, backend=backend)


@interpret
@pytest.mark.parametrize("rule", STEP_RULES)
@pytest.mark.parametrize("pairing, read, step_size, ridge_scaling", OPTIONS)
def test_fast_weight_step_matches_spec(monkeypatch, rule, pairing, read, step_size, ridge_scaling):
    """One step from a carried state, from a state without a carried key (a fresh shifted row writes nothing) and
    from none equals the float64 spec in o, S and the carried key; it ran the step kernel."""
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    options = dict(rule=rule, pairing=pairing, read=read, step_size=step_size, ridge_scaling=ridge_scaling)
    inputs = fw.make_inputs(rule, B=3, T=1, H=2, K=20, V=12)
    carried = fw.random_state(3, 2, 20, 12, window=1)
    fresh = FastWeightState(S=carried.S)  # no carried key: a shifted row writes nothing, and reads S
    for state in (carried, fresh, None):
        want_o, want = _fast_weight_step(inputs, state, backend="naive", **options)
        given = None if state is None else FastWeightState(
            S=state.S.float().to(DEVICE), last_k=None if state.last_k is None else state.last_k.float().to(DEVICE))
        o, got = _fast_weight_step([t.float().to(DEVICE) for t in inputs], given, backend="triton", **options)
        assert rel_err(o.double().cpu(), want_o) < TOL[torch.float32]
        assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32]
        if pairing == "shifted":
            assert torch.equal(got.last_k.cpu(), inputs[1][:, 0].float())
        else:
            assert got.last_k is None and want.last_k is None
    assert len(calls) == 3


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rule", STEP_RULES)
def test_fast_weight_step_16_bit(monkeypatch, rule, dtype):
    """16-bit q, k, v: the state in float32 as the torch step's, the output rounded once."""
    from hybridlm.ops.fast_weight.triton import step

    skip_bfloat16_interpreted(dtype)
    calls = _counting(monkeypatch, step)
    inputs = fw.make_inputs(rule, B=2, T=1, H=3, K=64, V=64)
    state = fw.random_state(2, 3, 64, 64, window=1)
    q, k, v = (t.to(dtype) for t in inputs[:3])
    want_o, want = _fast_weight_step([q.double(), k.double(), v.double(), *inputs[3:]], state, backend="naive",
                                     rule=rule)
    given = FastWeightState(S=state.S.float().to(DEVICE), last_k=state.last_k.float().to(DEVICE))
    o, got = _fast_weight_step([t.to(DEVICE) for t in (q, k, v)] + [t.float().to(DEVICE) for t in inputs[3:]],
                               given, backend="triton", rule=rule)
    assert o.dtype == dtype
    assert rel_err(o.double().cpu(), want_o) < TOL[dtype]
    assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
@pytest.mark.parametrize("rule", STEP_RULES)
@pytest.mark.parametrize("K, V", [(128, 128), (128, 100), (7, 65)])
def test_fast_weight_step_blocks_of_value_columns(monkeypatch, rule, K, V):
    """Heads of several value blocks per program grid (the default 128 x 128 runs four), odd sizes: every column."""
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    inputs = fw.make_inputs(rule, B=2, T=1, H=2, K=K, V=V)
    state = fw.random_state(2, 2, K, V, window=1)
    want_o, want = _fast_weight_step(inputs, state, backend="naive", rule=rule, ridge_scaling=rule == "1")
    given = FastWeightState(S=state.S.float().to(DEVICE), last_k=state.last_k.float().to(DEVICE))
    o, got = _fast_weight_step([t.float().to(DEVICE) for t in inputs], given, backend="triton", rule=rule,
                               ridge_scaling=rule == "1")
    assert rel_err(o.double().cpu(), want_o) < TOL[torch.float32]
    assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
def test_fast_weight_step_reads_row_slices_in_place(monkeypatch):
    """q, k, v as a mixer hands them over at several rows (slices of one wider row, in 16 bits): the spec's step, and
    no contiguous copy of the slices."""
    from hybridlm.ops.fast_weight.triton import step

    seen = []
    launch = step.forward
    monkeypatch.setattr(step, "forward", lambda q, k, v, *a, **kw: seen.append(v.is_contiguous()) or
                        launch(q, k, v, *a, **kw))
    B, H, K = 3, 2, 16
    g = torch.Generator().manual_seed(4)
    # [q | k | v | more] per row, on the device before slicing (moving a slice there would copy it densely)
    row = torch.randn(B, 1, 3 * H * K + 5, generator=g).to(DEVICE, torch.float16)
    q, k, v = (row[..., i * H * K:(i + 1) * H * K].unflatten(-1, (H, K)) for i in range(3))
    beta, lam = torch.rand(B, 1, H, generator=g).to(DEVICE), torch.rand(B, 1, H, generator=g).to(DEVICE)
    state = fw.random_state(B, H, K, K, window=1)
    want_o, want = _fast_weight_step([t.double().cpu() for t in (q, k, v, beta, lam)], state, backend="naive",
                                     rule="1")
    given = FastWeightState(S=state.S.float().to(DEVICE), last_k=state.last_k.float().to(DEVICE))
    o, got = _fast_weight_step([q, k, v, beta, lam], given, backend="triton", rule="1")
    assert o.dtype == torch.float16
    assert rel_err(o.double().cpu(), want_o) < TOL[torch.float16]
    assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32]
    assert seen == [False]  # the slices read in place


@interpret
@pytest.mark.parametrize("rule, pairing, K", [("1A", "shifted", 20), ("1", "shifted", 128), ("2A", "same_step", 20),
                                              ("2", "shifted", 128), ("1", "same_step", 128)])
def test_fast_weight_step_in_place_writes_the_same_state_over_the_old(rule, pairing, K):
    """`in_place=True`: the same o, S' and carried key bit for bit as the step into new tensors, written over the given
    S and carried key and returned in them; K = V = 20 is one value block (the key written by the kernel), 128 four
    (the key copied over after it)."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_step_triton

    q, k, v, beta, lam = (t[:, 0].float().to(DEVICE) for t in fw.make_inputs(rule, B=2, T=1, H=2, K=K, V=K))
    state = fw.random_state(2, 2, K, K, window=1)
    S, last_k = state.S.float().to(DEVICE), state.last_k.float().to(DEVICE) if pairing == "shifted" else None
    options = dict(rule=rule, pairing=pairing, read_after=True, step_size="nlms", ridge_scaling=False, eps=1e-6,
                   eps_gamma=1e-6)
    want = fast_weight_step_triton(q, k, v, beta, lam, S.clone(), None if last_k is None else last_k.clone(),
                                   **options)
    address = S.data_ptr()
    o, S_out, last_out = fast_weight_step_triton(q, k, v, beta, lam, S, last_k, **options, in_place=True)
    assert S_out is S and last_out is last_k and S.data_ptr() == address
    assert torch.equal(o, want[0]) and torch.equal(S, want[1])
    if pairing == "shifted":
        assert torch.equal(last_k, want[2])
    with pytest.raises(ValueError, match="needs its carried key"):
        fast_weight_step_triton(q, k, v, beta, lam, S, None, **{**options, "pairing": "shifted"}, in_place=True)


def _prepared_reference(q, k, beta_logits, lam_logits, beta_bias, lam_bias, beta_scale, lam_scale, qk_norm, qk_eps):
    """The mixer's preparation of a step in float64: q, k normalized over K, the gains from their logits."""
    def normalize(u):
        K = u.shape[-1]
        if qk_norm == "none":
            return u
        eps = qk_eps / K if qk_norm == "l2" else qk_eps
        n = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
        return n * K**-0.5 if qk_norm == "l2" else n

    beta = beta_scale * torch.sigmoid(beta_logits + beta_bias.reshape(beta_logits.shape[2:]))
    lam = lam_scale * torch.sigmoid(lam_logits + lam_bias)
    return normalize(q), normalize(k), beta, lam


@interpret
@pytest.mark.parametrize("rule", STEP_RULES)
@pytest.mark.parametrize("qk_norm", ["rms", "l2", "none"])
@pytest.mark.parametrize("pairing, step_size, ridge_scaling", [("shifted", "nlms", False), ("same_step", "direct", True),
                                                               ("shifted", "direct", True)])
def test_decoding_step_prepares_its_inputs(monkeypatch, rule, qk_norm, pairing, step_size, ridge_scaling):
    """`fast_weight_decoding_step` on raw q, k (slices of a wider row) and the gains' logits (slices of another):
    the float64 preparation (QK norm, gains) then the spec's step, in o, S and the carried (normalized) key; one
    launch of the step kernel."""
    from hybridlm.ops.fast_weight import fast_weight_decoding_step
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    B, H, K, V = 3, 2, 20, 12
    g = torch.Generator().manual_seed(7)
    row = 2 * torch.randn(B, 1, H * (2 * K + V) + 3, generator=g, dtype=torch.float64)  # [q | k | v | more]
    q, k = (row[..., i * H * K:(i + 1) * H * K].unflatten(-1, (H, K)) for i in range(2))
    v = row[..., 2 * H * K:2 * H * K + H * V].unflatten(-1, (H, V))
    per_column = rule in ("2A", "2")
    width = H * V if per_column else H
    logits = torch.randn(B, 1, width + H + 1, generator=g, dtype=torch.float64)  # [beta | lam | more]
    beta_logits = logits[..., :width].unflatten(-1, (H, V)) if per_column else logits[..., :width]
    lam_logits = logits[..., width:width + H]
    beta_bias, lam_bias = torch.randn(width, generator=g, dtype=torch.float64), torch.randn(H, generator=g,
                                                                                            dtype=torch.float64)
    scales = (2.0 / K, 1.5) if step_size == "direct" else (2.0, float(K))
    options = dict(rule=rule, pairing=pairing, step_size=step_size, ridge_scaling=ridge_scaling)
    state = fw.random_state(B, H, K, V, window=1)
    qk_eps = 0.5  # large enough to change the norm (l2 divides it by K)
    prepared = _prepared_reference(q, k, beta_logits, lam_logits, beta_bias, lam_bias, *scales, qk_norm, qk_eps)
    want_o, want = _fast_weight_step([prepared[0], prepared[1], v, prepared[2], prepared[3]], state, backend="naive",
                                     **options)
    given = FastWeightState(S=state.S.float().to(DEVICE), last_k=state.last_k.float().to(DEVICE))
    on_device = lambda t: t.to(DEVICE, torch.float32)  # noqa: E731
    row_d, logits_d = on_device(row), on_device(logits)  # sliced on the device: the slices read in place
    q_d, k_d = (row_d[..., i * H * K:(i + 1) * H * K].unflatten(-1, (H, K)) for i in range(2))
    v_d = row_d[..., 2 * H * K:2 * H * K + H * V].unflatten(-1, (H, V))
    beta_d = logits_d[..., :width].unflatten(-1, (H, V)) if per_column else logits_d[..., :width]
    o, got = fast_weight_decoding_step(
        q_d, k_d, v_d, beta_d, logits_d[..., width:width + H],
        gates=(on_device(beta_bias), on_device(lam_bias), *scales), qk_norm=qk_norm, qk_eps=qk_eps, **options,
        initial_state=given)
    assert rel_err(o.double().cpu(), want_o) < TOL[torch.float32]
    assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32]
    if pairing == "shifted":
        assert rel_err(got.last_k.double().cpu(), want.last_k) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoding_step_prepares_16_bit_inputs_as_the_mixer_rounds(dtype):
    """16-bit q, k: normalized, rounded to their dtype (l2: scaled, rounded again), as the mixer's `_normalize` and
    cast do before the op; the step then equals the op's on those inputs."""
    from hybridlm.ops.fast_weight import fast_weight_decoding_step

    skip_bfloat16_interpreted(dtype)
    B, H, K = 2, 3, 24  # 1 / sqrt(24) is no power of two: l2's second rounding shows
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, 1, H, K, generator=g).to(DEVICE, dtype) for _ in range(3))
    beta_logits, lam_logits = (torch.randn(B, 1, H, generator=g).to(DEVICE) for _ in range(2))
    beta_bias, lam_bias = (torch.randn(H, generator=g).to(DEVICE) for _ in range(2))
    state = FastWeightState(S=torch.randn(B, H, K, K, generator=g).to(DEVICE), last_k=torch.randn(B, H, K,
                                                                                                 generator=g).to(DEVICE))
    for qk_norm in ("rms", "l2"):
        eps = 1e-6 / K if qk_norm == "l2" else 1e-6
        rounded = [rms_normalize(u, eps=eps, backend="triton").to(dtype) for u in (q, k)]
        if qk_norm == "l2":
            rounded = [u * K**-0.5 for u in rounded]
        beta = 2.0 * torch.sigmoid(beta_logits + beta_bias)
        lam = 16.0 * torch.sigmoid(lam_logits + lam_bias)
        want_o, want = fast_weight_attention(*rounded, v, beta, lam, rule="1A", initial_state=state,
                                             output_final_state=True, backend="triton")
        o, got = fast_weight_decoding_step(q, k, v, beta_logits, lam_logits, gates=(beta_bias, lam_bias, 2.0, 16.0),
                                           qk_norm=qk_norm, qk_eps=1e-6, rule="1A", initial_state=state)
        assert o.dtype == dtype
        assert rel_err(o.double(), want_o.double()) < TOL[dtype]
        assert rel_err(got.S.double(), want.S.double()) < 1e-5
        torch.testing.assert_close(got.last_k, rounded[1][:, 0].float(), rtol=0, atol=0)


def _arguments_seen(monkeypatch, module) -> list:
    """The positional and keyword arguments of each call of `module.forward` (a step kernel's launcher)."""
    seen = []
    launch = module.forward
    monkeypatch.setattr(module, "forward", lambda *args, **kwargs: (seen.append((args, kwargs)),
                                                                     launch(*args, **kwargs))[1])
    return seen


@interpret
@pytest.mark.parametrize("rule", ["1A", "2A"])
def test_decoding_step_reads_16_bit_biases_without_a_cast(monkeypatch, rule):
    """The gains' biases of a 16-bit model reach the kernel in their dtype (no cast kernel per step) and the step
    equals the one on their float32 copies bit for bit: the kernel reads them as float32."""
    from hybridlm.ops.fast_weight import fast_weight_decoding_step
    from hybridlm.ops.fast_weight.triton import step

    B, H, K = 2, 3, 16
    width = H * K if rule == "2A" else H
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, 1, H, K, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    beta_logits = torch.randn(B, 1, width, generator=g).to(DEVICE, torch.float16)
    if rule == "2A":
        beta_logits = beta_logits.unflatten(-1, (H, K))
    lam_logits = torch.randn(B, 1, H, generator=g).to(DEVICE, torch.float16)
    biases = [torch.randn(n, generator=g).to(DEVICE, torch.float16) for n in (width, H)]
    state = FastWeightState(S=torch.randn(B, H, K, K, generator=g).to(DEVICE),
                            last_k=torch.randn(B, H, K, generator=g).to(DEVICE))
    seen = _arguments_seen(monkeypatch, step)
    outs = [fast_weight_decoding_step(q, k, v, beta_logits, lam_logits, gates=(*given, 2.0, 16.0), qk_norm="rms",
                                      qk_eps=1e-6, rule=rule, initial_state=state)
            for given in (biases, [b.float() for b in biases])]
    assert [kwargs["beta_bias"].dtype for _, kwargs in seen] == [torch.float16, torch.float32]
    assert [kwargs["lam_bias"].dtype for _, kwargs in seen] == [torch.float16, torch.float32]
    (o16, s16), (o32, s32) = outs
    torch.testing.assert_close(o16, o32, rtol=0, atol=0)
    torch.testing.assert_close(s16.S, s32.S, rtol=0, atol=0)


def test_decoding_step_refuses_wrong_biases():
    """A bias of the wrong size says which sizes the step takes."""
    pytest.importorskip("triton")
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_step_triton

    q = torch.zeros(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"biases must be \[2\] \(beta\) and \[2\] \(lam\)"):
        fast_weight_step_triton(q, q, q, torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 16, 16), None,
                                rule="1A", pairing="shifted", read_after=True, step_size="nlms", ridge_scaling=False,
                                eps=1e-6, eps_gamma=1e-6, gates=(torch.zeros(3), torch.zeros(2), 2.0, 1.0))
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        fast_weight_step_triton(q, q, q, torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 16, 16), None,
                                rule="1A", pairing="shifted", read_after=True, step_size="nlms", ridge_scaling=False,
                                eps=1e-6, eps_gamma=1e-6, qk_norm="layer")


def _mixer_inputs(rule, *, N, H, K, V, taps, bias, dtype, seed=0):
    """A mixer's step inputs: the projection's rows p [N, width], the conv's weight, bias and state, S, the carried
    key, the gains' biases, the norm's weight (float64; p and the conv state in `dtype`)."""
    g = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    beta_width = H * V if rule in ("2A", "2") else H
    p = torch.randn(N, C + H * V + beta_width + H, generator=g, dtype=torch.float64).to(dtype).double()
    conv_w = 0.5 * torch.randn(C, taps, generator=g, dtype=torch.float64)
    conv_b = 0.1 * torch.randn(C, generator=g, dtype=torch.float64) if bias else None
    conv_state = torch.randn(N, taps - 1, C, generator=g, dtype=torch.float64).to(dtype).double()
    state = fw.random_state(N, H, K, V, window=1, seed=seed + 1)
    gains = tuple(torch.randn(n, generator=g, dtype=torch.float64) for n in (beta_width, H))
    norm_w = 1.0 + 0.2 * torch.randn(H * V, generator=g, dtype=torch.float64)
    return p, conv_w, conv_b, conv_state, state, gains, norm_w


def _mixer_step_reference(p, conv_w, conv_b, conv_state, state, gains, norm_w, *, H, K, V, rule, pairing, read,
                          step_size, ridge_scaling, qk_norm, scales, norm_eps):
    """The mixer's steps 2-5 of one token in float64 (the conv, `_prepared_reference`, the naive op, the gated
    norm) -> y [N, H V], the new conv state, the state."""
    C = H * (2 * K + V)
    extended = torch.cat([conv_state, p[:, None, :C]], dim=1)  # [N, taps, C]
    conv = (extended * conv_w.T[None]).sum(1) + (0 if conv_b is None else conv_b)
    conv = conv * torch.sigmoid(conv)
    N = p.shape[0]
    q, k, v = (t.reshape(N, 1, H, -1) for t in conv.split([H * K, H * K, H * V], dim=-1))
    z = p[:, C:C + H * V].reshape(N, H, V)
    beta_width = H * V if rule in ("2A", "2") else H
    beta_logits = p[:, C + H * V:C + H * V + beta_width].reshape(N, 1, H, -1).squeeze(-1) if beta_width == H else \
        p[:, C + H * V:C + H * V + beta_width].reshape(N, 1, H, V)
    lam_logits = p[:, C + H * V + beta_width:].reshape(N, 1, H)
    q, k, beta, lam = _prepared_reference(q, k, beta_logits, lam_logits, *gains, *scales, qk_norm, _QK_EPS)
    o, final = fast_weight_attention(q, k, v, beta, lam, rule=rule, pairing=pairing, read=read, step_size=step_size,
                                     ridge_scaling=ridge_scaling, initial_state=state, output_final_state=True,
                                     backend="naive")
    u = o[:, 0]  # [N, H, V]
    y = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_w.view(H, V) * F.silu(z)
    return y.reshape(N, H * V), extended[:, 1:], final


_QK_EPS = 1e-6
MIXER_STEP_CASES = [  # rule, pairing, read, step_size, ridge_scaling, qk_norm, K, V, taps, bias
    ("1A", "shifted", "after", "nlms", False, "rms", 20, 12, 4, False),
    ("1", "shifted", "after", "nlms", True, "l2", 20, 12, 2, True),
    ("2A", "same_step", "before", "direct", False, "none", 16, 20, 3, False),
    ("2", "shifted", "before", "nlms", False, "rms", 20, 12, 4, True),
    ("1", "same_step", "after", "direct", True, "rms", 64, 100, 4, False),  # two value blocks, the second partial
    ("1A", "shifted", "before", "nlms", False, "l2", 128, 128, 4, False),  # four value blocks
]


@interpret
@pytest.mark.parametrize("rule, pairing, read, step_size, ridge_scaling, qk_norm, K, V, taps, bias", MIXER_STEP_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mixer_step_matches_spec(rule, pairing, read, step_size, ridge_scaling, qk_norm, K, V, taps, bias, dtype):
    """`fast_weight_mixer_decoding_step` (the conv, QK norm, gains, rule and gated norm in one kernel) equals the
    float64 composition of the mixer's steps in y, the conv state, S and the carried key: from a carried state and,
    shifted, from a fresh row (no carried key: no write); into new tensors and, bit for bit the same, in place."""
    from hybridlm.ops.fast_weight import fast_weight_mixer_decoding_step

    H, N = 2, 3
    p, conv_w, conv_b, conv_state, state, gains, norm_w = _mixer_inputs(rule, N=N, H=H, K=K, V=V, taps=taps,
                                                                         bias=bias, dtype=dtype)
    scales = (2.0 if step_size == "nlms" else 2.0 / K, 0.7)
    options = dict(rule=rule, pairing=pairing, read=read, step_size=step_size, ridge_scaling=ridge_scaling)
    states = [state] + ([FastWeightState(S=state.S)] if pairing == "shifted" else [])
    for given in states:
        want_y, want_conv, want = _mixer_step_reference(p, conv_w, conv_b, conv_state, given, gains, norm_w, H=H, K=K,
                                                        V=V, qk_norm=qk_norm, scales=scales, norm_eps=1e-5, **options)
        device_state = FastWeightState(S=given.S.float().to(DEVICE),
                                       last_k=None if given.last_k is None else given.last_k.float().to(DEVICE))
        args = dict(conv_weight=conv_w.float().to(DEVICE), conv_bias=None if conv_b is None else conv_b.float().to(
            DEVICE), norm_weight=norm_w.float().to(DEVICE), norm_eps=1e-5,
            gates=(*(t.float().to(DEVICE) for t in gains), *scales), qk_norm=qk_norm, qk_eps=_QK_EPS, **options)
        proj = p.to(DEVICE, dtype)[:, None]
        y, conv, got = fast_weight_mixer_decoding_step(proj, conv_state=conv_state.to(DEVICE, dtype),
                                                       initial_state=device_state, **args)
        assert y.shape == (N, 1, H * V) and y.dtype == conv.dtype == dtype
        tol = TOL[dtype] if dtype != torch.float32 else 5e-5
        assert rel_err(y[:, 0].double().cpu(), want_y) < tol
        assert torch.equal(conv.double().cpu(), want_conv)  # the inputs themselves, moved along
        assert rel_err(got.S.double().cpu(), want.S) < TOL[torch.float32] * (1 if dtype == torch.float32 else 50)
        if pairing == "shifted":
            assert rel_err(got.last_k.double().cpu(), want.last_k) < tol
        else:
            assert got.last_k is None
        if given.last_k is None and pairing == "shifted":
            continue  # a fresh row's new key has nowhere to go in place
        in_place = FastWeightState(S=device_state.S.clone(), last_k=None if device_state.last_k is None
                                   else device_state.last_k.clone())
        conv_in_place = conv_state.to(DEVICE, dtype)
        y2, conv2, got2 = fast_weight_mixer_decoding_step(proj, conv_state=conv_in_place, initial_state=in_place,
                                                          state_in_place=True, **args)
        assert conv2 is conv_in_place and got2.S is in_place.S
        assert got2.last_k is (in_place.last_k if pairing == "shifted" else None)
        assert torch.equal(y2, y) and torch.equal(conv2, conv) and torch.equal(got2.S, got.S)
        if pairing == "shifted":
            assert torch.equal(got2.last_k, got.last_k)


@interpret
def test_mixer_step_refuses_what_it_cannot_take():
    """Wrong sizes, heads past the kernel's state, a shifted row in place without its carried key: clear errors."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_mixer_step_triton

    p, conv_w, _, conv_state, state, gains, norm_w = _mixer_inputs("1A", N=2, H=2, K=16, V=16, taps=4, bias=False,
                                                                   dtype=torch.float32)
    p, conv_w, conv_state, norm_w = (t.float().to(DEVICE) for t in (p, conv_w, conv_state, norm_w))
    S, last_k = state.S.float().to(DEVICE), state.last_k.float().to(DEVICE)
    args = dict(gates=(*(t.float().to(DEVICE) for t in gains), 2.0, 1.0), norm_weight=norm_w, norm_eps=1e-5, rule="1A",
                pairing="shifted", read_after=True, step_size="nlms", ridge_scaling=False, eps=1e-6, eps_gamma=1e-6,
                qk_norm="rms", qk_eps=1e-6)
    with pytest.raises(ValueError, match="the mixer's step takes"):
        fast_weight_mixer_step_triton(p[:, 1:], conv_w, None, conv_state, S, last_k, **args)
    with pytest.raises(ValueError, match="the mixer's step takes"):
        fast_weight_mixer_step_triton(p, conv_w[:, :1], None, conv_state, S, last_k, **args)
    with pytest.raises(ValueError, match="needs? its carried key|carried key of a shifted row"):
        fast_weight_mixer_step_triton(p, conv_w, None, conv_state, S, None, **args, in_place=True)
    with pytest.raises(ValueError, match="rules 1A, 1, 2A and 2"):
        fast_weight_mixer_step_triton(p, conv_w, None, conv_state, S, last_k, **{**args, "rule": "3A"})
    big = _mixer_inputs("1A", N=1, H=1, K=256, V=128, taps=4, bias=False, dtype=torch.float32)
    p, conv_w, _, conv_state, state, _, norm_w = (t.float().to(DEVICE) if isinstance(t, torch.Tensor) else t
                                                  for t in big)
    gates = (torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE), 2.0, 1.0)
    with pytest.raises(ValueError, match="K V <= 16384"):
        fast_weight_mixer_step_triton(p, conv_w, None, conv_state, state.S.float().to(DEVICE),
                                      state.last_k.float().to(DEVICE), **{**args, "gates": gates,
                                                                          "norm_weight": norm_w})


@interpret
def test_step_ops_pass_opcheck():
    """The step custom ops' schemas, fake implementations and dispatch (torch.compile traces them: a graphed
    decoder's compiled step)."""
    from hybridlm.ops.fast_weight.triton import custom_ops  # noqa: F401  registers the ops
    from hybridlm.ops.ssd.triton import custom_ops as ssd_ops  # noqa: F401

    tests = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    q = torch.randn(2, 3, 16, device=DEVICE)
    S = torch.randn(2, 3, 16, 16, device=DEVICE)
    beta, lam = torch.rand(2, 3, device=DEVICE), torch.rand(2, 3, device=DEVICE)
    plain = (None, None, 1.0, 1.0, 0, 0.0, 1.0)
    prepared = (torch.randn(3, device=DEVICE), torch.randn(3, device=DEVICE), 2.0, 16.0, 2, 1e-6 / 16, 0.25)
    for last_k, preparation in ((q.clone(), plain), (None, plain), (q.clone(), prepared)):
        torch.library.opcheck(torch.ops.hybridlm.fast_weight_step,
                              (q, q.clone(), q.clone(), beta, lam, S, last_k, "1", True, True, True, False, 1e-6,
                               1e-6, *preparation), test_utils=tests)
    for last_k, shifted in ((q.clone(), True), (None, False)):  # the in-place form: S and the carried key mutated
        torch.library.opcheck(torch.ops.hybridlm.fast_weight_step_,
                              (q, q.clone(), q.clone(), beta, lam, S.clone(), last_k, "1", shifted, True, True, False,
                               1e-6, 1e-6, *plain), test_utils=tests)
    p, conv_w, conv_b, conv_state, state, gains, norm_w = (
        t.float().to(DEVICE) if isinstance(t, torch.Tensor) else t
        for t in _mixer_inputs("1", N=2, H=2, K=16, V=16, taps=3, bias=True, dtype=torch.float32))
    biases = tuple(t.float().to(DEVICE) for t in gains)
    options = (2, "1", True, True, True, False, 1e-6, 1e-6, 2.0, 1.0, 1, 1e-6, 1.0, 1e-5)
    S0, k0 = state.S.float().to(DEVICE), state.last_k.float().to(DEVICE)
    torch.library.opcheck(torch.ops.hybridlm.fast_weight_mixer_step,
                          (p, conv_w, conv_b, conv_state, S0, k0, *biases, norm_w, *options), test_utils=tests)
    torch.library.opcheck(torch.ops.hybridlm.fast_weight_mixer_step_,
                          (p, conv_w, None, conv_state.clone(), S0.clone(), k0.clone(), *biases, norm_w, *options),
                          test_utils=tests)
    x, Bm = torch.randn(2, 4, 8, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE)
    h = torch.randn(2, 4, 8, 16, device=DEVICE)
    z = torch.randn(2, 32, device=DEVICE)
    for D, dt_bias, gate in ((torch.randn(4, device=DEVICE), None, (None, 1.0)), (None, None, (z, 0.5)),
                             (None, torch.randn(4, device=DEVICE), (None, 1.0))):
        torch.library.opcheck(torch.ops.hybridlm.ssd_step, (x, torch.rand(2, 4, device=DEVICE), -torch.rand(4,
                              device=DEVICE), Bm, Bm.clone(), D, h, dt_bias, 0.0, float("inf"), *gate),
                              test_utils=tests)
        torch.library.opcheck(torch.ops.hybridlm.ssd_step_, (x, torch.rand(2, 4, device=DEVICE), -torch.rand(4,
                              device=DEVICE), Bm, Bm.clone(), D, h.clone(), dt_bias, 0.0, float("inf"), *gate),
                              test_utils=tests)


@interpret
@pytest.mark.parametrize("rule", ["1A", "1"])
def test_fast_weight_steps_continue_a_prefill(monkeypatch, rule):
    """A prefill of 9 steps on the chunk path, then 5 decoding steps through the step kernel: the outputs and the
    final state of the whole sequence in one call."""
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    inputs = [t.float().to(DEVICE) for t in fw.make_inputs(rule, B=2, T=14, H=2, K=16, V=16)]
    want_o, want = fast_weight_attention(*inputs, rule=rule, output_final_state=True, backend="chunk")
    o, state = fast_weight_attention(*(t[:, :9] for t in inputs), rule=rule, output_final_state=True, backend="chunk")
    outputs = [o]
    for t in range(9, 14):
        o, state = _fast_weight_step([x[:, t:t + 1] for x in inputs], state, backend="triton", rule=rule)
        outputs.append(o)
    assert rel_err(torch.cat(outputs, dim=1), want_o) < 1e-4
    assert rel_err(state.S, want.S) < 1e-4
    assert len(calls) == 5


@interpret
def test_fast_weight_step_not_taken_with_gradients(monkeypatch):
    """A step that autograd records runs the scan kernels, which have a backward, and its gradients match the
    spec's."""
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    inputs = fw.make_inputs("1A", B=2, T=1, H=2, K=16, V=16, requires_grad=True)
    state = fw.random_state(2, 2, 16, 16, window=1)
    want_o, _ = _fast_weight_step(inputs, state, backend="naive", rule="1A")
    (want,) = torch.autograd.grad(want_o.sum(), inputs[0])
    q = inputs[0].detach().float().to(DEVICE).requires_grad_()
    given = FastWeightState(S=state.S.float().to(DEVICE), last_k=state.last_k.float().to(DEVICE))
    o, _ = _fast_weight_step([q] + [t.detach().float().to(DEVICE) for t in inputs[1:]], given, backend="triton",
                             rule="1A")
    (grad,) = torch.autograd.grad(o.sum(), q)
    assert calls == []
    assert rel_err(grad.double().cpu(), want) < 1e-4


def test_fast_weight_backend_choice_for_one_step():
    """"auto" takes the step kernel only for a CUDA step of a window-1 rule with no gradient to record; on the CPU
    the step loop, whatever the rule."""
    q = torch.zeros(2, 1, 3, 16)
    choose = lambda q, **kw: fast_weight_op._backend(q, q, packed=False, backend="auto", **kw)  # noqa: E731
    assert choose(q, rule="1A", window=1, inference=True) == "recurrent"
    assert step_takes(rule="1A", window=1, K=16, V=16, dtype=torch.bfloat16)
    assert not step_takes(rule="3A", window=3, K=16, V=16, dtype=torch.bfloat16)
    assert not step_takes(rule="1", window=1, K=16, V=16, dtype=torch.float64)
    if ON_GPU:
        q = q.to("cuda", torch.bfloat16)
        assert choose(q, rule="1A", window=1, inference=True) == "triton"
        assert choose(q, rule="1A", window=1, inference=False) == "recurrent"
        assert choose(q, rule="3A", window=3, inference=True) == "recurrent"
        assert fast_weight_op._backend(q, q, rule="1", window=1, packed=True, backend="auto",
                                       inference=True) == "naive"


@interpret
@pytest.mark.parametrize("groups, with_D, with_state", [(1, True, True), (2, False, True), (2, True, False)])
def test_ssd_step_matches_spec(monkeypatch, groups, with_D, with_state):
    """One SSD step equals the float64 step loop in y and the state; it ran the step kernel."""
    from hybridlm.ops.ssd.triton import step

    calls = _counting(monkeypatch, step)
    inputs = {k: v.detach() for k, v in ssd_helpers.make_inputs(3, 1, 4, 20, groups, 12).items()}
    inputs["D"] = inputs["D"] if with_D else None
    inputs["initial_state"] = inputs["initial_state"] if with_state else None
    want_y, want_h = ssd(**inputs, output_final_state=True, backend="naive")
    given = {k: None if v is None else v.float().to(DEVICE) for k, v in inputs.items()}
    y, h = ssd(**given, output_final_state=True, backend="triton")
    assert rel_err(y.double().cpu(), want_y) < TOL[torch.float32]
    assert rel_err(h.double().cpu(), want_h) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_step_in_place_writes_the_same_state_over_the_old(groups):
    """`in_place=True`: the same y and h_t bit for bit as the step into a new tensor, written over h and returned in
    it; a strided h is refused."""
    from hybridlm.ops.ssd.triton import ssd_step_triton

    inputs = {k: None if v is None else v.detach().float().to(DEVICE)
              for k, v in ssd_helpers.make_inputs(3, 1, 4, 20, groups, 12).items()}
    x, dt, B, C = (inputs[name][:, 0] for name in ("x", "dt", "B", "C"))
    A, D, h = inputs["A"], inputs["D"], inputs["initial_state"]
    want_y, want_h = ssd_step_triton(x, dt, A, B, C, D, h.clone())
    address = h.data_ptr()
    y, h_out = ssd_step_triton(x, dt, A, B, C, D, h, in_place=True)
    assert h_out is h and h.data_ptr() == address
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    with pytest.raises(ValueError, match="must be contiguous"):
        ssd_step_triton(x, dt, A, B, C, D, h.transpose(2, 3).contiguous().transpose(2, 3), in_place=True)


@interpret
@pytest.mark.parametrize("groups, dt_limit", [(1, (0.0, float("inf"))), (2, (1e-3, 0.5))])
def test_ssd_decoding_step_discretizes(monkeypatch, groups, dt_limit):
    """`ssd_decoding_step` on the raw step sizes (slices of a wider row, with values past softplus's threshold of 20
    and far below zero) and A_log: the float64 discretization (clamp(softplus(dt + dt_bias)), -exp(A_log)) then the
    spec's step, in y and the state; one launch of the step kernel."""
    from hybridlm.ops.ssd import ssd_decoding_step
    from hybridlm.ops.ssd.triton import step

    calls = _counting(monkeypatch, step)
    inputs = {k: v.detach() for k, v in ssd_helpers.make_inputs(4, 1, 4, 20, groups, 12).items()}
    g = torch.Generator().manual_seed(9)
    row = torch.randn(4, 1, 4 + 3, generator=g, dtype=torch.float64) * 3  # [dt | more] per row
    row[0, 0, :4] = torch.tensor([25.0, -30.0, 19.5, -0.2], dtype=torch.float64)
    raw = row[..., :4]
    dt_bias, A_log = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(raw + dt_bias).clamp(*dt_limit)
    want_y, want_h = ssd(inputs["x"], dt, -torch.exp(A_log), inputs["B"], inputs["C"], D=inputs["D"],
                         initial_state=inputs["initial_state"], output_final_state=True, backend="naive")
    on_device = lambda t: t.to(DEVICE, torch.float32)  # noqa: E731
    row_d = on_device(row)  # sliced on the device: the slice read in place
    y, h = ssd_decoding_step(on_device(inputs["x"]), row_d[..., :4], on_device(A_log), on_device(inputs["B"]),
                             on_device(inputs["C"]), dt_bias=on_device(dt_bias), dt_limit=dt_limit,
                             D=on_device(inputs["D"]), initial_state=on_device(inputs["initial_state"]))
    assert rel_err(y.double().cpu(), want_y) < TOL[torch.float32]
    assert rel_err(h.double().cpu(), want_h) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m_z", [1.0, 0.35])
def test_ssd_decoding_step_takes_the_plain_gate(dtype, m_z):
    """`ssd_decoding_step(gate=(z, m_z))`: y gated in the kernel as the mixer's plain gate gives it, `silu_gate(y,
    m_z z)` on the step's y (z a row slice of a wider projection, read in place); the state unchanged by the gate."""
    from hybridlm.modules.gate import silu_gate
    from hybridlm.ops.ssd import ssd_decoding_step

    b, H, P, G, N = 3, 4, 16, 2, 16
    g = torch.Generator().manual_seed(14)
    x = torch.randn(b, 1, H, P, generator=g).to(DEVICE, dtype)
    Bm, Cm = (torch.randn(b, 1, G, N, generator=g).to(DEVICE, dtype) for _ in range(2))
    dt = torch.randn(b, 1, H, generator=g).to(DEVICE, dtype)
    A_log, D, dt_bias = (torch.randn(H, generator=g).to(DEVICE) for _ in range(3))
    h = torch.randn(b, H, P, N, generator=g).to(DEVICE)
    row = torch.randn(b, 1, H * P + 7, generator=g).to(DEVICE, dtype)
    z = row[..., 3:3 + H * P]  # [b, 1, H P], rows H P + 7 apart
    step = dict(dt_bias=dt_bias, dt_limit=(1e-3, 2.0), D=D, initial_state=h)
    y, state = ssd_decoding_step(x, dt, A_log, Bm, Cm, **step)
    gated, gated_state = ssd_decoding_step(x, dt, A_log, Bm, Cm, **step, gate=(z, m_z))
    want = silu_gate(y.reshape(b, 1, H * P), z * m_z if m_z != 1.0 else z)
    assert gated.dtype == dtype and torch.equal(gated_state, state)
    assert rel_err(gated.reshape(b, 1, H * P).double().cpu(), want.double().cpu()) < (1e-6 if dtype == torch.float32
                                                                                      else 1e-3)
    with pytest.raises(ValueError, match="the gate z must be"):
        ssd_decoding_step(x, dt, A_log, Bm, Cm, **step, gate=(z[..., 1:], m_z))


@interpret
def test_ssd_decoding_step_reads_16_bit_parameters_without_a_cast(monkeypatch):
    """A_log, D and dt_bias of a 16-bit model reach the kernel in their dtype (no cast kernel per step) and the step
    equals the one on their float32 copies bit for bit: the kernel reads them as float32."""
    from hybridlm.ops.ssd import ssd_decoding_step
    from hybridlm.ops.ssd.triton import step

    b, H, P, G, N = 2, 4, 16, 2, 16
    g = torch.Generator().manual_seed(13)
    x = torch.randn(b, 1, H, P, generator=g).to(DEVICE, torch.float16)
    Bm, Cm = (torch.randn(b, 1, G, N, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    dt = torch.randn(b, 1, H, generator=g).to(DEVICE, torch.float16)
    params = [torch.randn(H, generator=g).to(DEVICE, torch.float16) for _ in range(3)]  # A_log, D, dt_bias
    h = torch.randn(b, H, P, N, generator=g).to(DEVICE)
    seen = _arguments_seen(monkeypatch, step)
    outs = [ssd_decoding_step(x, dt, A_log, Bm, Cm, dt_bias=dt_bias, dt_limit=(1e-3, 2.0), D=D, initial_state=h)
            for A_log, D, dt_bias in (params, [p.float() for p in params])]
    assert [(args[2].dtype, args[5].dtype, kwargs["dt_bias"].dtype) for args, kwargs in seen] == \
        [(torch.float16,) * 3, (torch.float32,) * 3]
    (y16, h16), (y32, h32) = outs
    torch.testing.assert_close(y16, y32, rtol=0, atol=0)
    torch.testing.assert_close(h16, h32, rtol=0, atol=0)
    # the step on a softplus-ed dt and A itself (no discretization in the kernel), each in 16 bits
    from hybridlm.ops.ssd.triton import ssd_step_triton

    dt_on = torch.nn.functional.softplus(dt[:, 0].float()).half()
    A, D = -torch.exp(params[0].float()).half(), params[1]
    seen.clear()
    outs = [ssd_step_triton(x[:, 0], dt_i, A_i, Bm[:, 0], Cm[:, 0], D_i, h)
            for dt_i, A_i, D_i in ((dt_on, A, D), (dt_on.float(), A.float(), D.float()))]
    assert [(args[1].dtype, args[2].dtype, args[5].dtype) for args, _ in seen] == \
        [(torch.float16,) * 3, (torch.float32,) * 3]
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)


@interpret
def test_ssd_decoding_step_softplus_matches_torch():
    """The kernel's softplus (threshold 20, log1p through log(1 + z) z / ((1 + z) - 1)) against torch's in float32,
    over -40..40, at one row per value: y = dt x with B = C = 1, A_log = -inf-ish (no decay), zero state."""
    from hybridlm.ops.ssd import ssd_decoding_step

    raw = torch.linspace(-40, 40, 801, dtype=torch.float32)
    n = raw.numel()
    x = torch.ones(n, 1, 1, 16, device=DEVICE)
    ones = torch.ones(n, 1, 1, 16, device=DEVICE)
    y, _ = ssd_decoding_step(x, raw.reshape(n, 1, 1).to(DEVICE), torch.full((1,), -30.0, device=DEVICE), ones, ones,
                             dt_bias=torch.zeros(1, device=DEVICE))
    got = y[:, 0, 0, 0].cpu() / 16  # y = dt x |B|^2 with x = 1, |B|^2 = 16 (and D = None)
    want = torch.nn.functional.softplus(raw.double())
    assert ((got.double() - want).abs() / want).max() < 1e-5  # each value, the smallest (e^-40) included


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ssd_step_16_bit(monkeypatch, dtype):
    from hybridlm.ops.ssd.triton import step

    skip_bfloat16_interpreted(dtype)
    calls = _counting(monkeypatch, step)
    inputs = {k: v.detach() for k, v in ssd_helpers.make_inputs(2, 1, 4, 64, 2, 128).items()}
    for name in ("x", "B", "C"):
        inputs[name] = inputs[name].to(dtype)
    want_y, want_h = ssd(**{k: v.double() for k, v in inputs.items()}, output_final_state=True, backend="naive")
    given = {k: v.to(DEVICE) if v.dtype == dtype else v.float().to(DEVICE) for k, v in inputs.items()}
    y, h = ssd(**given, output_final_state=True, backend="triton")
    assert y.dtype == dtype
    assert rel_err(y.double().cpu(), want_y) < TOL[dtype]
    assert rel_err(h.double().cpu(), want_h) < TOL[torch.float32]
    assert len(calls) == 1


@interpret
def test_ssd_steps_continue_a_prefill(monkeypatch):
    """A prefill of 10 steps on the chunk path, then 4 steps through the step kernel: the whole sequence's outputs
    and final state."""
    from hybridlm.ops.ssd.triton import step

    calls = _counting(monkeypatch, step)
    inputs = {k: v.detach().float().to(DEVICE) for k, v in ssd_helpers.make_inputs(2, 14, 4, 16, 2, 16).items()}
    want_y, want_h = ssd(**inputs, output_final_state=True, backend="chunk")
    y, h = ssd(**ssd_helpers.time_slice(inputs, 0, 10), output_final_state=True, backend="chunk")
    outputs = [y]
    for t in range(10, 14):
        step = dict(ssd_helpers.time_slice(inputs, t, t + 1), initial_state=h)
        y, h = ssd(**step, output_final_state=True, backend="triton")
        outputs.append(y)
    assert rel_err(torch.cat(outputs, dim=1), want_y) < 1e-4
    assert rel_err(h, want_h) < 1e-4
    assert len(calls) == 4


@interpret
def test_ssd_step_not_taken_with_gradients(monkeypatch):
    from hybridlm.ops.ssd.triton import step

    calls = _counting(monkeypatch, step)
    inputs = {k: v.detach().float().to(DEVICE).requires_grad_() for k, v in
              ssd_helpers.make_inputs(2, 1, 2, 16, 1, 16).items()}
    y, h = ssd(**inputs, output_final_state=True, backend="triton")
    (y.sum() + h.sum()).backward()
    assert calls == []
    assert inputs["x"].grad is not None


def test_ssd_backend_choice_for_one_step():
    """"auto" on one step: the naive step on the CPU; on a GPU the step kernel unless autograd records the call or
    documents are marked per step."""
    x = torch.zeros(2, 1, 4, 16)
    B = torch.zeros(2, 1, 1, 16)
    assert ssd_backend(x, B, B, seq_idx=None, backend="auto", inference=True) == "naive"
    assert ssd_backend(x, B, B, seq_idx=None, backend="chunk", inference=True) == "chunk"
    if ON_GPU:
        x, B = x.to("cuda", torch.bfloat16), B.to("cuda", torch.bfloat16)
        assert ssd_backend(x, B, B, seq_idx=None, backend="auto", inference=True) == "triton"
        assert ssd_backend(x, B, B, seq_idx=None, backend="auto", inference=False) == "naive"


@pytest.mark.skipif(INTERPRET or ON_GPU, reason="checks the refusal on CPU tensors without the interpreter")
def test_step_kernels_refuse_cpu_tensors():
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_step_triton
    from hybridlm.ops.ssd.triton.custom_ops import ssd_step_triton

    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        fast_weight_step_triton(q, q, q, torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 16, 16), None,
                                rule="1A", pairing="shifted", read_after=True, step_size="nlms", ridge_scaling=False,
                                eps=1e-6, eps_gamma=1e-6)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        ssd_step_triton(q, torch.ones(1, 2), -torch.ones(2), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), None,
                        torch.zeros(1, 2, 16, 8))


MIXER_OPTIONS = {
    "fast_weight 1A": dict(fw_rule="1A"),
    "fast_weight 2A": dict(fw_rule="2A"),
    "fast_weight 1 l2": dict(fw_rule="1", fw_qk_norm="l2"),
    "fast_weight 2 none": dict(fw_rule="2", fw_qk_norm="none"),
    "fast_weight 1 options": dict(fw_rule="1", fw_pairing="same_step", fw_read="before", fw_step_size="direct",
                                  fw_ridge_scaling=True, fw_lam_scale=0.3),
    "fast_weight 1A options": dict(fw_rule="1A", fw_read="before", fw_step_size="direct", fw_lam_scale=2.0),
    "mamba2": dict(),
    "mamba2 limits": dict(time_step_limit=(0.2, 0.6), mamba_n_groups=2),
    "mamba2 multipliers": dict(ssm_multiplier_z=0.5, ssm_multiplier_x=0.7, ssm_multiplier_dt=0.6),
    "mamba2 norm": dict(mamba_rms_norm=True, mamba_n_groups=2),
}


MIXER_FORMS = [(mixer, form) for mixer in MIXER_OPTIONS
               for form in (["whole step", "apart"] if mixer.startswith("fast_weight") else ["apart"])]


@interpret
@pytest.mark.parametrize("mixer, form", MIXER_FORMS, ids=[" ".join(f) for f in MIXER_FORMS])
def test_mixer_decoding_steps_through_the_kernels(monkeypatch, mixer, form):
    """A mixer's prefill, then 4 one-token steps from two copies of its cache: on the step kernels and on the torch
    loops, the same outputs and states. The fast-weight mixer runs its steps 2-5 as one kernel
    (`fast_weight_mixer_decoding_step`, "whole step"), or, with its norm on the torch form, the op's step kernel (which
    takes the QK norm and gains) beside the conv's ("apart"), as the Mamba-2 mixer does (its discretization in the
    SSD's step kernel); each kernel one launch per step."""
    from hybridlm.layers.cache import LayerCache
    from hybridlm.ops.fast_weight.triton import mixer_step
    from hybridlm.ops.fast_weight.triton import step as fast_weight_step
    from hybridlm.ops.ssd.triton import step as ssd_step
    from tests.ops.test_mixer_recompute import D, fast_weight_mixer, mamba2_mixer

    is_mamba2 = mixer.startswith("mamba2")
    launches = {}
    for name, module_step in (("step", ssd_step if is_mamba2 else fast_weight_step), ("whole", mixer_step)):
        launches[name], launch = [], module_step.forward
        monkeypatch.setattr(module_step, "forward", lambda *a, calls=launches[name], launch=launch, **k: calls.append(
            all(t.is_contiguous() for t in a if isinstance(t, torch.Tensor))) or launch(*a, **k))
    from hybridlm.modules import short_conv

    conv_calls = []
    conv_step = short_conv.short_conv_step_triton
    monkeypatch.setattr(short_conv, "short_conv_step_triton",
                        lambda *a, **k: conv_calls.append(1) or conv_step(*a, **k))

    from hybridlm.layers import fast_weight as fast_weight_layer
    from hybridlm.layers import mamba2 as mamba2_layer

    fused_calls = []
    layer, name = (mamba2_layer, "ssd_decoding_step") if is_mamba2 else (fast_weight_layer,
                                                                         "fast_weight_decoding_step")
    fused = getattr(layer, name)
    monkeypatch.setattr(layer, name, lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    module = (mamba2_mixer if is_mamba2 else fast_weight_mixer)(**MIXER_OPTIONS[mixer])
    if form == "apart" and not is_mamba2:
        module.norm.backend = "torch"
    loops = "naive" if is_mamba2 else "recurrent"
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 13, D, generator=g).to(DEVICE)
    with torch.no_grad():
        cache = LayerCache()
        module(x[:, :9], cache=cache)
        caches = {"triton": cache, loops: cache.copy()}
        for t in range(9, 13):
            outputs = {}
            for backend, layer_cache in caches.items():
                module.backend = backend
                module.conv.backend = "triton" if backend == "triton" else "torch"
                outputs[backend] = module(x[:, t:t + 1], cache=layer_cache)
            assert rel_err(outputs["triton"], outputs[loops]) < 1e-4
    for name, state in caches["triton"].ssm.items():
        assert rel_err(state, caches[loops].ssm[name]) < 1e-4, name
    if form == "whole step":
        assert len(launches["whole"]) == 4 and launches["step"] == []
    else:
        assert launches["whole"] == [] and len(launches["step"]) == 4
        assert not any(launches["step"])  # the projection's row slices read in place (two rows), not copied
    # apart, the mixers hand the op's kernel their QK norm and gains (`fast_weight_decoding_step`) or discretization
    # (`ssd_decoding_step`), beside the conv's kernel
    assert len(conv_calls) == len(fused_calls) == (0 if form == "whole step" else 4)


@interpret
@pytest.mark.parametrize("mixer", ["fast_weight 1A", "fast_weight 1 options", "mamba2 limits"])
def test_mixer_steps_write_a_fixed_address_cache_in_place(mixer):
    """In a cache that takes its states in place (`states_in_place`, a graphed decoder's), the step kernels write the
    new conv tail and SSM state over the tensors the step read, bit for bit what they return as new tensors in a
    dynamic cache; the cache keeps the same tensors step after step."""
    from hybridlm.layers.cache import LayerCache
    from tests.ops.test_mixer_recompute import D, fast_weight_mixer, mamba2_mixer

    module = (mamba2_mixer if mixer.startswith("mamba2") else fast_weight_mixer)(**MIXER_OPTIONS[mixer])
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        dynamic = LayerCache()
        module.conv.backend = "torch"  # a prefill with a state out: the torch form
        module(x[:, :6], cache=dynamic)
        module.backend = module.conv.backend = "triton"
        fixed = dynamic.copy()
        fixed.states_in_place = True
        tensors = dict(fixed.ssm)
        assert tensors and all(t is not dynamic.ssm[name] for name, t in tensors.items())
        for t in range(6, 9):
            before = dict(dynamic.ssm)
            want = module(x[:, t:t + 1], cache=dynamic)
            assert all(dynamic.ssm[name] is not before[name] for name in before)  # a dynamic cache gets new tensors
            assert torch.equal(module(x[:, t:t + 1], cache=fixed), want)
            assert fixed.ssm.keys() == tensors.keys()
            for name, state in fixed.ssm.items():
                assert state is tensors[name] and torch.equal(state, dynamic.ssm[name]), name


@interpret
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-1"])
def test_compiled_static_step_on_the_kernels_writes_the_states_in_place(mixer):
    """The static decoder's step compiled (aot_eager: the custom ops that write the states over their buffers go
    through dynamo's functionalization) with the SSM mixers on their step kernels: each step's logits, and the states
    after them, equal the eager static step's."""
    from hybridlm.inference import GraphedDecoder
    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from tests.inference.helpers import MIXERS, ids, make_model

    torch._dynamo.reset()
    model = make_model(seed=12, **MIXERS[mixer]).to(DEVICE).eval()
    prompt = ids(2, 6, seed=12).to(DEVICE)
    with torch.no_grad():
        caches = [model.new_cache(), model.new_cache()]
        for cache in caches:
            model(prompt, cache=cache)
        for module in model.modules():  # the convs as "auto" takes them under torch.compile: the torch form
            if isinstance(module, (FastWeightMixer, Mamba2Mixer)):
                module.backend = "triton"
        plain, compiled = (GraphedDecoder(model, cache, capacity=10, batch_size=2, use_graph=False,
                                          compile_step=backend) for cache, backend in zip(caches, (None, "aot_eager")))
        token = prompt[:, -1]
        for _ in range(3):  # a mutation lost in the trace would show from the second step on
            expected = plain.step(token).clone()
            assert (compiled.step(token) - expected).abs().max() < 1e-5
            token = expected.argmax(-1)
        for a, b in zip(plain.cache.layers, compiled.cache.layers):
            for name in a.ssm:
                assert (a.ssm[name] - b.ssm[name]).abs().max() < 1e-5, name


@interpret
@pytest.mark.parametrize("mixer", ["mamba2 multipliers", "mamba2 norm"])
def test_mamba2_step_gates_in_its_kernel_without_a_norm(monkeypatch, mixer):
    """A Mamba-2 decoding step on its kernel takes the plain output gate along (no gate call of its own after it);
    with the grouped norm the gate stays with the norm."""
    from hybridlm.layers import mamba2 as mamba2_layer
    from hybridlm.layers.cache import LayerCache
    from tests.ops.test_mixer_recompute import D, mamba2_mixer

    calls = []
    gate = mamba2_layer.gated_output_projection
    monkeypatch.setattr(mamba2_layer, "gated_output_projection", lambda *a, **k: calls.append(1) or gate(*a, **k))
    module = mamba2_mixer(**MIXER_OPTIONS[mixer])
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with torch.no_grad():
        cache = LayerCache()
        module.conv.backend = "torch"
        module(x[:, :5], cache=cache)
        calls.clear()
        module.conv.backend = "triton"
        module(x[:, 5:], cache=cache)
    assert len(calls) == (0 if module.norm is None else 1)


@interpret
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-1"])
def test_static_step_kernels_write_the_states_into_their_buffers(mixer):
    """With the SSM mixers on their step kernels (CUDA's choice; the interpreter here), the static step leaves every
    state in the very buffer it read (so a replayed graph holds no copy of the new states), with the dynamic cache's
    logits."""
    from hybridlm.inference import GraphedDecoder
    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from hybridlm.modules import ShortConvolution
    from tests.inference.helpers import MIXERS, ids, make_model

    model = make_model(seed=10, **MIXERS[mixer]).to(DEVICE).eval()
    tokens = ids(2, 7, seed=10).to(DEVICE)
    with torch.no_grad():
        dynamic = model.new_cache()
        model(tokens[:, :5], cache=dynamic)  # the prefill on the torch forms, as "auto" on the CPU
        decoder = GraphedDecoder(model, dynamic.copy(), capacity=8, batch_size=2, use_graph=False)
        stepping = [m for m in model.modules() if isinstance(m, (FastWeightMixer, Mamba2Mixer, ShortConvolution))]
        for module in stepping:
            module.backend = "triton"
        for t in (5, 6):
            want = model(tokens[:, t:t + 1], cache=dynamic, logits_to_keep=1).logits[:, -1]
            decoder.token.copy_(tokens[:, t:t + 1])
            got = decoder._step()  # the model's step alone, before the decoder copies anything back
            assert (got - want).abs().max() < 1e-4
            for layer, buffers in zip(decoder.cache.layers, decoder.buffers):
                assert buffers and all(layer.ssm[name] is buffer for name, buffer in buffers.items())
            decoder.cache.seq_len += 1  # what `step` counts on the host after the replay
            for layer in decoder.cache.layers:
                layer.length += 1


@interpret
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A"])
def test_serving_slots_take_the_step_kernels_states_without_a_copy(mixer):
    """The serving engine's slots hand the mixers views of their rows; the step kernels write the new states into
    them, and `commit` copies nothing back (a state a mixer returns as a new tensor is still copied in): the rows
    hold what each sequence's dynamic cache holds after the same step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from hybridlm.modules import ShortConvolution
    from hybridlm.serving.slots import SlotCache
    from tests.inference.helpers import MIXERS, ids, make_model

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket.__name__ == "copy_"
            return func(*args, **(kwargs or {}))

    model = make_model(seed=11, **MIXERS[mixer]).to(DEVICE).eval()
    prompts = [ids(1, n, seed=n).to(DEVICE) for n in (4, 6)]
    with torch.no_grad():
        caches = [model.new_cache() for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            model(prompt, cache=cache)
        slots = SlotCache(len(model.model.layers), max_rows=3, capacity=16, device=torch.device(DEVICE))
        for cache in caches:
            slots.install(cache)
        for module in model.modules():
            if isinstance(module, (FastWeightMixer, Mamba2Mixer, ShortConvolution)):
                module.backend = "triton"
        tokens = ids(2, 1, seed=12).to(DEVICE)
        slots.begin()
        model(tokens, cache=slots)
        with Copies():
            slots.commit()
        assert Copies.count == 0
        for row, cache in enumerate(caches):
            model(tokens[row:row + 1], cache=cache)
            for layer, source in zip(slots.layers, cache.layers):
                for name, state in source.ssm.items():
                    assert rel_err(layer._states[name][row], state[0]) < 1e-5, name  # rows batched: rounding
        layer = slots.layers[0]
        name = next(iter(layer._states))
        slots.begin()
        layer.ssm[name] = layer.ssm[name] + 1  # a state returned as a new tensor
        with Copies():
            slots.commit()
        assert Copies.count == 1 and torch.equal(layer._states[name][:2], layer.ssm[name])


@interpret
@pytest.mark.parametrize("mixer", ["fast_weight", "mamba2"])
def test_mixer_steps_not_fused_where_a_gradient_or_fixed_gates_need_the_op(monkeypatch, mixer):
    """No fused step (`fast_weight_mixer_decoding_step` or `fast_weight_decoding_step` / `ssd_decoding_step`) where
    autograd records the step (through the parameters, or through a carried state that requires a gradient while the
    mixer is frozen) nor with fixed gates; the gradient through the state then equals the torch loops'."""
    from hybridlm.layers import fast_weight as fast_weight_layer
    from hybridlm.layers import mamba2 as mamba2_layer
    from hybridlm.layers.cache import LayerCache
    from tests.ops.test_mixer_recompute import D, fast_weight_mixer, mamba2_mixer

    layer, names = (mamba2_layer, ["ssd_decoding_step"]) if mixer == "mamba2" else (
        fast_weight_layer, ["fast_weight_decoding_step", "fast_weight_mixer_decoding_step"])
    fused_calls = []
    for name in names:
        fused = getattr(layer, name)
        monkeypatch.setattr(layer, name, lambda *a, fused=fused, **k: fused_calls.append(1) or fused(*a, **k))
    make = mamba2_mixer if mixer == "mamba2" else fast_weight_mixer
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def step(module, backend, *, state_grad):
        """One cached step after a prefill of 5 -> (its output, the carried state it started from)."""
        module.backend = backend
        cache = LayerCache()
        with torch.no_grad():
            module(x[:, :5], cache=cache)
        state_name = "ssm" if mixer == "mamba2" else "S"
        state = cache.ssm[state_name].clone().requires_grad_(state_grad)
        cache.ssm[state_name] = state
        return module(x[:, 5:], cache=cache), state

    module = make()
    step(module, "triton", state_grad=False)  # trainable parameters, grad mode on
    assert fused_calls == []
    module.requires_grad_(False)
    grads = {}
    for backend in ("triton", "naive" if mixer == "mamba2" else "recurrent"):
        out, state = step(module, backend, state_grad=True)
        (grads[backend],) = torch.autograd.grad(out.square().sum(), [state])
    assert rel_err(*grads.values()) < 1e-4
    assert fused_calls == []
    with torch.no_grad():
        step(module, "triton", state_grad=False)
    assert len(fused_calls) == 1  # frozen and nothing requiring a gradient: fused
    if mixer == "fast_weight":
        fixed = fast_weight_mixer(fw_gates="fixed", fw_step_size="direct")
        with torch.no_grad():
            step(fixed, "triton", state_grad=False)
        assert len(fused_calls) == 1  # fixed gates have no logits: the op's step


@interpret
def test_steps_of_no_rows():
    """A step of zero rows returns empty outputs and states (the kernels read rows at their strides)."""
    q = torch.zeros(0, 1, 2, 16, device=DEVICE)
    beta = torch.zeros(0, 1, 2, device=DEVICE)
    o, state = fast_weight_attention(q, q, q, beta, beta, rule="1A", output_final_state=True, backend="triton")
    assert o.shape == (0, 1, 2, 16) and state.S.shape == (0, 2, 16, 16)
    y, h = ssd(q, beta, -torch.ones(2, device=DEVICE), q[:, :, :1], q[:, :, :1], output_final_state=True,
               backend="triton")
    assert y.shape == (0, 1, 2, 16) and h.shape == (0, 2, 16, 16)


@interpret
def test_ssd_decoding_step_keeps_a_nan_step_size():
    """A NaN raw step size gives a NaN output, as torch's softplus and clamp give (not a clamped finite value)."""
    from hybridlm.ops.ssd import ssd_decoding_step

    x = torch.ones(1, 1, 2, 16, device=DEVICE)
    dt = torch.tensor([[[float("nan"), 0.5]]], device=DEVICE)
    y, _ = ssd_decoding_step(x, dt, torch.zeros(2, device=DEVICE), x[:, :, :1], x[:, :, :1],
                             dt_bias=torch.zeros(2, device=DEVICE), dt_limit=(1e-3, 0.1))
    assert y[0, 0, 0].isnan().all() and y[0, 0, 1].isfinite().all()


@interpret
@pytest.mark.parametrize("rule", ["1A", "1"])
def test_a_nan_ridge_stays_nan_in_the_kernels(monkeypatch, rule):
    """A NaN lam with a direct step (eta = beta: the ridge is lam's only way in) comes out NaN from the chunk
    kernels' write preparation and from the step kernel, in its head only, as from the torch paths: the decay's
    clamp propagates NaN (NVIDIA's min would return the other operand), so an unchecked lam (`check_lam=False`)
    never turns into a finite decay."""
    q, k, v, beta, lam = (t.float().to(DEVICE) for t in fw.make_inputs(rule, B=1, T=20, H=3, K=16, V=16))
    lam[0, 5, 1] = float("nan")
    options = dict(rule=rule, step_size="direct", check_lam=False)
    o, _ = fast_weight_attention(q, k, v, beta, lam, **options, backend="triton")
    assert o[0, 5:, 1].isnan().any() and not o[0, :, [0, 2]].isnan().any()
    _, clean = fast_weight_attention(q[:, :5], k[:, :5], v[:, :5], beta[:, :5], lam[:, :5], **options,
                                     output_final_state=True, backend="triton")  # the state before the NaN
    from hybridlm.ops.fast_weight.triton import step

    calls = _counting(monkeypatch, step)
    with torch.no_grad():
        o_step, _ = fast_weight_attention(*(t[:, 5:6] for t in (q, k, v, beta, lam)), **options,
                                          initial_state=clean, backend="auto" if ON_GPU else "triton")
    assert len(calls) == 1  # the step kernel
    assert o_step[0, 0, 1].isnan().all() and not o_step[0, 0, [0, 2]].isnan().any()
