"""Fixtures of the evaluation tests: a tokenizer and prepared shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.eval.prepared_data import held_out_documents, prepared_shards, trained_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on a seeded corpus (English, Chinese, LaTeX)."""
    return trained_tokenizer(tmp_path_factory.mktemp("eval_tok_corpus"), tmp_path_factory.mktemp("eval_tok"))


@pytest.fixture(scope="session")
def held_out_docs() -> list[str]:
    return held_out_documents()


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, tokenizer_dir, held_out_docs) -> Path:
    """Held-out documents prepared into small shards (documents cross shard boundaries)."""
    return prepared_shards(held_out_docs, tokenizer_dir, tmp_path_factory.mktemp("eval_shards_in"),
                           tmp_path_factory.mktemp("eval_shards"))
