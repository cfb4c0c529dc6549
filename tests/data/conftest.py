"""Session-wide fixtures of the data tests: a tokenizer trained on a tiny seeded corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridlm.data.tokenizer import HybridTokenizer, train_tokenizer
from tests.data.corpora import VOCAB_SIZE, documents, write_jsonl, write_txt_tree


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer trained (through the file readers) on a .txt tree plus a .jsonl file."""
    root = tmp_path_factory.mktemp("tok_corpus")
    docs = documents(seed=0, n_docs=300)
    write_txt_tree(root / "tree", docs[:150])
    write_jsonl(root / "more.jsonl", docs[150:])
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([root / "tree", root / "more.jsonl"], VOCAB_SIZE, out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return HybridTokenizer.load(tokenizer_dir)


@pytest.fixture(scope="session")
def train_texts() -> list[str]:
    return documents(seed=0, n_docs=300)

