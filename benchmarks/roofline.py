"""FLOP and byte counts of the timed ops, and the fraction of the H200's measured ceilings a time reaches.

    from roofline import fast_weight_counts, sdpa_counts, utilization
    flops, nbytes = fast_weight_counts("1A", B=8, T=4096, H=16, K=128, V=128, chunk=64, backward=True)
    utilization(ms=8.08, flops=flops, nbytes=nbytes)   # {"tflops": ..., "flop_frac": ..., "tbps": ..., ...}

Ceilings (measured on an H200; benchmarks/RESULTS.md): a device copy at ~4.3 TB/s and a large bf16
matmul at ~716 TFLOP/s. A kernel is near its roof when one of the two fractions is near 1.

Counts (per (batch row, head); multiply by B * H), matmul FLOPs only (the exponentials and elementwise work are
small beside them), as the chunked algorithms compute them (full C x C blocks, masked afterwards):

- rule 1A (and 2A), chunk C: the chunk's state contribution X^T (eta Y) 2KV per token, the inter-chunk read q S
  2KV, the intra-chunk scores q X^T 2CK and their product with Y 2CV: forward 4KV + 2C(K + V) per token;
- rule 1 (and 2) adds the WY form of each chunk: the Gram X X^T 2CK per token, the inverse of its triangle
  (C^3 / 3 multiply-adds per chunk: 2C^2 / 3 FLOPs per token), W = A^-1 X 2CK, U = A^-1 Y 2CV and the residual
  S^T w 2KV: forward 6KV + 2C(3K + 2V) + 2C^2 / 3 per token;
- rule 3 with window W runs rule 1's algorithm over W write events per step: W times the above; rule 3A runs
  rule 1A's once (over delayed writes) plus the band of the W - 1 pairs still being written: 2(W - 1)(K + V) more
  per token (a dot product and an axpy per pair; not matmuls, counted anyway);
- backward: 2x the forward (the usual ratio for matmul-bound ops: two products per forward product), so a
  forward + backward counts 3x the forward;
- causal SDPA, head dim D: forward 2 T^2 D (QK^T and PV, each 2 T^2 D, half of them masked), backward 2.5x.

Bytes: the unavoidable traffic only, each input read once per pass and each output written once (an ideal kernel
that keeps every intermediate of a pass on chip): forward reads q, k, v (and beta, lam for the fast-weight rules: one
value per step and head; rules 2 / 2A take beta per value column, V - 1 more per step, not counted) and writes o.
The backward is a separate pass (autograd runs it after the whole forward), so it reads the inputs again, reads dO
(SDPA's also reads o, for the softmax's row sums of dO * o) and writes the gradient of every input: forward +
backward moves 3x the inputs and 2x the output (SDPA: 12 [B, H, T, D] tensors). Chunked algorithms also move their
per-chunk states (N * H * T / C * K * V floats per pass), which this lower bound leaves out on purpose: it is the
part an implementation chooses.
"""

from __future__ import annotations

COPY_TBPS = 4.3  # measured device copy bandwidth, TB/s
BF16_TFLOPS = 716.0  # measured large bf16 matmul, TFLOP/s

_WINDOW = {"1": 1, "2": 1, "3": 3, "1A": 1, "2A": 1, "3A": 3}
_REGRESSION = ("1", "2", "3")


def fast_weight_counts(rule: str, *, B: int, T: int, H: int, K: int, V: int, chunk: int, backward: bool,
                       window: int | None = None, bytes_per_element: int = 2) -> tuple[float, float]:
    """(matmul FLOPs, minimal bytes) of one call of rule `rule` (module docstring)."""
    C = chunk
    W = _WINDOW[rule] if window is None else window
    per_token = 4 * K * V + 2 * C * (K + V)
    if rule in _REGRESSION:
        per_token = 6 * K * V + 2 * C * (3 * K + 2 * V) + 2 * C * C / 3
    if rule == "3A":  # one 1A scan plus the band
        per_token, W = per_token + 2 * (W - 1) * (K + V), 1
    flops = B * H * T * W * per_token * (3 if backward else 1)
    inputs = B * T * H * (2 * K + V + 2) * bytes_per_element  # q, k, v, beta, lam
    output = B * T * H * V * bytes_per_element
    nbytes = inputs + output + ((2 * inputs + output) if backward else 0)  # inputs again and dO in, gradients out
    return float(flops), float(nbytes)


def sdpa_counts(*, B: int, T: int, H: int, D: int, backward: bool, bytes_per_element: int = 2) -> tuple[float, float]:
    """(matmul FLOPs, minimal bytes) of causal scaled-dot-product attention over [B, H, T, D] q, k, v."""
    forward = 2.0 * B * H * T * T * D
    io = 4 * B * H * T * D * bytes_per_element  # q, k, v in, o out
    # backward: q, k, v, o, dO in and dq, dk, dv out, twice the forward's traffic
    return forward * (3.5 if backward else 1.0), float(io * (3 if backward else 1))


def utilization(*, ms: float, flops: float, nbytes: float) -> dict[str, float]:
    """Achieved TFLOP/s and TB/s of `ms` milliseconds, and their fractions of the ceilings."""
    seconds = ms * 1e-3
    tflops, tbps = flops / seconds / 1e12, nbytes / seconds / 1e12
    return {"tflops": tflops, "flop_frac": tflops / BF16_TFLOPS, "tbps": tbps, "byte_frac": tbps / COPY_TBPS}
