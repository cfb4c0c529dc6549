"""What the Triton backend of the fast-weight op takes: rules, windows, head sizes, dtypes and chunk lengths, and why
`backend="auto"` leaves a CUDA call on the chunk path (torch only)."""

from __future__ import annotations

import torch

from hybridlm.ops.head_limits import FAST_WEIGHT_MAX_HEAD_DIM
from hybridlm.ops.utils import TRITON_DTYPES

# 3A runs on 1A's kernels over delayed writes plus a band kernel (backend.py), 3 as 1 over its write events (a
# step's events do not see each other's writes); 1, 2A and 2: window 1 (2A, 2: decays per value column).
SUPPORTED_RULES = ("1A", "3A", "1", "2A", "3", "2")
MAX_HEAD_DIM = FAST_WEIGHT_MAX_HEAD_DIM  # K and V
# The rules whose single decoding steps (T = 1, window 1, no gradient) run as one kernel (`step.py`).
STEP_RULES = ("1A", "1", "2A", "2")
# The fast-weight mixer's whole decoding step (`mixer_step.py`) walks a head's [K, V] state in one program, so it
# takes heads of at most this many state elements (K = V = 128); larger ones run conv, step and norm apart, with
# more programs per head.
MAX_MIXER_STATE = 16384
# Rules 1 and 3 take chunks of at most 64: at 128 rule 1's gradient kernels ask for more shared memory than an H200
# block has (227 KiB), while chunks of 64 fit (tests/ops/test_triton_sm90.py builds them).
MAX_DELTA_CHUNK = 64
# Rule 3 lays each step out on the next power of two >= window slots; a chunk holds whole steps.
MAX_RULE_3_WINDOW = MAX_DELTA_CHUNK
# Rule 3A's fused window preparation (window_prepare.py) holds a step's window and history in [BT, next power of two
# >= W] tiles: windows up to this one; longer ones run chunk.py's prepare_writes.
MAX_PREPARED_WINDOW = 64
# Rules 2A and 2's chunk length: their intra-chunk decays form a [C, C, V] tensor of exponentials, so their chunks
# are kept short, as chunk.py's PER_COLUMN_MAX_CHUNK. Rule 2's kernels take chunks of 16 or 32.
PER_COLUMN_CHUNK = 16
MAX_RULE_2_CHUNK = 32
DTYPES = TRITON_DTYPES  # of q, k, v


def supports(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether the Triton backend handles this call (else use the chunk backend)."""
    fits = K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM
    return rule in SUPPORTED_RULES and _windowed(rule, window) and fits and dtype in DTYPES


def step_takes(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether a decoding step (T = 1, no packed sequences, no gradient) of this kind runs the step kernel."""
    return rule in STEP_RULES and window == 1 and K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM and dtype in DTYPES


def auto_takes(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether `backend="auto"` sends a CUDA call of this kind to these kernels (triton installed): every call that
    `supports` takes, since every rule's kernels run faster than the chunk path on a GPU (benchmarks/RESULTS.md)."""
    return supports(rule=rule, window=window, K=K, V=V, dtype=dtype)


def slow_path_reason(*, rule: str, window: int, K: int, V: int, dtype: torch.dtype) -> str | None:
    """Why `backend="auto"` runs a CUDA call of this kind on the torch chunk path instead of these kernels, and what
    to change: the text of its warning. None where "auto" takes the kernels, and for float64 inputs, whose exact
    path the caller chose (the kernels compute in float32)."""
    if auto_takes(rule=rule, window=window, K=K, V=V, dtype=dtype) or dtype == torch.float64:
        return None
    slow = "backend='auto' runs the torch chunk path (slower, more memory)"
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        dims = f"{K} dims" if K == V else f"K = {K}, V = {V} dims"
        return (f"fast-weight heads of {dims} exceed the Triton kernels' {MAX_HEAD_DIM}: {slow}. Use heads of at most "
                f"{MAX_HEAD_DIM} dims: HybridConfig fw_head_dim <= {MAX_HEAD_DIM}, or more fw_heads (mamba_d_ssm / "
                f"fw_heads <= {MAX_HEAD_DIM}); left unset, both are derived within it")
    if dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        return f"fast-weight inputs in {dtype} are not among the Triton kernels' dtypes ({names}): {slow}"
    if rule not in SUPPORTED_RULES or _windowed(rule, window):
        return None  # an unknown rule, or a window the rule does not have: the op rejects the call
    return (f"fast-weight rule {rule!r} with window {window}: the Triton kernels take windows of at most "
            f"{MAX_RULE_3_WINDOW}, so {slow}")


def _windowed(rule: str, window: int) -> bool:
    """Whether the kernels take this window: 1 for every rule, any for 3A, up to MAX_RULE_3_WINDOW for 3."""
    return window == 1 or rule == "3A" or (rule == "3" and window <= MAX_RULE_3_WINDOW)

