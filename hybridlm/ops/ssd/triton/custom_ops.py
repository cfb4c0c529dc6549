"""The Triton SSD scan as `torch.library` custom ops, so that `torch.compile` traces it as single graph nodes (fake
implementations give the output shapes; autograd is registered on the forward op and calls the backward op).

    hybridlm::ssd_fwd(x, dt, A, B, C, D?, h0?, chunk_size) -> (y, h_final)
    hybridlm::ssd_bwd(dy, dh_final?, x, dt, A, B, C, D?, h0?, chunk_size) -> (dx, ddt, dA, dB, dC, dD, dh0)
    hybridlm::ssd_step(x, dt, A, B, C, D?, h, dt_bias?, dt_min, dt_max, z?, z_scale) -> (y, h_t): one decoding step
        (`step.py`), inference only; with dt_bias, dt is the raw value and A is A_log (the mixer's discretization in
        the kernel); with z, y is gated, y * SiLU(z_scale z) (the mixer's output gate without a norm).
    hybridlm::ssd_step_(x, dt, A, B, C, D?, h!, dt_bias?, dt_min, dt_max, z?, z_scale) -> y: the same step writing h_t
        over h (a fixed-address cache that a replayed CUDA graph reads).

The implementation (`scan.py`, which needs triton) is imported on the first call; this file imports only torch.
dD and dh0 are always computed (dh0 is where the reverse pass ends); the autograd formula drops them when D / h0 is
None.
"""

import math

import torch

from hybridlm.ops.recompute import keep_in_compiled_regions, kept_kernel, on_contiguous
from hybridlm.ops.ssd.triton.limits import DTYPES, MAX_D_STATE, MAX_HEAD_DIM
from hybridlm.ops.utils import contiguous_rows, on_tensor_device, triton_interpreting, unit_last_stride

_FWD_SCHEMA = "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? h0, int chunk_size) " \
              "-> (Tensor, Tensor)"
_BWD_SCHEMA = "(Tensor dy, Tensor? dh_final, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, " \
              "Tensor? h0, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"


