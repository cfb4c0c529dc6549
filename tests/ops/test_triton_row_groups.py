"""Calls with more sequences x heads than a CUDA launch grid axis holds (65535): the front doors of both ops run the
Triton kernels once per group of sequences (`hybridlm.ops.utils.launch_row_groups`) and join the results.

The grouping is checked on small shapes by lowering the grid limit (GPU, or CPU with HYBRIDLM_TRITON_INTERPRET=1),
and on the real limit on a GPU.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from tests.ops.triton_modes import DEVICE, gpu_only, interpret  # sets the mode

from hybridlm.ops import FastWeightState, fast_weight_attention
from hybridlm.ops import utils as op_utils
from hybridlm.ops.fast_weight import op as fast_weight_op
from hybridlm.ops.ssd import ssd
from hybridlm.ops.utils import MAX_GRID_YZ, launch_row_groups, packed_group
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import front_door_errors, make_inputs, random_state
from tests.ops.ssd_helpers import make_inputs as ssd_inputs

ssd_package = importlib.import_module("hybridlm.ops.ssd")  # the module (the package exports the function)


def test_row_groups_cover_the_rows_within_the_limit():
    assert launch_row_groups(256, 12) is None and launch_row_groups(0, 8) is None  # one launch: no groups
    assert launch_row_groups(8191, 8) is None  # 65528 programs
    assert launch_row_groups(8192, 8) == [(0, 4096), (4096, 8192)]  # 65536: two even groups
    assert launch_row_groups(4097, 16) == [(0, 2049), (2049, 4097)]
    assert launch_row_groups(5, 3, max_programs=6) == [(0, 2), (2, 4), (4, 5)]
    assert launch_row_groups(3, 100, max_programs=10) == [(0, 1), (1, 2), (2, 3)]  # heads over the limit: one row
    for n_rows, heads in ((70000, 1), (9000, 8), (100_000, 7), (2, 65536)):
        groups = launch_row_groups(n_rows, heads)
        assert [g[0] for g in groups[1:]] == [g[1] for g in groups[:-1]] and groups[0][0] == 0
        assert groups[-1][1] == n_rows
        assert all((stop - start) * heads <= MAX_GRID_YZ or stop - start == 1 for start, stop in groups)
        sizes = [stop - start for start, stop in groups]
        assert max(sizes) - min(sizes) <= 1 and len(groups) == -(-n_rows * heads // MAX_GRID_YZ) or heads > MAX_GRID_YZ


def test_packed_group_rebases_offsets():
    offsets = torch.tensor([0, 5, 40, 41, 70])
    tokens, rebased = packed_group(offsets, 1, 3)
    assert (tokens.start, tokens.stop) == (5, 41) and rebased.tolist() == [0, 35, 36]
    tokens, rebased = packed_group(offsets, 0, 4)
    assert (tokens.start, tokens.stop) == (0, 70) and rebased.tolist() == offsets.tolist()


def test_state_slices_and_cat_round_trip():
    state = random_state(5, 2, 3, 4, window=3)
    parts = [state[0:2], state[2:3], state[3:5]]
    assert parts[1].S.shape == (1, 2, 3, 4) and parts[2].tail_len.shape == (2,)
    joined = FastWeightState.cat(parts)
    for name in ("S", "last_k", "tail_x", "tail_v", "tail_len"):
        assert torch.equal(getattr(joined, name), getattr(state, name)), name
    assert FastWeightState.cat([FastWeightState(S=state.S[:2]), FastWeightState(S=state.S[2:])]).last_k is None


def _spy_on(monkeypatch, module, name, *, max_programs):
    """Lower the grid limit the front doors plan their groups with, and count `module`'s calls of its Triton backend
    `name`."""
    monkeypatch.setattr(op_utils, "launch_row_groups", functools.partial(launch_row_groups, max_programs=max_programs))
    calls = []
    backend = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return backend(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@interpret
@pytest.mark.parametrize("rule,window,packed", [("1A", 1, False), ("1A", 1, True), ("1", 1, False), ("1", 1, True),
                                                ("3A", 3, False), ("3A", 3, True), ("2A", 1, True), ("3", 3, True)])
@pytest.mark.parametrize("per_group", [1, 2])
def test_fast_weight_groups_match_the_chunk_path(monkeypatch, rule, window, packed, per_group):
    """Grouped Triton calls (the limit lowered to one or two sequences per call) against the chunk backend: outputs,
    the whole final state (S, last key, window tail) and every gradient, with a carried state; batch rows and packed
    sequences (groups of several packed sequences rebase their interior offsets)."""
    calls = _spy_on(monkeypatch, fast_weight_op, "fast_weight_triton", max_programs=2 * per_group)
    errors = front_door_errors(rule, window, "shifted", "after", "nlms", packed, stateful=True)
    n = 4 if packed else 2  # sequences; H = 2 heads
    assert len(calls) == -(-n // per_group)
    assert max(errors.values()) < 1e-4, errors


@interpret
def test_fast_weight_groups_with_seq_idx(monkeypatch):
    """Documents restarted in place (`seq_idx`) under grouping: the same output as one call."""
    q, k, v, beta, lam = (t.to(DEVICE, torch.float32) for t in make_inputs("1", B=3, T=40, H=2, K=16, V=16))
    seq_idx = torch.tensor([[0] * 15 + [1] * 25, [0] * 40, [0] * 5 + [1] * 30 + [2] * 5], device=DEVICE)
    whole, _ = fast_weight_attention(q, k, v, beta, lam, rule="1", seq_idx=seq_idx, backend="triton")
    calls = _spy_on(monkeypatch, fast_weight_op, "fast_weight_triton", max_programs=2)
    grouped, _ = fast_weight_attention(q, k, v, beta, lam, rule="1", seq_idx=seq_idx, backend="triton")
    assert len(calls) == 3
    assert rel_err(grouped, whole) < 1e-6


def _ssd_outputs(inputs, **kwargs):
    y, h = ssd(**inputs, output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(3)
    w_y = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y)
    w_h = torch.randn(h.shape, generator=g, dtype=torch.float64).to(h)
    leaves = [inputs[name] for name in ("x", "dt", "A", "B", "C", "D", "initial_state")]
    return [y.detach(), h.detach(), *torch.autograd.grad((y * w_y).sum() + (h * w_h).sum(), leaves)]


@interpret
@pytest.mark.parametrize("packed", [False, True])
def test_ssd_groups_match_one_call(monkeypatch, packed):
    """Grouped SSD Triton calls (one sequence per group) against one call with the real limit and against the chunk
    backend: output, final state and every gradient (x, dt, A, B, C, D, initial state)."""
    lengths = [5, 21, 1, 9]
    b, T, n = (1, sum(lengths), len(lengths)) if packed else (3, 37, 3)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    inputs = {name: t.detach().to(DEVICE, torch.float32).requires_grad_(True)
              for name, t in ssd_inputs(b, T, 4, 3, 2, 5, n_states=n, seed=4).items()}
    options = {"chunk_size": 16, "cu_seqlens": cu_seqlens}
    whole = _ssd_outputs(inputs, backend="triton", **options)
    reference = _ssd_outputs(inputs, backend="chunk", **options)
    calls = _spy_on(monkeypatch, ssd_package, "ssd_triton", max_programs=4)
    grouped = _ssd_outputs(inputs, backend="triton", **options)
    assert len(calls) == n
    for a, b_, c in zip(grouped, whole, reference):
        assert rel_err(a, b_) < 1e-6 and rel_err(a, c) < 1e-4


@interpret
def test_empty_batch_passes_through(monkeypatch):
    """No rows: one (empty) call, as before the grouping existed."""
    q, k, v, beta, lam = (t[:0].to(DEVICE, torch.float32) for t in make_inputs("1A", B=2, T=5, H=2, K=16, V=16))
    o, s = fast_weight_attention(q, k, v, beta, lam, rule="1A", backend="triton", output_final_state=True)
    assert o.shape == (0, 5, 2, 16) and s.S.shape == (0, 2, 16, 16)


@gpu_only
def test_real_grid_limit_on_gpu():
    """4097 rows x 16 heads = 65552 programs per axis: both ops run (two groups) and match the chunk path."""
    q, k, v, beta, lam = (t.to("cuda", torch.float32) for t in make_inputs("1A", B=4097, T=20, H=16, K=16, V=16))
    o, s = fast_weight_attention(q, k, v, beta, lam, rule="1A", backend="triton", output_final_state=True)
    o_ref, s_ref = fast_weight_attention(q, k, v, beta, lam, rule="1A", backend="chunk", output_final_state=True)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s.S, s_ref.S) < 1e-4
    inputs = {name: t.detach().to("cuda", torch.float32) for name, t in ssd_inputs(4097, 20, 16, 16, 1, 16).items()}
    y, h = ssd(**inputs, chunk_size=16, output_final_state=True, backend="triton")
    y_ref, h_ref = ssd(**inputs, chunk_size=16, output_final_state=True, backend="chunk")
    assert rel_err(y, y_ref) < 1e-4 and rel_err(h, h_ref) < 1e-4


@interpret
def test_direct_fast_weight_preparation_refuses_grids_over_the_limit():
    """`fast_weight_triton` called past the front door: the fused preparation refuses before it launches. (Two
    steps: a single step without a gradient runs the decoding step's kernel, whose grid puts rows x heads on the
    axis that takes 2^31 - 1 programs.)"""
    from hybridlm.ops.fast_weight.options import FastWeightOptions
    from hybridlm.ops.fast_weight.triton import fast_weight_triton

    q = torch.zeros(65536, 2, 1, 16, device=DEVICE)
    eta = torch.zeros(65536, 2, 1, device=DEVICE)
    state = FastWeightState(S=torch.zeros(65536, 1, 16, 16, device=DEVICE))
    with pytest.raises(ValueError, match="65535: call fast_weight_attention"):
        fast_weight_triton(q, q, q, eta, eta, FastWeightOptions(rule="1A"), initial_state=state, offsets=None)


@interpret
def test_direct_ssd_kernels_refuse_grids_over_the_limit():
    """The SSD scan called past the front door with rows x heads over 65535: a clear error, not a failed launch."""
    from hybridlm.ops.ssd.triton import ssd_chunk_triton

    x = torch.zeros(65536, 1, 1, 16, device=DEVICE)
    dt = torch.zeros(65536, 1, 1, device=DEVICE)
    B = torch.zeros(65536, 1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="65535: call ssd"):
        ssd_chunk_triton(x, dt, torch.zeros(1, device=DEVICE), B, B, None, None, chunk_size=16)


def test_host_grid_arithmetic_matches_triton():
    """`cdiv` and `next_power_of_2` (plain integers, for the launchers' grids and blocks) give Triton's values."""
    triton = pytest.importorskip("triton")
    from hybridlm.ops.utils import cdiv, next_power_of_2

    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 16, 64, 100):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert next_power_of_2(2**40 + 1) == triton.next_power_of_2(2**40 + 1)
