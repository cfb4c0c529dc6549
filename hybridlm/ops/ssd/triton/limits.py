"""What the Triton backend of the SSD op takes: head and state sizes, dtypes (torch only)."""

from __future__ import annotations

import torch

MAX_HEAD_DIM = 128  # P: the backward kernels hold a whole head's [chunk, P] block
MAX_D_STATE = 256  # N: looped over in blocks of 64
MAX_CHUNK = 64  # the backward kernels hold several [chunk, chunk] and [chunk, P] fp32 tiles (more spills)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of x, B, C (float64 stays on the torch backends)


def supports(*, P: int, N: int, dtype: torch.dtype) -> bool:
    """Whether the Triton backend handles inputs of head dim P, state dim N and (promoted) dtype `dtype`."""
    return P <= MAX_HEAD_DIM and N <= MAX_D_STATE and dtype in DTYPES
