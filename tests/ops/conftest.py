"""The op tests' Triton mode is set before any test module loads a kernel: importing `triton_modes` sets
TRITON_INTERPRET under HYBRIDLM_TRITON_INTERPRET=1 (Triton reads it when a kernel is defined) and one fixed launch per
kernel instead of autotuning."""

import tests.ops.triton_modes  # noqa: F401

import pytest


@pytest.fixture
def walked_blocks(monkeypatch):
    """The row kernels (RMS normalization, gated norm, SiLU gate) with one program walking several row blocks at test
    sizes: `row_steps` spreads rows over ~2 x SPREAD_PROGRAMS programs before a program walks more than one block,
    which a test's few hundred rows never reach. At 1 a shape of n >= 2 blocks walks the largest power of two <= n
    (at most STEPS) per program, the last program with masked blocks where n is no power of two; one block walks one."""
    pytest.importorskip("triton")
    from hybridlm.ops import triton_utils

    monkeypatch.setattr(triton_utils, "SPREAD_PROGRAMS", 1)
