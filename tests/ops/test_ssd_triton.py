"""`ssd(..., backend="triton")` (the chunked Mamba-2 SSD scan in Triton, forward and backward) against the naive
spec and the torch chunk path: outputs, final states and every gradient (x, dt, A, B, C, D, initial_state), odd
sizes, grouped B/C, packed sequences, 16-bit inputs; the custom ops under opcheck and torch.compile.

Where they run:
- GPU machine (CUDA + triton): every test runs on CUDA tensors:
      python -m pytest -q tests/ops/test_ssd_triton.py
- CPU, no GPU (CI): skipped, except the import, error and "auto" tests and `test_kernels_compile_for_sm90` (every
  kernel compiled to PTX for sm_90, which needs triton but no GPU).
- CPU with triton installed and HYBRIDLM_TRITON_INTERPRET=1: the tests marked `interpret` run the kernels on CPU
  tensors under Triton's interpreter (~30 s; tests/ops/triton_modes.py sets TRITON_INTERPRET=1 before triton
  is imported):
      HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_ssd_triton.py
  The interpreter's tl.dot is wrong for bfloat16 (numpy has no bfloat16), so float16 stands in for the 16-bit
  path there; bfloat16 is checked on the GPU only.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.triton_modes import (  # sets the mode
    H200_SHARED_BYTES,
    DEVICE,
    INTERPRET,
    ON_GPU,
    compile_for_sm90,
    gpu_only,
    interpret,
    needs_cuda_backend,
)

from hybridlm.ops.ssd import ssd
from tests.helpers import rel_err
from tests.ops.ssd_helpers import NAMES, make_inputs, outputs_and_grads, time_slice


TOL = 1e-4  # float32 against float32 references


def inputs_on_device(*shape, dtype=torch.float32, with_state=True, with_D=True, **kwargs):
    """`make_inputs(*shape)` on DEVICE in `dtype` (leaves requiring grad), optionally without h0 / D."""
    inputs = {k: v.detach().to(DEVICE, dtype).requires_grad_() for k, v in make_inputs(*shape, **kwargs).items()}
    if not with_state:
        del inputs["initial_state"]
    if not with_D:
        del inputs["D"]
    return inputs


def run_all(inputs, **kwargs):
    """Outputs and gradients of every input present (NAMES order, absent ones skipped)."""
    y, h = ssd(**inputs, output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y)
    gh = torch.randn(h.shape, generator=g, dtype=torch.float64).to(h)
    names = [k for k in ("x", "dt", "A", "B", "C", "D", "initial_state") if k in inputs]
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), [inputs[k] for k in names])
    out = {"y": y.detach(), "final_state": h.detach()}
    out.update({"d" + ("h0" if k == "initial_state" else k): gr for k, gr in zip(names, grads)})
    return out


def assert_close(out, ref, tol, label=""):
    assert out.keys() == ref.keys()
    for name in out:
        assert torch.isfinite(out[name]).all(), f"{label} {name}"
        err = rel_err(out[name], ref[name])
        assert err < tol, f"{label} {name}: {err:.3e}"


# ------------------------------------------------------------------------------------ float32 vs references


CASES = {  # (b, T, H, P, G, N), chunk_size, with initial state, with D
    "T37_L16_G2_state": ((2, 37, 4, 6, 2, 5), 16, True, True),       # T not a multiple of the chunk, N != P
    "T5_L64_G1": ((1, 5, 2, 3, 1, 7), 64, True, True),                # one partial chunk of 64
    "T40_L32_G1_nostate_noD": ((1, 40, 3, 5, 1, 9), 32, False, False),
    "T33_L16_G4_R1": ((1, 33, 4, 4, 4, 3), 16, True, False),          # one head per group
}


@interpret
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_chunk_and_naive(case):
    shape, chunk_size, with_state, with_D = CASES[case]
    inputs = inputs_on_device(*shape, with_state=with_state, with_D=with_D, seed=len(case))
    out = run_all(inputs, backend="triton", chunk_size=chunk_size)
    assert out["y"].dtype == torch.float32 and out["final_state"].dtype == torch.float32
    assert_close(out, run_all(inputs, backend="chunk", chunk_size=chunk_size), TOL, "vs chunk")
    assert_close(out, run_all(inputs, backend="naive"), TOL, "vs naive")


@interpret
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 2),
    T=st.integers(1, 36),
    G=st.integers(1, 2),
    R=st.integers(1, 2),
    P=st.integers(1, 20),
    N=st.integers(1, 20),
    chunk_size=st.sampled_from([16, 32]),
    with_state=st.booleans(),
    with_D=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_naive(b, T, G, R, P, N, chunk_size, with_state, with_D, seed):
    """Random odd sizes against the float64 spec (where a gradient is exactly zero, e.g. dA with T = 1 and no
    initial state, float32 leaves a rounding residual: rel_err then measures its absolute size)."""
    inputs = inputs_on_device(b, T, G * R, P, G, N, with_state=with_state, with_D=with_D, seed=seed)
    out = run_all(inputs, backend="triton", chunk_size=chunk_size)
    assert_close(out, run_all({k: v.detach().double().requires_grad_() for k, v in inputs.items()}, backend="naive"),
                 TOL)


@interpret
def test_blocks_of_P_and_N():
    """P = 72 > 64 (two P blocks in the forward kernels, one padded 128 block in the backward) and N = 80 (two N
    blocks, the second partial), against the float64 naive spec."""
    inputs = inputs_on_device(1, 20, 2, 72, 1, 80, seed=4)
    out = run_all(inputs, backend="triton", chunk_size=16)
    ref = run_all({k: v.detach().double().requires_grad_() for k, v in inputs.items()}, backend="naive")
    assert_close(out, ref, TOL)


@interpret
def test_strong_decay_stays_finite():
    # Per-step log decays down to -40: every exponent in the kernels must stay <= 0 (see test_ssd.py's twin).
    inputs = inputs_on_device(1, 40, 4, 3, 1, 4, dt_scale=20.0, seed=7)
    with torch.no_grad():
        inputs["A"].copy_(torch.tensor([-2.0, -0.5, -1e-3, -1.0]))
    out = run_all(inputs, backend="triton", chunk_size=32)
    ref = run_all({k: v.detach().double().requires_grad_() for k, v in inputs.items()}, backend="naive")
    assert_close(out, ref, TOL)


@interpret
def test_state_carry_over():
    """Two calls chained through the final state equal one call (the split inside a chunk)."""
    inputs = {k: v.detach() for k, v in inputs_on_device(1, 40, 2, 4, 1, 3, seed=3).items()}
    y_full, h_full = ssd(**inputs, output_final_state=True, backend="triton", chunk_size=16)
    y_a, h_a = ssd(**time_slice(inputs, 0, 21), output_final_state=True, backend="triton", chunk_size=16)
    second = time_slice(inputs, 21, None)
    second["initial_state"] = h_a
    y_b, h_b = ssd(**second, output_final_state=True, backend="triton", chunk_size=16)
    assert rel_err(torch.cat([y_a, y_b], dim=1), y_full) < 1e-5 and rel_err(h_b, h_full) < 1e-5


@interpret
def test_varlen_matches_chunk():
    """Packed sequences (one shorter than a chunk, one of length 1) against the chunk backend's varlen path and
    a naive loop over the sequences, every gradient included."""
    lengths = [5, 21, 1, 9]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    inputs = inputs_on_device(1, sum(lengths), 4, 3, 2, 5, n_states=len(lengths), seed=11)
    out = run_all(inputs, backend="triton", chunk_size=16, cu_seqlens=cu_seqlens)
    assert_close(out, run_all(inputs, backend="chunk", chunk_size=16, cu_seqlens=cu_seqlens), TOL, "vs chunk")
    ys, hs = [], []
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        one = time_slice(inputs, start, end)
        one["initial_state"] = inputs["initial_state"][i : i + 1]
        y_i, h_i = ssd(**one, output_final_state=True, backend="naive")
        ys.append(y_i)
        hs.append(h_i)
    ref = outputs_and_grads(inputs, torch.cat(ys, dim=1), torch.cat(hs, dim=0))
    mine = outputs_and_grads(inputs, *ssd(**inputs, output_final_state=True, backend="triton", chunk_size=16,
                                          cu_seqlens=cu_seqlens))
    for name, a, b in zip(NAMES, mine, ref):
        assert rel_err(a, b) < TOL, f"{name}: {rel_err(a, b):.3e}"


@interpret
@pytest.mark.parametrize("used", ["y", "final_state"])
def test_one_output_used(used):
    """A loss of y alone (no dL/dh_final reaches the backward op) or of the final state alone (dL/dy = 0)."""
    inputs = inputs_on_device(1, 21, 2, 3, 1, 4, seed=8)

    def grads(backend):
        y, h = ssd(**inputs, output_final_state=True, backend=backend, chunk_size=16)
        loss = y.square().sum() if used == "y" else h.square().sum()
        return torch.autograd.grad(loss, list(inputs.values()), allow_unused=True)

    for (name, leaf), a, b in zip(inputs.items(), grads("triton"), grads("chunk")):
        a, b = (torch.zeros_like(leaf) if g is None else g for g in (a, b))  # D does not reach the state
        assert rel_err(a, b) < TOL, name


@interpret
def test_empty_sequence_passes_the_state_through():
    inputs = {k: v.detach() for k, v in inputs_on_device(2, 0, 2, 3, 1, 4).items()}
    y, h = ssd(**inputs, output_final_state=True, backend="triton")
    assert y.shape == (2, 0, 2, 3) and torch.equal(h, inputs["initial_state"])


# ------------------------------------------------------------------------------------------ 16-bit inputs


HALF = [pytest.param(torch.float16, id="f16"), pytest.param(torch.bfloat16, id="bf16", marks=gpu_only)]


@interpret
@pytest.mark.parametrize("dtype", HALF)
def test_half_inputs_fp32_state(dtype):
    """x, B, C in 16 bits (matmuls in 16 bits, fp32 accumulation; dt, A, D and the state in fp32): y keeps x's dtype,
    the state is float32, and all of it (gradients included) is close to float32 math on the same rounded values."""
    inputs = inputs_on_device(2, 40, 4, 16, 2, 16, dtype=dtype, seed=5)
    out = run_all(inputs, backend="triton", chunk_size=16)
    assert out["y"].dtype == dtype and out["final_state"].dtype == torch.float32
    assert out["dx"].dtype == dtype and out["ddt"].dtype == dtype
    ref = run_all({k: v.detach().float().requires_grad_() for k, v in inputs.items()}, backend="chunk",
                  chunk_size=16)
    assert_close({k: v.float() for k, v in out.items()}, ref, 2e-2)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_large_shape(dtype):
    """A model-sized call (P = 64, N = 128, G = 2, chunk 64, T not a multiple of it) against the chunk path."""
    inputs = inputs_on_device(2, 1000, 8, 64, 2, 128, dtype=dtype, seed=2)
    out = run_all(inputs, backend="triton", chunk_size=64)
    ref = run_all({k: v.detach().float().requires_grad_() for k, v in inputs.items()}, backend="chunk",
                  chunk_size=64)
    assert_close({k: v.float() for k, v in out.items()}, ref, TOL if dtype == torch.float32 else 3e-2)


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_kernels_run_on_the_tensors_gpu():
    """Tensors on cuda:1 while cuda:0 is current: the kernels launch there and give cuda:0's results."""
    inputs = inputs_on_device(2, 50, 2, 16, 1, 16, seed=4)
    ref = run_all(inputs, backend="triton", chunk_size=16)
    with torch.cuda.device(0):
        out = run_all({k: v.detach().to("cuda:1").requires_grad_() for k, v in inputs.items()}, backend="triton",
                      chunk_size=16)
    assert_close({k: v.to(DEVICE) for k, v in out.items()}, ref, 1e-6)


