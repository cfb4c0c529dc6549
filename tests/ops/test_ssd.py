"""Mamba-2 SSD op: the chunk backend against the naive spec, state passing, varlen, dtypes, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops.ssd import ssd
from tests.helpers import rel_err
from tests.ops.ssd_helpers import NAMES, make_inputs, outputs_and_grads, time_slice

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def run(inputs, **kwargs):
    """Outputs and every input gradient of one `ssd` call (see `outputs_and_grads`)."""
    y, h = ssd(**inputs, output_final_state=True, **kwargs)
    return outputs_and_grads(inputs, y, h)


# ---------------------------------------------------------------------------------------------- spec


@pytest.mark.parametrize(("backend", "chunk_size"), [("naive", 256), ("chunk", 1), ("chunk", 2)])
def test_matches_hand_computed_recurrence(backend, chunk_size):
    # One head, P = N = 1, two steps: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, y_t = h_t C_t + D x_t.
    f64 = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    x, dt, B, C = f64(2.0, -1.0), f64(0.5, 0.25), f64(3.0, 0.5), f64(1.5, -2.0)
    A, D, h0 = -0.8, 0.1, 0.7
    h1 = math.exp(0.5 * A) * h0 + 0.5 * 2.0 * 3.0
    h2 = math.exp(0.25 * A) * h1 + 0.25 * -1.0 * 0.5
    y, h = ssd(
        x.view(1, 2, 1, 1), dt.view(1, 2, 1), f64(A), B.view(1, 2, 1, 1), C.view(1, 2, 1, 1), D=f64(D),
        initial_state=f64(h0).view(1, 1, 1, 1), output_final_state=True, backend=backend, chunk_size=chunk_size,
    )
    assert rel_err(y.flatten(), f64(h1 * 1.5 + D * 2.0, h2 * -2.0 + D * -1.0)) < 1e-14
    assert abs(h.item() - h2) < 1e-14


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_head_reads_its_group(backend):
    # H = 4, G = 2: heads 0, 1 read group 0 and heads 2, 3 read group 1 (h // (H // G), not h % G).
    inputs = {k: v.detach() for k, v in make_inputs(1, 9, 4, 3, 2, 5).items()}
    y0, _ = ssd(**inputs, backend=backend, chunk_size=4)
    inputs["B"] = inputs["B"].clone()
    inputs["B"][:, :, 1] += 1.0
    y1, _ = ssd(**inputs, backend=backend, chunk_size=4)
    changed = (y1 - y0).abs().amax(dim=(0, 1, 3))  # [H]
    assert changed[:2].max() == 0 and changed[2:].min() > 1e-3


# ------------------------------------------------------------------------------------ chunk vs naive


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("G", [1, 2], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"L{c}")
@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T{t}")
def test_chunk_matches_naive(T, chunk_size, G, dtype):
    inputs = make_inputs(2, T, 4, 6, G, 5, dtype=dtype, seed=T + chunk_size + G)
    ref = run(inputs, backend="naive")
    out = run(inputs, backend="chunk", chunk_size=chunk_size)
    for name, a, b in zip(NAMES, out, ref):
        assert a.dtype == b.dtype == dtype, name
        assert rel_err(a, b) < TOL[dtype], f"{name}: {rel_err(a, b):.3e}"


def test_chunk_is_stable_under_strong_decay():
    # Per-step log decays down to -40 (cumulative sums reach about -1000 in a chunk): a chunk form that
    # splits exp(c_i - c_j) into exp(c_i) * exp(-c_j) overflows here; outputs and gradients must stay finite.
    inputs = make_inputs(1, 70, 4, 3, 1, 4, dt_scale=20.0, seed=7)
    with torch.no_grad():
        inputs["A"].copy_(torch.tensor([-2.0, -0.5, -1e-3, -1.0]))
    ref = run(inputs, backend="naive")
    out = run(inputs, backend="chunk", chunk_size=64)
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3e}"


def strong_decay_inputs(T=300, seed=11):
    """Falcon-H1-like decays (A = -1 .. -16, dt = softplus around a spread bias): per-step log decays down to ~ -80,
    so the chunk-local cumulative sums c_i reach ~ -1e3 .. -1e4 (float64 leaves; b=1, H=4, P=8, G=1, N=16)."""
    inputs = make_inputs(1, T, 4, 8, 1, 16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        bias = torch.linspace(-4.0, 2.0, 4, dtype=torch.float64)
        inputs["dt"].copy_(torch.nn.functional.softplus(torch.randn(1, T, 4, generator=g, dtype=torch.float64) + bias))
        inputs["A"].copy_(-torch.tensor([1.0, 4.0, 8.0, 16.0]))
    assert (inputs["dt"] * inputs["A"]).min() < -40
    return inputs


# float32 against the float64 spec under strong decays; dA, a sum of large cancelling terms over all steps, keeps
# ~1e-6 of float32 rounding whatever the exponents
STRONG_DECAY_TOL = {"y": 2e-7, "dA": 5e-6}  # else 1e-6


@pytest.mark.parametrize("chunk_size", [128, 256], ids=lambda c: f"L{c}")
def test_chunk_float32_is_precise_under_strong_decay(chunk_size):
    # An in-chunk exponent formed as the difference c_i - c_j of two prefix sums of ~1e4 loses eps * 1e4 to
    # cancellation (float32: rel. errors ~1e-6 in y and ddt, ~1e-4 in dA); summed as l_{j+1} + ... + l_i it is exact
    # to a few eps of itself.
    inputs = strong_decay_inputs()
    ref = run(inputs, backend="naive")
    out = run({k: v.detach().float().requires_grad_() for k, v in inputs.items()}, backend="chunk",
              chunk_size=chunk_size)
    for name, a, b in zip(NAMES, out, ref):
        err = rel_err(a.double(), b)
        assert err < STRONG_DECAY_TOL.get(name, 1e-6), f"{name}: {err:.3e}"


def test_defaults_auto_backend_and_no_final_state():
    inputs = {k: v.detach() for k, v in make_inputs(1, 20, 4, 3, 2, 5).items()}
    del inputs["D"], inputs["initial_state"]
    y, h = ssd(**inputs)
    assert h is None
    y_ref, h_ref = ssd(**inputs, backend="naive", output_final_state=True)
    assert rel_err(y, y_ref) < 1e-10
    # A zero initial state is the same as none.
    y0, h0 = ssd(**inputs, initial_state=torch.zeros_like(h_ref), output_final_state=True)
    assert rel_err(y0, y_ref) < 1e-10 and rel_err(h0, h_ref) < 1e-10


# ----------------------------------------------------------------------------------- state passing


@pytest.mark.parametrize("split", [1, 37], ids=["t1", "t37_inside_chunk"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_state_carry_over(backend, split):
    inputs = {k: v.detach() for k, v in make_inputs(2, 63, 4, 6, 2, 5, seed=3).items()}
    y_full, h_full = ssd(**inputs, output_final_state=True, backend=backend, chunk_size=16)
    y_a, h_a = ssd(**time_slice(inputs, 0, split), output_final_state=True, backend=backend, chunk_size=16)
    second = time_slice(inputs, split, None)
    second["initial_state"] = h_a
    y_b, h_b = ssd(**second, output_final_state=True, backend=backend, chunk_size=16)
    assert rel_err(torch.cat([y_a, y_b], dim=1), y_full) < 1e-12
    assert rel_err(h_b, h_full) < 1e-12


# ------------------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_varlen_matches_loop_over_sequences(backend):
    lengths = [5, 35, 1, 59]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = make_inputs(1, sum(lengths), 4, 6, 2, 5, n_states=len(lengths), seed=11)
    packed = run(inputs, backend=backend, chunk_size=16, cu_seqlens=cu_seqlens)

    # Reference: each sequence on its own (naive backend, no cu_seqlens), under the same loss.
    ys, hs = [], []
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        one = time_slice(inputs, start, end)
        one["initial_state"] = inputs["initial_state"][i : i + 1]
        y_i, h_i = ssd(**one, output_final_state=True, backend="naive")
        ys.append(y_i)
        hs.append(h_i)
    ref = outputs_and_grads(inputs, torch.cat(ys, dim=1), torch.cat(hs, dim=0))
    for name, a, b in zip(NAMES, packed, ref):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("backend", ["naive", "chunk", "chunk-compiled-form"])
def test_seq_idx_restarts_like_a_loop_over_documents(backend, chunk_size, monkeypatch):
    """seq_idx [b, T]: every document of a row restarts from zero (the row's first continues its initial_state) and
    the final state is the row's last document's; ids that come back after another document are a new one. Rows of
    odd lengths, restarts mid-chunk and on chunk boundaries, several in one chunk, a document across chunks; the
    chunk path also in the closed inter-chunk form that torch.compile takes."""
    if backend == "chunk-compiled-form":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        backend = "chunk"
    rows = [[5, 11, 1, 1, 20], [16, 3, 19]]  # both rows 38 steps
    ids = [[0] * 5 + [1] * 11 + [2] + [7] + [2] * 20, [4] * 16 + [5] * 3 + [4] * 19]
    seq_idx = torch.tensor(ids)
    inputs = make_inputs(2, 38, 4, 3, 2, 5, seed=13)
    got = run(inputs, backend=backend, chunk_size=chunk_size, seq_idx=seq_idx)

    ys, hs = [], []
    for r, lengths in enumerate(rows):
        row = {k: (v[r : r + 1] if k != "A" and k != "D" else v) for k, v in inputs.items()}
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        y_row, h = [], row["initial_state"]
        for d, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            one = time_slice(row, start, end)
            one["initial_state"] = h if d == 0 else torch.zeros_like(h)
            y_d, h = ssd(**one, output_final_state=True, backend="naive")
            y_row.append(y_d)
        ys.append(torch.cat(y_row, dim=1))
        hs.append(h)
    ref = outputs_and_grads(inputs, torch.cat(ys, dim=0), torch.cat(hs, dim=0))
    for name, a, b in zip(NAMES, got, ref):
        assert rel_err(a, b) < 1e-10, f"{name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("n_chunks", [0, 1, 7])
def test_inter_chunk_closed_form_matches_the_loop(n_chunks):
    """The compiled form of the chunk recurrence (one product over pairs of chunks) equals the eager loop in float64,
    values and gradients, also with chunks whose log decay is -inf (a restart inside: nothing passes through)."""
    from hybridlm.ops.ssd.chunk import inter_chunk

    g = torch.Generator().manual_seed(3)
    log_decay = -torch.rand(2, n_chunks, 2, 3, generator=g, dtype=torch.float64) * 2
    if n_chunks > 1:
        log_decay[0, 1, 0] = float("-inf")
        log_decay[1, -1] = float("-inf")
    writes = torch.randn(2, n_chunks, 2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    log_decay.requires_grad_()
    loop, closed = (inter_chunk(log_decay, writes, h0, closed_form=form) for form in (False, True))
    assert rel_err(closed, loop) < 1e-12
    weights = torch.randn(loop.shape, generator=g, dtype=torch.float64)
    inputs = [log_decay, writes, h0]
    for a, b in zip(torch.autograd.grad((loop * weights).sum(), inputs, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad((closed * weights).sum(), inputs, allow_unused=True, materialize_grads=True)):
        assert torch.isfinite(b).all() and rel_err(b, a) < 1e-12


def test_seq_idx_errors_and_empty_rows():
    empty = {k: v.detach() for k, v in make_inputs(1, 0, 2, 3, 1, 4).items()}
    y, h = ssd(**empty, seq_idx=torch.zeros(1, 0, dtype=torch.long), output_final_state=True, chunk_size=4)
    assert y.shape == (1, 0, 2, 3) and torch.equal(h, empty["initial_state"])
    inputs = {k: v.detach() for k, v in make_inputs(1, 6, 2, 3, 1, 4).items()}
    with pytest.raises(ValueError, match="seq_idx must be an integer tensor"):
        ssd(**inputs, seq_idx=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_idx must be an integer tensor"):
        ssd(**inputs, seq_idx=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="either cu_seqlens"):
        ssd(**inputs, seq_idx=torch.zeros(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="takes cu_seqlens, not seq_idx"):
        ssd(**inputs, seq_idx=torch.zeros(1, 6, dtype=torch.long), backend="triton")


# ------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_half_inputs_fp32_state(backend, dtype):
    inputs = {k: v.detach().to(dtype) for k, v in make_inputs(2, 50, 4, 8, 2, 8, seed=5).items()}
    y, h = ssd(**inputs, output_final_state=True, backend=backend, chunk_size=16)
    assert y.dtype == dtype and h.dtype == torch.float32
    # Reference: the same (rounded) values computed in float32 throughout.
    y_ref, h_ref = ssd(**{k: v.float() for k, v in inputs.items()}, output_final_state=True, backend="naive")
    assert rel_err(y.float(), y_ref) < 1e-2
    assert rel_err(h, h_ref) < 1e-5


def test_float64_inputs_float64_state():
    inputs = {k: v.detach() for k, v in make_inputs(1, 5, 2, 3, 1, 4).items()}
    y, h = ssd(**inputs, output_final_state=True)
    assert y.dtype == torch.float64 and h.dtype == torch.float64


# ------------------------------------------------------------------------------------------ errors


def _bad(**changes):
    inputs = {k: v.detach() for k, v in make_inputs(2, 10, 4, 3, 2, 5).items()}
    inputs.update(changes)
    return inputs


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _bad(B=torch.randn(2, 10, 3, 5), C=torch.randn(2, 10, 3, 5)), "multiple of the number of groups"),
        (lambda: _bad(x=torch.randn(2, 10, 12)), r"x must be \[b, T, H, P\]"),
        (lambda: _bad(dt=torch.rand(2, 9, 4)), r"dt must be \[b, T, H\]"),
        (lambda: _bad(A=-torch.rand(4, 1)), r"A must be \[H\]"),
        (lambda: _bad(D=torch.rand(3)), r"D must be None or \[H\]"),
        (lambda: _bad(B=torch.randn(1, 10, 2, 5)), r"B must be \[b, T, G, N\]"),
        (lambda: _bad(C=torch.randn(2, 10, 2, 4)), "C must have B's shape"),
        (lambda: _bad(initial_state=torch.randn(2, 4, 5, 3)), r"initial_state must be \[b, H, P, N\]"),
        (lambda: _bad(cu_seqlens=torch.tensor([0, 4, 10])), "B == 1"),
        (lambda: _bad(backend="triton2"), "unknown backend"),
        (lambda: _bad(chunk_size=0), "chunk_size must be a positive int"),
        (lambda: _bad(dt=torch.rand(2, 10, 4, device="meta")), "dt is on meta, x on cpu"),
    ],
    ids=[
        "groups", "x_rank", "dt_T", "A_shape", "D_shape", "B_batch", "C_shape", "h0_shape", "cu_batch", "backend",
        "chunk", "device",
    ],
)
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        ssd(**make())


def test_varlen_errors():
    inputs = {k: v.detach() for k, v in make_inputs(1, 10, 4, 3, 2, 5).items()}
    with pytest.raises(ValueError, match=r"initial_state must be \[N_seq, H, P, N\]"):
        ssd(**inputs, cu_seqlens=torch.tensor([0, 4, 10]))  # 2 sequences, initial_state has 1 row
    with pytest.raises(ValueError, match="end at the packed length"):
        ssd(**inputs, cu_seqlens=torch.tensor([0, 4, 9]))


# -------------------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 2),
    T=st.integers(0, 40),
    G=st.integers(1, 2),
    R=st.integers(1, 2),
    P=st.integers(1, 4),
    N=st.integers(1, 4),
    chunk_size=st.integers(1, 17),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_chunk_matches_naive(b, T, G, R, P, N, chunk_size, with_state, seed):
    inputs = {k: v.detach() for k, v in make_inputs(b, T, G * R, P, G, N, seed=seed).items()}
    if not with_state:
        del inputs["initial_state"]
    y_ref, h_ref = ssd(**inputs, output_final_state=True, backend="naive")
    y, h = ssd(**inputs, output_final_state=True, backend="chunk", chunk_size=chunk_size)
    assert y.shape == (b, T, G * R, P) and h.shape == (b, G * R, P, N)
    assert rel_err(y, y_ref) < 1e-10 and rel_err(h, h_ref) < 1e-10


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_bf16_autocast_leaves_the_recurrence_in_float32(backend):
    """A caller's bf16 autocast must not reach the scan's einsums (DESIGN: recurrent math in fp32)."""
    inputs = {k: v.detach() for k, v in make_inputs(2, 70, 4, 6, 2, 5, dtype=torch.float32).items()}
    y, h = ssd(**inputs, output_final_state=True, backend=backend, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_autocast, h_autocast = ssd(**inputs, output_final_state=True, backend=backend, chunk_size=16)
    assert rel_err(y_autocast, y) < 1e-6 and rel_err(h_autocast, h) < 1e-6
