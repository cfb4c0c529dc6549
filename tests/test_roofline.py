"""benchmarks/roofline.py: the FLOP and byte counts behind the utilization columns of the GPU benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from roofline import BF16_TFLOPS, COPY_TBPS, fast_weight_counts, sdpa_counts, utilization  # noqa: E402


def test_rule_1a_counts_by_hand():
    # One row, one head, T = 2 chunks of C = 4, K = 2, V = 3: 4KV + 2C(K + V) = 24 + 40 = 64 FLOPs per token.
    flops, nbytes = fast_weight_counts("1A", B=1, T=8, H=1, K=2, V=3, chunk=4, backward=False)
    assert flops == 8 * 64
    assert nbytes == 8 * (2 * 2 + 3 + 2) * 2 + 8 * 3 * 2  # q, k, v, beta, lam in; o out (2 bytes each)
    flops_bwd, nbytes_bwd = fast_weight_counts("1A", B=1, T=8, H=1, K=2, V=3, chunk=4, backward=True)
    inputs, output = 8 * (2 * 2 + 3 + 2) * 2, 8 * 3 * 2
    assert flops_bwd == 3 * flops
    assert nbytes_bwd == nbytes + 2 * inputs + output  # the backward re-reads the inputs, reads dO, writes gradients


def test_windows_and_regression_rules_cost_more():
    args = dict(B=2, T=64, H=3, K=16, V=16, chunk=16, backward=False)
    one_a, _ = fast_weight_counts("1A", **args)
    three_a, _ = fast_weight_counts("3A", **args)
    assert three_a == one_a + 2 * 64 * 3 * 2 * 2 * (16 + 16)  # one 1A scan plus a band of W - 1 = 2 pairs per step
    one, _ = fast_weight_counts("1", **args)
    assert one == one_a + 2 * 64 * 3 * (2 * 16 * 16 + 2 * 16 * (2 * 16 + 16) + 2 * 16 * 16 / 3)
    three, _ = fast_weight_counts("3", **args)
    assert three == 3 * one  # window 3: three write events per step


def test_sdpa_and_utilization():
    flops, nbytes = sdpa_counts(B=1, T=10, H=2, D=4, backward=False)
    assert flops == 2 * 2 * 100 * 4 and nbytes == 4 * 2 * 10 * 4 * 2
    flops_bwd, nbytes_bwd = sdpa_counts(B=1, T=10, H=2, D=4, backward=True)
    assert flops_bwd == 3.5 * flops and nbytes_bwd == 12 * 2 * 10 * 4 * 2  # + q, k, v, o, dO in, dq, dk, dv out
    use = utilization(ms=1.0, flops=BF16_TFLOPS * 1e9, nbytes=COPY_TBPS * 1e9)
    assert use["flop_frac"] == pytest.approx(1.0) and use["byte_frac"] == pytest.approx(1.0)
