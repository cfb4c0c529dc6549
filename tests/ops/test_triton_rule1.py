"""Rules 1A and 1 in Triton, the two window-1 scans with a scalar decay per step, on prepared writes

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t y_t^T                      (rule 1A)
    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T     (rule 1)
    o_t = S_t^T q_t (read after) or S_{t-1}^T q_t (before),

against a float64 step loop of the same recurrence (parametrized over both kernels), rule 1A's state scan (its
blocks, its per-chunk state dtype), and the front door with backend="triton" (raw inputs, packed sequences included)
against the torch chunk backend. tests/ops/test_triton_compile.py checks the custom ops and torch.compile,
tests/ops/test_triton_sm90.py the kernels' builds for sm_90.

Where they run:
- GPU machine (CUDA + triton): every test runs on CUDA tensors (float32, bfloat16, float16):
      python -m pytest -q tests/ops/test_triton_rule1.py
- CPU, no GPU (CI): skipped, except the tests that need no kernel launch.
- CPU with triton installed and HYBRIDLM_TRITON_INTERPRET=1: the tests marked `interpret` run the kernels on CPU
  tensors under Triton's interpreter (tests/ops/conftest.py sets TRITON_INTERPRET=1 before triton is imported):
      HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_triton_rule1.py
  The interpreter's tl.dot is wrong for bfloat16 (numpy has no bfloat16), so float16 stands in for the 16-bit
  path there; bfloat16 is checked on the GPU only.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.triton import (
    MAX_DELTA_CHUNK,
    fast_weight_1_triton,
    fast_weight_1a_triton,
    fast_weight_triton,
    supports,
)
from tests.helpers import rel_err
from tests.ops.fast_weight_helpers import KERNELS, check_against_reference, front_door_errors, prepared, record_launches
from tests.ops.triton_modes import DEVICE, HAS_TRITON, ON_GPU, gpu_only, interpret, skip_bfloat16_interpreted

CASES = list(itertools.product(KERNELS, (torch.float32, torch.float16, torch.bfloat16), (1, 63, 130), (16, 64),
                               (True, False)))


@interpret
@pytest.mark.parametrize("rule,dtype,T,chunk_size,read_after", CASES,
                         ids=[f"rule{r}-{str(d)[6:]}-T{T}-C{c}-{'after' if a else 'before'}" for r, d, T, c, a in CASES])
def test_matches_reference(rule, dtype, T, chunk_size, read_after):
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("the interpreter's tl.dot is wrong for bfloat16; float16 covers the 16-bit path on the CPU")
    rows = 2 if dtype == torch.float32 else 1  # several rows: the kernels' (row, head) program indexing
    check_against_reference(rows, T, 2, 16, 24, dtype=dtype, chunk_size=chunk_size, read_after=read_after, rule=rule)


SCAN_CASES = [(130, 16, True, True, 16, 24), (63, 16, False, False, 16, 24), (1, 16, True, True, 16, 24),
              (200, 64, False, True, 100, 40)]


@interpret
@pytest.mark.parametrize("min_programs", [0, 10**6], ids=["fixed-blocks", "narrowed-blocks"])
@pytest.mark.parametrize("T,chunk_size,read_after,with_S0,K,V", SCAN_CASES,
                         ids=[f"T{c[0]}-C{c[1]}-{'after' if c[2] else 'before'}-{'S0' if c[3] else 'noS0'}-K{c[4]}V{c[5]}"
                              for c in SCAN_CASES])
def test_state_scan_matches_reference(T, chunk_size, read_after, with_S0, K, V, min_programs, monkeypatch):
    """The state stages (1) + (2) and (1') + (2') (one kernel, `state_scan_kernel`) give rule 1A's outputs, final
    state and every gradient of the step loop (several key / value blocks with K = 100, V = 40), also when only
    the outputs or only the final state carry a gradient; with the scan's fixed [64, 32] blocks (SCAN_MIN_PROGRAMS
    = 0) and with the blocks narrowed as far as they go (`inner_product.scan_blocks`: 16 x 16, several blocks on both
    sides at K = 100, V = 40; the default narrows these few rows x heads that far too)."""
    from hybridlm.ops.fast_weight.triton import inner_product

    monkeypatch.setattr(inner_product, "SCAN_MIN_PROGRAMS", min_programs)
    check_against_reference(2, T, 2, K, V, dtype=torch.float32, chunk_size=chunk_size, read_after=read_after,
                            with_S0=with_S0)
    check_against_reference(1, T, 2, K, V, dtype=torch.float16, chunk_size=chunk_size, read_after=read_after,
                            with_S0=with_S0)
    for grad_o, grad_S in ((True, False), (False, True)):
        check_against_reference(1, T, 2, K, V, dtype=torch.float32, chunk_size=chunk_size, read_after=read_after,
                                with_S0=with_S0, grad_o=grad_o, grad_S=grad_S)


@interpret
@pytest.mark.parametrize("read_after", [True, False], ids=["after", "before"])
def test_backward_without_final_state_gradient(read_after):
    """The backward op with dS_final = None (autograd always passes zeros through the forward op, so the op is
    called directly): the reverse scan starting from no gradient equals the one starting from a zero gradient."""
    import hybridlm.ops.fast_weight.triton.custom_ops  # noqa: F401  (registers the ops)

    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in prepared(2, 75, 2, 16, 24, seed=3))
    do = torch.randn(q.shape[:3] + (24,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    zero = torch.zeros_like(S0)
    without = torch.ops.hybridlm.fast_weight_1a_bwd(do, None, q, x, y, eta, log_gamma, S0, read_after, 16)
    with_zero = torch.ops.hybridlm.fast_weight_1a_bwd(do, zero, q, x, y, eta, log_gamma, S0, read_after, 16)
    for name, a, b in zip(("dq", "dx", "dy", "deta", "dlog_gamma", "dS0"), without, with_zero):
        assert rel_err(a.cpu(), b.cpu()) < 1e-6, name


@interpret
@pytest.mark.parametrize("rule", KERNELS)
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (100, 40), (128, 16)])
def test_head_dims(rule, K, V):
    """Several K/V blocks per state, all of K in one program where a kernel needs it (the WY, pass and dq kernels),
    non-powers of two; K = 128 with V = 16: rule 1's passes on [128, 16] state blocks (a block shape whose forward
    pass failed with one pipeline stage on a GPU, benchmarks/RESULTS.md)."""
    check_against_reference(1, 70, 1, K, V, dtype=torch.float32, chunk_size=64, read_after=True, rule=rule)


@interpret
@pytest.mark.parametrize("blocks", [(64, 32), (32, 64), (64, 16), (16, 64)], ids=str)
@pytest.mark.parametrize("read_after", [True, False], ids=["after", "before"])
def test_gradient_kernel_with_more_key_or_value_blocks(monkeypatch, blocks, read_after):
    """Rule 1A's dq/dx/dy kernel with more key blocks than value blocks and the reverse (programs that take only a
    key block of dq and dx, or only a value block of dy), d eta and d log_gamma summed from per-block shares."""
    from hybridlm.ops.fast_weight.triton import inner_product

    monkeypatch.setattr(inner_product, "grad_qxy_blocks", lambda K, V: blocks)
    check_against_reference(2, 70, 1, 128, 128, dtype=torch.float32, chunk_size=32, read_after=read_after)


@interpret
@pytest.mark.parametrize("rule", KERNELS)
def test_no_initial_state_and_the_largest_chunk(rule):
    """Chunks of 128 for 1A, of MAX_DELTA_CHUNK (64) for rule 1, which refuses 128 (shared memory)."""
    chunk = 128 if rule == "1A" else MAX_DELTA_CHUNK
    check_against_reference(1, 150, 2, 16, 16, dtype=torch.float32, chunk_size=chunk, read_after=False, with_S0=False,
                            rule=rule)
    if rule == "1":
        q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in prepared(1, 8, 1, 16, 16))
        with pytest.raises(ValueError, match="at most 64"):
            fast_weight_1_triton(q, x, y, eta, log_gamma, S0, read_after=True, chunk_size=128)


@interpret
@pytest.mark.parametrize("rule", KERNELS)
@pytest.mark.parametrize("read_after", [True, False], ids=["after", "before"])
def test_odd_sizes_without_initial_state(rule, read_after):
    """K != V (V below the smallest block), T not a multiple of the chunk, no initial state (S0 = None)."""
    check_against_reference(2, 37, 1, 16, 8, dtype=torch.float32, chunk_size=16, read_after=read_after,
                            with_S0=False, rule=rule)


@gpu_only
@pytest.mark.parametrize("rule", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_shape(rule, dtype):
    """A model-sized head (K = V = 128) over many chunks, several rows and heads."""
    check_against_reference(2, 1000, 4, 128, 128, dtype=dtype, chunk_size=64, read_after=True, rule=rule)


@interpret
@pytest.mark.parametrize("rule", KERNELS)
@pytest.mark.parametrize("grad_o,grad_S", [(True, False), (False, True)])
def test_one_output_used(rule, grad_o, grad_S):
    """Only o or only the final state reaches the loss (the other gradient arrives as None)."""
    check_against_reference(1, 40, 2, 16, 16, dtype=torch.float32, chunk_size=16, read_after=True, rule=rule,
                            grad_o=grad_o, grad_S=grad_S)


@interpret
@pytest.mark.parametrize("rule", KERNELS)
def test_state_carry_over(rule):
    """Running [0:T] equals running [0:t] and then [t:T] from the returned state (t not on a chunk edge)."""
    kernel = KERNELS[rule]
    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in prepared(1, 100, 2, 16, 16, seed=3))
    o, S = kernel(q, x, y, eta, log_gamma, S0, read_after=True, chunk_size=16)
    o1, S1 = kernel(*(t[:, :37] for t in (q, x, y, eta, log_gamma)), S0, read_after=True, chunk_size=16)
    o2, S2 = kernel(*(t[:, 37:] for t in (q, x, y, eta, log_gamma)), S1, read_after=True, chunk_size=16)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-5
    assert rel_err(S2, S) < 1e-5


CONTRACT_CASES = [  # rule, window, pairing, read, step_size, packed, with an initial state
    ("1A", 1, "shifted", "after", "nlms", False, True), ("1A", 1, "shifted", "before", "direct", True, True),
    ("1A", 1, "same_step", "after", "nlms", True, True),
    ("1", 1, "shifted", "after", "nlms", False, True), ("1", 1, "shifted", "before", "direct", True, True),
    ("1", 1, "same_step", "after", "nlms", True, True), ("1", 1, "shifted", "before", "nlms", True, False),
    ("1", 1, "same_step", "after", "nlms", False, False),
]


@interpret
@pytest.mark.parametrize("rule,window,pairing,read,step_size,packed,stateful", CONTRACT_CASES,
                         ids=["-".join(map(str, case[:5])) + ("-packed" if case[5] else "")
                              + ("" if case[6] else "-fresh")
                              for case in CONTRACT_CASES])
def test_front_door_matches_chunk(rule, window, pairing, read, step_size, packed, stateful):
    """`fast_weight_attention(backend="triton")` (raw q, k, v, beta, lam -> prepared writes -> kernels) against the
    torch chunk backend, with or without a carried state (S, last key), ridge scaling and packed sequences
    (`cu_seqlens`): outputs, the whole final state and all gradients (q, k, v, beta, lam and the initial S)."""
    errors = front_door_errors(rule, window, pairing, read, step_size, packed, stateful)
    assert max(errors.values()) < 1e-4, errors


@interpret
def test_rejects_launch_grids_over_the_cuda_limit():
    """Rows x heads (and chunks) go on launch-grid axes limited to 65535: a clear error instead of a failed launch."""
    q = torch.zeros(65536, 1, 1, 16, device=DEVICE)
    eta = torch.zeros(65536, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="65535"):
        fast_weight_1a_triton(q, q, q, eta, eta, None, read_after=True, chunk_size=16)


@interpret
def test_rejects_unsupported_calls():
    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in prepared(1, 8, 1, 16, 16))
    with pytest.raises(ValueError, match="chunk_size"):
        fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, read_after=True, chunk_size=48)
    with pytest.raises(ValueError, match="one dtype"):
        fast_weight_1a_triton(q, x.half(), y, eta, log_gamma, S0, read_after=True, chunk_size=16)
    big = torch.zeros(1, 8, 1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="K, V <= 128"):
        fast_weight_1a_triton(big, big, y, eta, log_gamma, None, read_after=True, chunk_size=16)
    with pytest.raises(ValueError, match="rules 1A"):
        fast_weight_triton(q, q, y, eta, eta, FastWeightOptions(rule="3", window=65), initial_state=None,
                           offsets=None)


@interpret
@pytest.mark.parametrize("rule", ["1A", "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_chunk_states_are_stored_in_the_inputs_dtype(monkeypatch, rule, dtype):
    """The per-chunk state buffers of a forward + backward. Rule 1A: the entry states, their recomputation and dS_out
    all in the inputs' dtype (every product that reads them takes that dtype; half the bytes of the op's largest
    buffers). Rule 1: the forward's entry states in the inputs' dtype (only the outputs read them, rounded to it
    anyway), the backward's recomputed states float32 (its TF32 products; its dS_out is a float32 buffer of its own).
    float32 inputs: all float32. The final state is float32 either way."""
    from hybridlm.ops.fast_weight.triton import inner_product, regression

    plan = inner_product.ScalarPlan if rule == "1A" else regression.EventPlan
    made = []
    original = plan.state_buffer

    def recording(self, *args):
        buffer = original(self, *args)
        made.append(buffer.dtype)
        return buffer

    monkeypatch.setattr(plan, "state_buffer", recording)
    g = torch.Generator().manual_seed(0)
    q, x = (torch.randn(1, 40, 2, 16, generator=g).to(DEVICE, dtype).requires_grad_(True) for _ in range(2))
    y = torch.randn(1, 40, 2, 8, generator=g).to(DEVICE, dtype).requires_grad_(True)
    eta = (0.5 * torch.rand(1, 40, 2, generator=g)).to(DEVICE).requires_grad_(True)
    log_gamma = (-torch.rand(1, 40, 2, generator=g)).to(DEVICE).requires_grad_(True)
    scan = fast_weight_1a_triton if rule == "1A" else fast_weight_1_triton
    o, S = scan(F.normalize(q, dim=-1), F.normalize(x, dim=-1), y, eta, log_gamma, None, read_after=True,
                chunk_size=16)
    (o.float().sum() + S.sum()).backward()
    assert made == ([dtype] * 3 if rule == "1A" else [dtype, torch.float32])
    assert S.dtype == torch.float32


@interpret
@pytest.mark.parametrize("read_after", [True, False])
def test_rule_1_outputs_are_the_same_from_16bit_stored_states(monkeypatch, read_after):
    """Rule 1's forward stores its entry states in the inputs' dtype: its outputs and final state are bit for bit
    those from float32 stored states (the output kernel's product rounds the states to the inputs' dtype either way;
    the pass carries its own float32 state)."""
    from hybridlm.ops.fast_weight.triton import regression

    g = torch.Generator().manual_seed(1)
    q, x = (F.normalize(torch.randn(2, 50, 2, 32, generator=g), dim=-1).to(DEVICE, torch.float16) for _ in range(2))
    y = torch.randn(2, 50, 2, 16, generator=g).to(DEVICE, torch.float16)
    eta = (0.5 * torch.rand(2, 50, 2, generator=g)).to(DEVICE)
    log_gamma = (-0.1 * torch.rand(2, 50, 2, generator=g)).to(DEVICE)
    o16, S16 = regression.forward_1(q, x, y, eta, log_gamma, None, read_after, 16)
    scan = regression.EventPlan.scan
    monkeypatch.setattr(regression.EventPlan, "scan", lambda self, *args, states_dtype: scan(self, *args))
    o32, S32 = regression.forward_1(q, x, y, eta, log_gamma, None, read_after, 16)
    assert o16.dtype == torch.float16 and torch.equal(o16, o32) and torch.equal(S16, S32)


@interpret
@pytest.mark.parametrize("K,V,extra,chunk_size,read_after", [(32, 24, 3, 16, False), (20, 12, 2, 64, True)],
                         ids=["K32V24-C16-before", "K20V12-C64-after"])
@pytest.mark.parametrize("dtype,walk", [(torch.float32, False), (torch.float16, False), (torch.float16, True),
                                        (torch.bfloat16, True)], ids=["float32", "float16", "float16-walk",
                                                                      "bfloat16-walk"])
def test_rule_1a_reads_the_first_rows_of_longer_writes(monkeypatch, dtype, walk, K, V, extra, chunk_size, read_after):
    """Rule 1A's kernels on x and y with T_xy > T rows (rule 3A's delayed op passes its ext rows, of which the first T
    are the delayed writes) give exactly the results of their first T rows alone, in the forward walk and the
    chunk-parallel form, on several rows (each program finds its row's writes at the row stride T_xy): the same
    outputs, final state and gradients bit for bit, and zero gradients for the rows after the first T. The public
    op takes x and y of T rows only."""
    skip_bfloat16_interpreted(dtype)
    from hybridlm.ops.fast_weight.triton import inner_product

    monkeypatch.setattr(inner_product, "WALK_MIN_PROGRAMS", 0 if walk else 10**6)
    walks = record_launches(monkeypatch, inner_product.whole_state, "output_walk_kernel", lambda grid, kwargs: grid)
    T = 70
    q, x, y, eta, log_gamma, S0 = prepared(3, T, 2, K, V, seed=5)
    x_long = torch.cat([x, torch.randn(3, extra, 2, K, dtype=x.dtype) * 50], dim=1)
    y_long = torch.cat([y, torch.randn(3, extra, 2, V, dtype=y.dtype) * 50], dim=1)
    q, x, y, x_long, y_long = (t.to(DEVICE, dtype) for t in (q, x, y, x_long, y_long))
    eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in (eta, log_gamma, S0))
    do, dS = torch.randn_like(q[..., :V]), torch.randn_like(S0)
    results = []
    for xs, ys in ((x, y), (x_long, y_long)):
        o, S = inner_product.forward_1a(q, xs, ys, eta, log_gamma, S0, read_after, chunk_size)
        results.append((o, S, *inner_product.backward_1a(do, dS, q, xs, ys, eta, log_gamma, S0, read_after,
                                                         chunk_size)))
    assert walks == ([(6,)] * 2 if walk else [])
    (o, S, dq, dx, dy, deta, dlg, dS0), (o2, S2, dq2, dx2, dy2, deta2, dlg2, dS02) = results
    for a, b in ((o, o2), (S, S2), (dq, dq2), (dx, dx2[:, :T]), (dy, dy2[:, :T]), (deta, deta2), (dlg, dlg2),
                 (dS0, dS02)):
        assert torch.equal(a, b)
    assert dx2.shape == x_long.shape and not dx2[:, T:].any() and not dy2[:, T:].any()
    assert o.float().abs().amax() > 0
    with pytest.raises(ValueError, match=r"x \[N, T, H, K\]"):
        fast_weight_1a_triton(q, x_long, y_long, eta, log_gamma, S0, read_after=False, chunk_size=16)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (no GPU)")
def test_scan_blocks_narrow_for_few_states():
    """By default (SCAN_MIN_PROGRAMS = 264, two waves of an H200's 132 SMs) the scan keeps [64, 32] blocks when the
    states give enough programs and narrows them (the larger side first, not below 16) when few rows x heads would
    leave SMs idle; 0 programs asked: the fixed blocks."""
    from hybridlm.ops.fast_weight.triton.inner_product import SCAN_MIN_PROGRAMS, scan_blocks

    assert SCAN_MIN_PROGRAMS == 264
    assert scan_blocks(128, 128, 8 * 16) == (64, 32)  # the op benchmark's shape: 2 x 4 x 128 = 1024 programs
    assert scan_blocks(64, 64, 10) == scan_blocks(64, 64, 10, SCAN_MIN_PROGRAMS) == (16, 16)  # a model's row: 1 x 10
    assert scan_blocks(64, 64, 10, 0) == (64, 32) and scan_blocks(128, 128, 8 * 16, 0) == (64, 32)
    assert scan_blocks(64, 64, 10, 80) == (16, 32)  # K halved twice: 4 x 2 x 10 = 80 programs
    for K, V, NH in ((64, 64, 10), (100, 40, 4), (16, 24, 2), (128, 128, 1), (128, 128, 8 * 16), (64, 64, 8 * 16)):
        BK, BV = scan_blocks(K, V, NH)
        programs = -(-K // BK) * -(-V // BV) * NH
        assert min(BK, BV) >= 16 and (programs >= SCAN_MIN_PROGRAMS or (BK, BV) == (16, 16))


@interpret
# K = 64, V = 48: 4 x 3 blocks of 16 x 16 (narrowed as far as they go: 1 row x 2 heads), or 1 x 2 of [64, 32]
@pytest.mark.parametrize("min_programs,blocks", [(None, (4 * 3, 16, 16)), (0, (1 * 2, 64, 32))],
                         ids=["default-narrowed", "fixed-blocks"])
def test_rule_1a_scan_launches_with_scan_blocks(monkeypatch, min_programs, blocks):
    """The forward and backward scans launch with `scan_blocks`' blocks for the call's sizes and SCAN_MIN_PROGRAMS
    (the fixed- and narrowed-block tests above rely on it): by default narrowed for 1 row x 2 heads, with
    SCAN_MIN_PROGRAMS = 0 the fixed [64, 32] blocks."""
    from hybridlm.ops.fast_weight.triton import inner_product

    launched = record_launches(monkeypatch, inner_product.chunk_state, "state_scan_kernel",
                               lambda grid, kwargs: (grid, kwargs["BK"], kwargs["BV"]))
    if min_programs is not None:
        monkeypatch.setattr(inner_product, "SCAN_MIN_PROGRAMS", min_programs)
    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32).requires_grad_(True)
                                   for t in prepared(1, 40, 2, 64, 48, seed=5))
    o, S = fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, read_after=True, chunk_size=16)
    (o.sum() + S.sum()).backward()
    n_blocks, BK, BV = blocks
    assert len(launched) == 3  # forward states; backward: recomputed states, then their gradients
    assert launched == [((n_blocks, 2), BK, BV)] * 3


WALK_CASES = [(130, 16, True, True, 16, 24), (63, 16, False, False, 16, 24), (1, 64, True, False, 16, 24),
              (200, 64, False, True, 100, 40), (70, 16, True, True, 128, 16)]
WALK_IDS = [f"T{c[0]}-C{c[1]}-{'after' if c[2] else 'before'}-{'S0' if c[3] else 'noS0'}-K{c[4]}V{c[5]}"
            for c in WALK_CASES]


@interpret
@pytest.mark.parametrize("T,chunk_size,read_after,with_S0,K,V", WALK_CASES, ids=WALK_IDS)
def test_rule_1a_forward_walk_matches_reference(monkeypatch, T, chunk_size, read_after, with_S0, K, V):
    """Rule 1A's forward walk (`whole_state.output_walk_kernel`, taken here for 16-bit inputs of every shape with
    WALK_MIN_PROGRAMS = 0) gives the step loop's outputs, final state and, through the chunk-parallel backward,
    gradients: float16, with and without S0, reading before and after, one step, odd lengths, padded blocks (K =
    100, V = 40), K up to WALK_MAX_DIM; it launches once per call, one program per row x head, and no state scan.
    The same kernel on float32 inputs (called directly, chunks of 16: the op keeps float32 chunk-parallel) to
    float32's precision."""
    from hybridlm.ops.fast_weight.triton import inner_product
    from tests.ops.fast_weight_helpers import reference

    monkeypatch.setattr(inner_product, "WALK_MIN_PROGRAMS", 0)
    walks = record_launches(monkeypatch, inner_product.whole_state, "output_walk_kernel", lambda grid, kwargs: grid)
    scans = record_launches(monkeypatch, inner_product.chunk_state, "state_scan_kernel", lambda grid, kwargs: grid)
    check_against_reference(1, T, 2, K, V, dtype=torch.float16, chunk_size=chunk_size, read_after=read_after,
                            with_S0=with_S0)
    assert walks == [(2,)] and len(scans) == 2  # the backward's recomputed states and their gradients
    for grad_o, grad_S in ((True, False), (False, True)):
        check_against_reference(1, T, 2, K, V, dtype=torch.float16, chunk_size=chunk_size, read_after=read_after,
                                with_S0=with_S0, grad_o=grad_o, grad_S=grad_S)

    q, x, y, eta, log_gamma, S0 = prepared(2, T, 2, K, V, seed=3)
    o_ref, S_ref = reference(q, x, y, eta, log_gamma, S0 if with_S0 else torch.zeros_like(S0), read_after=read_after)
    q, x, y, eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in (q, x, y, eta, log_gamma, S0))
    plan = inner_product.ScalarPlan(q, y, 16, read_after)  # chunks of 16: float32 tiles of 64 exceed shared memory
    L = inner_product.chunk_cumsum(plan, log_gamma)
    o, S = plan.output_walk(q, x, y, eta, L, S0 if with_S0 else None, 8)
    assert rel_err(o.cpu(), o_ref) < 1e-5 and rel_err(S.cpu(), S_ref) < 1e-5


@interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rule_1a_forward_walk_equals_the_chunk_parallel_forward(monkeypatch, dtype):
    """The forward walk against the state scan + outputs on the same 16-bit inputs: the same final state (the same
    products of each step), outputs within the rounding of their sums over K taken in one block instead of two."""
    skip_bfloat16_interpreted(dtype)
    from hybridlm.ops.fast_weight.triton import inner_product

    q, x, y, eta, log_gamma, S0 = prepared(3, 150, 2, 128, 64, seed=11)
    q, x, y = (t.to(DEVICE, dtype) for t in (q, x, y))
    eta, log_gamma, S0 = (t.to(DEVICE, torch.float32) for t in (eta, log_gamma, S0))
    results = {}
    for min_programs in (0, 10**6):
        monkeypatch.setattr(inner_product, "WALK_MIN_PROGRAMS", min_programs)
        results[min_programs] = inner_product.forward_1a(q, x, y, eta, log_gamma, S0, True, 64)
    (o1, S1), (o2, S2) = results[0], results[10**6]
    assert rel_err(S1.cpu(), S2.cpu()) < 1e-6
    assert rel_err(o1.float().cpu(), o2.float().cpu()) < 4e-3


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (no GPU)")
def test_forward_walk_takes_16bit_inputs_with_enough_rows_and_heads():
    """The forward walk runs one program per row x head (K, V <= 128) at 8 warps for float16 / bfloat16 inputs
    where the rows x heads reach WALK_MIN_PROGRAMS (128, about an H100's SMs); otherwise the chunk-parallel
    forward."""
    from hybridlm.ops.fast_weight.triton.inner_product import WALK_MAX_DIM, WALK_MIN_PROGRAMS, walk_warps

    assert (WALK_MAX_DIM, WALK_MIN_PROGRAMS) == (128, 128)
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert walk_warps(128, 128, 8 * 16, bf16) == 8 and walk_warps(64, 40, 200, f16) == 8
    assert walk_warps(128, 128, 8 * 16, f32) is None                                   # float32 tiles spill
    assert walk_warps(128, 128, 10, bf16) is None and walk_warps(128, 128, 127, bf16) is None  # a model's row
    assert walk_warps(256, 128, 8 * 16, bf16) is None and walk_warps(128, 256, 8 * 16, bf16) is None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (no GPU)")
