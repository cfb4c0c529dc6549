"""Prepared data for the evaluation and experiment tests: a small tokenizer and held-out shards (a helper module,
used by tests/eval/conftest.py and tests/experiments/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from hybridlm.data.shards import prepare
from hybridlm.data.tokenizer import train_tokenizer
from tests.data.corpora import VOCAB_SIZE, documents, write_jsonl


def held_out_documents() -> list[str]:
    """12 seeded documents (English, Chinese, LaTeX) of 3 to 60 words."""
    return documents(seed=5, n_docs=12, lo=3, hi=60)


def trained_tokenizer(corpus_dir: Path, out: Path) -> Path:
    """A byte-level BPE tokenizer trained on a seeded corpus written to `corpus_dir`, saved to `out`."""
    write_jsonl(corpus_dir / "train.jsonl", documents(seed=0, n_docs=200))
    train_tokenizer([corpus_dir / "train.jsonl"], VOCAB_SIZE, out)
    return out


def prepared_shards(docs: list[str], tokenizer_dir: Path, jsonl_dir: Path, out: Path) -> Path:
    """`docs` prepared into small shards (documents cross shard boundaries) in `out`."""
    write_jsonl(jsonl_dir / "val.jsonl", docs)
    prepare([jsonl_dir / "val.jsonl"], tokenizer_dir, out, workers=1, shard_tokens=211, progress=False)
    return out
