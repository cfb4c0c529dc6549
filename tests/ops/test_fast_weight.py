"""The fast-weight op: chunk vs the naive spec, identities of the rule table, state carry-over, varlen."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops import FastWeightState, fast_weight_attention
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import RULES, SLIDING, make_inputs, random_state


def run(inputs, backend, **kwargs):
    return fast_weight_attention(*inputs, backend=backend, output_final_state=True, **kwargs)


def state_tensors(state):
    return [t for t in (state.S, state.last_k, state.tail_x, state.tail_v) if t is not None]


def assert_states_equal(a, b, tol):
    assert (a.last_k is None) == (b.last_k is None)
    assert (a.tail_x is None) == (b.tail_x is None)
    for x, y in zip(state_tensors(a), state_tensors(b)):
        assert rel_err(x, y) < tol
    if a.tail_len is not None:
        assert torch.equal(a.tail_len.cpu(), b.tail_len.cpu())


def grads_of(inputs, o, state, extra=()):
    """Gradients of a fixed random projection of (o, S) w.r.t. the inputs (and `extra` leaves)."""
    g = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    loss = loss + (state.S * torch.randn(state.S.shape, generator=g, dtype=state.S.dtype)).sum()
    leaves = [t for t in list(inputs) + list(extra) if t.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # T = 1 shifted: k is never written
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def check_backends_agree(rule, *, window=1, chunk_size=16, tol=1e-10, dtype=torch.float64, with_state=False,
                         grads=True, backend="chunk", **shape_and_options):
    shape = {key: shape_and_options.pop(key) for key in ("B", "T", "H", "K", "V") if key in shape_and_options}
    inputs = make_inputs(rule, dtype=dtype, requires_grad=grads, **shape)
    B, T, H, K = inputs[0].shape
    V = inputs[2].shape[-1]
    options = dict(rule=rule, window=window, **shape_and_options)
    state = random_state(B, H, K, V, window=window, dtype=dtype, requires_grad=grads) if with_state else None
    o_ref, s_ref = run(inputs, "naive", initial_state=state, **options)
    o, s = run(inputs, backend, initial_state=state, chunk_size=chunk_size, **options)
    assert o.dtype == dtype and s.S.dtype == dtype
    assert rel_err(o, o_ref) < tol
    assert_states_equal(s, s_ref, tol)
    if grads:
        extra = (state.S,) if with_state else ()
        for g, g_ref in zip(grads_of(inputs, o, s, extra), grads_of(inputs, o_ref, s_ref, extra)):
            assert rel_err(g, g_ref) < tol


# Every option combination of every rule, float64, outputs + final states + all gradients.
OPTION_GRID = list(itertools.product(RULES, ("shifted", "same_step"), ("after", "before"), ("nlms", "direct"),
                                     (False, True)))


@pytest.mark.parametrize("rule,pairing,read,step_size,ridge_scaling", OPTION_GRID,
                         ids=[f"rule{r}-{p}-{rd}-{s}-ridgescale{int(rs)}" for r, p, rd, s, rs in OPTION_GRID])
def test_chunk_matches_naive_float64(rule, pairing, read, step_size, ridge_scaling):
    check_backends_agree(rule, window=3 if rule in SLIDING else 1, pairing=pairing, read=read, step_size=step_size,
                     ridge_scaling=ridge_scaling, T=37, with_state=True)


@pytest.mark.parametrize("rule,pairing,read,step_size,ridge_scaling", OPTION_GRID,
                         ids=[f"rule{r}-{p}-{rd}-{s}-ridgescale{int(rs)}" for r, p, rd, s, rs in OPTION_GRID])
def test_recurrent_matches_naive_float64(rule, pairing, read, step_size, ridge_scaling):
    # 4 rows whose carried tails hold 0, 1 or 2 pairs (random_state draws tail_len per row): the rows' windows
    # differ in size B_t at every step while they run together; T = 1 is the decoding step, T = 5 fills windows.
    for T, with_state in ((1, True), (5, True), (5, False)):
        check_backends_agree(rule, window=3 if rule in SLIDING else 1, pairing=pairing, read=read, step_size=step_size,
                             ridge_scaling=ridge_scaling, B=4, T=T, with_state=with_state, backend="recurrent")


def test_recurrent_refuses_packed_sequences_and_auto_decodes_with_it(monkeypatch):
    inputs = make_inputs("3A", B=1, T=6)
    with pytest.raises(ValueError, match="recurrent backend does not take packed sequences"):
        run(inputs, "recurrent", rule="3A", window=3, cu_seqlens=torch.tensor([0, 2, 6]))
    import hybridlm.ops.fast_weight.op as op

    calls = []
    monkeypatch.setattr(op, "fast_weight_recurrent", lambda *a, **kw: calls.append(1) or op.fast_weight_naive(*a, **kw))
    step = [t[:, :1] for t in make_inputs("1A", B=3, T=1)]
    run(step, "auto", rule="1A")
    assert calls == [1]  # a decoding step of a batch takes the vectorized loop
    run([t[:, :1] for t in inputs], "auto", rule="3A", window=3, cu_seqlens=torch.tensor([0, 1]))
    assert calls == [1]  # packed sequences keep the per-sequence spec


SIZE_GRID = [(rule, T, chunk, window)
             for rule in RULES for T in (1, 63, 130) for chunk in (16, 64)
             for window in ((1, 3, 8) if rule in SLIDING else (1,))]


@pytest.mark.parametrize("rule,T,chunk_size,window", SIZE_GRID,
                         ids=[f"rule{r}-T{t}-C{c}-W{w}" for r, t, c, w in SIZE_GRID])
def test_chunk_matches_naive_odd_sizes(rule, T, chunk_size, window):
    check_backends_agree(rule, window=window, chunk_size=chunk_size, T=T, K=6, V=5, grads=T <= 63)


@pytest.mark.parametrize("rule", RULES)
def test_chunk_matches_naive_float32(rule):
    check_backends_agree(rule, window=3 if rule in SLIDING else 1, dtype=torch.float32, tol=1e-4, T=130, with_state=True)


@pytest.mark.parametrize("rule", RULES)
def test_bf16_inputs_keep_fp32_state(rule):
    window = 3 if rule in SLIDING else 1
    inputs = make_inputs(rule, T=70, dtype=torch.float32)
    o32, s32 = run(inputs, "chunk", rule=rule, window=window)
    o16, s16 = run([t.bfloat16() for t in inputs], "chunk", rule=rule, window=window)
    assert o16.dtype == torch.bfloat16 and s16.S.dtype == torch.float32
    assert rel_err(o16.float(), o32) < 2e-2
    assert rel_err(s16.S, s32.S) < 2e-2


# ---- identities of the rule table -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("sliding,single", [("3", "1"), ("3A", "1A")])
def test_window_one_equals_single_pair_rule(backend, sliding, single):
    inputs = make_inputs(single, T=40)
    o_w, s_w = run(inputs, backend, rule=sliding, window=1, ridge_scaling=True)
    o_1, s_1 = run(inputs, backend, rule=single, ridge_scaling=True)
    assert rel_err(o_w, o_1) < 1e-12 and rel_err(s_w.S, s_1.S) < 1e-12


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("per_column,scalar", [("2", "1"), ("2A", "1A")])
def test_equal_column_gains_equal_scalar_rule(backend, per_column, scalar):
    q, k, v, beta, lam = make_inputs(scalar, T=40)
    column_beta = beta[..., None].expand(*beta.shape, v.shape[-1]).contiguous()
    o_2, s_2 = run((q, k, v, column_beta, lam), backend, rule=per_column)
    o_1, s_1 = run((q, k, v, beta, lam), backend, rule=scalar)
    assert rel_err(o_2, o_1) < 1e-12 and rel_err(s_2.S, s_1.S) < 1e-12


def delta_rule_reference(q, k, v, beta):
    """The classic delta rule (DeltaNet): S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = S_t^T q_t."""
    B, T, H, K = k.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=k.dtype)
    outputs = []
    for t in range(T):
        residual = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * residual[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_same_step_rule1_without_ridge_is_the_delta_rule(backend):
    q, k, v, beta, _ = make_inputs("1", T=50)
    k = k / k.norm(dim=-1, keepdim=True)  # DeltaNet's L2-normalized keys: beta in (0, 2) is its usual range
    o, _ = run((q, k, v, beta, None), backend, rule="1", pairing="same_step", step_size="direct")
    assert rel_err(o, delta_rule_reference(q, k, v, beta)) < 1e-12
    # With NLMS steps the same rule is the delta rule with beta / (|k|^2 + eps).
    o, _ = run((q, k, v, beta, None), backend, rule="1", pairing="same_step", eps=1e-3)
    eta = beta / (k.pow(2).sum(-1) + 1e-3)
    assert rel_err(o, delta_rule_reference(q, k, v, eta)) < 1e-12


def test_shifted_pairing_is_same_step_on_shifted_keys():
    """Shifted = same-step with the keys moved one step later and the first step not written."""
    q, k, v, beta, lam = make_inputs("1", T=30)
    o_shift, _ = run((q, k, v, beta, lam), "chunk", rule="1")
    k_shifted = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
    beta_masked = beta.clone()
    beta_masked[:, 0] = 0.0
    o_same, _ = run((q, k_shifted, v, beta_masked, lam), "chunk", rule="1", pairing="same_step")
    assert rel_err(o_shift, o_same) < 1e-12


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_fresh_shifted_sequence_first_step_neither_writes_nor_decays(backend):
    q, k, v, beta, lam = make_inputs("1A", B=1, T=1, H=2, K=4, V=3)
    state = random_state(1, 2, 4, 3, window=1)
    state.last_k = None
    _, final = run((q, k, v, beta, lam * 0 + 5.0), backend, rule="1A", initial_state=state)
    assert torch.equal(final.S, state.S)


@pytest.mark.parametrize("rule", ["1", "2", "3"])
def test_gains_above_one_stay_stable_and_above_two_diverge(rule):
    """NLMS with beta in (1, 2) flips the sign along x but contracts (|1 - beta| < 1); beta > 2 expands, which is
    why the op refuses such gains unless told not to check them (`check_beta=False`)."""
    window = 3 if rule == "3" else 1

    def final_norm(low, high):
        q, k, v, beta, _ = make_inputs(rule, B=1, T=600, H=2, K=8, V=8)
        beta = low + (high - low) * torch.rand_like(beta)
        _, s = run((q, k, v, beta, None), "chunk", rule=rule, window=window, chunk_size=64, check_beta=False)
        return s.S.norm().item()

    stable = final_norm(1.5, 1.99)
    assert torch.isfinite(torch.tensor(stable)) and stable < 50.0
    assert final_norm(2.5, 2.9) > 1e6


def test_clamped_decay_keeps_state_finite():
    q, k, v, beta, lam = make_inputs("1A", B=1, T=200)
    o, s = run((q, k, v, beta, lam * 0 + 1e4), "chunk", rule="1A", step_size="direct")
    o_ref, s_ref = run((q, k, v, beta, lam * 0 + 1e4), "naive", rule="1A", step_size="direct")
    assert torch.isfinite(o).all() and rel_err(o, o_ref) < 1e-10


# ---- state carry-over --------------------------------------------------------------------------------------

CARRY_GRID = [(rule, pairing, backend) for rule in RULES for pairing in ("shifted", "same_step")
              for backend in ("naive", "chunk")]


@pytest.mark.parametrize("rule,pairing,backend", CARRY_GRID, ids=[f"rule{r}-{p}-{b}" for r, p, b in CARRY_GRID])
def test_state_carry_over_is_exact(rule, pairing, backend):
    window = 4 if rule in SLIDING else 1
    T = 45
    inputs = make_inputs(rule, T=T)
    options = dict(rule=rule, window=window, pairing=pairing, chunk_size=16, lam=None)
    options.pop("lam")
    o_full, s_full = run(inputs, backend, **options)
    # t = 1, t inside a chunk, T - t < window, and a second cut after the first.
    for cuts in ([1], [21], [T - 2], [2, 3, 30]):
        pieces, state, start = [], None, 0
        for end in cuts + [T]:
            segment = [t[:, start:end] for t in inputs]
            o, state = run(segment, backend, initial_state=state, **options)
            pieces.append(o)
            start = end
        assert rel_err(torch.cat(pieces, dim=1), o_full) < 1e-12
        assert_states_equal(state, s_full, 1e-12)


# ---- packed variable-length batches ------------------------------------------------------------------------

VARLEN_GRID = [(rule, pairing, backend) for rule in RULES for pairing in ("shifted", "same_step")
               for backend in ("naive", "chunk")]


@pytest.mark.parametrize("rule,pairing,backend", VARLEN_GRID, ids=[f"rule{r}-{p}-{b}" for r, p, b in VARLEN_GRID])
def test_packed_call_equals_loop_over_sequences(rule, pairing, backend):
    window = 3 if rule in SLIDING else 1
    lengths = [1, 2, 17, 40, 5]
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)))
    q, k, v, beta, lam = make_inputs(rule, B=1, T=int(offsets[-1]))
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    state = random_state(len(lengths), H, K, V, window=window, tail_len=[0, 1, 2, 0, 2][: len(lengths)]
                         if window > 1 else None)
    options = dict(rule=rule, window=window, pairing=pairing, chunk_size=8)
    o, s = run((q, k, v, beta, lam), backend, initial_state=state, cu_seqlens=offsets, **options)
    for n in range(len(lengths)):
        a, b = int(offsets[n]), int(offsets[n + 1])
        row_state = FastWeightState(*(None if t is None else t[n : n + 1] for t in
                                      (state.S, state.last_k, state.tail_x, state.tail_v, state.tail_len)))
        o_n, s_n = run([t[:, a:b] for t in (q, k, v, beta, lam)], "naive", initial_state=row_state, **options)
        assert rel_err(o[:, a:b], o_n) < 1e-12
        row = FastWeightState(*(None if t is None else t[n : n + 1] for t in
                                (s.S, s.last_k, s.tail_x, s.tail_v, s.tail_len)))
        assert_states_equal(row, s_n, 1e-12)


def test_packed_gradients_match_naive():
    lengths = [3, 20, 9]
    offsets = torch.tensor([0, 3, 23, 32])
    inputs = make_inputs("3", B=1, T=32, requires_grad=True)
    o, s = run(inputs, "chunk", rule="3", window=3, cu_seqlens=offsets, chunk_size=8)
    o_ref, s_ref = run(inputs, "naive", rule="3", window=3, cu_seqlens=offsets)
    assert sum(lengths) == 32
    for g, g_ref in zip(grads_of(inputs, o, s), grads_of(inputs, o_ref, s_ref)):
        assert rel_err(g, g_ref) < 1e-10


# ---- property-based ----------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    rule=st.sampled_from(RULES),
    B=st.integers(1, 2), T=st.integers(1, 20), H=st.integers(1, 2), K=st.integers(1, 5), V=st.integers(1, 5),
    window=st.integers(1, 4), chunk_size=st.integers(1, 9),
    pairing=st.sampled_from(["shifted", "same_step"]), read=st.sampled_from(["after", "before"]),
    step_size=st.sampled_from(["nlms", "direct"]), ridge_scaling=st.booleans(), seed=st.integers(0, 10_000),
)
def test_property_chunk_matches_naive(rule, B, T, H, K, V, window, chunk_size, pairing, read, step_size,
                                      ridge_scaling, seed):
    window = window if rule in SLIDING else 1
    inputs = make_inputs(rule, B=B, T=T, H=H, K=K, V=V, seed=seed)
    options = dict(rule=rule, window=window, pairing=pairing, read=read, step_size=step_size,
                   ridge_scaling=ridge_scaling)
    o_ref, s_ref = run(inputs, "naive", **options)
    o, s = run(inputs, "chunk", chunk_size=chunk_size, **options)
    assert rel_err(o, o_ref) < 1e-9
    assert_states_equal(s, s_ref, 1e-9)


# ---- bad input ---------------------------------------------------------------------------------------------


def test_unchecked_lam_propagates_nan_instead_of_raising():
    """`check_lam=False` (the mixer's call: its lam is a scaled sigmoid) skips the lam >= 0 check, which on CUDA is a
    device-side assert that stops the process: a NaN lam reaches the output, and the loss, where the trainer's guard
    skips the update. The default still refuses it."""
    q, k, v, beta, lam = make_inputs("1A", B=1, T=8)
    lam = lam.clone()
    lam[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="lam must be >= 0"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A")
    o, _ = fast_weight_attention(q, k, v, beta, lam, rule="1A", check_lam=False)
    assert o[:, :, 1].isnan().any() and not o[:, :, [0, 2]].isnan().any()  # the heads are independent


@pytest.mark.parametrize("rule", ["1", "2A"])
def test_beta_out_of_range_raises_unless_unchecked(rule):
    """beta is an NLMS gain in [0, 2] (above 2 the write diverges) or, with direct steps, a finite step size >= 0:
    anything else, NaN included, raises a ValueError naming the range; the ends are legal. `check_beta=False` (the
    mixer's call: its beta is a scaled sigmoid) skips the check, also where seq_idx takes the packed path."""
    q, k, v, beta, lam = make_inputs(rule, B=1, T=8)

    def with_entry(value):
        changed = beta.clone()
        changed[0, 3, 1] = value  # one step of one head (every column of it for rule 2A)
        return changed

    for value in (2.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"beta must be in \[0, 2\] with step_size='nlms'"):
            fast_weight_attention(q, k, v, with_entry(value), lam, rule=rule)
    for value in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"beta must be finite and >= 0 with step_size='direct'"):
            fast_weight_attention(q, k, v, with_entry(value), lam, rule=rule, step_size="direct")
    edges = with_entry(0.0)
    edges[0, 5, 0] = 2.0
    assert fast_weight_attention(q, k, v, edges, lam, rule=rule)[0].isfinite().all()
    fast_weight_attention(q, k, v, 10.0 * beta, lam, rule=rule, step_size="direct")  # a step size has no bound
    nan = with_entry(float("nan"))
    o, _ = fast_weight_attention(q, k, v, nan, lam, rule=rule, check_beta=False)
    assert o[:, 3:, 1].isnan().any() and not o[:, :, 0].isnan().any()
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    o, _ = fast_weight_attention(q, k, v, nan, lam, rule=rule, seq_idx=documents, backend="naive", check_beta=False)
    assert o[:, 3, 1].isnan().any()


def test_mixed_qkv_dtypes_raise_instead_of_a_silent_cast():
    """q, k and v of different dtypes are refused with the three named; beta and lam may have any float dtype."""
    q, k, v, beta, lam = make_inputs("1A", B=1, T=8, dtype=torch.float32)
    message = r"q, k and v must have one dtype; got q torch.float32, k torch.float32, v torch.bfloat16: cast them"
    for backend in ("naive", "chunk"):
        with pytest.raises(ValueError, match=message):
            fast_weight_attention(q, k, v.bfloat16(), beta, lam, rule="1A", backend=backend)
    with pytest.raises(ValueError, match="got q torch.float64, k torch.float32, v torch.float32"):
        fast_weight_attention(q.double(), k, v, beta, lam, rule="1A")
    o, _ = fast_weight_attention(*(t.bfloat16() for t in (q, k, v)), beta.double(), lam, rule="1A")
    assert o.dtype == torch.bfloat16


def test_bad_input_raises_clear_errors():
    q, k, v, beta, lam = make_inputs("1", B=1, T=8)
    call = fast_weight_attention
    with pytest.raises(ValueError, match="unknown rule"):
        call(q, k, v, beta, rule="4")
    for window in (0, True, 2.0):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            call(q, k, v, beta, rule="3", window=window)
    with pytest.raises(ValueError, match="only applies to the sliding rules"):
        call(q, k, v, beta, rule="1", window=2)
    with pytest.raises(ValueError, match="one gain per value column"):
        call(q, k, v, beta, rule="2")
    with pytest.raises(ValueError, match=r"rule '1' takes beta as \[B, T, H\]"):
        call(q, k, v, beta[..., None].expand(-1, -1, -1, v.shape[-1]), rule="1")
    with pytest.raises(ValueError, match="lam must be >= 0"):
        call(q, k, v, beta, -lam, rule="1")
    with pytest.raises(ValueError, match="lam must be"):
        call(q, k, v, beta, lam[:, :, :1], rule="1")
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        call(q, k[..., :3], v, beta, rule="1")
    with pytest.raises(ValueError, match="v must be"):
        call(q, k, v[:, :4], beta, rule="1")
    with pytest.raises(ValueError, match="unknown pairing"):
        call(q, k, v, beta, rule="1", pairing="previous")
    with pytest.raises(ValueError, match="unknown backend"):
        call(q, k, v, beta, rule="1", backend="cuda")
    with pytest.raises(ValueError, match="B == 1"):
        q2, k2, v2, beta2, _ = make_inputs("1", B=2, T=8)
        call(q2, k2, v2, beta2, rule="1", cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match="strictly increasing"):
        call(q, k, v, beta, rule="1", cu_seqlens=torch.tensor([0, 5, 5, 8]))
    with pytest.raises(ValueError, match="end at the packed length"):
        call(q, k, v, beta, rule="1", cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D integer tensor \[N \+ 1\], got list"):
        call(q, k, v, beta, rule="1", cu_seqlens=[0, 5, 8])
    with pytest.raises(ValueError, match="initial_state.S must be"):
        call(q, k, v, beta, rule="1", initial_state=FastWeightState(S=torch.zeros(2, 3, 5, 7)))
    _, s = run((q, k, v, beta, lam), "chunk", rule="3", window=3)
    with pytest.raises(ValueError, match=r"tail must hold window - 1 = 3 pairs.*got \[1, 3, 2, 5\]"):
        call(q, k, v, beta, rule="3", window=4, initial_state=s)
    for bad in (torch.tensor([5]), torch.tensor([-1]), torch.tensor([1.0])):
        s.tail_len = bad
        for backend in ("naive", "chunk", "recurrent"):
            with pytest.raises(ValueError, match="initial_state.tail_len must"):
                call(q, k, v, beta, rule="3", window=3, initial_state=s, backend=backend)
    with pytest.raises(ValueError, match="k is on meta, q on cpu"):
        call(q, k.to("meta"), v, beta, rule="1")
    with pytest.raises(ValueError, match="recurrent backend does not take packed sequences \\(cu_seqlens or seq_idx"):
        call(q, k, v, beta, rule="1", seq_idx=torch.zeros(1, 8, dtype=torch.int64), backend="recurrent")


@pytest.mark.parametrize("backend", ["naive", "chunk"])
@pytest.mark.parametrize("rule", RULES)
def test_bf16_autocast_leaves_the_recurrence_in_float32(rule, backend):
    """A caller's bf16 autocast must not reach the recurrence's matmuls (DESIGN: recurrent math in fp32)."""
    window = 3 if rule in SLIDING else 1
    inputs = make_inputs(rule, T=40, dtype=torch.float32)
    o, s = run(inputs, backend, rule=rule, window=window)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_autocast, s_autocast = run(inputs, backend, rule=rule, window=window)
    assert rel_err(o_autocast, o) < 1e-6 and rel_err(s_autocast.S, s.S) < 1e-6


def test_compiled_chunk_path_across_lengths_with_and_without_padding():
    """torch.compile (aot_eager, dynamic after the second length) of the chunk path over lengths that need chunk
    padding and one that does not (T a multiple of the chunk): equal to eager. A zero pad of a transposed tensor
    used to be traced as contiguous and viewed (a runtime error at the third length)."""
    def run(q, k, v, beta, lam):
        return fast_weight_attention(q, k, v, beta, lam, rule="3A", window=2, backend="chunk", chunk_size=16)[0]

    compiled = torch.compile(run, backend="aot_eager")
    for T in (20, 24, 32):
        inputs = make_inputs("3A", B=1, T=T, H=2, K=8, V=8, dtype=torch.float32, requires_grad=True)
        out = compiled(*inputs)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        eager = run(*inputs)
        eager_grads = torch.autograd.grad(eager.square().sum(), inputs)
        assert rel_err(out, eager) < 1e-6
        for grad, eager_grad in zip(grads, eager_grads):
            assert rel_err(grad, eager_grad) < 1e-6
