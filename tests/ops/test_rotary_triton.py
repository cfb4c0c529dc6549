"""The one-kernel rotation of queries and keys (`hybridlm.ops.rotary`) against the torch form
(`hybridlm.modules.rotary.apply_rotary`), bit for bit and signed zeros included: dtypes, head dims and head counts
that are no powers of two, strided inputs, per-row and shared tables, float32 tables rounded by the kernel; its
gradients against the torch form's autograd (bit for bit up to the sign of a zero) and against float64; and where
`rotate_qk` takes it.

- On a GPU, or under the interpreter (HYBRIDLM_TRITON_INTERPRET=1): everything marked `interpret`.
- CPU, no GPU (CI): the choice of form, the input checks and the sm_90 build.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules import rotary
from hybridlm.modules.rotary import apply_rotary, rotary_cos_sin, rotate_qk
from hybridlm.ops.rotary import rotary_qk_triton
from tests.ops.triton_modes import (
    DEVICE,
    H200_SHARED_BYTES,
    ON_GPU,
    compile_for_sm90,
    interpret,
    needs_cuda_backend,
    skip_bfloat16_interpreted,
)


def _inputs(B, T, HQ, HK, D, *, table_rows, dtype, seed=0):
    """q, k (with some entries +0 and -0) and float32 tables."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g)
    k = torch.randn(B, T, HK, D, generator=g)
    for t in (q, k):
        t.view(-1)[::7] = 0.0
        t.view(-1)[3::7] = -0.0
    positions = torch.randint(0, 5000, (table_rows, T), generator=g)
    cos, sin = rotary_cos_sin(positions, head_dim=D, base=10000.0)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), cos.to(DEVICE), sin.to(DEVICE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("tables", ["float32", "activations"])
@pytest.mark.parametrize("B, T, HQ, HK, D, table_rows", [
    (2, 5, 3, 1, 16, 1),  # shared table, grouped keys
    (1, 1, 12, 4, 64, 1),  # a decoding step of the 125m shape
    (3, 4, 5, 2, 80, 3),  # a table per row, a head dim that is no power of two
    (2, 3, 8, 8, 128, 2),
])
def test_equals_the_torch_form_bit_for_bit(B, T, HQ, HK, D, table_rows, tables, dtype):
    skip_bfloat16_interpreted(dtype)
    q, k, cos, sin = _inputs(B, T, HQ, HK, D, table_rows=table_rows, dtype=dtype)
    rounded = cos.to(dtype), sin.to(dtype)  # what the torch form multiplies by
    q_out, k_out = rotary_qk_triton(q, k, *(rounded if tables == "activations" else (cos, sin)))
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert _same(q_out, apply_rotary(q, *rounded)) and _same(k_out, apply_rotary(k, *rounded))


def _torch_form_grads(q, k, cos, sin, dq_out, dk_out):
    """dL/dq, dL/dk of the torch form's autograd for L = <q', dq_out> + <k', dk_out> (either may be None)."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    rounded = cos.to(q.dtype), sin.to(q.dtype)
    outputs = [(apply_rotary(q, *rounded), dq_out), (apply_rotary(k, *rounded), dk_out)]
    torch.autograd.backward([o for o, g in outputs if g is not None], [g for _, g in outputs if g is not None])
    return q.grad if q.grad is not None else torch.zeros_like(q), k.grad if k.grad is not None else torch.zeros_like(k)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("B, T, HQ, HK, D, table_rows", [
    (2, 5, 3, 1, 16, 1),
    (3, 4, 5, 2, 80, 3),
    (1, 7, 12, 4, 64, 1),
])
@pytest.mark.parametrize("tables", ["rope", "any"])
def test_gradients_equal_the_torch_form_autograd(B, T, HQ, HK, D, table_rows, dtype, tables):
    """Each product rounded, then the sum, as autograd computes them: equal values (a zero's sign may differ:
    autograd also adds its slices' zero gradients). "any": tables whose halves differ (RoPE's repeat), so a sine
    read at the wrong half shows."""
    skip_bfloat16_interpreted(dtype)
    q, k, cos, sin = _inputs(B, T, HQ, HK, D, table_rows=table_rows, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    if tables == "any":
        cos, sin = (torch.rand(t.shape, generator=g).to(DEVICE) * 2 - 1 for t in (cos, sin))
    dq_out = torch.randn(q.shape, generator=g).to(DEVICE, dtype)
    dk_out = torch.randn(k.shape, generator=g).to(DEVICE, dtype)
    q_leaf, k_leaf = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = rotary_qk_triton(q_leaf, k_leaf, cos, sin)
    torch.autograd.backward([q_out, k_out], [dq_out, dk_out])
    want_q, want_k = _torch_form_grads(q, k, cos, sin, dq_out, dk_out)
    assert torch.equal(q_leaf.grad, want_q) and torch.equal(k_leaf.grad, want_k)


@interpret
def test_gradients_match_float64_and_an_unused_output():
    """float32 against the float64 torch form's gradients; an output that nothing reads has a zero gradient (its
    input's gradient is the other half's alone); strided q, k (slices of one projection output)."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(2, 6, 4 * 32 + 2 * 32 + 3, generator=g, dtype=torch.float64)
    _, _, cos, sin = _inputs(2, 6, 1, 1, 32, table_rows=2, dtype=torch.float32)
    dq_out = torch.randn(2, 6, 4, 32, generator=g, dtype=torch.float64)
    dk_out = torch.randn(2, 6, 2, 32, generator=g, dtype=torch.float64)

    def grads(leaf, rotate, dtype, use_k=True):
        x = leaf.to(dtype).detach().requires_grad_()
        q, k = x[..., :4 * 32].unflatten(-1, (4, 32)), x[..., 4 * 32:6 * 32].unflatten(-1, (2, 32))
        q_out, k_out = rotate(q, k)
        dq, dk = dq_out.to(x.device, dtype), dk_out.to(x.device, dtype)
        loss = (q_out * dq).sum() + ((k_out * dk).sum() if use_k else 0.0)
        loss.backward()
        return x.grad.double()

    cos64, sin64 = cos.double().cpu(), sin.double().cpu()
    reference = grads(row, lambda q, k: (apply_rotary(q, cos64, sin64), apply_rotary(k, cos64, sin64)), torch.float64)
    kernel = grads(row.to(DEVICE), lambda q, k: rotary_qk_triton(q, k, cos, sin), torch.float32)
    torch.testing.assert_close(kernel.cpu(), reference, rtol=1e-6, atol=1e-6)
    only_q = grads(row.to(DEVICE), lambda q, k: rotary_qk_triton(q, k, cos, sin), torch.float32, use_k=False).cpu()
    torch.testing.assert_close(only_q[..., :4 * 32], reference[..., :4 * 32], rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(only_q[..., 4 * 32:]) == 0


@interpret
def test_reads_slices_of_a_wider_row():
    """q and k as row slices of one projection output (unit stride along D only)."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(2, 3, 6 * 16 + 2 * 16 + 5, generator=g).to(DEVICE)
    q = row[..., :6 * 16].unflatten(-1, (6, 16))
    k = row[..., 6 * 16:8 * 16].unflatten(-1, (2, 16))
    _, _, cos, sin = _inputs(2, 3, 1, 1, 16, table_rows=1, dtype=torch.float32)
    q_out, k_out = rotary_qk_triton(q, k, cos, sin)
    assert _same(q_out, apply_rotary(q, cos, sin)) and _same(k_out, apply_rotary(k, cos, sin))


@interpret
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_model_trains_the_same_on_the_kernel(monkeypatch, autocast):
    """A Transformer's loss and every parameter's gradient with RoPE on the kernel (forced as `rotate_qk` takes it on
    CUDA) equal those with the torch form: q and k as views of their projections, grouped keys, the gradients coming
    back from attention. Deterministic kernels (`deterministic_kernels`), so that attention's backward repeats on a
    GPU."""
    if autocast:
        skip_bfloat16_interpreted(torch.bfloat16)
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.models.presets import get_preset
    from hybridlm.training.rng import deterministic_kernels

    config = get_preset("tiny", ssm_mixer="none", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = HybridForCausalLM(config).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    calls = []
    kernel = rotary.rotary_qk_triton
    monkeypatch.setattr(rotary, "rotary_qk_triton", lambda *a: calls.append(1) or kernel(*a))
    results = []
    for on_kernel in (False, True):
        monkeypatch.setattr(rotary, "_takes_kernel", lambda q, k, cos, sin, on=on_kernel: on and cos.dim() == 3)
        with deterministic_kernels(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert len(calls) == config.num_hidden_layers
    (loss_torch, grads_torch), (loss_kernel, grads_kernel) = results
    assert torch.equal(loss_torch, loss_kernel)
    assert all(torch.equal(a, b) for a, b in zip(grads_torch, grads_kernel))


def test_rotate_qk_takes_the_kernel_on_cuda_where_the_tables_take_no_gradient(monkeypatch):
    """The kernel for CUDA calls with [B or 1, T, D] tables, with or without a gradient recorded for q; the torch form
    for tables that take a gradient, 2-D tables (1-D position_ids) and on the CPU: the same values every time."""
    calls = []
    monkeypatch.setattr(rotary, "rotary_qk_triton", lambda *a: calls.append(1) or rotary_qk_triton(*a))
    q, k, cos, sin = _inputs(1, 2, 2, 1, 16, table_rows=1, dtype=torch.float16)
    rounded = cos.half(), sin.half()
    want = (apply_rotary(q, *rounded), apply_rotary(k, *rounded))
    cases = ((q, (cos, sin)), (q.clone().requires_grad_(), (cos, sin)), (q, (cos[0], sin[0])),
             (q, (cos.clone().requires_grad_(), sin)))
    for q_in, tables in cases:
        got = rotate_qk(q_in, k, *tables)
        assert all(_same(a.detach(), b) for a, b in zip(got, want))
    assert calls == ([1, 1] if ON_GPU else [])


@interpret
@pytest.mark.parametrize("slots", ["shared", "per row", "ring"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_rotation_into_a_cache_equals_rotating_then_copying(slots, dtype):
    """`rotary_qk_into_cache_triton`: q' equal to `rotary_qk_triton`'s bit for bit, k' and v written at each row's slot
    (one shared slot, one per row, a slot taken modulo a ring) and nothing else of the storage touched; q, k, v read
    as slices of one projection row."""
    from hybridlm.ops.rotary import rotary_qk_into_cache_triton

    B, HQ, HK, D, S = 3, 6, 2, 20, 9
    g = torch.Generator().manual_seed(11)
    row = torch.randn(B, 1, (HQ + 2 * HK) * D + 5, generator=g).to(DEVICE, dtype)
    q, k, v = (row[..., a * D:b * D].unflatten(-1, (-1, D)) for a, b in ((0, HQ), (HQ, HQ + HK),
                                                                         (HQ + HK, HQ + 2 * HK)))
    positions = torch.randint(0, 5000, (B, 1), generator=g)
    cos, sin = (t.to(DEVICE) for t in rotary_cos_sin(positions, head_dim=D, base=10000.0))
    keys, values = (torch.randn(B, S, HK, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    before = keys.clone(), values.clone()
    slot = {"shared": torch.tensor(4), "per row": torch.tensor([0, 8, 3]), "ring": torch.tensor([13, 9, 21])}[slots]
    ring = S if slots == "ring" else None
    out = rotary_qk_into_cache_triton(q, k, v, cos, sin, keys, values, slot.to(DEVICE), ring=ring)
    want_q, want_k = rotary_qk_triton(q, k, cos, sin)
    assert torch.equal(out, want_q)
    index = (slot.expand(B) % S).tolist()
    for b, i in enumerate(index):
        assert torch.equal(keys[b, i], want_k[b, 0]) and torch.equal(values[b, i], v[b, 0])
        others = [j for j in range(S) if j != i]
        assert torch.equal(keys[b, others], before[0][b, others]) and torch.equal(values[b, others],
                                                                                   before[1][b, others])
    with pytest.raises(ValueError, match="records no gradient"):
        rotary_qk_into_cache_triton(q.detach().requires_grad_(), k, v, cos, sin, keys, values, slot.to(DEVICE))
    with pytest.raises(ValueError, match=r"q \[B, 1, Hq, D\]"):
        rotary_qk_into_cache_triton(q, k, v[..., :1, :], cos, sin, keys, values, slot.to(DEVICE))


def _fuses_on_any_device(q, k, v, cos, sin, keys):
    """`rotate_into_cache_fuses` without its CUDA condition: the interpreter runs the kernel on CPU tensors."""
    return (keys is not None and q.shape[1] == 1 and v.dtype == q.dtype == k.dtype == keys.dtype
            and cos.dim() == 3 and not any(t.requires_grad for t in (q, k, v)))


@interpret
@pytest.mark.parametrize("mixer", ["none", "fast_weight-1A"])
@pytest.mark.parametrize("window", [None, 4])
def test_static_decoding_step_rotates_into_its_cache(monkeypatch, mixer, window):
    """The static decoder's step with the rotation writing into the storage (every layer's attention, every step):
    the dynamic cache's logits; with a window below the capacity, a ring."""
    from hybridlm.inference import GraphedDecoder
    from hybridlm.layers import cache as cache_module
    from tests.inference.helpers import MIXERS, ids, make_model

    calls = []
    monkeypatch.setattr(cache_module, "rotate_into_cache_fuses",
                        lambda *a: calls.append(1) or _fuses_on_any_device(*a))
    model = make_model(seed=13, **MIXERS[mixer], attention_window=window).to(DEVICE).eval()
    prompt = ids(2, 6, seed=13).to(DEVICE)
    with torch.no_grad():
        dynamic = model.new_cache()
        logits = model(prompt, cache=dynamic, logits_to_keep=1).logits[:, -1]
        fresh = model.new_cache()
        model(prompt, cache=fresh)
        decoder = GraphedDecoder(model, fresh, capacity=12, batch_size=2, use_graph=False)
        for _ in range(5):
            token = logits.argmax(-1)
            logits = model(token[:, None], cache=dynamic, logits_to_keep=1).logits[:, -1]
            assert (decoder.step(token) - logits).abs().max() < 1e-5
    assert len(calls) == 5 * len(model.model.layers)


