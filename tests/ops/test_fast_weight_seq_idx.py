"""`fast_weight_attention(..., seq_idx=)`: packed documents given as a document index per step.

In place (the chunk and Triton backends, a read after the write, shifted pairing for the regression rules: a log
decay of -100 and no pair at each document's first step, windows kept inside their document; the rows keep their
shapes) against the same documents through `cu_seqlens` (chunk: float64 against the naive loop; Triton: float32
against the chunk path), outputs and every gradient; the conversion to `cu_seqlens` wherever the in-place form does
not apply; `torch.compile(fullgraph)` of the in-place form and of the mixer; and the errors.

Where they run (as the Triton tests: tests/ops/conftest.py sets TRITON_INTERPRET before any kernel loads):
    GPU:  python -m pytest -q tests/ops/test_fast_weight_seq_idx.py
    CPU:  HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_fast_weight_seq_idx.py
(the chunk, conversion and error tests run everywhere).
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import fast_weight_attention
from hybridlm.ops.fast_weight.op import document_offsets, seq_idx_in_place
from hybridlm.ops.fast_weight.state import FastWeightState
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import make_inputs
from tests.ops.triton_modes import DEVICE, interpret

T = 53  # not a multiple of the chunk (16)


def layouts() -> dict[str, torch.Tensor]:
    """seq_idx [2, T] per case: restarts mid-chunk, on chunk boundaries (16, 32), several inside one chunk
    (1-token documents included), an id that comes back after another document, one document per row, and chunks
    made of 1-token documents (the restart decays add up to -1600 in a chunk: float32's worst case here)."""
    def row(lengths, ids=None):
        ids = ids or list(range(len(lengths)))
        return torch.cat([torch.full((n,), i) for n, i in zip(lengths, ids)])

    return {
        "mid_chunk": torch.stack([row([5, 30, 18]), row([40, 13])]),
        "chunk_edges": torch.stack([row([16, 16, 21]), row([32, 21])]),
        "dense": torch.stack([row([1, 2, 1, 3, 1, 45]), row([7, 1, 1, 44])]),
        "id_returns": torch.stack([row([10, 10, 33], ids=[4, 9, 4]), row([20, 13, 20], ids=[3, 8, 3])]),
        "single": torch.stack([row([T]), row([T], ids=[7])]),
        "tiny_docs": torch.stack([row([1] * 32 + [21]), row([1] * 16 + [37])]),  # 16 restarts per chunk of 16
    }


def run(inputs, seq_idx, *, rule, backend, packed, **options):
    """The op over seq_idx in place, or over the same documents as cu_seqlens (the rows laid end to end)."""
    q, k, v, beta, lam = inputs
    B, T, H, _ = q.shape
    if not packed:
        return fast_weight_attention(q, k, v, beta, lam, rule=rule, seq_idx=seq_idx.to(q.device), chunk_size=16,
                                     backend=backend, **options)[0]
    o, _ = fast_weight_attention(*(t.reshape(1, B * T, *t.shape[2:]) for t in inputs), rule=rule,
                                 cu_seqlens=document_offsets(seq_idx), chunk_size=16, backend=backend, **options)
    return o.reshape(B, T, H, -1)


# (rule, window, pairing, step_size, ridge_scaling): every case the in-place form takes
IN_PLACE = [("1A", 1, "shifted", "nlms", False), ("1A", 1, "same_step", "nlms", False),
            ("1A", 1, "shifted", "direct", True), ("1", 1, "shifted", "nlms", False), ("1", 1, "shifted", "nlms", True),
            ("3A", 3, "shifted", "nlms", False), ("3A", 2, "same_step", "direct", True),
            ("3", 3, "shifted", "nlms", False), ("2A", 1, "same_step", "nlms", False),
            ("2", 1, "shifted", "nlms", True)]
IDS = [f"{r}-w{w}-{p}-{s}{'-ridge' if rs else ''}" for r, w, p, s, rs in IN_PLACE]


def errors_in_place(seq_idx, case, *, backend, reference_backend, dtype, device) -> dict[str, float]:
    """Relative errors of the op in place on `backend` against the same documents through cu_seqlens on
    `reference_backend`: o and the gradients of q, k, v, beta, lam."""
    rule, window, pairing, step_size, ridge_scaling = case
    options = dict(window=window, pairing=pairing, step_size=step_size, ridge_scaling=ridge_scaling)
    assert seq_idx_in_place(torch.zeros(1, 2, 1, 1, device=device), rule=rule, window=window, pairing=pairing,
                            backend=backend)
    inputs = [t.to(device).detach().requires_grad_(True)
              for t in make_inputs(rule, B=2, T=T, H=2, K=16, V=8, dtype=dtype, lam_scale=0.5)]
    o = run(inputs, seq_idx, rule=rule, backend=backend, packed=False, **options)
    o_ref = run(inputs, seq_idx, rule=rule, backend=reference_backend, packed=True, **options)
    w = torch.randn_like(o_ref)
    grads = torch.autograd.grad((o * w).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * w).sum(), inputs)
    errors = {"o": rel_err(o, o_ref)}
    errors.update({f"d{name}": rel_err(grad, grad_ref)
                   for name, grad, grad_ref in zip(("q", "k", "v", "beta", "lam"), grads, grads_ref)})
    return errors


