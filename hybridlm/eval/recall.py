"""Recall at long context: multi-query associative recall (MQAR) and single / multi-needle retrieval, and a
model's teacher-forced answer accuracy on them.

    tasks = RecallTasks(mqar_pairs=16, needles=4)
    scores = evaluate(model, tasks, ["mqar", "needle"], [512, 2048], count=64, device="cuda")
    scores["mqar"][2048]["token_acc"], scores["mqar"][2048]["exact_match"]

Vocabulary (`RecallVocab`, 328 ids by default): <pad> 0, <bos> 1, <eos> 2, <blank> 3, <needle> 4,
<query> 5 (6, 7 unused), then 128 keys, 128 values and 64 haystack words. Every sequence starts with
<bos>; its labels are -100 except at the answers (the value that must follow a queried key), which is
what a training loss trains and the accuracy scores (teacher-forced, argmax).

    mqar           <bos> k1 v1 k2 v2 ... kN vN | then N queries ki vi, each key once in random order, at
                   random slots of the rest of the sequence, <blank> everywhere else (Zoology's layout).
                   N = `mqar_pairs` distinct keys; values drawn with replacement.
    needle         a haystack of random words with one "<needle> k v" at a uniformly random depth; the
                   sequence ends with "<query> k v <eos>".
    multi_needle   `needles` needles with distinct keys at random depths; the end queries all of them in
                   random order: "<query> k v" each, then <eos>.

Evaluation sequences (`eval_set`) come from fixed seed streams of their own, the same for every model: "test" for
reported results and "val", a separate stream, for picking a checkpoint during training, so that the selection never
sees the test sequences. `evaluate` reports per task and length the answer-token accuracy, the exact rate (every
answer of a sequence right) and the loss per answer token. The training experiment on these tasks is
`hybridlm.experiments.recall`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hybridlm.eval import scoring
from hybridlm.eval.scoring import IGNORE_INDEX

TASKS = ("mqar", "needle", "multi_needle")
PAD, BOS, EOS, BLANK, NEEDLE, QUERY = 0, 1, 2, 3, 4, 5
_FIRST_FREE = 8
_EVAL_SEED = 3_000_017


@dataclass(frozen=True)
class RecallVocab:
    keys: int = 128
    values: int = 128
    words: int = 64

    @property
    def key0(self) -> int:
        return _FIRST_FREE

    @property
    def value0(self) -> int:
        return _FIRST_FREE + self.keys

    @property
    def word0(self) -> int:
        return _FIRST_FREE + self.keys + self.values

    @property
    def size(self) -> int:
        return self.word0 + self.words


def mqar_example(rng: np.random.Generator, length: int, pairs: int,
                 vocab: RecallVocab) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [length], labels [length]) of one MQAR sequence."""
    if pairs > vocab.keys:
        raise ValueError(f"mqar: {pairs} pairs need as many distinct keys, the vocabulary has {vocab.keys}")
    rest = length - 1 - 2 * pairs
    if rest < 2 * pairs:
        raise ValueError(f"mqar: length {length} is too short for {pairs} pairs and their queries")
    keys = vocab.key0 + rng.choice(vocab.keys, size=pairs, replace=False)
    values = vocab.value0 + rng.integers(0, vocab.values, size=pairs)
    tokens = np.full(length, BLANK, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    tokens[0] = BOS
    tokens[1:1 + 2 * pairs:2], tokens[2:2 + 2 * pairs:2] = keys, values
    # queries: `pairs` non-overlapping 2-token slots among the rest // 2 slots after the pairs
    slots = np.sort(rng.choice(rest // 2, size=pairs, replace=False))
    starts = 1 + 2 * pairs + 2 * slots
    order = rng.permutation(pairs)
    tokens[starts], tokens[starts + 1] = keys[order], values[order]
    labels[starts + 1] = values[order]
    return tokens, labels


def needle_example(rng: np.random.Generator, length: int, needles: int,
                   vocab: RecallVocab) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of a haystack with `needles` needles, every one queried at the end."""
    tail = 3 * needles + 1  # "<query> k v" per needle, then <eos>
    hay = length - 1 - tail
    if hay < 3 * needles:
        raise ValueError(f"needle: length {length} is too short for {needles} needle(s)")
    keys = vocab.key0 + rng.choice(vocab.keys, size=needles, replace=False)
    values = vocab.value0 + rng.integers(0, vocab.values, size=needles)
    tokens = np.empty(length, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    tokens[0] = BOS
    tokens[1:1 + hay] = vocab.word0 + rng.integers(0, vocab.words, size=hay)
    # needles at non-overlapping 3-token slots of the haystack, uniformly random depths
    slots = np.sort(rng.choice(hay // 3, size=needles, replace=False))
    for slot, k, v in zip(slots, keys, values):
        at = 1 + 3 * slot
        tokens[at:at + 3] = (NEEDLE, k, v)
    order = rng.permutation(needles)
    at = 1 + hay
    for i in order:
        tokens[at:at + 3] = (QUERY, keys[i], values[i])
        labels[at + 2] = values[i]
        at += 3
    tokens[at] = EOS
    return tokens, labels


@dataclass(frozen=True)
class RecallTasks:
    """Task parameters shared by training and evaluation."""

    mqar_pairs: int = 16
    needles: int = 4  # multi_needle
    vocab: RecallVocab = field(default_factory=RecallVocab)

    def example(self, task: str, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        if task == "mqar":
            return mqar_example(rng, length, self.mqar_pairs, self.vocab)
        if task == "needle":
            return needle_example(rng, length, 1, self.vocab)
        if task == "multi_needle":
            return needle_example(rng, length, self.needles, self.vocab)
        raise ValueError(_unknown_task(task))

    def shortest(self, task: str) -> int:
        """The shortest sequence `task` can be laid out in (MQAR: one pair and its query)."""
        if task == "mqar":
            return 5
        return 6 * (1 if task == "needle" else self.needles) + 2  # <bos>, haystack >= the needles, the queries, <eos>

    def full_length(self, task: str) -> int:
        """The shortest sequence `task` can be laid out in at full size (MQAR: all `mqar_pairs` and their queries)."""
        return 4 * self.mqar_pairs + 1 if task == "mqar" else self.shortest(task)

    def for_length(self, length: int) -> RecallTasks:
        """These tasks with as many MQAR pairs as a `length`-token sequence holds with room for their queries
        (at most `mqar_pairs`; a training curriculum's short sequences)."""
        pairs = max(1, min(self.mqar_pairs, (length - 1) // 4))
        return self if pairs == self.mqar_pairs else replace(self, mqar_pairs=pairs)

    def batch(self, task: str, rng: np.random.Generator, batch_size: int, length: int, *,
              pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """`batch_size` examples of `length` tokens, right-padded with <pad> (label -100) to `pad_to` tokens: after
        the example, so a causal model's outputs on it are unchanged, and one shape for every training batch (a
        compiled model would otherwise recompile, and record a CUDA graph, per length)."""
        rows = [self.example(task, rng, length) for _ in range(batch_size)]
        ids, labels = np.stack([t for t, _ in rows]), np.stack([lab for _, lab in rows])
        if pad_to is not None and pad_to > length:
            ids = np.pad(ids, ((0, 0), (0, pad_to - length)), constant_values=PAD)
            labels = np.pad(labels, ((0, 0), (0, pad_to - length)), constant_values=IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


SPLITS = ("test", "val")


def eval_set(tasks: RecallTasks, task: str, length: int, count: int, *, split: str = "test") -> dict[str, torch.Tensor]:
    """The fixed held-out sequences of one task and length: "test" for the reported results, "val" (a seed stream
    of its own) for picking the best checkpoint during training, so the selection never sees the test sequences."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    if task not in TASKS:
        raise ValueError(_unknown_task(task))
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1 (sequences per task and length), got {count!r}")
    rng = np.random.default_rng([_EVAL_SEED, TASKS.index(task), length, SPLITS.index(split)])
    return tasks.batch(task, rng, count, length)


def _unknown_task(task: str) -> str:
    return f"unknown recall task {task!r}; choose from {TASKS}"


@torch.no_grad()
def evaluate(model, tasks: RecallTasks, task_names: Sequence[str], lengths: Sequence[int], *, count: int,
             device, tokens_per_batch: int = 1 << 16, split: str = "test") -> dict[str, dict[int, dict[str, float]]]:
    """task -> length -> answer accuracy, exact rate, loss (teacher-forced) on `eval_set`'s `split`."""
    was_training = model.training
    model.eval()
    try:
        out: dict[str, dict[int, dict[str, float]]] = {}
        for task in task_names:
            out[task] = {}
            for length in lengths:
                data = eval_set(tasks, task, length, count, split=split)
                per_batch = max(1, tokens_per_batch // length)
                total = None
                for start in range(0, count, per_batch):
                    ids = data["input_ids"][start:start + per_batch].to(device)
                    labels = data["labels"][start:start + per_batch].to(device)
                    with scoring.autocast_for(device):
                        logits = model(ids).logits
                    total = scoring.accumulate(total, scoring.target_scores(logits, labels))
                out[task][length] = scoring.finish(total)
    finally:
        model.train(was_training)
    return out