@interpret
def test_serving_steps_rotate_into_the_slots(monkeypatch):
    """The serving engine's fixed-shape steps (padded rows, each row at its own slot) with the rotation writing into the
    slots: the same tokens as rotating, then copying into the slots (float32: the kernel's rotation is the torch
    form's bit for bit)."""
    from hybridlm.serving import Engine, SamplingParams
    from hybridlm.serving import slots as slots_module
    from hybridlm.serving.graphed import SlotStepGraphs
    from tests.inference.helpers import ids, make_model
    from tests.serving.test_engine import run_staggered

    model = make_model(seed=14).to(DEVICE)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 9, 5)]
    lengths = [6, 4, 7]

    def run():
        engine = Engine(model, max_num_seqs=3, max_model_len=32, block_size=4, max_prefill_tokens=8,
                        decode_step="fixed")
        engine.step_graphs = SlotStepGraphs(model, engine.slots, use_graph=False, min_span=4)
        return run_staggered(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])

    want = run()
    calls = []
    monkeypatch.setattr(slots_module, "rotate_into_cache_fuses",
                        lambda *a: calls.append(1) or _fuses_on_any_device(*a))
    assert run() == want and len(calls) >= sum(lengths) - len(lengths)


def test_refuses_bad_inputs():
    q, k, cos, sin = (torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="share one dtype"):
        rotary_qk_triton(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="float32 or that dtype"):
        rotary_qk_triton(q.half(), k.half(), cos.double(), sin.double())
    with pytest.raises(ValueError, match=r"\[B or 1, T, D\]"):
        rotary_qk_triton(q, k, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="must be even"):
        rotary_qk_triton(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="take no gradient"):
        rotary_qk_triton(q, k, cos.requires_grad_(), sin)


