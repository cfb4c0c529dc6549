"""Fixtures of the evaluation tests: a tokenizer and prepared shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridlm.data.shards import prepare
from hybridlm.data.tokenizer import train_tokenizer
from tests.data.corpora import VOCAB_SIZE, documents, write_jsonl


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on a seeded corpus (English, Chinese, LaTeX)."""
    root = tmp_path_factory.mktemp("eval_tok_corpus")
    write_jsonl(root / "train.jsonl", documents(seed=0, n_docs=200))
    out = tmp_path_factory.mktemp("eval_tok")
    train_tokenizer([root / "train.jsonl"], VOCAB_SIZE, out)
    return out


@pytest.fixture(scope="session")
def held_out_docs() -> list[str]:
    return documents(seed=5, n_docs=12, lo=3, hi=60)


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, tokenizer_dir, held_out_docs) -> Path:
    """Held-out documents prepared into small shards (documents cross shard boundaries)."""
    root = tmp_path_factory.mktemp("eval_shards_in")
    write_jsonl(root / "val.jsonl", held_out_docs)
    out = tmp_path_factory.mktemp("eval_shards")
    prepare([root / "val.jsonl"], tokenizer_dir, out, workers=1, shard_tokens=211, progress=False)
    return out
