"""The short conv's Triton kernels (`hybridlm.ops.short_conv`) against the float64 reference: outputs and the
gradients of x, weight and bias, rows and documents restarting inside them, odd sizes, several programs.

Where they run: on a GPU (CUDA + triton) every test; on the CPU under Triton's interpreter with
HYBRIDLM_TRITON_INTERPRET=1 (float16 stands in for bfloat16 there); in CI (no triton) only the reference's own tests
and the input checks that need no kernel.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.modules import ShortConvolution, causal_conv1d
from hybridlm.ops.short_conv import short_conv_naive, short_conv_triton
from tests.helpers import assert_near_reference, rel_err
from tests.ops.triton_modes import (
    DEVICE,
    ELEMENTWISE_TOL,
    H200_SHARED_BYTES,
    HAS_TRITON,
    INTERPRET,
    ON_GPU,
    compile_for_sm90,
    interpret,
    needs_cuda_backend,
    skip_bfloat16_interpreted,
)

TOL = ELEMENTWISE_TOL


def _inputs(B, T, C, K, *, documents=0, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, K, generator=g, dtype=torch.float64) / K**0.5
    b = torch.randn(C, generator=g, dtype=torch.float64) if bias else None
    seq_idx = None
    if documents:  # document starts at random steps (some documents one step long), the same ids coming back
        starts = torch.rand(B, T, generator=g) < documents / T
        seq_idx = (starts.long().cumsum(1) % 3).to(torch.int32)
    return x, weight, b, seq_idx


def _check(B, T, C, K, *, dtype, documents=0, bias=True, activation="silu", seed=0):
    x, weight, b, seq_idx = _inputs(B, T, C, K, documents=documents, bias=bias, seed=seed)
    x = x.to(dtype).double()  # the reference sees the rounded inputs
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, b) if t is not None]
    y_ref = short_conv_naive(*leaves[:2], leaves[2] if bias else None, seq_idx=seq_idx, activation=activation)
    probe = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), leaves)

    ins = [x.to(DEVICE, dtype), weight.to(DEVICE, torch.float32)] + ([b.to(DEVICE, torch.float32)] if bias else [])
    ins = [t.requires_grad_(True) for t in ins]
    y = short_conv_triton(ins[0], ins[1], ins[2] if bias else None,
                          seq_idx=None if seq_idx is None else seq_idx.to(DEVICE), activation=activation)
    assert y.dtype == dtype and y.shape == (B, T, C)
    grads = torch.autograd.grad((y.double() * probe.to(DEVICE)).sum(), ins)
    pairs = {"y": (y, y_ref)}
    for name, grad, grad_ref, leaf in zip(("dx", "dw", "db"), grads, grads_ref, ins):
        assert grad.dtype == leaf.dtype, name
        pairs[name] = (grad, grad_ref)
    assert_near_reference(pairs, TOL[dtype])


CASES = [  # B, T, C, K, documents, bias, activation
    (2, 37, 20, 4, 0, True, "silu"),  # odd sizes: a partial channel block, a partial step block
    (2, 37, 20, 4, 6, True, "silu"),  # documents restarting inside the rows
    (1, 50, 8, 3, 12, False, None),  # no bias, no activation, another width
    (3, 2, 5, 4, 0, True, "silu"),  # rows shorter than the kernel
    (1, 9, 70, 1, 3, False, "silu"),  # a one-tap kernel, two channel blocks
    (2, 45, 70, 4, 5, True, "silu"),  # two channel blocks with documents
    (1, 33, 12, 2, 4, True, None),  # two taps
    (2, 20, 9, 5, 3, True, "silu"),  # five taps (a padded tap block of 8)
    (3, 700, 16, 4, 40, True, "silu"),  # several programs along the steps (2100 > 16 x 32)
]


@interpret
@pytest.mark.parametrize("B,T,C,K,documents,bias,activation", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_float64_reference(B, T, C, K, documents, bias, activation, dtype):
    skip_bfloat16_interpreted(dtype)
    _check(B, T, C, K, dtype=dtype, documents=documents, bias=bias, activation=activation)


@interpret
def test_documents_never_see_each_other():
    """Changing one document's inputs changes no other document's outputs (nor the rows' around it)."""
    x, weight, b, _ = _inputs(2, 30, 6, 4, seed=1)
    seq_idx = torch.tensor([[0] * 10 + [1] * 1 + [2] * 19, [5] * 30], dtype=torch.int32)
    run = lambda x: short_conv_triton(x.float().to(DEVICE), weight.float().to(DEVICE), b.float().to(DEVICE),
                                      seq_idx=seq_idx.to(DEVICE), activation="silu").cpu()
    changed = x.clone()
    changed[0, 10] += 5.0  # the one-step document
    diff = (run(changed) - run(x)).abs().amax(-1)
    assert diff[0, 10] > 0 and diff[0, :10].max() == 0 and diff[0, 11:].max() == 0 and diff[1].max() == 0
    # backward: the one-step document's output reaches its own input only
    leaf = x.float().to(DEVICE).requires_grad_(True)
    y = short_conv_triton(leaf, weight.float().to(DEVICE), b.float().to(DEVICE), seq_idx=seq_idx.to(DEVICE),
                          activation="silu")
    y[0, 10].sum().backward()
    reached = leaf.grad.abs().amax(-1).cpu()
    assert reached[0, 10] > 0 and reached.sum() == reached[0, 10]


@interpret
def test_documents_starting_at_block_and_program_edges():
    """Documents that start exactly at a step block's edge (BT) and a program's (STEPS x BT), and one step either
    side, in forward and backward."""
    from hybridlm.ops.short_conv import kernels

    T = 2 * kernels.STEPS * kernels.BT + 40
    starts = sorted({e + d for e in (kernels.BT, kernels.STEPS * kernels.BT) for d in (-1, 0, 1)})
    seq_idx = torch.zeros(1, T, dtype=torch.int32)
    for start in starts:
        seq_idx[0, start:] += 1
    x, weight, b, _ = _inputs(1, T, 6, 4, seed=4)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, b)]
    y_ref = short_conv_naive(*leaves, seq_idx=seq_idx, activation="silu")
    probe = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), leaves)
    ins = [t.float().to(DEVICE).requires_grad_(True) for t in (x, weight, b)]
    y = short_conv_triton(*ins, seq_idx=seq_idx.to(DEVICE), activation="silu")
    grads = torch.autograd.grad((y.double() * probe.to(DEVICE)).sum(), ins)
    for name, ours, ref in zip(("y", "dx", "dw", "db"), (y, *grads), (y_ref, *grads_ref)):
        assert rel_err(ours.cpu(), ref) < 1e-5, name