# The chunk path (fast on the CPU) also takes wider windows and direct steps for rules 3 and 2A
CHUNK_ONLY = [("3A", 4, "same_step", "nlms", False), ("3A", 5, "shifted", "direct", False),
              ("3", 5, "shifted", "direct", True), ("2A", 1, "shifted", "direct", False)]


@pytest.mark.parametrize("layout", sorted(layouts()))
@pytest.mark.parametrize("case", IN_PLACE + CHUNK_ONLY, ids=IDS + [f"{r}-w{w}-{p}-{s}" for r, w, p, s, _ in CHUNK_ONLY])
def test_chunk_in_place_matches_documents(layout, case):
    """The torch chunk path in place vs the naive step loop over cu_seqlens, float64 (< 1e-10)."""
    errors = errors_in_place(layouts()[layout], case, backend="chunk", reference_backend="naive",
                             dtype=torch.float64, device="cpu")
    assert max(errors.values()) < 1e-10, errors


@pytest.mark.parametrize("rule,window", [("1A", 1), ("3A", 3), ("1", 1)])
def test_chunk_in_place_float32_with_many_restarts_per_chunk(rule, window):
    """100 one-token documents and a long one in a chunk of 128 (restart decays summing to -10^4): the chunk path
    takes its log decays in float64 there, so float32 stays within 2e-6 of float64 through cu_seqlens (float32
    sums: ~2e-4)."""
    seq_idx = torch.cat([torch.arange(100), torch.full((156,), 100)])[None]
    inputs = make_inputs(rule, B=1, T=256, H=2, K=16, V=8)
    o_ref = fast_weight_attention(*inputs, rule=rule, window=window, cu_seqlens=document_offsets(seq_idx),
                                  chunk_size=128, backend="chunk")[0]
    o = fast_weight_attention(*(t.float() for t in inputs), rule=rule, window=window, seq_idx=seq_idx,
                              chunk_size=128, backend="chunk")[0]
    assert rel_err(o, o_ref) < 2e-6


@pytest.mark.parametrize("rule,window", [("3A", 5), ("3", 4)])
def test_chunk_in_place_rows_shorter_than_the_window(rule, window):
    """T = 3 < W, one row of three 1-token documents, one of a single document: float64 against the naive loop."""
    seq_idx = torch.tensor([[0, 1, 2], [5, 5, 5]])
    inputs = [t.detach().requires_grad_(True) for t in make_inputs(rule, B=2, T=3, H=2, K=4, V=3)]
    o = run(inputs, seq_idx, rule=rule, window=window, backend="chunk", packed=False)
    o_ref = run(inputs, seq_idx, rule=rule, window=window, backend="naive", packed=True)
    assert rel_err(o, o_ref) < 1e-12
    for grad, grad_ref in zip(torch.autograd.grad(o.sum(), inputs), torch.autograd.grad(o_ref.sum(), inputs)):
        assert rel_err(grad, grad_ref) < 1e-12


