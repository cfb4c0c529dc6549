"""`deterministic_kernels`: what it switches on, and that it leaves the process's settings as they were."""

from __future__ import annotations

import os

import pytest
import torch

from hybridlm.training.rng import CUBLAS_DETERMINISTIC_WORKSPACE, CUBLAS_WORKSPACE_VARIABLE, deterministic_kernels


def _settings() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            os.environ.get(CUBLAS_WORKSPACE_VARIABLE))


def test_inside_deterministic_outside_as_before(monkeypatch):
    monkeypatch.delenv(CUBLAS_WORKSPACE_VARIABLE, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    before = _settings()
    with deterministic_kernels():
        assert _settings() == (True, False, True, False, CUBLAS_DETERMINISTIC_WORKSPACE)
    assert _settings() == before and before[-1] is None


def test_the_users_workspace_and_warn_only_mode_are_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_VARIABLE, ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_kernels():
            assert os.environ[CUBLAS_WORKSPACE_VARIABLE] == ":16:8"  # also deterministic; the user's choice
            assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one raises
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_disabled_changes_nothing_and_an_error_inside_restores():
    before = _settings()
    with deterministic_kernels(False):
        assert _settings() == before
    with pytest.raises(RuntimeError, match="boom"), deterministic_kernels():
        raise RuntimeError("boom")
    assert _settings() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CPU kernels are deterministic already")
def test_index_add_repeats_bit_for_bit_on_a_gpu():
    """index_add_ on CUDA sums with atomic adds: in float32 with many colliding indices the order shows in the
    low bits from call to call; under deterministic_kernels every call gives the same bits."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    index = torch.randint(0, 8, (1 << 20,), device="cuda", generator=generator)
    source = torch.randn(1 << 20, 64, device="cuda", generator=generator)

    def total() -> torch.Tensor:
        return torch.zeros(8, 64, device="cuda").index_add_(0, index, source)

    with deterministic_kernels():
        first = total()
        assert all(torch.equal(first, total()) for _ in range(5))