# ---------------------------------------------------------------------------------- custom ops and compile


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@interpret
def test_opcheck():
    """The forward op with D and an initial state; the backward op without them (and without dL/dh_final)."""
    import hybridlm.ops.ssd.triton.custom_ops  # noqa: F401  (registers the ops)

    inp = inputs_on_device(1, 20, 2, 4, 1, 3, seed=1)
    x, dt, A, B, C, D, h0 = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "initial_state"))
    torch.library.opcheck(torch.ops.hybridlm.ssd_fwd, (x, dt, A, B, C, D, h0, 16), test_utils=OPCHECKS)
    dy = torch.randn(1, 20, 2, 4, device=DEVICE)
    detached = [t.detach() for t in (x, dt, A, B, C)]
    torch.library.opcheck(torch.ops.hybridlm.ssd_bwd, (dy, None, *detached, None, None, 16), test_utils=OPCHECKS)


@interpret
@pytest.mark.parametrize("compile_backend", ["aot_eager", pytest.param("inductor", marks=gpu_only)])
def test_compiled_front_door_matches_eager(compile_backend):
    """torch.compile(fullgraph=True) of `ssd(backend="triton")`: no graph break; outputs, final state and every
    gradient equal to eager's (the same kernels run)."""

    def fn(x, dt, A, B, C, D, initial_state):
        return ssd(x, dt, A, B, C, D=D, initial_state=initial_state, output_final_state=True, backend="triton",
                   chunk_size=16)

    inputs = inputs_on_device(2, 23, 4, 4, 2, 3, seed=6)
    leaves = list(inputs.values())
    y, h = fn(*leaves)
    grads = torch.autograd.grad(y.square().sum() + h.square().sum(), leaves)
    y_c, h_c = torch.compile(fn, fullgraph=True, backend=compile_backend)(*leaves)
    grads_c = torch.autograd.grad(y_c.square().sum() + h_c.square().sum(), leaves)
    assert rel_err(y_c, y) < 1e-5 and rel_err(h_c, h) < 1e-5
    for name, grad, grad_c in zip(inputs, grads, grads_c):
        assert rel_err(grad_c, grad) < 1e-5, name


