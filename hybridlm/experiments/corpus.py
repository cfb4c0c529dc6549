"""A built-in synthetic language for small training sweeps that need no download (`SyntheticLanguage`).

    language = SyntheticLanguage()                       # the fixed language (its own seed)
    batch = language.batch(np.random.default_rng(0), batch_size=32, length=256)   # input_ids, labels

Each row is one document of `length` tokens starting with <bos> (ids: <pad> 0, <bos> 1, <eos> 2, words
3..383, names 384..511). Three kinds of structure, so that every part of a hybrid block has something
to do:
- local grammar: a hidden Markov chain of 48 states, each emitting from its own Zipf-weighted set of
  64 words and moving to one of 4 successor states (n-gram statistics: MLP and short-range mixing);
- per-document names: 4 "name" states emit the document's own names, 4 drawn from 128 name tokens per
  document, so the same name slot reads a different token in every document (in-context recall);
- verbatim repeats: with probability 1/2 a document repeats a span of 16-32 earlier tokens later on
  (copying / induction: attention's strength).
The language (states, emissions, transitions) is fixed by `language_seed`; documents are drawn from the
generator the caller passes, so a held-out set is just another seed. A loss floor exists (the chain is
random), so absolute losses only compare within one sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridlm.eval.scoring import IGNORE_INDEX

PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class SyntheticLanguage:
    vocab_size: int = 512
    names: int = 128  # the last `names` ids
    states: int = 48
    name_states: int = 4
    words_per_state: int = 64
    successors: int = 4
    zipf: float = 1.1
    repeat_probability: float = 0.5
    repeat_span: tuple[int, int] = (16, 32)
    language_seed: int = 1234

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.language_seed)
        first_name = self.vocab_size - self.names
        words = np.stack([rng.choice(np.arange(3, first_name), size=self.words_per_state, replace=False)
                          for _ in range(self.states)])  # [S, W]
        weights = 1.0 / np.arange(1, self.words_per_state + 1) ** self.zipf
        successors = np.stack([rng.choice(self.states, size=self.successors, replace=False)
                               for _ in range(self.states)])  # [S, K]
        transition = rng.dirichlet(np.full(self.successors, 0.5), size=self.states)  # [S, K]
        object.__setattr__(self, "_words", words)
        object.__setattr__(self, "_word_cdf", np.cumsum(weights / weights.sum()))
        object.__setattr__(self, "_successors", successors)
        object.__setattr__(self, "_transition_cdf", np.cumsum(transition, axis=1))

    def documents(self, rng: np.random.Generator, count: int, length: int) -> np.ndarray:
        """int64 [count, length]: <bos> then `length - 1` tokens of one document per row."""
        out = np.empty((count, length), dtype=np.int64)
        out[:, 0] = BOS
        first_name = self.vocab_size - self.names
        doc_names = first_name + np.stack([rng.choice(self.names, size=self.name_states, replace=False)
                                           for _ in range(count)])  # [count, name_states]
        state = rng.integers(0, self.states, size=count)
        rows = np.arange(count)
        for t in range(1, length):
            word = np.minimum(np.searchsorted(self._word_cdf, rng.random(count)), self.words_per_state - 1)
            token = self._words[state, word]
            is_name = state < self.name_states
            token[is_name] = doc_names[rows[is_name], state[is_name]]
            out[:, t] = token
            cdf = self._transition_cdf[state]  # [count, K]
            pick = np.minimum((rng.random(count)[:, None] > cdf).sum(1), self.successors - 1)
            state = self._successors[state, pick]
        lo, hi = self.repeat_span
        for row in np.nonzero(rng.random(count) < self.repeat_probability)[0]:
            span = int(rng.integers(lo, hi + 1))
            if length < 4 * span:
                continue
            source = int(rng.integers(1, length // 2 - span))
            target = int(rng.integers(length // 2, length - span))
            out[row, target:target + span] = out[row, source:source + span]
        return out

    def batch(self, rng: np.random.Generator, batch_size: int, length: int) -> dict[str, torch.Tensor]:
        """input_ids and labels [B, length] (labels = inputs: every token after <bos> is a target)."""
        ids = torch.from_numpy(self.documents(rng, batch_size, length))
        labels = ids.clone()
        labels[:, 0] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}
