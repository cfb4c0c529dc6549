"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO_MAX_BYTES = 400_000  # the demo corpus of these tests: a slice of the standard library's sources
DEMO_HELDOUT_EVERY = 4


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """The built-in demo corpus, prepared once for every trainer test (and reused: preparation is idempotent)."""
    from hybridlm.training.demo import prepare_demo

    directory = tmp_path_factory.mktemp("demo")
    prepare_demo(directory, max_bytes=DEMO_MAX_BYTES, heldout_every=DEMO_HELDOUT_EVERY)
    return directory