# ----------------------------------------------------------------------------------------- import, errors


def test_import_without_triton():
    """The package imports (and reports unavailable) where triton is missing; the custom ops register there too."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import importlib; t = importlib.import_module('hybridlm.ops.ssd.triton')\n"
            "import hybridlm.ops.ssd.triton.custom_ops\n"
            "from hybridlm.ops.ssd import ssd\n"
            "import torch; torch.ops.hybridlm.ssd_fwd\n"
            "assert not t.is_available()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


_SM90_KERNELS = """
from hybridlm.ops.ssd.triton import kernels as k

IO = ("x_ptr", "B_ptr", "C_ptr", "y_ptr", "dy_ptr", "dx_ptr", "dB_ptr", "dC_ptr", "a_ptr", "w_ptr")
build(k.chunk_cumsum_kernel, dict(BT=64))
build(k.state_pass_kernel, dict(P=64, N=128, BT=64, BP=32, BN=32, HAS_INIT=True, REVERSE=True, INTERPRET=False))
for io, prec, s in (("*bf16", "tf32", dict(P=64, N=128, BT=64)), ("*fp32", "ieee", dict(P=16, N=16, BT=16))):
    b = functools.partial(build, io=io, io_names=IO)
    blocks = dict(s, BP=min(s["P"], 64), BN=min(s["N"], 64), PREC=prec)
    b(k.chunk_state_kernel, dict(blocks, GRAD=True))
    b(k.output_kernel, dict(blocks, HAS_D=True))
    b(k.grad_x_kernel, dict(blocks, HAS_D=True))
    b(k.grad_bc_kernel, dict(blocks, R=2))