def ssd_chunk_triton(x, dt, A, B, C, D, h0, *, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD on the Triton kernels, differentiable in every tensor input.

    Args:
        x: `[b, T, H, P]`; B, C: `[b, T, G, N]` (one dtype among float32, bfloat16, float16; G divides H).
        dt: `[b, T, H]` float32 (>= 0). A: `[H]` float32 (< 0). D: `[H]` float32 or None.
        h0: `[b, H, P, N]` float32 entry state, or None for zeros.
        chunk_size: a power of two in [16, 128].

    Returns:
        y `[b, T, H, P]` in x's dtype and the final state `[b, H, P, N]` float32.
    """
    _check(x, dt, A, B, C, D, h0, chunk_size)
    return torch.ops.hybridlm.ssd_fwd(x, dt, A, B, C, D, h0, int(chunk_size))


def _check(x, dt, A, B, C, D, h0, chunk_size) -> None:
    if x.dim() != 4 or B.dim() != 4 or C.shape != B.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"x must be [b, T, H, P] and B, C [b, T, G, N]; got x {tuple(x.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    if T < 1:
        raise ValueError("the sequence is empty (T = 0)")
    if G < 1 or H % G != 0:
        raise ValueError(f"the number of heads H = {H} must be a multiple of the number of groups G = {G}")
    if x.dtype not in DTYPES or B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"x, B, C must share one dtype among {DTYPES}; got {x.dtype}, {B.dtype}, {C.dtype}")
    for name, t, shape in (("dt", dt, (b, T, H)), ("A", A, (H,)), ("D", D, (H,)), ("h0", h0, (b, H, P, N))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 {list(shape)}; got {list(t.shape)} {t.dtype}")
    if P > MAX_HEAD_DIM or N > MAX_D_STATE:
        raise ValueError(f"the Triton kernels take P <= {MAX_HEAD_DIM} and N <= {MAX_D_STATE}; got P = {P}, "
                         f"N = {N} (use the chunk backend)")
    if not (isinstance(chunk_size, int) and 16 <= chunk_size <= 128 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a power of two in [16, 128] for the Triton kernels; got {chunk_size}")
    devices = {t.device for t in (x, dt, A, B, C, D, h0) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not triton_interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {x.device}; on a CPU set TRITON_INTERPRET=1 "
                         "before triton is imported to run them under the interpreter)")


def _implementation():
    """The launchers (`scan.py`), imported on the first call (they need triton)."""
    from hybridlm.ops.ssd.triton import scan

    return scan


def _contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


@torch.library.custom_op("hybridlm::ssd_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def _ssd_fwd(x, dt, A, B, C, D, h0, chunk_size):
    with on_tensor_device(x):  # kept, not run again, in a recomputed region (hybridlm.ops.recompute)
        return kept_kernel(on_contiguous(_implementation().forward), x, dt, A, B, C, D, h0, chunk_size)


@_ssd_fwd.register_fake
def _(x, dt, A, B, C, D, h0, chunk_size):
    b, _, H, P = x.shape
    return x.new_empty(x.shape), x.new_empty(b, H, P, B.shape[-1], dtype=torch.float32)


@torch.library.custom_op("hybridlm::ssd_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def _ssd_bwd(dy, dh_final, x, dt, A, B, C, D, h0, chunk_size):
    dh_final = None if dh_final is None else dh_final.float()
    with on_tensor_device(x):
        return _implementation().backward(*_contiguous(dy, dh_final, x, dt, A, B, C, D, h0), chunk_size)


@_ssd_bwd.register_fake
def _(dy, dh_final, x, dt, A, B, C, D, h0, chunk_size):
    b, _, H, P = x.shape
    # Contiguous, as the kernels write them (the inputs are made contiguous first).
    return (x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
            C.new_empty(C.shape), A.new_empty(H), x.new_empty(b, H, P, B.shape[-1], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, h0, chunk_size = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, h0)
    ctx.chunk_size = chunk_size
    ctx.set_materialize_grads(False)  # an unused final state's gradient stays None, not a zero-filled tensor


def _backward(ctx, dy, dh_final):
    x, dt, A, B, C, D, h0 = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    dx, ddt, dA, dB, dC, dD, dh0 = _ssd_bwd(dy.to(x.dtype), dh_final, x, dt, A, B, C, D, h0, ctx.chunk_size)
    return dx, ddt, dA, dB, dC, (None if D is None else dD), (None if h0 is None else dh0), None


_ssd_fwd.register_autograd(_backward, setup_context=_setup_context)
keep_in_compiled_regions(torch.ops.hybridlm.ssd_fwd.default)


def ssd_step_triton(x, dt, A, B, C, D, h, *, discretize: tuple | None = None, gate: tuple | None = None,
                    in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the SSD recurrence in one kernel (`step.py`), without autograd.

    Args:
        x: `[b, H, P]`; B, C: `[b, G, N]` (x, B, C in one dtype among the kernels'). dt: `[b, H]` (softplus-ed), A,
            D: `[H]` (D may be None), any float dtype (the kernel reads them as float32: a bf16 model's parameters
            take no cast kernel of their own). h: `[b, H, P, N]` float32, the state before the step.
        discretize: None, or `(dt_bias, (dt_min, dt_max))`: dt is then the raw value (any float dtype, read at its
            row stride) and A is A_log, and the kernel takes dt = clamp(softplus(dt + dt_bias), dt_min, dt_max),
            A = -exp(A_log) (dt_bias `[H]`, any float dtype), as the Mamba-2 mixer does.
        gate: None, or `(z, z_scale)`: y comes out gated, y * SiLU(z_scale z) with y and z_scale z rounded to their
            dtypes first (the Mamba-2 mixer's output gate without a norm); z `[b, H P]` in x's dtype (any row stride).
        in_place: write the state after the step over `h` (contiguous) and return `h` itself.

    Returns:
        y `[b, H, P]` in x's dtype and the state after the step `[b, H, P, N]` float32.
    """
    b, H, P = x.shape if x.dim() == 3 else (None,) * 3
    if (x.dim() != 3 or B.dim() != 3 or B.shape[0] != b or C.shape != B.shape or tuple(dt.shape) != (b, H)
            or tuple(A.shape) != (H,) or (D is not None and tuple(D.shape) != (H,))
            or tuple(h.shape) != (b, H, P, B.shape[-1]) or H % B.shape[1] != 0):
        raise ValueError(f"the step takes x [b, H, P], dt [b, H], A [H], B and C [b, G, N] (G dividing H), D [H] and "
                         f"h [b, H, P, N]; got {list(x.shape)}, {list(dt.shape)}, {list(A.shape)}, {list(B.shape)}, "
                         f"{list(C.shape)}, {None if D is None else list(D.shape)}, {list(h.shape)}")
    if x.dtype not in DTYPES or B.dtype != x.dtype or C.dtype != x.dtype or h.dtype != torch.float32:
        raise ValueError(f"x, B, C must share one dtype among {DTYPES} and h be float32; got {x.dtype}, {B.dtype}, "
                         f"{C.dtype}, {h.dtype}")
    if P > MAX_HEAD_DIM or B.shape[-1] > MAX_D_STATE:
        raise ValueError(f"the Triton kernels take P <= {MAX_HEAD_DIM} and N <= {MAX_D_STATE}; got P = {P}, "
                         f"N = {B.shape[-1]}")
    dt_bias, (dt_min, dt_max) = discretize if discretize is not None else (None, (0.0, math.inf))
    if dt_bias is not None and tuple(dt_bias.shape) != (H,):
        raise ValueError(f"dt_bias must be [H] = [{H}]; got {list(dt_bias.shape)}")
    z, z_scale = gate if gate is not None else (None, 1.0)
    if z is not None and (tuple(z.shape) != (b, H * P) or z.dtype != x.dtype):
        raise ValueError(f"the gate z must be [b, H P] = {[b, H * P]} in x's dtype {x.dtype}; got {list(z.shape)} "
                         f"{z.dtype}")
    if x.device.type != "cuda" and not triton_interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {x.device})")
    options = (dt_bias, float(dt_min), float(dt_max), z, float(z_scale))
    if in_place:
        if not h.is_contiguous():
            raise ValueError("ssd_step_triton: a state updated in place must be contiguous")
        return torch.ops.hybridlm.ssd_step_(x, dt, A, B, C, D, h, *options), h
    return torch.ops.hybridlm.ssd_step(x, dt, A, B, C, D, h, *options)