_SM90 = """
import itertools

from hybridlm.ops.rotary import kernels as k

options = dict(k.LAUNCH, num_stages=3)
shapes = (("*bf16", "*fp32", 12, 4, 64), ("*fp32", "*fp32", 5, 2, 80), ("*fp16", "*fp16", 16, 16, 128))
for (io, table, HQ, HK, D), backward in itertools.product(shapes, (False, True)):
    consts = dict(D=D, BHQ=triton.next_power_of_2(HQ), BHK=triton.next_power_of_2(HK), BD=triton.next_power_of_2(D),
                  BACKWARD=backward)
    fn = k.rotary_qk_kernel
    sig = {n: "constexpr" if n in consts else table if n in ("cos_ptr", "sin_ptr") else io if n.endswith("_ptr")
           else "i32" for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    assert "fma." not in compiled.asm["ptx"], "a fused multiply-add would round differently from the torch form"
    print("built", fn.__name__, compiled.metadata.shared)
for (io, table, HQ, HK, D), ring in itertools.product(shapes, (False, True)):  # a decoding step into a cache
    consts = dict(D=D, BHQ=triton.next_power_of_2(HQ), BHK=triton.next_power_of_2(HK), BD=triton.next_power_of_2(D),
                  RING=ring)
    fn = k.rotary_qk_cache_kernel
    sig = {n: "constexpr" if n in consts else table if n in ("cos_ptr", "sin_ptr") else "*i64" if n == "slot_ptr"
           else io if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    assert "fma." not in compiled.asm["ptx"], "a fused multiply-add would round differently from the torch form"
    print("built", fn.__name__, compiled.metadata.shared)
"""


@needs_cuda_backend
def test_kernel_compiles_for_sm90_without_fused_multiply_adds():
    """Built with the launch's options (`kernels.LAUNCH`): no fused multiply-add in the PTX, whose single rounding
    would differ from the torch form's two."""
    report = compile_for_sm90(_SM90, modules=("hybridlm.ops.rotary.kernels",))
    assert set(report["built"]) == report["defined"] == {"rotary_qk_kernel", "rotary_qk_cache_kernel"}, report
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
