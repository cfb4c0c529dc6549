"""Rule 3A's band on Triton (`kernels_band.py`): launchers of the forward and backward, the implementations of the
custom ops `hybridlm::fast_weight_band_fwd` / `_bwd` (`custom_ops.py`).

The band is O(W (K + V)) work per step and reads each input a few times: memory-bound, one program per block of
BT steps (or ext rows) and (row, head).
"""

from __future__ import annotations

import torch
import triton

from hybridlm.ops.fast_weight.triton import kernels_band

BT, NUM_WARPS = 16, 4  # bwd_xy holds six [BT, 128] float32 blocks: 96 registers per thread at 16


def _sizes(q, y_ext, c):
    N, T, H, K = q.shape
    V = y_ext.shape[-1]
    W = c.shape[-1] + 1
    return N, T, H, {"W": W, "K": K, "V": V, "BT": BT, "BK": max(16, triton.next_power_of_2(K)),
                     "BV": max(16, triton.next_power_of_2(V))}


def forward(q, x_ext, y_ext, c, base, shift: int) -> torch.Tensor:
    """base + o_band [N, T, H, V] in base's dtype (contiguous inputs: q [N, T, H, K], x_ext [N, W-1+T, H, K], y_ext
    [N, W-1+T, H, V], c [N, T, H, W-1] float32, base [N, T, H, V])."""
    N, T, H, sizes = _sizes(q, y_ext, c)
    o = torch.empty_like(base)
    kernels_band.band_fwd_kernel[(triton.cdiv(T, BT), N * H)](q, x_ext, y_ext, c, base, o, T, H, SHIFT=shift,
                                                              **sizes, num_warps=NUM_WARPS)
    return o


def backward(do, q, x_ext, y_ext, c, shift: int):
    """dq (q's dtype), dx_ext, dy_ext (their dtypes) and dc (float32) for do [N, T, H, V] (any float dtype: the
    kernels read it in float32)."""
    N, T, H, sizes = _sizes(q, y_ext, c)
    dq, dc = torch.empty_like(q), torch.empty_like(c)
    dx, dy = torch.empty_like(x_ext), torch.empty_like(y_ext)
    kernels_band.band_bwd_q_kernel[(triton.cdiv(T, BT), N * H)](do, q, x_ext, y_ext, c, dq, dc, T, H, SHIFT=shift,
                                                                **sizes, num_warps=NUM_WARPS)
    rows = x_ext.shape[1]
    kernels_band.band_bwd_xy_kernel[(triton.cdiv(rows, BT), N * H)](do, q, x_ext, y_ext, c, dx, dy, T, H,
                                                                    SHIFT=shift, **sizes, num_warps=NUM_WARPS)
    return dq, dx, dy, dc
