"""Long-context document augmentations on token ids: fill-in-the-middle and section reordering.

Both act on one tokenized document (its trailing EOS kept at the end) and use sentinel special tokens
of our tokenizer (`hybridlm.data.tokenizer.SPECIAL_TOKENS`). Cuts fall on token boundaries, because
the shards hold tokens, not text. Off by default; the loader draws one `numpy.random.Generator` per
document from its seed, so the result is a function of (seed, source, draw number) only.

Fill-in-the-middle, PSM order (prefix, suffix, middle), two cut points uniform over the document:
    <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle EOS
Section reordering: 2..max_sections contiguous sections at uniform cut points, shown in a shuffled
(never the original) order, each after a <|section|> marker; then the document in its original order,
which the model learns to reconstruct from the shuffled copy:
    <|section|> s_3 <|section|> s_1 <|section|> s_2 <|original_order|> s_1 s_2 s_3 EOS
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AugmentConfig:
    fim_rate: float = 0.0          # probability a document becomes a FIM example
    reorder_rate: float = 0.0      # probability a document becomes a section-reordering example
    fim_min_tokens: int = 8        # shorter documents (EOS not counted) are left alone
    reorder_min_tokens: int = 32
    max_sections: int = 4

    def __post_init__(self):
        for name in ("fim_rate", "reorder_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.fim_rate + self.reorder_rate > 1.0:
            raise ValueError(f"fim_rate + reorder_rate must be <= 1 (one augmentation per document), got "
                             f"{self.fim_rate} + {self.reorder_rate}")
        if self.max_sections < 2:
            raise ValueError(f"max_sections must be >= 2, got {self.max_sections}")
        if self.fim_min_tokens < 2 or self.reorder_min_tokens < self.max_sections:
            raise ValueError("fim_min_tokens must be >= 2 and reorder_min_tokens >= max_sections")

    @property
    def enabled(self) -> bool:
        return self.fim_rate > 0 or self.reorder_rate > 0


def fill_in_middle(body: np.ndarray, rng: np.random.Generator, *, prefix_id: int, suffix_id: int,
                   middle_id: int) -> np.ndarray:
    """PSM-format FIM of `body` (no EOS); returns len(body) + 3 tokens."""
    i, j = np.sort(rng.integers(0, len(body) + 1, size=2))
    return np.concatenate([[prefix_id], body[:i], [suffix_id], body[j:], [middle_id], body[i:j]]).astype(body.dtype)


def reorder_sections(body: np.ndarray, rng: np.random.Generator, *, section_id: int, original_id: int,
                     max_sections: int) -> np.ndarray:
    """Shuffled sections of `body` (no EOS) followed by `body` itself; len(body) >= max_sections."""
    k = int(rng.integers(2, max_sections + 1))
    cuts = np.sort(rng.choice(np.arange(1, len(body)), size=k - 1, replace=False))
    sections = np.split(body, cuts)
    order = rng.permutation(k)
    if np.array_equal(order, np.arange(k)):
        order = np.roll(order, 1)  # a shuffle that keeps the order teaches nothing
    parts = []
    for p in order:
        parts += [[section_id], sections[p]]
    parts += [[original_id], body]
    return np.concatenate(parts).astype(body.dtype)


def augment(doc: np.ndarray, rng: np.random.Generator, config: AugmentConfig, special_ids: dict[str, int]) -> np.ndarray:
    """Apply at most one augmentation to `doc` (ending with EOS), as `config` and `rng` decide."""
    u = rng.random()  # always drawn, so the choice is one uniform per document
    eos = special_ids["eos"]
    body, tail = (doc[:-1], doc[-1:]) if len(doc) and doc[-1] == eos else (doc, doc[:0])
    if u < config.fim_rate:
        if len(body) < config.fim_min_tokens:
            return doc
        body = fill_in_middle(body, rng, prefix_id=special_ids["fim_prefix"], suffix_id=special_ids["fim_suffix"],
                              middle_id=special_ids["fim_middle"])
    elif u < config.fim_rate + config.reorder_rate:
        if len(body) < config.reorder_min_tokens:
            return doc
        body = reorder_sections(body, rng, section_id=special_ids["section"],
                                original_id=special_ids["original_order"], max_sections=config.max_sections)
    else:
        return doc
    return np.concatenate([body, tail])