@interpret
def test_frozen_inputs_and_an_expanded_gradient_without_activation():
    """Only the gradients asked for come back (x or the weight frozen), and without an activation dL/dy reaches the
    kernels as it is: here an expanded one (the gradient of y.sum() * 2), not contiguous."""
    x, weight, b, seq_idx = _inputs(2, 37, 9, 3, documents=5, seed=6)
    y_ref = short_conv_naive(x.requires_grad_(True), weight.requires_grad_(True), b.requires_grad_(True),
                             seq_idx=seq_idx)
    grads_ref = torch.autograd.grad(y_ref.sum() * 2, (x, weight, b))
    seq = seq_idx.to(DEVICE)
    for frozen in ("x", "weight"):
        ins = {"x": x.detach().float(), "weight": weight.detach().float(), "bias": b.detach().float()}
        ins = {k: v.to(DEVICE).requires_grad_(k != frozen) for k, v in ins.items()}
        y = short_conv_triton(ins["x"], ins["weight"], ins["bias"], seq_idx=seq)
        wanted = [name for name in ins if name != frozen]
        grads = torch.autograd.grad(y.sum() * 2, [ins[name] for name in wanted])
        reference = dict(zip(("x", "weight", "bias"), grads_ref))
        for name, grad in zip(wanted, grads):
            assert rel_err(grad.cpu(), reference[name]) < 1e-5, (frozen, name)


