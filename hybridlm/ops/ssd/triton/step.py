"""One decoding step of the SSD recurrence in one kernel: `naive.py`'s step for every row and head at once. The
implementation of the custom op `hybridlm::ssd_step` (`custom_ops.py`); inference only (no backward).

On the torch path a step is some sixteen small kernels per layer (casts, the decay, the rank-1 write, the read, the
skip, the output cast), and a CUDA-graphed step's time is its kernel count. Here one program per (row b, head h,
block of head dims) computes, in float32 (the state's dtype), with g = h // (H / G) the head's group:

    a = exp(dt * A[h])
    h_t = a * h_{t-1} + (dt * x) B_g^T          [BP, N]
    y = h_t C_g + D[h] * x                      [BP]

and writes y in x's dtype and h_t.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.triton_utils import block

NUM_WARPS = 4
STATE_BLOCK = 4096  # float32 elements of the state per program: BP x BN, 32 per thread at 4 warps


@triton.jit
def step_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, h_ptr, y_ptr, h_out_ptr, H, G, sx_b, sx_h, sb_b, sb_g,
                sc_b, sc_g, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                HAS_D: tl.constexpr):
    # x, B, C are read at (row, head or group) strides (unit stride along the last dim): the mixer hands over row
    # slices of its conv's output, which a contiguous copy would cost a kernel each; dt, h, y, h' are contiguous.
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
    dt = tl.load(dt_ptr + bh)
    decay = tl.exp(dt * tl.load(A_ptr + i_h))
    h_offs = (bh * P + rp[:, None]) * N + rn[None, :]
    h_mask = mp[:, None] & mn[None, :]
    h = tl.load(h_ptr + h_offs, mask=h_mask, other=0.0)                                   # [BP, BN] h_{t-1}
    h = decay * h + (dt * x)[:, None] * Bg[None, :]
    y = tl.sum(h * Cg[None, :], axis=1)
    if HAS_D:
        y = y + tl.load(D_ptr + i_h) * x
    tl.store(y_ptr + bh * P + rp, y.to(y_ptr.dtype.element_ty), mask=mp)
    tl.store(h_out_ptr + h_offs, h, mask=h_mask)


def forward(x, dt, A, B, C, D, h):
    """y [b, H, P] (x's dtype) and h_t [b, H, P, N] float32 from x [b, H, P], B, C [b, G, N] (any strides but a unit
    one along the last dim), dt [b, H], A [H], D [H] or None (float32) and h [b, H, P, N] float32 (contiguous)."""
    b, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = x.new_empty(b, H, P)
    h_out = torch.empty_like(h)
    BN = block(N, 256)
    BP = min(block(P, 256), max(16, STATE_BLOCK // BN))
    step_kernel[(b * H, triton.cdiv(P, BP))](
        x, dt, A, B, C, D if D is not None else A, h, y, h_out, H, G, x.stride(0), x.stride(1), B.stride(0),
        B.stride(1), C.stride(0), C.stride(1), P=P, N=N, BP=BP, BN=BN, HAS_D=D is not None, num_warps=NUM_WARPS)
    return y, h_out
