"""A deterministic, resumable loader that packs documents from a weighted mixture into training batches.

    loader = PackedLoader(
        [Source("web", "data/web", weight=0.7), Source("math", "data/math", weight=0.3, max_epochs=4)],
        batch_size=8, seq_len=4096, seed=0,
        schedule=[(0, {"web": 0.7, "math": 0.3}), (10**9, {"web": 0.5, "math": 0.5})],
    )
    batch = next(loader)       # input_ids, labels, position_ids [B, L]; cu_seqlens [N + 1]; max_seqlen
    state = loader.state_dict()            # a small JSON-able dict; store it with the checkpoint
    loader2 = PackedLoader(...same arguments...); loader2.load_state_dict(state)   # continues exactly

Packing: documents (each ending with EOS) are laid end to end in one token stream. A batch takes the
next B*L + 1 stream tokens; row r is the window [r*L, r*L + L + 1): inputs its first L tokens, labels
its last L (the next token of the stream, also across a document boundary; `cross_doc_labels=False`
puts -100 on the label of each document's last token instead). The batch consumes B*L tokens, so every
stream token is a label exactly once. Document starts are reported as `position_ids` that restart at
0 (and at every row start) and as `cu_seqlens`, the offsets of those segments in the flattened
[B * L] batch (for B == 1 exactly the packed varlen layout the ops take).

Mixture: which source gives the next document is decided by token counts, not dice: the source with
the fewest tokens drawn in the current schedule phase per unit of weight goes next (ties: the first
listed). Realized token shares therefore track the weights to within one document. A source whose
`max_epochs` passes are used up drops out and the others' weights renormalize; the loader stops
(StopIteration, the last partial batch dropped) when no source with positive weight is left. A
`schedule` entry (t, weights) takes over once t tokens have been drawn into the stream.

Order inside a source: a fresh permutation per epoch from (seed, source name, epoch) (`shuffle=False`:
file order). Augmentations (FIM, section reordering; `augment.py`) draw from (seed, source name, draw
number). Hence the position is fully described by counters: `state_dict()` holds no tokens.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hybridlm.data.augment import AugmentConfig, augment
from hybridlm.data.shards import TokenDataset

STATE_VERSION = 1


@dataclass(frozen=True)
class Source:
    """One prepared dataset in the mixture. `max_epochs=None` repeats it without limit."""

    name: str
    path: str | Path
    weight: float = 1.0
    max_epochs: float | None = None


class _Stream:
    """Token segments waiting to be batched; a segment is one document or the tail of one."""

    def __init__(self):
        self.segments: deque[list] = deque()  # [tokens, starts_a_document, head]
        self.length = 0

    def push(self, tokens: np.ndarray, starts_doc: bool) -> None:
        self.segments.append([tokens, starts_doc, 0])
        self.length += len(tokens)

    def peek(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n tokens and a bool mask of which of them start a document."""
        toks, starts = [], []
        for tokens, starts_doc, head in self.segments:
            take = min(n, len(tokens) - head)
            toks.append(tokens[head:head + take])
            flag = np.zeros(take, dtype=bool)
            flag[0] = starts_doc and head == 0
            starts.append(flag)
            n -= take
            if n == 0:
                break
        return np.concatenate(toks), np.concatenate(starts)

    def drop(self, n: int) -> None:
        self.length -= n
        while n:
            seg = self.segments[0]
            take = min(n, len(seg[0]) - seg[2])
            seg[2] += take
            n -= take
            if seg[2] == len(seg[0]):
                self.segments.popleft()


