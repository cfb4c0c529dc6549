"""What the Triton backend of the fast-weight op takes: rules, windows, head sizes, dtypes and chunk lengths (torch
only)."""

from __future__ import annotations

import torch

# 3A runs on 1A's kernels over delayed writes plus a band kernel (backend.py), 3 as 1 over its write events (a
# step's events do not see each other's writes); 1, 2A and 2: window 1 (2A, 2: decays per value column).
SUPPORTED_RULES = ("1A", "3A", "1", "2A", "3", "2")
# The rules `backend="auto"` sends to these kernels on CUDA: those whose kernels are timed against the chunk path on a
# GPU (benchmarks/RESULTS.md). The others run when asked for (`backend="triton"`).
AUTO_RULES = ("1A", "3A", "1")
MAX_HEAD_DIM = 128  # K and V
# Rules 1 and 3 take chunks of at most 64: at 128 rule 1's gradient kernels ask for more shared memory than an H200
# block has (227 KiB), while chunks of 64 fit (tests/ops/test_triton_sm90.py builds them).
MAX_DELTA_CHUNK = 64
# Rule 3 lays each step out on the next power of two >= window slots; a chunk holds whole steps.
MAX_RULE_3_WINDOW = MAX_DELTA_CHUNK
# Rules 2A and 2's chunk length: their intra-chunk decays form a [C, C, V] tensor of exponentials, so their chunks
# are kept short, as chunk.py's PER_COLUMN_MAX_CHUNK. Rule 2's kernels take chunks of 16 or 32.
PER_COLUMN_CHUNK = 16
MAX_RULE_2_CHUNK = 32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of q, k, v (float64 stays on the torch backends)


def supports(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether the Triton backend handles this call (else use the chunk backend)."""
    windowed = window == 1 or rule == "3A" or (rule == "3" and window <= MAX_RULE_3_WINDOW)
    return rule in SUPPORTED_RULES and windowed and K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM and dtype in DTYPES

