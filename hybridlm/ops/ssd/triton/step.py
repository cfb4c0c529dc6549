"""One decoding step of the SSD recurrence in one kernel: `naive.py`'s step for every row and head at once. The
implementation of the custom op `hybridlm::ssd_step` (`custom_ops.py`); inference only (no backward).

On the torch path a step is some sixteen small kernels per layer (casts, the decay, the rank-1 write, the read, the
skip, the output cast), and a CUDA-graphed step's time is its kernel count. Here one program per (row b, head h,
block of head dims) computes, in float32 (the state's dtype), with g = h // (H / G) the head's group:

    a = exp(dt * A[h])
    h_t = a * h_{t-1} + (dt * x) B_g^T          [BP, N]
    y = h_t C_g + D[h] * x                      [BP]

and writes y in x's dtype and h_t: into a new tensor, or over h_{t-1} itself (`in_place`: a fixed-address cache that
a replayed CUDA graph reads, which then needs no copy of the new state into it). Each program owns its block of the
state, so only its own threads read what it overwrites: a barrier between its loads and its store orders them.

The Mamba-2 mixer's step can hand over its raw discretization inputs instead (RAW), which the kernel turns into dt
and A where it loads them (the mixer's step 3: five kernels per layer on the unfused path), and its output gate
without a norm (GATE: y <- y * SiLU(m_z z), y and m_z z rounded to their dtypes first, `silu_gate`'s float32 product;
one kernel, two with the multiplier, per layer unfused):

    dt = clamp(softplus(dt_raw + dt_bias[h]), dt_min, dt_max)     A[h] = -exp(A_log[h])

with softplus(u) = u above 20 (torch's threshold), else log1p(exp(u)) (log1p as log(1 + z) z / ((1 + z) - 1),
accurate where 1 + z rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton_utils import block
from hybridlm.ops.utils import cdiv

NUM_WARPS = 4
STATE_BLOCK = 4096  # float32 elements of the state per program: BP x BN, 32 per thread at 4 warps


@triton.jit
def _softplus(u):
    """torch's softplus (beta 1, threshold 20) of float32 u."""
    z = tl.exp(tl.minimum(u, 20.0, propagate_nan=tl.PropagateNan.ALL))
    w = 1.0 + z
    rounded = w == 1.0  # z below half an ulp of 1: log1p(z) = z to float32 precision
    log1p = tl.where(rounded, z, tl.log(w) * tl.math.div_rn(z, tl.where(rounded, 1.0, w - 1.0)))
    return tl.where(u > 20.0, u, log1p)


@triton.jit
def step_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, h_ptr, y_ptr, h_out_ptr, dt_bias_ptr, z_ptr, H, G, sx_b,
                sx_h, sb_b, sb_g, sc_b, sc_g, sdt_b, sz_b, dt_min, dt_max, z_scale, P: tl.constexpr, N: tl.constexpr,
                BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, RAW: tl.constexpr, GATE: tl.constexpr,
                IN_PLACE: tl.constexpr):
    # x, B, C are read at (row, head or group) strides (unit stride along the last dim), dt at its row stride: the
    # mixer hands over row slices of its projection and conv output, which a contiguous copy would cost a kernel
    # each; h, y, h' are contiguous.
    i_bh, i_p = tl.program_id(0), tl.program_id(1)
    bh = i_bh.to(tl.int64)
    i_b, i_h = bh // H, bh % H
    i_g = i_h // (H // G)
    rp = i_p * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    x = tl.load(x_ptr + i_b * sx_b + i_h * sx_h + rp, mask=mp, other=0.0).to(tl.float32)      # [BP]
    Bg = tl.load(B_ptr + i_b * sb_b + i_g * sb_g + rn, mask=mn, other=0.0).to(tl.float32)     # [BN]
    Cg = tl.load(C_ptr + i_b * sc_b + i_g * sc_g + rn, mask=mn, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i_b * sdt_b + i_h).to(tl.float32)
    A = tl.load(A_ptr + i_h).to(tl.float32)
    if RAW:  # the mixer's discretization: dt from its raw value, A from A_log
        # a NaN dt stays NaN, as torch's clamp keeps it (a diverged model shows)
        dt = tl.maximum(_softplus(dt + tl.load(dt_bias_ptr + i_h).to(tl.float32)), dt_min, propagate_nan=tl.PropagateNan.ALL)
        dt = tl.minimum(dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
        A = -tl.exp(A)
    decay = tl.exp(dt * A)
    h_offs = (bh * P + rp[:, None]) * N + rn[None, :]
    h_mask = mp[:, None] & mn[None, :]
    h = tl.load(h_ptr + h_offs, mask=h_mask, other=0.0)                                   # [BP, BN] h_{t-1}
    h = decay * h + (dt * x)[:, None] * Bg[None, :]
    y = tl.sum(h * Cg[None, :], axis=1)
    if HAS_D:
        y = y + tl.load(D_ptr + i_h).to(tl.float32) * x
    if GATE:  # the mixer's output gate on y as the op hands it over (in x's dtype)
        z = tl.load(z_ptr + i_b * sz_b + i_h * P + rp, mask=mp, other=0.0).to(tl.float32)
        z = (z * z_scale).to(z_ptr.dtype.element_ty).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) * z * tl.sigmoid(z)
    tl.store(y_ptr + bh * P + rp, y.to(y_ptr.dtype.element_ty), mask=mp)
    if IN_PLACE:
        tl.debug_barrier()  # every thread's reads of h_{t-1} done before any of it is overwritten
    tl.store(h_out_ptr + h_offs, h, mask=h_mask)


def forward(x, dt, A, B, C, D, h, *, dt_bias=None, dt_limit: tuple[float, float] = (0.0, float("inf")), z=None,
            z_scale: float = 1.0, in_place: bool = False):
    """y [b, H, P] (x's dtype) and h_t [b, H, P, N] float32 from x [b, H, P], B, C [b, G, N] (any strides but a unit
    one along the last dim), dt [b, H] (any row stride), A [H], D [H] or None (any float dtype, read as float32) and
    h [b, H, P, N] float32 (contiguous). With dt_bias [H] (likewise), dt is the raw value (any float dtype) and A is
    A_log (RAW). With z [b, H P] (x's dtype, any row stride), y is gated: y * SiLU(z_scale z) (GATE). `in_place`: h_t
    is h itself, overwritten."""
    b, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = x.new_empty(b, H, P)
    h_out = h if in_place else torch.empty_like(h)
    BN = block(N, 256)
    BP = min(block(P, 256), max(16, STATE_BLOCK // BN))
    step_kernel[(b * H, cdiv(P, BP))](
        x, dt, A, B, C, D if D is not None else A, h, y, h_out, dt_bias if dt_bias is not None else A,
        z if z is not None else x, H, G, x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        dt.stride(0), z.stride(0) if z is not None else 0, dt_limit[0], dt_limit[1], z_scale, P=P, N=N, BP=BP, BN=BN,
        HAS_D=D is not None, RAW=dt_bias is not None, GATE=z is not None, IN_PLACE=in_place, num_warps=NUM_WARPS)
    return y, h_out