@interpret
@pytest.mark.parametrize("layout", sorted(layouts()))
@pytest.mark.parametrize("case", IN_PLACE, ids=IDS)
def test_triton_in_place_matches_documents(layout, case):
    """The Triton kernels in place vs the chunk path over cu_seqlens, float32 (< 1e-4)."""
    errors = errors_in_place(layouts()[layout], case, backend="triton", reference_backend="chunk",
                             dtype=torch.float32, device=DEVICE)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("rule,window,backend", [pytest.param("1A", 1, "triton", marks=interpret),
                                                 ("3A", 3, "chunk"), ("3", 2, "chunk")])
def test_in_place_compiles_without_graph_breaks(rule, window, backend):
    """torch.compile(fullgraph=True, aot_eager) of the in-place form equals eager, gradients included: nothing is
    read on the host."""
    device = DEVICE if backend == "triton" else "cpu"
    seq_idx = layouts()["dense"].to(device)
    inputs = [t.to(device).detach().requires_grad_(True)
              for t in make_inputs(rule, B=2, T=T, H=2, K=16, V=8, dtype=torch.float32)]

    def fn(q, k, v, beta, lam, seq_idx):
        return fast_weight_attention(q, k, v, beta, lam, rule=rule, window=window, seq_idx=seq_idx, chunk_size=16,
                                     backend=backend)[0]

    o = fn(*inputs, seq_idx)
    o_c = torch.compile(fn, fullgraph=True, backend="aot_eager")(*inputs, seq_idx)
    grads = torch.autograd.grad(o.square().sum(), inputs)
    grads_c = torch.autograd.grad(o_c.square().sum(), inputs)
    assert rel_err(o_c, o) < 1e-6
    for grad, grad_c in zip(grads, grads_c):
        assert rel_err(grad_c, grad) < 1e-6


@pytest.mark.parametrize("rule,window,pairing,read,backend", [
    ("1A", 1, "shifted", "before", "chunk"), ("3A", 3, "same_step", "before", "chunk"),
    ("1", 1, "same_step", "after", "chunk"), ("3", 2, "same_step", "after", "chunk"),
    ("1A", 1, "shifted", "after", "naive")])
def test_other_calls_run_as_cu_seqlens(rule, window, pairing, read, backend):
    """What the in-place form does not take (a read before the write, a same-step regression rule, the naive step
    loop) runs the same documents as cu_seqlens: outputs and gradients equal, float64."""
    seq_idx = layouts()["id_returns"]
    options = dict(window=window, pairing=pairing, read=read)
    assert not seq_idx_in_place(torch.zeros(1, 2, 1, 1), rule=rule, backend=backend, **options)
    inputs = [t.detach().requires_grad_(True)
              for t in make_inputs(rule, B=2, T=T, H=2, K=6, V=5, dtype=torch.float64)]
    o = run(inputs, seq_idx, rule=rule, backend=backend, packed=False, **options)
    o_ref = run(inputs, seq_idx, rule=rule, backend="naive", packed=True, **options)
    assert rel_err(o, o_ref) < 1e-10
    grads = torch.autograd.grad(o.sum(), inputs)
    grads_ref = torch.autograd.grad(o_ref.sum(), inputs)
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < 1e-10


@pytest.mark.parametrize("backend,dtype,scale,tol", [
    ("chunk", torch.float64, 1e10, 1e-12),
    pytest.param("triton", torch.float32, 1e6, 1e-5, marks=interpret)])
