"""Post-training data on the training loop: SFT rows packed from chat samples, DPO batches of preference pairs.

SFT and DPO are `TrainLoop` runs like pretraining (same config, schedules, checkpoints, resume, metrics); only the
data source and the loss differ. `build_post_training_data(config, ...)` reads the records (`hybridlm.data.chat`),
tokenizes them once with the model's chat template, and returns the source:

- `ChatRows` (sft): samples packed into rows of `batch.seq_len` tokens by best-fit decreasing (`best_fit_rows`: the
  longest sample first, each into the row it fills most closely; rows ~98% full where greedy packing in the order
  drawn leaves ~20% padding for samples of up to ~70% of a row), the rows in a seeded order per epoch. A sample never
  spans two rows; the rest of a row is padding (its own segment, scoring nothing). Every sample is its own document of the packed row (`cu_seqlens`; `position_ids`
  restart), so no recurrent state or attention crosses samples, and a sample's loss is the one it has alone. Labels
  are the next token where that token trains (the assistant's, by default), -100 elsewhere.
- `PreferencePairs` (dpo): `batch.micro_batch` pairs per rank per micro-step, each pair's chosen and rejected
  sequences (prompt + response) packed into one row as documents; labels score the responses only.

Lengths: a sample longer than `batch.seq_len` is cut to it (counted); one whose trained tokens are all cut away is
skipped (counted). A DPO pair keeps the end of its prompt and the start of its responses within `batch.seq_len`.

Both sources draw from an endless stream of epochs (`EpochStream`: a seeded permutation per epoch); a micro-step
takes the next `micro_batch x data-parallel size` units (rows or pairs) of the stream, rank r the r-th slice. Their
state is the stream position, so a resumed run draws the same batches, and under another number of ranks the same
global stream (keep the global batch the same for exactness).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridlm.training.config import ConfigError
from hybridlm.training.loop import IGNORE_INDEX


@dataclass
class EpochStream:
    """Positions in an endless sequence of epochs over `size(epoch)` units each, in the order `order(epoch)`."""

    size: Callable[[int], int]
    epoch: int = 0
    index: int = 0  # next unit of `epoch`

    def take(self, count: int) -> list[tuple[int, int]]:
        """The next `count` (epoch, index) positions; advances."""
        out = []
        while len(out) < count:
            if self.index >= self.size(self.epoch):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            n = min(count - len(out), self.size(self.epoch) - self.index)
            out.extend((self.epoch, self.index + i) for i in range(n))
            self.index += n
        return out


def _permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


class _Stream:
    """What both sources share: the stream, this rank's slice of each micro-step and the state a checkpoint keeps."""

    def __init__(self, *, batch_size: int, seed: int, shuffle: bool, rank: int, world_size: int) -> None:
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.stream = EpochStream(self._epoch_size)

    def _epoch_size(self, epoch: int) -> int:
        raise NotImplementedError

    def _my_positions(self) -> list[tuple[int, int]]:
        step = self.stream.take(self.batch_size * self.world_size)
        return step[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def __iter__(self):
        return self

    def state_dict(self) -> dict[str, Any]:
        # "config" holds what a resume under another number of ranks replaces (as the pretraining loader's does)
        return {"epoch": self.stream.epoch, "index": self.stream.index,
                "config": {"batch_size": self.batch_size, "world_size": self.world_size, "seed": self.seed}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"]["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data order used seed {state['config']['seed']}, this run "
                             f"train.seed {self.seed}")
        saved = state["config"]["batch_size"] * state["config"]["world_size"]
        if saved != self.batch_size * self.world_size:
            raise ValueError(f"the checkpoint drew {saved} units per micro-step, this run "
                             f"{self.batch_size * self.world_size} (batch.micro_batch x data-parallel ranks); keep "
                             "the global batch")
        self.stream.epoch, self.stream.index = int(state["epoch"]), int(state["index"])


def _segments_batch(rows: list[list[tuple[list[int], list[int]]]], seq_len: int | None, pad_id: int) -> dict:
    """Rows of segments (ids, labels) -> a packed batch: input_ids / labels / position_ids [B, L] (L = seq_len,
    the rest of a row padded as one more segment; None: one row, unpadded) and cu_seqlens, the offsets of every
    segment in the flattened batch."""
    ids_rows, label_rows, pos_rows, offsets = [], [], [], [0]
    for segments in rows:
        ids, labels, pos = [], [], []
        for seg_ids, seg_labels in segments:
            ids += seg_ids
            labels += seg_labels
            pos += range(len(seg_ids))
            offsets.append(offsets[-1] + len(seg_ids))
        if seq_len is not None and len(ids) < seq_len:
            pad = seq_len - len(ids)
            ids += [pad_id] * pad
            labels += [IGNORE_INDEX] * pad
            pos += range(pad)
            offsets.append(offsets[-1] + pad)
        ids_rows.append(ids)
        label_rows.append(labels)
        pos_rows.append(pos)
    cu = torch.tensor(offsets, dtype=torch.int32)
    return {"input_ids": torch.tensor(ids_rows, dtype=torch.long), "labels": torch.tensor(label_rows, dtype=torch.long),
            "position_ids": torch.tensor(pos_rows, dtype=torch.long), "cu_seqlens": cu,
            "max_seqlen": int((cu[1:] - cu[:-1]).max())}


def next_token_labels(ids: list[int], trained: list[int]) -> list[int]:
    """labels[t] = ids[t + 1] where token t + 1 trains, else -100; the last position scores nothing."""
    return [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def best_fit_rows(lengths: list[int], order: list[int], capacity: int) -> list[list[int]]:
    """Pack items of `lengths` into rows of `capacity` by best-fit decreasing: items longest first (ties in `order`),
    each into the open row whose free space is the smallest that holds it (a new row when none does). Free spaces are
    counted in a segment tree over 0..capacity, so each item costs O(log capacity)."""
    size = 1
    while size < capacity + 1:
        size *= 2
    tree = [0] * (2 * size)  # rows per free space, summed over each node's range
    by_space: list[list[int]] = [[] for _ in range(capacity + 1)]
    rows: list[list[int]] = []

    def count(space: int, delta: int) -> None:
        node = space + size
        while node:
            tree[node] += delta
            node //= 2

    def smallest_at_least(n: int) -> int | None:
        node = n + size
        if not tree[node]:
            while True:  # up until a right sibling holds a row
                if node == 1:
                    return None
                if node % 2 == 0 and tree[node + 1]:
                    node += 1
                    break
                node //= 2
            while node < size:  # down to its smallest free space
                node = 2 * node if tree[2 * node] else 2 * node + 1
        return node - size

    for i in sorted(order, key=lambda i: -lengths[i]):  # stable: equal lengths keep `order`
        n = lengths[i]
        space = smallest_at_least(n) if n <= capacity else None
        if space is None:
            rows.append([i])
            row, left = len(rows) - 1, capacity - n
        else:
            row = by_space[space].pop()
            count(space, -1)
            rows[row].append(i)
            left = space - n
        if left > 0:
            by_space[left].append(row)
            count(left, 1)
    return rows


class ChatRows(_Stream):
    """The SFT source (module docstring): an iterator of packed batches [batch_size, seq_len] with a state."""

    def __init__(self, samples: list[tuple[list[int], list[int]]], *, batch_size: int, seq_len: int, seed: int,
                 pad_id: int, shuffle: bool = True, rank: int = 0, world_size: int = 1) -> None:
        if not samples:
            raise ValueError("no samples")
        self.samples = [(ids, next_token_labels(ids, trained)) for ids, trained in samples]
        if max(len(ids) for ids, _ in self.samples) > seq_len:
            raise ValueError(f"a sample is longer than seq_len {seq_len}; cut samples first (`fit_sample`)")
        self.seq_len, self.pad_id = seq_len, pad_id
        self._rows: tuple[int, list[list[int]]] | None = None
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """The rows of an epoch: sample indices, packed by best-fit decreasing (`best_fit_rows`) from the epoch's
        sample order (which breaks ties between equal lengths), then in the epoch's row order."""
        if self._rows is None or self._rows[0] != epoch:
            order = _permutation(len(self.samples), self.seed, epoch, self.shuffle).tolist()
            rows = best_fit_rows([len(ids) for ids, _ in self.samples], order, self.seq_len)
            self._rows = (epoch, [rows[i] for i in _permutation(len(rows), self.seed + 1, epoch, self.shuffle)])
        return self._rows[1]

    def _epoch_size(self, epoch: int) -> int:
        return len(self.epoch_rows(epoch))

    def __next__(self) -> dict:
        rows = []
        for epoch, index in self._my_positions():
            rows.append([self.samples[i] for i in self.epoch_rows(epoch)[index]])
        return _segments_batch(rows, self.seq_len, self.pad_id)


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """(ids, labels) of prompt + chosen and prompt + rejected: the responses' tokens are scored."""
        out = []
        for response in (self.chosen, self.rejected):
            ids = self.prompt + response
            out.append((ids, next_token_labels(ids, [0] * len(self.prompt) + [1] * len(response))))
        return out


class PreferencePairs(_Stream):
    """The DPO source (module docstring): an iterator of batches of `batch_size` pairs, packed into one row as
    chosen_0, rejected_0, chosen_1, ...; `pairs` [P] holds the pairs' indices and, once `reference` [num_pairs, 2]
    (the reference model's summed log-probabilities of chosen and rejected) is set, `reference` [P, 2] their rows."""

    def __init__(self, pairs: list[Pair], *, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        if not pairs:
            raise ValueError("no pairs")
        self.pairs = pairs
        self.reference: torch.Tensor | None = None
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_size(self, epoch: int) -> int:
        return len(self.pairs)

    def _order_of(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, _permutation(len(self.pairs), self.seed, epoch, self.shuffle))
        return self._order[1]

    def batch(self, indices: list[int]) -> dict:
        """The packed batch of these pairs (in this order)."""
        batch = _segments_batch([[s for i in indices for s in self.pairs[i].sequences()]], None, 0)
        batch["pairs"] = torch.tensor(indices, dtype=torch.long)
        if self.reference is not None:
            batch["reference"] = self.reference[batch["pairs"]]
        return batch

    def __next__(self) -> dict:
        return self.batch([int(self._order_of(epoch)[index]) for epoch, index in self._my_positions()])


# ---------------------------------------------------------------------------------------------- building
@dataclass
class FitCounts:
    """What fitting samples into `batch.seq_len` did."""

    samples: int = 0
    truncated: int = 0
    skipped: int = 0  # nothing left to train on after the cut
    tokens: int = 0
    trained_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def describe(self, what: str) -> str:
        parts = [f"{self.samples:,} {what} ({self.tokens:,} tokens, {self.trained_tokens:,} trained)"]
        if self.truncated:
            parts.append(f"{self.truncated:,} cut to batch.seq_len")
        if self.skipped:
            parts.append(f"{self.skipped:,} skipped (nothing left to train on after the cut)")
        return ", ".join(parts + self.notes)


def fit_sample(ids: list[int], trained: list[int], seq_len: int, counts: FitCounts) -> tuple | None:
    """A sample cut to `seq_len`; None (counted) when no token after the first trains any more."""
    if len(ids) > seq_len:
        ids, trained = ids[:seq_len], trained[:seq_len]
        counts.truncated += 1
    if not any(trained[1:]):
        counts.skipped += 1
        return None
    counts.samples += 1
    counts.tokens += len(ids)
    counts.trained_tokens += sum(trained[1:])
    return ids, trained


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, counts: FitCounts) -> Pair:
    """A pair whose sequences fit `seq_len`: responses cut to leave the prompt room (at least half of seq_len for the
    prompt's end), then the prompt's start cut."""
    longest = len(prompt) + max(len(chosen), len(rejected))
    if longest > seq_len:
        counts.truncated += 1
        keep_prompt = min(len(prompt), max(seq_len // 2, seq_len - max(len(chosen), len(rejected))))
        prompt = prompt[len(prompt) - keep_prompt:]
        room = seq_len - len(prompt)
        chosen, rejected = chosen[:room], rejected[:room]
    counts.samples += 1
    counts.tokens += 2 * len(prompt) + len(chosen) + len(rejected)
    counts.trained_tokens += len(chosen) + len(rejected)
    return Pair(prompt, chosen, rejected)


@dataclass
class ChatData:
    """What `build_chat_source` made: the source, the encoder (tokenizer + template) and the records read."""

    source: ChatRows | PreferencePairs
    encoder: Any  # hybridlm.data.chat.ChatEncoder
    records: list  # hybridlm.data.chat.Record
    summary: str  # one line: what was read, cut and skipped


def check_chat_inputs(config: Any) -> None:
    """ConfigError for what an sft / dpo run (train.task) would read and cannot, found without reading the data:
    data.chat that does not exist, holds no record files or cannot be opened; a first .jsonl record (unless
    data.skip_bad_records) that is not of the task's format (a file of another kind given as --data); data.chat_template
    missing or empty; model.init without a tokenizer. The trainer calls it before the run's directory is created:
    what is wrong with the records further on is a DataError of `build_chat_source`, found while reading them."""
    from hybridlm.data.chat import RECORD_FORMATS, raw_records, check_record, read_chat_template
    from hybridlm.data.corpus import find_files
    from hybridlm.data.errors import DataError
    from hybridlm.data.tokenizer import HF_CONFIG_FILE, TOKENIZER_FILE

    data, init = config.data, Path(config.model.init)
    if not ((init / TOKENIZER_FILE).is_file() or (init / HF_CONFIG_FILE).is_file()):
        raise ConfigError(f"model.init: {init} has no tokenizer ({TOKENIZER_FILE} / {HF_CONFIG_FILE}); copy the "
                          "tokenizer files of the model's training run into it (a `hybridlm train` run's final/ has "
                          "them)")
    try:
        read_chat_template(data.chat_template)
    except (DataError, OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.chat_template: {err} (--chat-template)") from err
    if data.demo:
        return
    kind = "preference" if config.train.task == "dpo" else "sft"
    try:
        files = find_files([data.chat], RECORD_FORMATS)
        for file in files:
            with open(file.path, "rb"):
                pass
    except (DataError, OSError) as err:
        raise ConfigError(f"data.chat: {err}; --data takes a .jsonl / .parquet file or a directory of them") from err
    if data.skip_bad_records or Path(files[0].path).suffix.lower() == ".parquet":  # (read whole: not cheap)
        return
    try:
        with contextlib.closing(raw_records(Path(files[0].path))) as records:
            first = next(records, None)
    except DataError as err:  # not UTF-8
        raise ConfigError(f"data.chat: {err}") from err
    if first is not None:
        where, raw = first
        try:
            check_record(raw, kind)
        except DataError as err:
            raise ConfigError(f"data.chat: {where}: {err} (the first record: is --data the right file? "
                              "data.skip_bad_records=true skips bad records)") from err


def build_chat_source(config: Any, *, rank: int, world_size: int) -> ChatData:
    """The sft / dpo source of a `TrainConfig` (train.task): records from data.chat (or the demo conversations),
    tokenized with model.init's tokenizer and chat template (or data.chat_template). DataError for bad data."""
    from hybridlm.data.chat import (
        ChatEncoder,
        ReadCounts,
        Record,
        demo_conversations,
        demo_preferences,
        read_records,
    )
    from hybridlm.data.errors import DataError

    data, batch, task = config.data, config.batch, config.train.task
    kind = "preference" if task == "dpo" else "sft"
    read = ReadCounts()
    if data.demo:
        made = demo_preferences() if kind == "preference" else demo_conversations()
        records = [Record(f"demo:{i + 1}", r) for i, r in enumerate(made)]
    else:
        records = read_records(data.chat, kind=kind, skip_bad=data.skip_bad_records, counts=read)
    encoder = ChatEncoder.from_model_dir(config.model.init, data.chat_template, train_on=data.train_on)
    fit = FitCounts()
    if read.skipped:
        fit.notes.append("bad records skipped: " + "; ".join(f"{n} x {why}" for why, n in sorted(read.skipped.items())))
    pad_id = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else 0
    common = dict(batch_size=batch.micro_batch, seed=config.train.seed, shuffle=data.shuffle, rank=rank,
                  world_size=world_size)
    if kind == "preference":
        pairs = [fit_pair(*_encode(encoder.encode_preference, r), batch.seq_len, fit) for r in records]
        return ChatData(PreferencePairs(pairs, **common), encoder, records, fit.describe("preference pairs"))
    samples = [s for r in records if (s := fit_sample(*_encode(encoder.encode_sft, r), batch.seq_len, fit))]
    if not samples:
        raise DataError(f"{data.chat or 'the demo data'}: no sample has a token to train on within "
                        f"batch.seq_len {batch.seq_len} ({fit.describe('samples')}); raise batch.seq_len")
    source = ChatRows(samples, seq_len=batch.seq_len, pad_id=pad_id, **common)
    return ChatData(source, encoder, records, fit.describe("samples"))


def _encode(encode: Callable, record: Any) -> tuple:
    """`encode(record.data)`, a DataError naming the record's file and line."""
    from hybridlm.data.errors import DataError

    try:
        return encode(record.data)
    except DataError as err:
        raise DataError(f"{record.where}: {err}") from None
