"""Fixtures of the experiment tests: prepared shards for the allocation sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.eval.prepared_data import held_out_documents, prepared_shards, trained_tokenizer


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory) -> Path:
    """Held-out documents prepared with a small tokenizer into small shards (documents cross shard boundaries)."""
    tokenizer = trained_tokenizer(tmp_path_factory.mktemp("exp_tok_corpus"), tmp_path_factory.mktemp("exp_tok"))
    return prepared_shards(held_out_documents(), tokenizer, tmp_path_factory.mktemp("exp_shards_in"),
                           tmp_path_factory.mktemp("exp_shards"))