def test_pass_launch_widens_when_its_programs_cover_the_sms():
    """Rule 1's passes: the narrow launch (32 value columns, 8 warps) for few rows x heads, the wide one (64 columns,
    4 warps, two programs per SM) once its V / 64 x rows x heads programs reach WIDE_PASS_MIN_PROGRAMS (about an
    H200's 132 SMs); at K <= 64 value blocks of 64 at the narrow launch's warps, whatever the batch."""
    from hybridlm.ops.fast_weight.triton.regression import (
        NARROW_PASSES,
        WIDE_PASS_MIN_PROGRAMS,
        WIDE_PASSES,
        pass_launch,
        pass_launches,
    )

    assert WIDE_PASS_MIN_PROGRAMS == 128
    assert (NARROW_PASSES.block_v, NARROW_PASSES.kwargs(), NARROW_PASSES.kwargs(reverse=True)) == (
        32, {"num_warps": 8, "num_stages": 2}, {"num_warps": 8, "num_stages": 3})
    assert (WIDE_PASSES.block_v, WIDE_PASSES.kwargs(), WIDE_PASSES.kwargs(reverse=True)) == (
        64, {"num_warps": 4, "num_stages": 1}, {"num_warps": 4, "num_stages": 1})
    assert pass_launch(128, 128, 8 * 16) == WIDE_PASSES  # the op benchmark's shape: 2 x 128 = 256 programs
    assert pass_launch(128, 128, 4 * 16) == WIDE_PASSES and pass_launch(128, 128, 63) == NARROW_PASSES  # 128 vs 126
    assert pass_launch(128, 128, 2 * 8) == NARROW_PASSES and pass_launch(128, 40, 128) == WIDE_PASSES
    for NH in (1, 4096):
        small = pass_launch(64, 64, NH)
        assert (small.block_v, small.forward, small.reverse) == (64, NARROW_PASSES.forward, NARROW_PASSES.reverse)
    assert pass_launches(128, 128) == [NARROW_PASSES, WIDE_PASSES] and pass_launches(64, 64) == [small]