@interpret
def test_strided_inputs_and_16bit_weights():
    """x and dL/dy strided (not contiguous), float16 weights and bias: the same as the reference on those values,
    the weight gradients in float16."""
    g = torch.Generator().manual_seed(5)
    x_wide = torch.randn(2, 40, 24, generator=g)
    weight = (torch.randn(12, 4, generator=g) / 2).half()
    b = torch.randn(12, generator=g).half()
    probe = torch.randn(2, 12, 40, generator=g, dtype=torch.float64)  # dL/dy arrives transposed: strided
    leaves = [t.double().requires_grad_(True) for t in (x_wide[:, :, ::2], weight, b)]
    y_ref = short_conv_naive(*leaves, activation="silu")
    grads_ref = torch.autograd.grad((y_ref.transpose(1, 2) * probe).sum(), leaves)
    x_dev = x_wide.to(DEVICE).requires_grad_(True)
    ins = [x_dev, weight.to(DEVICE).requires_grad_(True), b.to(DEVICE).requires_grad_(True)]
    y = short_conv_triton(x_dev[:, :, ::2], ins[1], ins[2], activation="silu")
    grads = torch.autograd.grad((y.transpose(1, 2).double() * probe.to(DEVICE)).sum(), ins)
    assert rel_err(y.cpu(), y_ref) < 1e-5
    assert grads[1].dtype == grads[2].dtype == torch.float16
    assert rel_err(grads[0][:, :, ::2].cpu(), grads_ref[0]) < 1e-5 and grads[0][:, :, 1::2].abs().max() == 0
    assert rel_err(grads[1].cpu(), grads_ref[1]) < 2e-3 and rel_err(grads[2].cpu(), grads_ref[2]) < 2e-3


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reads_a_slice_of_a_wider_row_in_place(dtype):
    """x a slice of a projection's output (unit channel stride, rows 29 elements apart) with documents: the kernels read
    it where it lies (the tensor kept for the backward shares its storage, no copy) and match the reference."""
    B, T, C, K, wide, start = 2, 45, 20, 4, 29, 6
    x, weight, b, seq_idx = _inputs(B, T, wide, K, documents=5, seed=7)
    weight, b = weight[start:start + C], b[start:start + C]
    x = x.to(dtype).double()
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, b)]
    y_ref = short_conv_naive(leaves[0][..., start:start + C], leaves[1], leaves[2], seq_idx=seq_idx, activation="silu")
    probe = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), leaves)
    ins = [x.to(DEVICE, dtype), weight.to(DEVICE, torch.float32), b.to(DEVICE, torch.float32)]
    ins = [t.requires_grad_(True) for t in ins]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        y = short_conv_triton(ins[0][..., start:start + C], ins[1], ins[2], seq_idx=seq_idx.to(DEVICE),
                              activation="silu")
    assert any(t.untyped_storage().data_ptr() == ins[0].untyped_storage().data_ptr() for t in kept)
    assert all(t.numel() < x.numel() // 2 or t.untyped_storage().data_ptr() == ins[0].untyped_storage().data_ptr()
               for t in kept), "a copy of x was kept for the backward"
    grads = torch.autograd.grad((y.double() * probe.to(DEVICE)).sum(), ins)
    assert grads[0][..., :start].abs().max() == 0 and grads[0][..., start + C:].abs().max() == 0
    assert_near_reference({"y": (y, y_ref), "dx": (grads[0], grads_ref[0]), "dw": (grads[1], grads_ref[1]),
                           "db": (grads[2], grads_ref[2])}, TOL[dtype])


