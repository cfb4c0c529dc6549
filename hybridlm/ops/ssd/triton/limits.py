"""What the Triton backend of the SSD op takes: head and state sizes, dtypes, and why `backend="auto"` leaves a CUDA
call on the chunk path (torch only)."""

from __future__ import annotations

import torch

from hybridlm.ops.head_limits import SSD_MAX_D_STATE, SSD_MAX_HEAD_DIM
from hybridlm.ops.utils import TRITON_DTYPES

MAX_HEAD_DIM = SSD_MAX_HEAD_DIM  # P
MAX_D_STATE = SSD_MAX_D_STATE  # N
MAX_CHUNK = 64  # the backward kernels hold several [chunk, chunk] and [chunk, P] fp32 tiles (more spills)
DTYPES = TRITON_DTYPES  # of x, B, C
# The dtypes `backend="auto"` sends here on CUDA: float32 inputs run exact ("ieee") products without tensor cores
# and spill registers (README.md), so they stay on the chunk path.
AUTO_DTYPES = (torch.bfloat16, torch.float16)


def supports(*, P: int, N: int, dtype: torch.dtype) -> bool:
    """Whether the Triton backend handles inputs of head dim P, state dim N and (promoted) dtype `dtype`."""
    return P <= MAX_HEAD_DIM and N <= MAX_D_STATE and dtype in DTYPES


def auto_takes(*, P: int, N: int, dtype: torch.dtype) -> bool:
    """Whether `backend="auto"` sends a CUDA call of this kind here (triton installed, no `seq_idx`): 16-bit x, B, C
    that `supports` takes."""
    return dtype in AUTO_DTYPES and supports(P=P, N=N, dtype=dtype)


def slow_path_reason(*, P: int, N: int, dtype: torch.dtype) -> str | None:
    """Why `backend="auto"` runs a 16-bit CUDA call of this kind on the chunk path instead of these kernels, and what to
    change: the text of its warning. None where "auto" takes the kernels, and for float32 and float64 inputs, which
    it keeps on the chunk path by design (the kernels' 16-bit path is the fast one; float64 is exact)."""
    if dtype not in AUTO_DTYPES or auto_takes(P=P, N=N, dtype=dtype):
        return None
    slow = "backend='auto' runs the torch chunk path (slower, more memory)"
    if P > MAX_HEAD_DIM:
        return (f"Mamba-2 heads of {P} dims exceed the SSD Triton kernels' {MAX_HEAD_DIM}: {slow}. Use heads of at "
                f"most {MAX_HEAD_DIM} dims: HybridConfig mamba_d_head <= {MAX_HEAD_DIM} (mamba_d_ssm / mamba_n_heads); "
                "left unset, mamba_n_heads is derived within it")
    return (f"a Mamba-2 state of {N} dims exceeds the SSD Triton kernels' {MAX_D_STATE}: {slow}. Use "
            f"mamba_d_state <= {MAX_D_STATE}")