@interpret
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_rule_1_passes_under_both_launches(monkeypatch, wide):
    """Both launches of the passes (forward and reverse) give rule 1's outputs, final state and gradients against the
    float64 loop at K = V = 128 (several value blocks per state); they launch with the chosen value block and warps."""
    from hybridlm.ops.fast_weight.triton import regression

    def describe(grid, kwargs):
        return grid[0], kwargs["BV"], kwargs["num_warps"], kwargs["num_stages"]

    forward, reverse = (record_launches(monkeypatch, regression.regression_kernels, name, describe)
                        for name in ("delta_pass_kernel", "delta_grad_pass_kernel"))
    monkeypatch.setattr(regression, "WIDE_PASS_MIN_PROGRAMS", 1 if wide else 10**6)
    check_against_reference(1, 70, 2, 128, 128, dtype=torch.float32, chunk_size=32, read_after=True, rule="1")
    passes = regression.WIDE_PASSES if wide else regression.NARROW_PASSES
    assert forward == [(128 // passes.block_v, passes.block_v, *passes.forward)] * 2  # the forward, recomputed
    assert reverse == [(128 // passes.block_v, passes.block_v, *passes.reverse)]


def test_supports_rule_1_window_1_only():
    assert supports(rule="1", window=1, K=64, V=64, dtype=torch.float32)
    assert not supports(rule="1", window=2, K=64, V=64, dtype=torch.float32)
    assert supports(rule="1A", window=1, K=64, V=64, dtype=torch.bfloat16)
    assert supports(rule="3A", window=3, K=64, V=64, dtype=torch.bfloat16)
    assert not supports(rule="2", window=2, K=64, V=64, dtype=torch.float32)  # windows: rules 3A and 3 only
    assert not supports(rule="1A", window=1, K=256, V=64, dtype=torch.float32)
