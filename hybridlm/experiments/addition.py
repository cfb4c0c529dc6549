"""Variable-digit addition (fast-weight paper, section 5.2 and Table 3): data, scoring, one training run.

Task. For width n, a and b are n-digit strings (each digit uniform in 0..9, so leading zeros occur:
digits_n zero-pads) and the model reads the prompt `digits_n(a) + digits_n(b) =` and must continue with
the (n+1)-digit sum reversed, least significant digit first (the last digit is the carry, possibly 0):

    a = 095, b = 717 (n = 3):   <bos> 0 9 5 + 7 1 7 = 2 1 8 0 <eos>        (95 + 717 = 812 -> "0812" reversed)

Character-level vocabulary (`VOCAB`): <pad> 0, <bos> 1, <eos> 2, digits 3..12, "+" 13, "=" 14. The
paper's display puts spaces around "+", "="; they are typography, not tokens (a space token would be
a constant). A sequence has 3n + 5 tokens. Training: widths n uniform in 1..32 per example, masked
next-token loss on the target suffix only (the n+1 sum digits and <eos>). Evaluation, per width
n = 1..48: teacher-forced token accuracy over the n+1 sum digits (<eos> not counted) and the
exact-match rate (all n+1 digits right, teacher-forced), on held-out pairs.

Train / evaluation split: a fixed hash partition of the (n, a, b) space. `pair_hash` mixes the width
and every digit of a and b (FNV-1a over the digit string, then the splitmix64 finalizer); a pair is
held out iff hash % 16 == 0 (1/16 of every width). Training rejects and redraws held-out pairs;
evaluation draws only held-out pairs, distinct within a width (for n <= 3 the whole held-out set is
enumerated and sampled without replacement: width 1 has only 100 pairs, 5 of them held out; width 2
has 619 of 10^4). The partition does not depend on any seed, so no seed can leak.

Reported (Table 3's columns): "val. acc." = the mean over widths 1..32 of the held-out token accuracy,
"mean acc." = the mean over widths 33..48, and the values at 33 and 48; the "best step" is the
checkpoint with the best validation accuracy (a separate held-out draw over 1..32, evaluated every
`eval_every` steps; ties go to the lower validation loss, then the later step). The two draws come from the same
held-out pool, so they can share pairs where it is small: at width 1 (5 pairs) the validation pairs are the test
pairs, at width 2 (619 pairs) 12 of its 32 are among the test's 256; from width 3 on (~62,500 pairs) they share
none in the default draws. Widths 1-2 say little about generalization anyway: the swapped pair (b, a) of a held-out
(a, b), with the same sum, is almost always a training pair.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from hybridlm.eval import scoring
from hybridlm.eval.scoring import IGNORE_INDEX
from hybridlm.experiments.train import TrainRecipe, check_counts_and_size, check_non_negative

PAD, BOS, EOS, DIGIT0, PLUS, EQUALS = 0, 1, 2, 3, 13, 14
VOCAB = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "=")
VOCAB_SIZE = len(VOCAB)  # 15
MODEL_VOCAB_SIZE = 16  # embedding rows (one unused)
HELD_OUT_MODULUS = 16
_ENUMERATE_MAX_WIDTH = 3  # widths with at most 10**6 pairs are enumerated for evaluation
_EVAL_SEED, _VAL_SEED = 1_000_003, 2_000_003

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


# --- text <-> ids ----------------------------------------------------------------------------------

def encode(text: str) -> list[int]:
    """"<bos>12+34=64<eos>"-style text -> ids (spaces ignored)."""
    ids, i = [], 0
    text = text.replace(" ", "")
    while i < len(text):
        for special, token in (("<bos>", BOS), ("<eos>", EOS), ("<pad>", PAD)):
            if text.startswith(special, i):
                ids.append(token)
                i += len(special)
                break
        else:
            ids.append(VOCAB.index(text[i]))
            i += 1
    return ids


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


# --- pairs: digits, sums, the held-out partition ---------------------------------------------------

def sample_digits(rng: np.random.Generator, width: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) digit arrays [count, width] uint8, most significant digit first, each digit uniform."""
    a = rng.integers(0, 10, size=(count, width), dtype=np.uint8)
    b = rng.integers(0, 10, size=(count, width), dtype=np.uint8)
    return a, b