def test_reference_matches_the_module_conv():
    """The reference is the same function as `hybridlm.modules.causal_conv1d` (seq_idx form, float64)."""
    x, weight, b, seq_idx = _inputs(2, 40, 7, 4, documents=8, seed=2)
    for activation in (None, "silu"):
        y_ref = short_conv_naive(x, weight, b, seq_idx=seq_idx, activation=activation)
        y_mod, _ = causal_conv1d(x, weight, b, activation=activation, seq_idx=seq_idx)
        torch.testing.assert_close(y_ref, y_mod, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_TRITON, reason="imports the kernels (needs triton)")
def test_rejects_bad_inputs():
    x = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="weight must be"):
        short_conv_triton(x, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="bias must be"):
        short_conv_triton(x, torch.zeros(3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="unknown activation"):
        short_conv_triton(x, torch.zeros(3, 4), activation="relu")
    with pytest.raises(ValueError, match=r"x must be \[B, T, C\]"):
        short_conv_triton(x[0], torch.zeros(3, 4))
    with pytest.raises(ValueError, match="run float64 on"):
        short_conv_triton(x.double(), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="seq_idx must be"):
        short_conv_triton(x, torch.zeros(3, 4), seq_idx=torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="split the batch"):  # int32 step indices (no memory: an expanded view)
        short_conv_triton(torch.zeros(1, 1, 1).expand(2**16, 2**15, 1), torch.zeros(1, 4))


@interpret
@pytest.mark.parametrize("form", ["rows", "seq_idx", "cu_seqlens", "no-activation"])
def test_module_conv_on_the_kernels(form):
    """`causal_conv1d(backend="triton")` is the torch form's function: plain rows, documents by seq_idx, and packed
    documents by cu_seqlens (which it runs in place through the kernels), with and without SiLU, outputs and
    gradients in float32."""
    x, weight, b, seq_idx = _inputs(2, 41, 10, 4, documents=7, seed=3)
    kwargs = {"activation": None if form == "no-activation" else "silu"}
    if form == "seq_idx":
        kwargs["seq_idx"] = seq_idx.to(DEVICE)
    if form == "cu_seqlens":
        x = x[:1]
        kwargs["cu_seqlens"] = torch.tensor([0, 1, 9, 30, 41])
    results = []
    for backend in ("torch", "triton"):
        leaves = [t.float().to(DEVICE).requires_grad_(True) for t in (x, weight, b)]
        y, final = causal_conv1d(*leaves, backend=backend, **kwargs)
        assert final is None
        probe = torch.linspace(-1, 1, y.numel(), device=DEVICE).reshape(y.shape)
        results.append([y, *torch.autograd.grad((y * probe).sum(), leaves)])
    for name, ours, torch_form in zip(("y", "dx", "dw", "db"), results[1], results[0]):
        assert rel_err(ours.cpu(), torch_form.cpu()) < 1e-5, name


def test_module_conv_backend_choice(monkeypatch):
    """"auto" takes the kernels only for a 32- or 16-bit CUDA tensor with no state in or out; "triton" refuses a
    state and a tensor the kernels cannot take; an unknown backend is an error, from the module's attribute too."""
    from hybridlm.modules import short_conv

    calls = []
    monkeypatch.setattr(short_conv, "short_conv_triton", lambda x, *a, **k: calls.append(x.device.type) or x)
    x, weight = torch.zeros(1, 6, 3), torch.zeros(3, 4)
    causal_conv1d(x, weight)  # a CPU tensor: the torch form
    assert calls == []
    if ON_GPU:
        causal_conv1d(x.cuda(), weight.cuda())
        causal_conv1d(x.cuda(), weight.cuda(), output_final_state=True)  # a state out: the torch form
        causal_conv1d(x.cuda().double(), weight.cuda())  # float64: the torch form's float64 math
        assert calls == ["cuda"]
    with pytest.raises(ValueError, match="takes no initial_state"):
        causal_conv1d(x, weight, backend="triton", initial_state=torch.zeros(1, 3, 3))
    if not (ON_GPU or INTERPRET):
        with pytest.raises(ValueError, match="needs triton and a CUDA tensor"):
            causal_conv1d(x, weight, backend="triton")
    if ON_GPU or INTERPRET:
        with pytest.raises(ValueError, match="takes float32, bfloat16 or float16"):
            causal_conv1d(x.double().to(DEVICE), weight.to(DEVICE), backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        causal_conv1d(x, weight, backend="cuda")
    from hybridlm.parallel.tensor_parallel import _LocalShortConvolution

    for module in (ShortConvolution(3, 4), _LocalShortConvolution(3, 4)):  # the attribute reaches causal_conv1d
        module.backend = "cuda"
        assert "backend=cuda" in repr(module)
        with pytest.raises(ValueError, match="unknown backend"):
            module(x)


@interpret
@pytest.mark.parametrize("K, bias, activation", [(4, True, "silu"), (2, False, None), (3, True, None),
                                                  (5, False, "silu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_decoding_steps_on_the_step_kernel(monkeypatch, K, bias, activation, dtype):
    """A prefill of 6 steps on the torch form, then 5 one-token steps through the step kernel (each one launch, 130
    channels: two channel blocks): the whole sequence's outputs and final state, against the float64 torch form."""
    skip_bfloat16_interpreted(dtype)
    from hybridlm.modules import short_conv

    calls = []
    step = short_conv.short_conv_step_triton
    monkeypatch.setattr(short_conv, "short_conv_step_triton", lambda *a, **k: calls.append(1) or step(*a, **k))
    x, weight, b, _ = _inputs(2, 11, 130, K, bias=bias, seed=5)
    x = x.to(dtype).double()
    want, want_state = causal_conv1d(x, weight, b, activation=activation, output_final_state=True, backend="torch")
    device_args = [weight.float().to(DEVICE), None if b is None else b.float().to(DEVICE)]
    xs = x.to(DEVICE, dtype)
    y, state = causal_conv1d(xs[:, :6], *device_args, activation=activation, output_final_state=True, backend="torch")
    outputs = [y]
    for t in range(6, 11):
        y, state = causal_conv1d(xs[:, t:t + 1], *device_args, activation=activation, initial_state=state,
                                 output_final_state=True, backend="triton")
        assert y.dtype == state.dtype == dtype
        outputs.append(y)
    assert len(calls) == 5
    assert rel_err(torch.cat(outputs, dim=1).double().cpu(), want) < TOL[dtype]
    assert torch.equal(state.double().cpu(), want_state)  # the inputs themselves, moved along


@interpret
@pytest.mark.parametrize("K", [4, 2])
def test_decoding_step_writes_the_state_in_place(K):
    """`state_in_place=True`: the step kernel writes the same new state bit for bit over the one it read (here a
    channel slice of a wider buffer, so at its own strides) and returns it; a state in another dtype than x (which
    the step reads through a cast) comes back in a new tensor, and so does every step outside the kernel."""
    x, weight, b, _ = _inputs(3, 1, 130, K, bias=True, seed=6)
    x, weight, b = x.float().to(DEVICE), weight.float().to(DEVICE), b.float().to(DEVICE)
    wide = torch.randn(3, K - 1, 140, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    state = wide[..., 5:135]
    edges = wide[..., :5].clone(), wide[..., 135:].clone()
    want_y, want_state = causal_conv1d(x, weight, b, activation="silu", initial_state=state.clone(),
                                       output_final_state=True, backend="triton")
    y, new = causal_conv1d(x, weight, b, activation="silu", initial_state=state, output_final_state=True,
                           backend="triton", state_in_place=True)
    assert new is state and torch.equal(y, want_y) and torch.equal(state, want_state)
    assert torch.equal(wide[..., :5], edges[0]) and torch.equal(wide[..., 135:], edges[1])  # only the slice written
    other = state.double()
    _, new = causal_conv1d(x, weight, b, activation="silu", initial_state=other, output_final_state=True,
                           backend="triton", state_in_place=True)
    assert new is not other and torch.equal(other, state.double())
    _, new = causal_conv1d(x, weight, b, activation="silu", initial_state=state, output_final_state=True,
                           backend="torch", state_in_place=True)
    assert new is not state


@interpret
def test_decoding_step_kernel_not_taken(monkeypatch):
    """The step kernel runs for one token with a state in and out and no gradient to record: not with a gradient,
    not for two tokens or a one-tap conv (no state), and "auto" not on a CPU tensor."""
    from hybridlm.modules import short_conv

    calls = []
    step = short_conv.short_conv_step_triton
    monkeypatch.setattr(short_conv, "short_conv_step_triton", lambda *a, **k: calls.append(1) or step(*a, **k))
    x, weight = torch.randn(2, 1, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    state = torch.randn(2, 3, 8, device=DEVICE)
    taken = dict(initial_state=state, output_final_state=True)
    if ON_GPU:
        y, _ = causal_conv1d(x, weight.requires_grad_(), **taken)  # "auto": the torch form, which has a backward
        assert y.requires_grad and calls == []
    with pytest.raises(ValueError, match="except in a decoding step"):
        causal_conv1d(x, weight.requires_grad_(), backend="triton", **taken)
    assert calls == []
    causal_conv1d(x, torch.randn(8, 1, device=DEVICE), initial_state=state[:, :0], output_final_state=True)
    assert calls == []
    if not ON_GPU:
        causal_conv1d(x, weight.detach(), **taken)  # "auto" on a CPU tensor under the interpreter
        assert calls == []
    else:
        causal_conv1d(x, weight.detach(), **taken)
        assert calls == [1]


_SM90_BUILDS = """
from hybridlm.ops.short_conv import kernels as k

sizes = dict(BT=k.BT, BC=k.BC, STEPS=k.STEPS)
for io in ("*bf16", "*fp32"):
    for K, bias, silu, seg in ((4, True, True, True), (4, False, False, True), (3, True, True, False),
                               (1, True, True, True), (5, False, True, False), (4, True, True, False)):
        flags = dict(sizes, K=K, KP=triton.next_power_of_2(K), HAS_BIAS=bias, SILU=silu, HAS_SEG=seg)
        build(k.short_conv_fwd_kernel, flags, io=io, io_names=("x_ptr", "y_ptr"), types={"seg_ptr": "*i32"})
        build(k.short_conv_bwd_weight_kernel, flags, io=io, io_names=("x_ptr", "dy_ptr"), types={"seg_ptr": "*i32"})
        build(k.short_conv_bwd_input_kernel, flags, io=io, io_names=("dx_ptr",) if silu else ("g_ptr", "dx_ptr"),
              types={"seg_ptr": "*i32"})
"""

_SM90_STEP = """
from hybridlm.ops.short_conv import step as k

for io in ("*bf16", "*fp32"):
    for K, bias, silu, in_place in ((4, True, True, True), (2, False, False, False), (5, True, False, True)):
        build(k.step_kernel, dict(K=K, KP=triton.next_power_of_2(K), BC=k.BC, HAS_BIAS=bias, SILU=silu,
              IN_PLACE=in_place), io=io, io_names=("x_ptr", "state_ptr", "y_ptr", "state_out_ptr"), warps=k.NUM_WARPS)
"""


@needs_cuda_backend
def test_kernels_compile_for_sm90():
    """The three kernels build for sm_90 (bf16 and fp32 activations, with and without bias and SiLU, K = 1, 3, 4 and
    5, so tap blocks of 1, 4 and 8): the compiled path the interpreter never runs."""
    report = compile_for_sm90(_SM90_BUILDS, modules=("hybridlm.ops.short_conv.kernels",))
    assert set(report["built"]) == report["defined"] == {
        "short_conv_fwd_kernel", "short_conv_bwd_weight_kernel", "short_conv_bwd_input_kernel"}, report
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]
    report = compile_for_sm90(_SM90_STEP, modules=("hybridlm.ops.short_conv.step",))
    assert set(report["built"]) == report["defined"] == {"step_kernel"}, report