def test_nothing_leaks_into_the_next_document(backend, dtype, scale, tol):
    """Values of the first document scaled by `scale` change nothing in the second: the restart decay (-100) leaves
    exp(-100) * scale of the first document's state, far below the tolerance (a weak decay, e.g. -12, fails)."""
    seq_idx = torch.tensor([[0] * 20 + [1] * (T - 20)])
    device = "cpu" if backend == "chunk" else DEVICE
    q, k, v, beta, lam = (t.to(device) for t in make_inputs("1A", B=1, T=T, H=2, K=16, V=8, dtype=dtype))
    outs = []
    for factor in (1.0, scale):
        scaled = v.clone()
        scaled[:, :20] *= factor
        o, _ = fast_weight_attention(q, k, scaled, beta, lam, rule="1A", seq_idx=seq_idx.to(device), chunk_size=16,
                                     backend=backend)
        outs.append(o[:, 20:])
    assert rel_err(outs[1], outs[0]) < tol


def test_document_offsets():
    seq_idx = torch.tensor([[3, 3, 5, 5, 3], [1, 1, 1, 1, 1]])
    assert document_offsets(seq_idx).tolist() == [0, 2, 4, 5, 10]


def test_errors():
    q, k, v, beta, lam = make_inputs("1A", B=1, T=6, H=1, K=4, V=4, dtype=torch.float32)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2]])
    with pytest.raises(ValueError, match="not both"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"integer tensor \[B, T\]"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx.float())
    with pytest.raises(ValueError, match=r"integer tensor \[B, T\]"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx[:, :5])
    with pytest.raises(ValueError, match="zero state"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx, output_final_state=True)
    with pytest.raises(ValueError, match="move seq_idx"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx.to("meta"))
    with pytest.raises(ValueError, match="zero state"):
        fast_weight_attention(q, k, v, beta, lam, rule="1A", seq_idx=seq_idx,
                              initial_state=FastWeightState(S=torch.zeros(1, 1, 4, 4)))


@interpret
@pytest.mark.parametrize("fw", [dict(fw_rule="1"), dict(fw_rule="1A", fw_pairing="same_step"),
                                dict(fw_rule="3A", fw_window=3), dict(fw_rule="1", fw_read="before")],
                         ids=["fw-1", "fw-1A-same", "fw-3A", "fw-1-read-before"])
def test_mixer_restarts_in_place_inside_graphs(monkeypatch, fw):
    """The fast-weight mixer on the Triton backend given the compiled block's seq_idx: rules 1, 1A and 3A run the op
    in place (never `_packed_op`, the call outside the graphs; the whole mixer compiles with fullgraph=True), a read
    before the write through `_packed_op`; output and every parameter's gradient equal to the mixer on cu_seqlens
    alone (float32, < 1e-4)."""
    from hybridlm.layers import fast_weight as layer
    from hybridlm.modules.boundaries import sequence_ids
    from tests.layers.block_helpers import make_block, runs_with_and_without_seq_idx

    mixer = make_block(ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=16, fw_chunk_size=16, **fw).ssm.to(DEVICE)
    mixer.backend = "triton"
    outside = []
    monkeypatch.setattr(layer, "_packed_op", lambda *a, **kw: outside.append(1) or fast_weight_attention(*a, **kw))
    cu_seqlens = torch.tensor([0, 1, 19, 34, 50])
    seq_idx = sequence_ids(cu_seqlens, 50).unsqueeze(0).to(DEVICE)
    x = torch.randn(1, 50, 16, device=DEVICE)
    outs, grads = runs_with_and_without_seq_idx(mixer, x, cu_seqlens, seq_idx)
    assert rel_err(outs[1], outs[0]) < 1e-4
    for a, b in zip(grads[1], grads[0]):
        assert rel_err(a, b) < 1e-4
    in_place = fw.get("fw_read", "after") == "after"
    assert outside == ([] if in_place else [1, 1])  # in the forward, and in the backward's recomputation
    if in_place:  # the whole mixer traces as one graph
        compiled = torch.compile(mixer, fullgraph=True, backend="aot_eager")
        assert rel_err(compiled(x, cu_seqlens=cu_seqlens, seq_idx=seq_idx), outs[1]) < 1e-6
