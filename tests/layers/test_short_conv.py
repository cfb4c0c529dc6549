"""Short causal conv: reference conv, exact state passing, packed documents == each alone."""

import pytest
import torch
import torch.nn.functional as F

from hybridlm.modules import ShortConvolution, causal_conv1d, cu_seqlens_from_position_ids, short_conv


def _reference(x, weight, bias):
    """Left-zero-padded depthwise conv1d + SiLU, as transformers' falcon_h1 torch path computes it."""
    channels, kernel = weight.shape
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=kernel - 1, groups=channels)
    return F.silu(out[..., : x.shape[1]]).transpose(1, 2)


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_matches_reference_conv(kernel):
    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel, bias=True, activation="silu")
    x = torch.randn(2, 11, 6)
    y, _ = conv(x)
    torch.testing.assert_close(y, _reference(x, conv.weight, conv.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["conv1d", "shifted_sum"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_both_forms_match_reference_conv_with_gradients(monkeypatch, form, with_bias):
    """The conv1d form (eager mode on a GPU) and the shifted-sum form (torch.compile, the CPU): outputs and gradients
    (input, weight, bias, carried state) equal the padded reference conv's, in float64."""
    spy = {}
    original = getattr(short_conv, f"_{form}")
    monkeypatch.setattr(short_conv, "_depthwise", lambda *a: spy.setdefault("ran", original(*a)))
    torch.manual_seed(3)
    x = torch.randn(2, 13, 6, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True) if with_bias else None
    leaves = [x, state, weight] + ([bias] if with_bias else [])
    y, _ = causal_conv1d(x, weight, bias, activation="silu", initial_state=state)
    assert "ran" in spy
    expected = _reference(torch.cat([state, x], dim=1), weight, bias)[:, 3:]
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(y)
    got = torch.autograd.grad((y * w).sum(), leaves)
    want = torch.autograd.grad((expected * w).sum(), leaves)
    for name, a, b in zip(("x", "state", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_compiled_conv_matches_eager():
    """Through torch.compile (the shifted-sum form) the module gives eager mode's outputs and gradients."""
    torch.manual_seed(4)
    conv = ShortConvolution(8, 4, bias=True)
    x = torch.randn(2, 9, 8, requires_grad=True)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda t: conv(t)[0], backend=recording_backend, fullgraph=True)
    eager_out = conv(x)[0]
    eager_grads = torch.autograd.grad(eager_out.square().sum(), [x, conv.weight, conv.bias])
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), [x, conv.weight, conv.bias])
    traced = " ".join(str(node.target) for gm in graphs for node in gm.graph.nodes)
    assert graphs and "conv1d" not in traced, traced  # the shifted sum ran, not F.conv1d
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [1, 2, 5, 10])
def test_state_passing_is_exact(split):
    torch.manual_seed(1)
    conv = ShortConvolution(5, 4, bias=True)
    x = torch.randn(3, 11, 5)
    full, full_state = conv(x, output_final_state=True)
    first, state = conv(x[:, :split], output_final_state=True)
    second, final = conv(x[:, split:], initial_state=state, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, full_state)
    torch.testing.assert_close(full_state, x[:, -3:])  # the state is the last K-1 inputs


def test_step_by_step_equals_full():
    torch.manual_seed(2)
    conv = ShortConvolution(4, 4, bias=False)
    x = torch.randn(2, 9, 4)
    full, _ = conv(x)
    state, steps = None, []
    for t in range(9):
        y, state = conv(x[:, t : t + 1], initial_state=state, output_final_state=True)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_documents_equal_each_alone(with_state):
    torch.manual_seed(3)
    conv = ShortConvolution(5, 4, bias=True)
    lengths = [5, 1, 2, 7]  # some shorter than K - 1
    cu = torch.tensor([0, 5, 6, 8, 15])
    x = torch.randn(1, 15, 5)
    states = torch.randn(4, 3, 5) if with_state else None
    packed, finals = conv(x, cu_seqlens=cu, initial_state=states, output_final_state=True)
    for n in range(len(lengths)):
        start, end = int(cu[n]), int(cu[n + 1])
        alone, final = conv(x[:, start:end], initial_state=None if states is None else states[n : n + 1],
                            output_final_state=True)
        torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(finals[n : n + 1], final, rtol=0, atol=0)
    # Without the boundaries the second document would see the first one's tail.
    unpacked, _ = conv(x)
    assert not torch.allclose(unpacked[:, 5:6], packed[:, 5:6], atol=1e-4)


def test_packed_documents_without_state_run_in_place(monkeypatch):
    """Packed documents with no state in or out (training) take the in-place form (taps masked at the documents'
    starts): the same outputs and gradients, in float64, as each document alone and as the gapped form (which zero
    initial states select); documents shorter than K - 1."""
    torch.manual_seed(4)
    cu = torch.tensor([0, 6, 7, 9, 17])
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 17, 5, dtype=torch.float64, requires_grad=True)
    seen = []
    real = short_conv._depthwise
    with monkeypatch.context() as patch:  # the in-place form never builds the gapped row (whose conv `_depthwise` runs)
        patch.setattr(short_conv, "_depthwise", lambda *args: seen.append(args[0].shape) or real(*args))
        in_place, final = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu)
        assert seen == [] and final is None
        causal_conv1d(x, weight, bias, cu_seqlens=cu, output_final_state=True)  # a final state: the gapped row
        assert seen == [(1, 17 + 4 * 3, 5)]
    gapped, _ = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu,
                              initial_state=torch.zeros(4, 3, 5, dtype=torch.float64))
    alone = torch.cat([causal_conv1d(x[:, a:b], weight, bias, activation="silu")[0]
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    probe = torch.randn_like(in_place)
    grads = [torch.autograd.grad((y * probe).sum(), (x, weight, bias)) for y in (in_place, gapped, alone)]
    for y, g in zip((gapped, alone), grads[1:]):
        torch.testing.assert_close(in_place, y, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads[0], g):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_packed_rows_run_in_place_for_short_documents():
    """On the CPU (where the conv is the shifted sum anyway) always; elsewhere (a GPU in eager mode; here the meta
    device) while the documents average at most IN_PLACE_MAX_MEAN_DOCUMENT tokens."""
    assert short_conv.IN_PLACE_MAX_MEAN_DOCUMENT == 1024
    assert short_conv.packed_in_place(torch.empty(1, 10**6, 8), 1)
    x = torch.empty(1, 491_520, 8, device="meta")  # a packed addition batch: 480 rows x 1024 tokens
    assert short_conv.packed_in_place(x, 8700) and short_conv.packed_in_place(x, 480)
    assert not short_conv.packed_in_place(x, 479) and not short_conv.packed_in_place(x[:, :32768], 8)


def test_position_ids_mark_the_same_boundaries():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 5, 6, 10, 12]


def test_bad_state_shape_is_rejected():
    x = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, torch.randn(4, 4), initial_state=torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, torch.randn(4, 4), initial_state=torch.zeros(1, 3, 4), cu_seqlens=torch.tensor([0, 2, 6]))


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_seq_idx_runs_each_document_alone(kernel):
    """seq_idx: no tap crosses a change of document (rows of documents shorter and longer than the kernel, an id
    that comes back), the carried state reaches only a row's first document, and the final state is the last
    document's alone; outputs and gradients (float64) equal each document run on its own."""
    torch.manual_seed(0)
    channels = 3
    rows = [[2, 1, 6], [9]]
    ids = torch.tensor([[0, 0, 1, 0, 0, 0, 0, 0, 0], [5] * 9])
    x = torch.randn(2, 9, channels, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(channels, kernel, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(channels, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, kernel - 1, channels, dtype=torch.float64, requires_grad=True)
    y, final = causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True,
                             seq_idx=ids)
    ys, finals = [], []
    for r, lengths in enumerate(rows):
        start, carried, parts = 0, state[r : r + 1], []
        for d, length in enumerate(lengths):
            begin = carried if d == 0 else torch.zeros_like(carried)
            y_d, carried = causal_conv1d(x[r : r + 1, start : start + length], weight, bias, activation="silu",
                                         initial_state=begin, output_final_state=True)
            parts.append(y_d)
            start += length
        ys.append(torch.cat(parts, dim=1))
        finals.append(carried)
    want_y, want_final = torch.cat(ys), torch.cat(finals)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    got = torch.autograd.grad((y * g).sum() + final.sum(), [x, weight, bias, state])
    want = torch.autograd.grad((want_y * g).sum() + want_final.sum(), [x, weight, bias, state])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
