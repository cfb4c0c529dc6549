"""What is particular to rule 1 in Triton (regression / delta rule, scalar decay, window 1).

Its kernels (forward and backward) are checked with rule 1A's in tests/ops/test_fast_weight_triton.py (parametrized
over the kernels: against a float64 step loop, the front door with backend="triton" against the chunk backend,
packed sequences included, carry-over), its custom ops and torch.compile in test_fast_weight_triton_compile.py;
here: which calls the Triton backend accepts.
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.triton import supports


def test_supports_rule_1_window_1_only():
    assert supports(rule="1", window=1, K=64, V=64, dtype=torch.float32)
    assert not supports(rule="1", window=2, K=64, V=64, dtype=torch.float32)
    assert supports(rule="1A", window=1, K=64, V=64, dtype=torch.bfloat16)
    assert supports(rule="3A", window=3, K=64, V=64, dtype=torch.bfloat16)
    assert not supports(rule="2", window=2, K=64, V=64, dtype=torch.float32)  # windows: rules 3A and 3 only
    assert not supports(rule="1A", window=1, K=256, V=64, dtype=torch.float32)