def reversed_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Digits (most significant first) [N, n] x2 -> the (n+1)-digit sum, least significant first [N, n+1]."""
    count, width = a.shape
    out = np.zeros((count, width + 1), dtype=np.uint8)
    carry = np.zeros(count, dtype=np.uint8)
    for j in range(width):  # j-th least significant digit
        column = a[:, width - 1 - j] + b[:, width - 1 - j] + carry
        out[:, j] = column % 10
        carry = column // 10
    out[:, width] = carry
    return out


def pair_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """uint64 [N]: FNV-1a over (width, digits of a, a separator, digits of b), then splitmix64's finalizer."""
    count, width = a.shape
    h = np.full(count, _FNV_OFFSET ^ np.uint64(width), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in (*a.T, np.full(count, 10, dtype=np.uint8), *b.T):
            h = (h ^ (column.astype(np.uint64) + np.uint64(1))) * _FNV_PRIME
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = h ^ (h >> np.uint64(31))
    return h


def is_held_out(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [N]: the pair belongs to the evaluation side of the partition."""
    return pair_hash(a, b) % np.uint64(HELD_OUT_MODULUS) == 0


def sample_train_pairs(rng: np.random.Generator, width: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` pairs of `width` digits from the training side (held-out draws are redrawn)."""
    a, b = sample_digits(rng, width, count)
    bad = is_held_out(a, b)
    while bad.any():
        a[bad], b[bad] = sample_digits(rng, width, int(bad.sum()))
        bad = is_held_out(a, b)
    return a, b


@functools.lru_cache(maxsize=_ENUMERATE_MAX_WIDTH)
def _held_out_set(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Every held-out pair of a small width (enumerated)."""
    values = np.arange(10**width)
    digits = (values[:, None] // 10 ** np.arange(width - 1, -1, -1)[None, :] % 10).astype(np.uint8)
    ia, ib = np.meshgrid(np.arange(10**width), np.arange(10**width), indexing="ij")
    a, b = digits[ia.ravel()], digits[ib.ravel()]
    keep = is_held_out(a, b)
    return a[keep], b[keep]


def sample_eval_pairs(width: int, count: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to `count` distinct held-out pairs of `width` digits (fewer only when the held-out set is smaller)."""
    rng = np.random.default_rng([seed, width])
    if width <= _ENUMERATE_MAX_WIDTH:
        a, b = _held_out_set(width)
        pick = rng.permutation(len(a))[:count]
        return a[pick], b[pick]
    seen: set[bytes] = set()
    rows_a, rows_b = [], []
    while len(rows_a) < count:
        a, b = sample_digits(rng, width, 4 * HELD_OUT_MODULUS * count)
        keep = is_held_out(a, b)
        for x, y in zip(a[keep], b[keep]):
            key = x.tobytes() + y.tobytes()
            if key not in seen and len(rows_a) < count:
                seen.add(key)
                rows_a.append(x)
                rows_b.append(y)
    return np.stack(rows_a), np.stack(rows_b)


# --- sequences and batches -------------------------------------------------------------------------

def example_length(width):
    """Tokens of one example of `width`-digit operands (or of each in an array): <bos> a + b = (the n + 1 sum
    digits) <eos>."""
    return 3 * width + 5


def sequences(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Token ids [N, 3n + 5]: <bos> a + b = reversed sum <eos>."""
    count = len(a)
    columns = [
        np.full((count, 1), BOS), a + DIGIT0, np.full((count, 1), PLUS), b + DIGIT0, np.full((count, 1), EQUALS),
        reversed_sum(a, b) + DIGIT0, np.full((count, 1), EOS),
    ]
    return np.concatenate([c.astype(np.int64) for c in columns], axis=1)


def target_labels(tokens: np.ndarray, *, include_eos: bool) -> np.ndarray:
    """Labels [N, L] for sequences of one width: the sum digits (and <eos>), -100 elsewhere."""
    width = (tokens.shape[1] - 5) // 3
    labels = np.full_like(tokens, IGNORE_INDEX)
    first = 2 * width + 3  # position of the first sum digit
    last = tokens.shape[1] if include_eos else tokens.shape[1] - 1
    labels[:, first:last] = tokens[:, first:last]
    return labels


def train_batch(rng: np.random.Generator, batch_size: int, *, min_width: int = 1, max_width: int = 32,
                pad_width: int | None = None) -> dict:
    """One training batch: widths uniform in [min_width, max_width] per example, right-padded with <pad> to
    the length of a `pad_width`-digit example (default `max_width`), so batches of one run have one shape
    even while a curriculum grows `max_width`."""
    pad_width = max_width if pad_width is None else pad_width
    if pad_width < max_width:
        raise ValueError(f"pad_width ({pad_width}) must be >= max_width ({max_width})")
    widths = rng.integers(min_width, max_width + 1, size=batch_size)
    length = example_length(pad_width)
    input_ids = np.full((batch_size, length), PAD, dtype=np.int64)
    labels = np.full((batch_size, length), IGNORE_INDEX, dtype=np.int64)
    for width in np.unique(widths):
        rows = np.nonzero(widths == width)[0]
        tokens = sequences(*sample_train_pairs(rng, int(width), len(rows)))
        input_ids[rows, : tokens.shape[1]] = tokens
        labels[rows, : tokens.shape[1]] = target_labels(tokens, include_eos=True)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


def packed_train_batch(rng: np.random.Generator, rows: int, row_length: int, *, min_width: int = 1,
                       max_width: int = 32) -> dict:
    """One training batch of `rows` rows of `row_length` tokens, each filled with whole examples end to end, the way
    a language-model run packs documents into fixed rows: many more examples per update than rows.

    Widths are drawn uniformly in [min_width, max_width], one example after another; a row takes examples while the
    next one fits and ends in <pad> (that example opens the next row). `position_ids` restart at 0 at every example
    and at the padding, so that the model runs each example on its own (attention and recurrent states stop at the
    restarts: `HybridModel`'s packed documents); labels as in `train_batch` (the sum digits and <eos>)."""
    longest = example_length(max_width)
    if row_length < longest:
        raise ValueError(f"a packed row of {row_length} tokens cannot hold a {max_width}-digit example "
                         f"({longest} tokens); use --pack-length >= {longest}")
    mean_length = example_length((min_width + max_width) / 2)
    widths, row_of, start_of = [], [], []
    row, used = 0, 0
    while row < rows:  # draws in blocks of about one batch's examples; the last block's unused draws are dropped
        for width in rng.integers(min_width, max_width + 1, size=int(rows * row_length / mean_length) + 16).tolist():
            length = example_length(width)
            if used + length > row_length:
                row, used = row + 1, 0
                if row == rows:
                    break
            widths.append(width)
            row_of.append(row)
            start_of.append(used)
            used += length
    widths, row_of, start_of = np.array(widths), np.array(row_of), np.array(start_of)
    input_ids = np.full((rows, row_length), PAD, dtype=np.int64)
    labels = np.full((rows, row_length), IGNORE_INDEX, dtype=np.int64)
    restarts = np.zeros((rows, row_length), dtype=bool)
    for width in np.unique(widths):
        pick = np.nonzero(widths == width)[0]
        tokens = sequences(*sample_train_pairs(rng, int(width), len(pick)))
        cells = (row_of[pick][:, None], start_of[pick][:, None] + np.arange(tokens.shape[1])[None, :])
        input_ids[cells] = tokens
        labels[cells] = target_labels(tokens, include_eos=True)
        restarts[row_of[pick], start_of[pick]] = True
    ends = np.zeros(rows, dtype=np.int64)
    np.maximum.at(ends, row_of, start_of + example_length(widths))
    tail = ends < row_length
    restarts[np.nonzero(tail)[0], ends[tail]] = True  # the padding is a document of its own
    columns = np.arange(row_length)[None, :]
    position_ids = columns - np.maximum.accumulate(np.where(restarts, columns, 0), axis=1)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids)}


@dataclass
class EvalSet:
    """Held-out sequences of one width with digit-only labels."""

    width: int
    input_ids: torch.Tensor  # [N, 3n + 5]
    labels: torch.Tensor  # [N, 3n + 5], the n+1 sum digits only


def eval_sets(widths: Sequence[int], per_width: int, *, seed: int = _EVAL_SEED) -> list[EvalSet]:
    """The fixed held-out evaluation sets (the same for every model and training seed)."""
    out = []
    for width in widths:
        tokens = sequences(*sample_eval_pairs(width, per_width, seed=seed))
        out.append(EvalSet(width, torch.from_numpy(tokens),
                           torch.from_numpy(target_labels(tokens, include_eos=False))))
    return out


@torch.no_grad()
def evaluate(model, sets: Sequence[EvalSet], *, device, batch_size: int = 512) -> dict[int, dict[str, float]]:
    """Per width: token accuracy, exact match, loss per digit, counts (teacher-forced, model in eval mode), and
    "digit_acc": the accuracy of each of the n+1 sum digits in the order they are emitted (least significant
    first), which tells a model that gets the first k digits right and guesses the rest from one whose errors
    spread over all positions, where the width's token accuracy (their mean) cannot."""
    was_training = model.training
    model.eval()
    results = {}
    for s in sets:
        total, digit_hits = None, torch.zeros(s.width + 1, dtype=torch.float64)
        first = 2 * s.width + 3  # position of the first sum digit, predicted from the logits at first - 1
        for start in range(0, len(s.input_ids), batch_size):
            ids = s.input_ids[start:start + batch_size].to(device)
            labels = s.labels[start:start + batch_size].to(device)
            with scoring.autocast_for(device):
                logits = model(ids).logits
            total = scoring.accumulate(total, scoring.target_scores(logits, labels))
            pred = logits[:, first - 1:first + s.width].argmax(-1)  # [N, n + 1]
            digit_hits += (pred == ids[:, first:first + s.width + 1]).sum(0).cpu().double()
        results[s.width] = {**scoring.finish(total), "digit_acc": (digit_hits / len(s.input_ids)).tolist()}
    model.train(was_training)
    return results


def summarize(per_width: dict[int, dict[str, float]], *, train_max_width: int = 32,
              ood: tuple[int, int] = (33, 48)) -> dict[str, float]:
    """Table 3's numbers (fractions in [0, 1]): val_acc (mean token accuracy over widths 1..train_max_width),
    ood_mean (mean over ood[0]..ood[1]), acc_at_<ood[0]>, acc_at_<ood[1]>, and the exact-match means."""

    def mean(key: str, lo: int, hi: int) -> float:
        values = [per_width[w][key] for w in range(lo, hi + 1) if w in per_width]
        return float(np.mean(values)) if values else math.nan

    lo, hi = ood
    return {
        "val_acc": mean("token_acc", 1, train_max_width),
        "ood_mean": mean("token_acc", lo, hi),
        f"acc_at_{lo}": per_width.get(lo, {}).get("token_acc", math.nan),
        f"acc_at_{hi}": per_width.get(hi, {}).get("token_acc", math.nan),
        "val_exact": mean("exact_match", 1, train_max_width),
        "ood_exact": mean("exact_match", lo, hi),
    }


SOLVED_ACCURACY = 0.99  # the bar for "learns the in-distribution task"


def solved_width(per_width: dict[str, dict[str, float]], *, threshold: float = SOLVED_ACCURACY) -> int:
    """The largest n such that every width 1..n reaches `threshold` token accuracy (0 if width 1 misses).
    `per_width` is keyed by the width as text, as a run's JSON stores it. A run that stalls on a plateau shows
    here as learned up to some width and no further: its accuracy then falls by about one digit's share per
    extra digit, which the width-averaged val_acc hides."""
    n = 0
    while str(n + 1) in per_width and per_width[str(n + 1)]["token_acc"] >= threshold:
        n += 1
    return n


def end_digits_solved(digit_acc: Sequence[float], *, threshold: float = SOLVED_ACCURACY) -> tuple[int, int]:
    """(low, high): how many sum digits from each end of the sum all reach `threshold` accuracy. `low` counts from
    the first digit emitted (the least significant), `high` from the last (the most significant) and stops where
    `low` stopped, so low + high <= n + 1 and a sum right at every digit is (n + 1, 0). A model can be right at
    both ends and at chance in between; past the training widths the pair says which of the digits it computes
    survive the longer input."""
    low = 0
    while low < len(digit_acc) and digit_acc[low] >= threshold:
        low += 1
    high = 0
    while high < len(digit_acc) - low and digit_acc[-1 - high] >= threshold:
        high += 1
    return low, high


# --- one run ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdditionRecipe(TrainRecipe):
    """The shared training recipe of `hybridlm bench addition`, protocol "curriculum" (README.md in this folder
    explains it; `PaperAdditionRecipe` is the paper's protocol).

    Defaults: size "small", 8000 updates of 1024 examples, AdamW lr 1e-3 with 800 warmup steps, and a width
    curriculum over the first 2000 updates (the paper samples widths 1..32 uniformly from the first step:
    `curriculum_steps=0`). Its `to_dict` (a run's spec) has no "protocol" key, so the run files recorded before
    the protocols had names are this protocol's runs. Results: benchmarks/RESULTS.md."""

    protocol: ClassVar[str] = "curriculum"

    steps: int = 8000
    batch_size: int = 1024
    warmup: int = 800
    size: str = "small"
    min_width: int = 1
    train_max_width: int = 32
    eval_max_width: int = 48
    eval_per_width: int = 256
    val_per_width: int = 32
    eval_every: int = 250
    eval_batch_size: int = 512
    curriculum_steps: int = 2000
    curriculum_start: int = 4
    pack_length: int = 0

    def max_width_at(self, step: int) -> int:
        """The widest training operands at `step`: `train_max_width`, or with `curriculum_steps` > 0 a cap that
        grows linearly from `curriculum_start` to `train_max_width` over the first `curriculum_steps` updates
        (widths stay uniform below the cap). The paper samples 1..32 uniformly throughout: `curriculum_steps=0`."""
        if step >= self.curriculum_steps:
            return self.train_max_width
        start = max(self.min_width, min(self.curriculum_start, self.train_max_width))
        return start + (self.train_max_width - start) * step // self.curriculum_steps

    def batch(self, rng: np.random.Generator, step: int) -> dict:
        """The training batch of `step`: widths uniform in min_width..max_width_at(step), labels on the target suffix
        only (the n + 1 sum digits and <eos>; -100 elsewhere). `batch_size` examples, each padded to the widest; or
        with `pack_length` > 0, `batch_size` rows of `pack_length` tokens packed with whole examples
        (`packed_train_batch`: about pack_length / (1.5 (min_width + train_max_width) + 5) examples per row)."""
        if self.pack_length:
            return packed_train_batch(rng, self.batch_size, self.pack_length, min_width=self.min_width,
                                      max_width=self.max_width_at(step))
        return train_batch(rng, self.batch_size, min_width=self.min_width, max_width=self.max_width_at(step),
                           pad_width=self.train_max_width)

    def to_dict(self) -> dict:
        """The run's spec; without `pack_length` when it is 0, so the runs recorded before packing existed match."""
        values = super().to_dict()
        if not values["pack_length"]:
            del values["pack_length"]
        return values

    def model_overrides(self) -> dict:
        """HybridConfig fields the protocol sets beyond the model name and size (none here)."""
        return {}


@dataclass(frozen=True)
class PaperAdditionRecipe(AdditionRecipe):
    """Protocol "paper": the fast-weight paper's section 5.2 as far as it states it, its silences filled as written
    here (README.md in this folder).

    Stated by the paper: widths uniform in 1..32 from the first update (no curriculum), the masked next-token loss on
    the target suffix only, evaluation to 48 digits with its four columns, the 124M-130M language models' shape
    (size "lm130m"; tied embeddings, AdamW (0.9, 0.95), lr 1e-3 with cosine decay, weight decay 0.1, clip 1.0:
    Appendix B.1). Chosen here: 3000 updates (the paper's best steps are <= 2000, at multiples of 100: validation
    every 100 updates), batch 256, warmup 300 (10%), cosine to 0.1x, 256 held-out pairs per width."""

    steps: int = 3000
    batch_size: int = 256
    warmup: int = 300
    size: str = "lm130m"
    eval_every: int = 100
    curriculum_steps: int = 0

    protocol: ClassVar[str] = "paper"

    def model_overrides(self) -> dict:
        """Tied input / output embeddings (Appendix B.1)."""
        return {"tie_word_embeddings": True}

    def to_dict(self) -> dict:
        return {"protocol": self.protocol, **super().to_dict()}


# The paper's Table 3 (section 5.2): best step and %, by the model name that reproduces each row (`models.py`;
# `mamba2` and `mamba2-ref` both stand for its Mamba-2 row).
_PAPER_COLUMNS = ("best_step", "val_acc", "ood_mean", "acc_at_33", "acc_at_48")
PAPER_TABLE3: dict[str, dict[str, float]] = {
    name: dict(zip(_PAPER_COLUMNS, row)) for name, row in {
        "transformer": (2000, 100.0, 65.8, 97.0, 49.0),
        "retnet": (2000, 99.7, 82.9, 99.0, 63.0),
        "mamba2": (2000, 100.0, 75.2, 100.0, 51.0),
        "mamba2-ref": (2000, 100.0, 75.2, 100.0, 51.0),
        "fw-1A.1": (1900, 100.0, 80.6, 100.0, 59.0),
        "fw-1A.2": (2000, 100.0, 85.2, 100.0, 63.0),
        "fw-1A.3": (1900, 99.8, 85.9, 100.0, 69.0),
        "fw-3A.3": (2000, 99.9, 87.2, 100.0, 69.0),
    }.items()
}

PROTOCOLS: dict[str, type[AdditionRecipe]] = {"curriculum": AdditionRecipe, "paper": PaperAdditionRecipe}


def recipe_from_dict(recipe: dict) -> AdditionRecipe:
    """The recipe a run's spec stores (`to_dict`): its "protocol" key (absent: "curriculum") picks the class."""
    values = dict(recipe)
    protocol = values.pop("protocol", "curriculum")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown addition protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[protocol](**values)


def check_recipe(recipe: AdditionRecipe) -> None:
    """Clear errors, before any training, for recipes that cannot run or cannot be evaluated."""
    if not 1 <= recipe.min_width <= recipe.train_max_width < recipe.eval_max_width:
        raise ValueError(f"need 1 <= --min-width ({recipe.min_width}) <= --train-max-width "
                         f"({recipe.train_max_width}) < --eval-max-width ({recipe.eval_max_width})")
    if recipe.protocol == "paper" and recipe.curriculum_steps:
        raise ValueError(f"--protocol paper samples widths uniformly from the first update; --curriculum-steps must be "
                         f"0, got {recipe.curriculum_steps} (--protocol curriculum has the width curriculum)")
    if recipe.curriculum_steps and recipe.curriculum_start > recipe.train_max_width:
        raise ValueError(f"--curriculum-start {recipe.curriculum_start} is wider than --train-max-width "
                         f"{recipe.train_max_width}: the curriculum grows the widest operands up to it")
    if recipe.curriculum_steps >= recipe.steps > 1:
        raise ValueError(f"the width curriculum ({recipe.curriculum_steps} steps) must end before training does "
                         f"({recipe.steps} steps), or the model never sees the widest operands; lower "
                         "--curriculum-steps (0 turns it off)")
    check_non_negative(recipe, "eval_every", "curriculum_steps", "pack_length")  # 0: at the end / none / no packing
    if recipe.pack_length and recipe.pack_length < example_length(recipe.train_max_width):
        raise ValueError(f"--pack-length {recipe.pack_length} cannot hold a {recipe.train_max_width}-digit example "
                         f"({example_length(recipe.train_max_width)} tokens); use 0 (no packing) or at least that")
    check_counts_and_size(recipe, "steps", "batch_size", "eval_per_width", "val_per_width", "eval_batch_size",
                          "curriculum_start")


def run_addition(model_name: str, seed: int, recipe: AdditionRecipe, *, device: str = "cpu",
                 log_fn=None, checkpoint=None, should_stop=None, model=None) -> dict:
    """Train `model_name` with `recipe` from `seed`, then evaluate every width: a JSON-able result dict.
    `model`: an initialized model of the addition vocabulary to train instead of a fresh `model_name` (e.g. one
    carried over from pretrained weights; `model_name` then only labels the run).

    `checkpoint` (a path stem) and `should_stop` go to `train_on_task`: the run saves there, resumes from
    there, and stops (raising `TrainingInterrupted`) when `should_stop()` turns true."""
    from hybridlm.experiments.models import build_model, run_record, task_config
    from hybridlm.experiments.train import generator_state, train_on_task

    check_recipe(recipe)
    if model is None:
        config = task_config(model_name, vocab_size=MODEL_VOCAB_SIZE, size=recipe.size, **recipe.model_overrides())
        model = build_model(config, seed=seed)
    rng = np.random.default_rng([seed, 7])
    train_widths = range(recipe.min_width, recipe.train_max_width + 1)
    val = eval_sets(train_widths, recipe.val_per_width, seed=_VAL_SEED)

    def batch_fn(step: int) -> dict:
        return recipe.batch(rng, step)

    def val_fn(m) -> tuple[float, float]:
        per_width = evaluate(m, val, device=device, batch_size=recipe.eval_batch_size)
        return (float(np.mean([r["token_acc"] for r in per_width.values()])),
                float(np.mean([r["loss"] for r in per_width.values()])))

    trained = train_on_task(model, batch_fn, device=device, eval_fn=val_fn, eval_every=recipe.eval_every,
                            log_fn=log_fn, checkpoint=checkpoint, batch_state=generator_state(rng),
                            fingerprint={"task": "addition", "model": model_name, "seed": seed,
                                         "recipe": recipe.to_dict()},
                            should_stop=should_stop, **recipe.train_options())
    sets = eval_sets(range(1, recipe.eval_max_width + 1), recipe.eval_per_width)
    per_width = evaluate(model, sets, device=device, batch_size=recipe.eval_batch_size)
    return {
        **run_record(model_name, seed, model, trained),
        "protocol": recipe.protocol,
        "summary": summarize(per_width, train_max_width=recipe.train_max_width,
                             ood=(recipe.train_max_width + 1, recipe.eval_max_width)),
        "per_width": {str(w): r for w, r in per_width.items()},
    }


# --- the benchmark: models x seeds -> results.md / results.json / the two PNGs ----------------------

RUNNER = "hybridlm.experiments.addition:run_job"


def run_job(spec: dict, *, device: str, log_fn=None, checkpoint=None, should_stop=None) -> dict:
    """`bench.Job` entry point: spec = {"task", "model", "seed", "recipe"}; resumable (see `run_addition`)."""
    return run_addition(spec["model"], spec["seed"], recipe_from_dict(spec["recipe"]), device=device, log_fn=log_fn,
                        checkpoint=checkpoint, should_stop=should_stop)


def bench_addition(models: Sequence[str], seeds: Sequence[int], recipe: AdditionRecipe, out_dir, **run_options) -> dict:
    """Train every model with every seed and write the report; `run_options` go to `bench.run_jobs`
    (devices, per_device, time_budget, echo). Finished runs in out_dir/runs are reused."""
    from hybridlm.experiments import bench

    check_recipe(recipe)  # before any worker starts: one clear error, not one per run after its training
    return bench.bench_model_seeds(
        "addition", RUNNER, models, seeds, recipe.to_dict(), out_dir,
        lambda by_model, out, missing: write_report(by_model, recipe, out, missing=missing), **run_options,
    )


def aggregate(results: Sequence[dict], recipe: AdditionRecipe) -> dict:
    """Mean ± std over seeds of the summary numbers and of each width's token accuracy / exact match."""
    from hybridlm.experiments.bench import mean_std

    keys = results[0]["summary"].keys() if results else []
    widths = range(1, recipe.eval_max_width + 1)
    return {
        "seeds": [r["seed"] for r in results],
        "parameters": results[0]["parameters"] if results else None,
        "best_step": mean_std([r["best_step"] for r in results]),
        "summary": {k: mean_std([r["summary"][k] for r in results]) for k in keys},
        "token_acc": {w: mean_std([r["per_width"][str(w)]["token_acc"] for r in results]) for w in widths},
        "exact_match": {w: mean_std([r["per_width"][str(w)]["exact_match"] for r in results]) for w in widths},
        "solved_width": [solved_width(r["per_width"]) for r in results],
        "digit_acc": _digit_stats(results, recipe),
    }


def digit_widths(recipe: AdditionRecipe) -> tuple[int, ...]:
    """The widths whose per-digit accuracy the report shows: the widest trained, the next, the widest evaluated."""
    return tuple(sorted({recipe.train_max_width, recipe.train_max_width + 1, recipe.eval_max_width}))


def _digit_stats(results: Sequence[dict], recipe: AdditionRecipe) -> dict | None:
    """{"runs": how many runs have per-digit scores (a run's JSON without "digit_acc" has none), "widths": {w: ...} per shown width}: "acc", the mean ± std over those runs of each digit's
    accuracy, and "end_solved", each seed's (low, high) digits solved, None for a seed without scores. None when
    no run has them."""
    from hybridlm.experiments.bench import mean_std

    widths = digit_widths(recipe)
    scored = [all("digit_acc" in r["per_width"][str(w)] for w in widths) for r in results]
    if not any(scored):
        return None
    digits = {w: [r["per_width"][str(w)]["digit_acc"] for r, ok in zip(results, scored) if ok] for w in widths}
    return {"runs": sum(scored),
            "widths": {w: {"acc": [mean_std(list(col)) for col in zip(*digits[w])],
                           "end_solved": [end_digits_solved(r["per_width"][str(w)]["digit_acc"]) if ok else None
                                          for r, ok in zip(results, scored)]}
                       for w in widths}}


def write_report(by_model: dict[str, list[dict]], recipe: AdditionRecipe, out_dir, *, missing=()) -> dict:
    """results.json, results.md (Table 3 layout, mean ± std over seeds), accuracy_vs_width.png and, when a run has
    per-digit scores, accuracy_by_digit.png and digit_map.png."""
    from hybridlm.experiments import bench
    from hybridlm.experiments.models import describe

    lo, hi = recipe.train_max_width + 1, recipe.eval_max_width
    shown = digit_widths(recipe)
    stats = {m: aggregate(rs, recipe) for m, rs in by_model.items()}
    # The paper's numbers go beside ours under its protocol and widths only.
    paper = PAPER_TABLE3 if recipe.protocol == "paper" and (recipe.min_width, lo, hi) == (1, 33, 48) else {}
    ranks = paper_ranks(stats, paper)
    rows, exact_rows = [], []
    for m, s in stats.items():
        label = f"{describe(m)} `{m}`"
        if not s["seeds"]:
            rows.append([label, "–", "–", "–", "–", "–", "0", *(["–"] if paper else [])])
            continue
        best = s["best_step"]
        best_text = f"{best['mean']:.0f}" + (f" ± {best['std']:.0f}" if best["n"] > 1 else "")
        summary = s["summary"]

        def beside(text: str, key: str, digits: int = 1) -> str:
            return text + (f" (paper {paper[m][key]:.{digits}f})" if m in paper else "")

        rows.append([
            label, bench.human_count(s["parameters"]), beside(best_text, "best_step", 0),
            beside(bench.pm(summary["val_acc"]), "val_acc"), beside(bench.pm(summary["ood_mean"]), "ood_mean"),
            f"{beside(bench.pm(summary[f'acc_at_{lo}']), 'acc_at_33')} / "
            f"{beside(bench.pm(summary[f'acc_at_{hi}']), 'acc_at_48')}",
            str(len(s["seeds"])), *([" / ".join(map(str, ranks[m])) if m in ranks else "–"] if paper else []),
        ])
        digits = None if s["digit_acc"] is None else s["digit_acc"]["widths"]
        ends = "–" if digits is None else "; ".join(
            "–" if digits[shown[0]]["end_solved"][i] is None
            else " / ".join("+".join(map(str, digits[w]["end_solved"][i])) for w in shown)
            for i in range(len(s["seeds"])))
        exact_rows.append([label, bench.pm(summary["val_exact"]), bench.pm(summary["ood_exact"]),
                           ", ".join(map(str, s["solved_width"])), ends])
    marks = sorted({1, recipe.train_max_width // 2, recipe.train_max_width, lo, (lo + hi) // 2, hi})
    by_digit, grids = Path(out_dir) / "accuracy_by_digit.png", Path(out_dir) / "digit_map.png"
    panels = {}
    for m, rs in by_model.items():
        if (scored := digit_map(rs, recipe)) is not None:
            grid, runs = scored
            panels[_scored_label(m, runs, len(rs))] = grid
    notes = []  # the per-digit figures this report writes (none when no run has per-digit scores), then the dash
    if any(s["digit_acc"] for s in stats.values()):
        notes.append(f"`{by_digit.name}` plots every digit at these widths")
    if panels:
        notes.append(f"`{grids.name}` at every width")
    notes.append('"–": runs recorded without per-digit scores')
    width_rows = [[f"`{m}`", *(bench.pm(s["token_acc"][w]) if s["seeds"] else "–" for w in marks)]
                  for m, s in stats.items()]
    text = [
        "# Variable-digit addition: teacher-forced length generalization",
        "",
        f"Command: `{bench.command_line()}`",
        "",
        (f"Protocol `{recipe.protocol}`. Recipe: size `{recipe.size}`, {recipe.steps} steps x batch {recipe.batch_size}, AdamW lr {recipe.lr:g} "
         f"(warmup {recipe.warmup}, cosine to {recipe.min_lr_ratio:g}x), wd {recipe.weight_decay:g}, clip "
         f"{recipe.grad_clip:g}; train widths {recipe.min_width}..{recipe.train_max_width}"
         + (f" after a width curriculum (the widest grows from {recipe.curriculum_start} to "
            f"{recipe.train_max_width} over the first {recipe.curriculum_steps} steps; the paper samples uniformly "
            "from the start)" if recipe.curriculum_steps > 0 else " uniformly from the start (as the paper)")
         + f", evaluated on {recipe.eval_per_width} held-out pairs per width 1..{hi}. Numbers are % (mean ± sample "
         "std over seeds)."),
        "",
        "## Table 3 layout (token accuracy on the n+1 reversed sum digits)",
        "",
        bench.markdown_table(["Model", "Params", "Best step", "Val. acc.", f"Mean acc. ({lo}–{hi})",
                              f"Acc@d{lo}/d{hi}", "Seeds", *(["Rank by mean acc., ours / paper"] if paper else [])],
                             rows),
        "",
        *([("Protocol `paper` (hybridlm/experiments/README.md): in parentheses the paper's Table 3 number for the row "
            "the model stands for; the last column ranks the rows that have one by the mean over 33–48, ours (by the "
            "mean over seeds) and the paper's."), ""] if paper else []),
        "## Exact match (all n+1 digits right, teacher-forced) and the widths solved",
        "",
        bench.markdown_table(["Model", f"Val. (1–{recipe.train_max_width})", f"Mean ({lo}–{hi})",
                              f"Solved 1..n (token acc. ≥ {SOLVED_ACCURACY:.0%} at every width), per seed",
                              f"Sum digits ≥ {SOLVED_ACCURACY:.0%}, least + most significant end, at "
                              f"n={' / '.join(map(str, shown))}, per seed"],
                             exact_rows),
        "",
        ("The last column counts the sum digits that all reach "
         f"{SOLVED_ACCURACY:.0%} at that width from each end of the sum: from the least significant (emitted first) "
         "and from the most significant (emitted last), the second count stopping where the first stopped "
         f"({'; '.join(notes)}). A sum right at every digit reads {recipe.train_max_width + 1}+0 at "
         f"n = {recipe.train_max_width}. Counts that stay from the first width to the next mean that one more digit "
         "of input leaves those digits intact; counts that fall mean that it breaks digits the model gets right at "
         "the widest trained width."),
        "",
        "## Token accuracy at selected widths",
        "",
        bench.markdown_table(["Model", *(f"n={w}" for w in marks)], width_rows),
        "",
    ]
    files = bench.write_outputs(
        out_dir, lines=text, missing=missing, png="accuracy_vs_width.png",
        payload={"task": "addition", "protocol": recipe.protocol, "recipe": recipe.to_dict(), "aggregate": stats, "runs": by_model},
        plot=lambda path: plot_accuracy(stats, recipe, path),
    )
    if any(s["digit_acc"] for s in stats.values()):
        files.append(str(by_digit))
        plot_digit_accuracy(stats, recipe, by_digit)
    else:  # an earlier report's figure of other runs would stand beside this report
        by_digit.unlink(missing_ok=True)
    if panels:
        files.append(str(grids))
        plot_digit_map(panels, recipe, grids)
    else:
        grids.unlink(missing_ok=True)
    return {"files": files, "aggregate": stats}


def paper_ranks(stats: dict, paper: dict[str, dict[str, float]]) -> dict[str, tuple[int, int]]:
    """model -> (our rank, the paper's rank) by the mean accuracy over the widths past training (1 = best), among
    the models with finished runs and a paper number."""
    present = [m for m, s in stats.items() if s["seeds"] and m in paper]
    ours = sorted(present, key=lambda m: -stats[m]["summary"]["ood_mean"]["mean"])
    theirs = sorted(present, key=lambda m: -paper[m]["ood_mean"])
    return {m: (ours.index(m) + 1, theirs.index(m) + 1) for m in present}


def _scored_label(model: str, scored: int, runs: int) -> str:
    """A per-digit figure's name for a model, saying how many of its runs have per-digit scores if not all."""
    from hybridlm.experiments.models import describe

    return describe(model) + (f" ({scored} of {runs} seeds)" if scored < runs else "")


def digit_map(results: Sequence[dict], recipe: AdditionRecipe) -> tuple[np.ndarray, int] | None:
    """(grid, runs): grid [W, W + 1] (W = eval_max_width), row n - 1 each sum digit's accuracy at width n, the
    mean over the `runs` runs with per-digit scores at every width, NaN past digit n + 1; None when no run has
    them."""
    widths = range(1, recipe.eval_max_width + 1)
    scored = [r for r in results if all("digit_acc" in r["per_width"][str(w)] for w in widths)]
    if not scored:
        return None
    grid = np.full((len(widths), len(widths) + 1), np.nan)
    for w in widths:
        grid[w - 1, :w + 1] = np.mean([r["per_width"][str(w)]["digit_acc"] for r in scored], axis=0)
    return grid, len(scored)


def plot_accuracy(stats: dict, recipe: AdditionRecipe, path) -> None:
    from hybridlm.experiments.bench import plot_percent_with_std, pyplot
    from hybridlm.experiments.models import describe
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    widths = np.arange(1, recipe.eval_max_width + 1)
    for m, s in stats.items():
        if not s["seeds"]:
            continue
        mean = np.array([s["token_acc"][w]["mean"] for w in widths]) * 100
        std = np.array([s["token_acc"][w]["std"] for w in widths]) * 100
        plot_percent_with_std(ax, widths, mean, std, label=describe(m), linewidth=1.5)
    ax.axvspan(recipe.train_max_width + 0.5, recipe.eval_max_width + 0.5, color="0.9", zorder=0)
    ax.set_xlabel("digits n (shaded: longer than any training example)")
    ax.set_ylabel("teacher-forced target-digit accuracy (%)")
    ax.set_xlim(1, recipe.eval_max_width)
    ax.set_title("Variable-digit addition")
    if ax.get_legend_handles_labels()[0]:  # no finished run yet: no legend
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path, dpi=110)  # a crash mid-write keeps the previous PNG
    finally:
        plt.close(fig)


def plot_digit_accuracy(stats: dict, recipe: AdditionRecipe, path) -> None:
    """One panel per width of `digit_widths`: each sum digit's accuracy (mean ± std over the seeds that have
    per-digit scores) by position."""
    from hybridlm.experiments.bench import plot_percent_with_std, pyplot
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    widths = digit_widths(recipe)
    fig, axes = plt.subplots(1, len(widths), figsize=(4.2 * len(widths), 4), sharey=True, squeeze=False)
    for ax, width in zip(axes[0], widths):
        positions = np.arange(1, width + 2)
        for m, s in stats.items():
            if s["digit_acc"] is None:
                continue
            acc = s["digit_acc"]["widths"][width]["acc"]
            plot_percent_with_std(ax, positions, np.array([a["mean"] for a in acc]) * 100,
                                  np.array([a["std"] for a in acc]) * 100,
                                  label=_scored_label(m, s["digit_acc"]["runs"], len(s["seeds"])), linewidth=1.3)
        if width + 1 > recipe.train_max_width + 1:  # digits no training example had
            ax.axvspan(recipe.train_max_width + 1.5, width + 1.5, color="0.9", zorder=0)
        ax.set_title(f"n = {width} digits")
        ax.set_xlabel("sum digit (1 = least significant, emitted first)")
        ax.set_xlim(1, width + 1)
    axes[0][0].set_ylabel("teacher-forced accuracy (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    rows = -(-len(labels) // 3)  # the legend goes below the panels: the curves span the whole height
    fig.tight_layout(rect=(0, 0.035 * rows + 0.02, 1, 1))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7, frameon=False)
    try:
        save_figure_atomic(fig, path, dpi=110)
    finally:
        plt.close(fig)


def plot_digit_map(panels: dict[str, np.ndarray], recipe: AdditionRecipe, path) -> None:
    """One panel per title: a model's accuracy by width (rows) and sum digit (columns), `digit_map`'s grid.
    Digits learned at a fixed place show as bright columns (counted from the least significant end) or diagonals
    (from the most significant end) that stay bright as the width grows."""
    from hybridlm.experiments.bench import pyplot
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 4.2 * rows), squeeze=False)
    hi = recipe.eval_max_width
    for ax, (title, grid) in zip(axes.flat, panels.items()):
        image = ax.imshow(grid * 100, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=100,
                          extent=(0.5, hi + 1.5, 0.5, hi + 0.5), interpolation="nearest")
        ax.axhline(recipe.train_max_width + 0.5, color="white", linewidth=0.8, linestyle="--")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("sum digit (1 = least significant)")
        ax.set_ylabel("digits n (dashed: widest trained)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.colorbar(image, cax=fig.add_axes((0.9, 0.15, 0.015, 0.7)), label="teacher-forced accuracy (%)")
    try:
        save_figure_atomic(fig, path, dpi=110)
    finally:
        plt.close(fig)