_STEP_OPTIONS = "Tensor? dt_bias, float dt_min, float dt_max, Tensor? z, float z_scale"


@torch.library.custom_op("hybridlm::ssd_step", mutates_args=(),
                         schema="(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor h, "
                                f"{_STEP_OPTIONS}) -> (Tensor, Tensor)")
def _ssd_step(x, dt, A, B, C, D, h, *options):
    return _run_step(x, dt, A, B, C, D, h.contiguous(), *options, in_place=False)


@_ssd_step.register_fake
def _(x, dt, A, B, C, D, h, *options):
    return x.new_empty(x.shape), h.new_empty(h.shape)


@torch.library.custom_op("hybridlm::ssd_step_", mutates_args=("h",),
                         schema="(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor(a!) h, "
                                f"{_STEP_OPTIONS}) -> Tensor")
def _ssd_step_in_place(x, dt, A, B, C, D, h, *options):
    return _run_step(x, dt, A, B, C, D, h, *options, in_place=True)[0]


@_ssd_step_in_place.register_fake
def _(x, dt, A, B, C, D, h, *options):
    return x.new_empty(x.shape)


def _run_step(x, dt, A, B, C, D, h, dt_bias, dt_min, dt_max, z, z_scale, *, in_place: bool):
    from hybridlm.ops.ssd.triton import step

    x, B, C = (unit_last_stride(t) for t in (x, B, C))  # read at their row strides
    dt = contiguous_rows(dt)
    A, D, dt_bias = _contiguous(A, D, dt_bias)
    with on_tensor_device(x):
        return step.forward(x, dt, A, B, C, D, h, dt_bias=dt_bias, dt_limit=(dt_min, dt_max),
                            z=None if z is None else unit_last_stride(z), z_scale=z_scale, in_place=in_place)