"""

_SM90_STEP = """
from hybridlm.ops.ssd.triton import step as k

# The decoding step as step.forward blocks it: a model's sizes in bf16, the largest state, odd float32 sizes; with
# the mixer's discretization (RAW: the raw dt in bf16), its gate and in place, and without.
for io, P, N in (("*bf16", 64, 128), ("*bf16", 128, 256), ("*fp32", 20, 12)):
    BN = max(16, triton.next_power_of_2(N))
    BP = min(max(16, triton.next_power_of_2(P)), max(16, k.STATE_BLOCK // BN))
    for has_d, raw in ((True, False), (False, False), (True, True)):  # the mixer's form in place (a graphed decoder's)
        build(k.step_kernel, dict(P=P, N=N, BP=BP, BN=BN, HAS_D=has_d, RAW=raw, GATE=raw, IN_PLACE=raw), io=io,
              io_names=("x_ptr", "B_ptr", "C_ptr", "y_ptr", "z_ptr") + (("dt_ptr",) if raw else ()),
              types={"dt_min": "fp32", "dt_max": "fp32", "z_scale": "fp32"}, warps=k.NUM_WARPS)
"""


@needs_cuda_backend
def test_kernels_compile_for_sm90():
    """Every kernel compiles to PTX for sm_90 (bf16 at a model's sizes, fp32 small): the interpreter does not type-
    check the compiled path (`triton_modes.compile_for_sm90`, ~10 s without a GPU)."""
    for script, module in ((_SM90_KERNELS, "kernels"), (_SM90_STEP, "step")):
        report = compile_for_sm90(script, modules=(f"hybridlm.ops.ssd.triton.{module}",))
        assert set(report["built"]) == report["defined"], report  # every kernel of the file
        assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]


@pytest.mark.skipif(INTERPRET or ON_GPU, reason="checks the refusal on CPU tensors without the interpreter")
def test_cpu_tensors_refused_without_interpreter():
    inputs = {k: v.detach() for k, v in make_inputs(1, 5, 2, 3, 1, 4, dtype=torch.float32).items()}
    with pytest.raises(ValueError, match="needs triton installed and the tensors on a CUDA device"):
        ssd(**inputs, backend="triton")


@interpret
def test_rejects_unsupported_calls():
    inputs = {k: v.detach().to(DEVICE) for k, v in make_inputs(1, 5, 2, 3, 1, 4).items()}  # float64
    with pytest.raises(ValueError, match="use backend='chunk'"):
        ssd(**inputs, backend="triton")
    inputs = {k: v.float() for k, v in make_inputs(1, 5, 1, 130, 1, 4).items()}
    with pytest.raises(ValueError, match="P <= 128"):
        ssd(**{k: v.to(DEVICE) for k, v in inputs.items()}, backend="triton")


def test_auto_picks_triton_only_on_cuda(monkeypatch):
    """"auto" takes the Triton kernels for 16-bit CUDA tensors they support and the chunk path for everything else:
    CPU tensors (even under the interpreter), float32 and float64, P > 128."""
    ssd_module = sys.modules["hybridlm.ops.ssd"]  # (hybridlm.ops.ssd, the attribute, is the function)
    real = ssd_module.ssd_triton
    called = []

    def spy(*args, **kwargs):
        called.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssd_module, "ssd_triton", spy)
    inputs = {k: v.detach().float() for k, v in make_inputs(1, 9, 2, 3, 1, 4).items()}
    y, _ = ssd(**inputs)
    y_chunk, _ = ssd(**inputs, backend="chunk")
    assert torch.equal(y, y_chunk) and called == []
    if torch.cuda.is_available():
        on_gpu = {k: v.cuda() for k, v in inputs.items()}
        half = {k: v.to(torch.bfloat16) if k in ("x", "B", "C") else v for k, v in on_gpu.items()}
        y_gpu, _ = ssd(**half)
        assert called == ["cuda"]
        torch.testing.assert_close(y_gpu.float().cpu(), y_chunk, rtol=2e-2, atol=2e-2)
        ssd(**on_gpu)  # float32: the chunk path
        ssd(**{k: v.double() for k, v in on_gpu.items()})  # float64: the chunk path
        wide = {k: v.detach().to(torch.bfloat16).cuda() for k, v in make_inputs(1, 5, 1, 130, 1, 4).items()}
        ssd(**wide)  # P = 130 > 128: the chunk path
        assert called == ["cuda"]


@interpret
def test_strided_inputs_are_copied_inside_the_kept_call(monkeypatch):
    """The forward op hands the scan's launcher, wrapped by `on_contiguous`, the caller's strided tensors: their
    contiguous copies are made inside the kept call, so a recomputed region's replay makes none to throw away."""
    from hybridlm.ops.recompute import on_contiguous
    from hybridlm.ops.ssd.triton import custom_ops, scan, ssd_chunk_triton

    seen = []
    kept = custom_ops.kept_kernel
    monkeypatch.setattr(custom_ops, "kept_kernel", lambda launch, *args: (seen.append((launch, args)),
                                                                          kept(launch, *args))[1])
    g = torch.Generator().manual_seed(3)
    b, T, H, P, G, N = 1, 20, 2, 16, 1, 16
    xbc = torch.randn(b, T, H * P + 2 * G * N, generator=g).to(DEVICE)  # x | B | C of one projection
    x = xbc[..., :H * P].unflatten(-1, (H, P))
    B, C = (xbc[..., H * P + i * G * N:H * P + (i + 1) * G * N].unflatten(-1, (G, N)) for i in range(2))
    dt = torch.rand(b, T, H, generator=g).to(DEVICE)
    A = -torch.rand(H, generator=g).to(DEVICE)
    assert not x.is_contiguous() and not B.is_contiguous()
    y, _ = ssd_chunk_triton(x, dt, A, B, C, None, None, chunk_size=16)
    (launch, args), = seen
    assert launch is on_contiguous(scan.forward) and args[0] is x and args[3] is B and args[4] is C
    want, _ = ssd(x, dt, A, B, C, backend="naive")
    assert rel_err(y.double().cpu(), want.double().cpu()) < 1e-4