class PackedLoader:
    """Iterator of packed batches over one dataset directory or a weighted mixture of `Source`s."""

    def __init__(
        self,
        sources: str | Path | Sequence[Source],
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        schedule: Sequence[tuple[int, dict[str, float]]] | None = None,
        shuffle: bool = True,
        augment: AugmentConfig | None = None,
        cross_doc_labels: bool = True,
        rank: int = 0,
        world_size: int = 1,
        verify: str = "full",
    ):
        if isinstance(sources, (str, Path)):
            sources = [Source("data", sources)]
        self.sources = list(sources)
        names = [s.name for s in self.sources]
        if not self.sources or len(set(names)) != len(names):
            raise ValueError(f"sources need unique names, got {names}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.cross_doc_labels = shuffle, cross_doc_labels
        self.augment = augment or AugmentConfig()
        self.datasets = [TokenDataset(s.path, verify=verify) for s in self.sources]
        if len({d.tokenizer_sha256 for d in self.datasets}) > 1:
            raise ValueError("the sources were prepared with different tokenizers: "
                             + ", ".join(f"{s.name}={d.tokenizer_sha256[:12]}" for s, d in zip(self.sources, self.datasets)))
        self.special_ids = self.datasets[0].special_tokens
        if self.augment.enabled:
            missing = {"fim_prefix", "fim_suffix", "fim_middle", "section", "original_order"} - set(self.special_ids)
            if missing:
                raise ValueError(f"augmentations need the special tokens {sorted(missing)}, which this tokenizer lacks")
        self._doc_limit = []
        for s, d in zip(self.sources, self.datasets):
            if s.max_epochs is not None and s.max_epochs <= 0:
                raise ValueError(f"source {s.name}: max_epochs must be positive or None, got {s.max_epochs}")
            self._doc_limit.append(None if s.max_epochs is None else max(1, round(s.max_epochs * d.num_docs)))
        self.schedule = self._check_schedule(schedule)
        self._name_keys = [zlib.crc32(n.encode("utf-8")) for n in names]
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}
        self._reset()

    def _check_schedule(self, schedule) -> list[tuple[int, list[float]]]:
        if schedule is None:
            schedule = [(0, {s.name: s.weight for s in self.sources})]
        out = []
        names = {s.name for s in self.sources}
        for i, (start, weights) in enumerate(schedule):
            unknown = set(weights) - names
            if unknown:
                raise ValueError(f"schedule entry {i} names unknown sources {sorted(unknown)}")
            w = [float(weights.get(s.name, 0.0)) for s in self.sources]
            if any(x < 0 or not math.isfinite(x) for x in w) or not any(x > 0 for x in w):
                raise ValueError(f"schedule entry {i}: weights must be finite, >= 0, and not all 0; got {weights}")
            if (i == 0 and start != 0) or (i > 0 and start <= out[-1][0]):
                raise ValueError("schedule must start at token 0 and increase strictly")
            total = sum(w)
            out.append((int(start), [x / total for x in w]))
        return out

    # --- position ---------------------------------------------------------------------------------

    def _reset(self) -> None:
        n = len(self.sources)
        self._docs_drawn = [0] * n
        self._drawn_tokens = [0] * n
        self._phase = 0
        self._phase_tokens = [0] * n
        self._stream_tokens = 0
        self._batches = 0
        self._last: tuple[int, int, int] | None = None  # (source, draw, length) of the last document drawn
        self._stream = _Stream()
        self._finished = False  # no source with positive weight left

    def _config(self) -> dict:
        return {
            "sources": [s.name for s in self.sources],
            "num_docs": [d.num_docs for d in self.datasets],
            "max_epochs": [s.max_epochs for s in self.sources],
            "schedule": [[t, w] for t, w in self.schedule],
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "augment": asdict(self.augment),
        }

    def state_dict(self) -> dict:
        """Where the loader is, after the last batch it returned (JSON-serializable, no tokens)."""
        carry = None
        if self._stream.length and not self._finished:
            # After a batch the stream holds only the tail of the last document drawn.
            s, n, length = self._last
            carry = {"source": s, "draw": n, "offset": length - self._stream.length}
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "batches": self._batches,
            "docs_drawn": list(self._docs_drawn),
            "drawn_tokens": list(self._drawn_tokens),
            "phase": self._phase,
            "phase_tokens": list(self._phase_tokens),
            "stream_tokens": self._stream_tokens,
            "carry": carry,
            "finished": self._finished,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        mine = self._config()
        theirs = state["config"]
        differ = [k for k in mine if _jsonable(mine[k]) != _jsonable(theirs.get(k))]
        if differ:
            raise ValueError(f"loader state was saved with a different configuration ({', '.join(differ)}); "
                             "resume with the same sources, schedule, batch shape, seed and augmentations")
        self._reset()
        self._batches = int(state["batches"])
        self._docs_drawn = [int(x) for x in state["docs_drawn"]]
        self._drawn_tokens = [int(x) for x in state["drawn_tokens"]]
        self._phase = int(state["phase"])
        self._phase_tokens = [int(x) for x in state["phase_tokens"]]
        self._stream_tokens = int(state["stream_tokens"])
        self._finished = bool(state["finished"])
        carry = state["carry"]
        if carry is not None:
            s, n, offset = int(carry["source"]), int(carry["draw"]), int(carry["offset"])
            doc = self._document(s, n)
            self._last = (s, n, len(doc))
            self._stream.push(doc[offset:], starts_doc=offset == 0)

    # --- reporting --------------------------------------------------------------------------------

    @property
    def tokens_per_source(self) -> dict[str, int]:
        """Tokens drawn into the packing stream from each source so far (augmentation sentinels included)."""
        return {s.name: t for s, t in zip(self.sources, self._drawn_tokens)}

    def report(self) -> dict[str, dict]:
        """Per source: tokens and documents drawn, epochs done, share of all drawn tokens, exhausted or not."""
        total = sum(self._drawn_tokens) or 1
        return {
            s.name: {
                "tokens": self._drawn_tokens[i],
                "share": self._drawn_tokens[i] / total,
                "docs": self._docs_drawn[i],
                "epochs": self._docs_drawn[i] / self.datasets[i].num_docs,
                "exhausted": self._exhausted(i),
            }
            for i, s in enumerate(self.sources)
        }

    def most_tokens(self) -> int | None:
        """The most tokens the stream can ever hold before the loader stops (every source drawn from at its
        `max_epochs`, a partial epoch counted with its longest documents), or None when that has no bound: a source
        without max_epochs, or augmentations (they add tokens)."""
        drawn = [s for s, weights in enumerate(zip(*(w for _, w in self.schedule))) if any(w > 0 for w in weights)]
        if self.augment.enabled or any(self._doc_limit[s] is None for s in drawn):
            return None
        total = 0
        for s in drawn:
            dataset, limit = self.datasets[s], self._doc_limit[s]
            epochs, rest = divmod(limit, dataset.num_docs)
            total += epochs * dataset.num_tokens
            if rest:
                lengths = dataset.doc_lengths()
                total += int(np.partition(lengths, len(lengths) - rest)[len(lengths) - rest:].sum())
        return total

    # --- drawing documents ------------------------------------------------------------------------

    def _exhausted(self, s: int) -> bool:
        limit = self._doc_limit[s]
        return limit is not None and self._docs_drawn[s] >= limit

    def _next_source(self) -> int | None:
        while self._phase + 1 < len(self.schedule) and self._stream_tokens >= self.schedule[self._phase + 1][0]:
            self._phase += 1
            self._phase_tokens = [0] * len(self.sources)
        weights = self.schedule[self._phase][1]
        best, best_score = None, math.inf
        for s, w in enumerate(weights):
            if w > 0 and not self._exhausted(s):
                score = self._phase_tokens[s] / w
                if score < best_score:
                    best, best_score = s, score
        return best

    def _document(self, s: int, n: int) -> np.ndarray:
        """The n-th document drawn from source s (epoch n // N), augmented as the seed decides."""
        ds = self.datasets[s]
        epoch, pos = divmod(n, ds.num_docs)
        if self.shuffle:
            cached = self._perm_cache.get(s)
            if cached is None or cached[0] != epoch:
                perm = np.random.default_rng([self.seed, self._name_keys[s], epoch]).permutation(ds.num_docs)
                perm = perm.astype(np.uint32) if ds.num_docs < 1 << 32 else perm  # half the memory
                self._perm_cache[s] = cached = (epoch, perm)
            pos = int(cached[1][pos])
        doc = ds.doc(pos)
        if self.augment.enabled:
            rng = np.random.default_rng([self.seed, self._name_keys[s], n, 0xF1A])
            doc = augment(doc, rng, self.augment, self.special_ids)
        return doc

    # --- batches ----------------------------------------------------------------------------------

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> dict:
        rows, L = self.batch_size * self.world_size, self.seq_len
        need = rows * L + 1
        if self._finished:
            raise StopIteration
        while self._stream.length < need:
            s = self._next_source()
            if s is None:
                self._finished = True  # the tokens left over cannot fill a batch: dropped
                raise StopIteration
            n = self._docs_drawn[s]
            doc = self._document(s, n)
            self._docs_drawn[s] += 1
            self._drawn_tokens[s] += len(doc)
            self._phase_tokens[s] += len(doc)
            self._stream_tokens += len(doc)
            self._last = (s, n, len(doc))
            self._stream.push(doc, starts_doc=True)
        tokens, starts = self._stream.peek(need)
        self._stream.drop(rows * L)  # the last token stays: it is the next batch's first input
        self._batches += 1
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        idx = np.arange(lo * L, hi * L).reshape(self.batch_size, L)
        input_ids, labels = tokens[idx], tokens[idx + 1]
        row_starts = starts[idx]
        if not self.cross_doc_labels:
            labels = np.where(starts[idx + 1], -100, labels)
        row_starts[:, 0] = True
        pos = np.arange(L)
        position_ids = pos - np.maximum.accumulate(np.where(row_starts, pos, 0), axis=1)
        flat = np.flatnonzero(row_starts.reshape(-1))
        cu_seqlens = np.append(flat, row_starts.size)
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)),
            "labels": torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
            "position_ids": torch.from_numpy(np.ascontiguousarray(position_ids, dtype=np.int64)),
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
            "max_seqlen": int(np.diff(cu_seqlens).max()),
        }


def _jsonable(x):
    """Normalize tuples to lists (a state that went through JSON compares equal to a fresh one)."""
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x
