"""Recall tasks: every scored answer is the value bound to its key earlier in the same sequence; fixed evaluation
sets."""

from __future__ import annotations

import numpy as np
import pytest

from hybridlm.eval.recall import BLANK, BOS, EOS, NEEDLE, QUERY, RecallTasks, eval_set
from hybridlm.eval.scoring import IGNORE_INDEX

TASKS = RecallTasks(mqar_pairs=8, needles=3)
V = TASKS.vocab


def _is_key(t):
    return V.key0 <= t < V.value0


def _is_value(t):
    return V.value0 <= t < V.word0


@pytest.mark.parametrize("length", [40, 97, 300])
def test_mqar_layout_and_answers(length):
    rng = np.random.default_rng(length)
    tokens, labels = TASKS.example("mqar", rng, length)
    assert tokens.shape == labels.shape == (length,) and tokens[0] == BOS
    pairs = tokens[1:1 + 2 * 8].reshape(8, 2)
    assert all(_is_key(k) and _is_value(v) for k, v in pairs)
    binding = {int(k): int(v) for k, v in pairs}
    assert len(binding) == 8  # distinct keys
    answers = np.nonzero(labels != IGNORE_INDEX)[0]
    assert len(answers) == 8
    assert sorted(int(tokens[a - 1]) for a in answers) == sorted(binding)  # each key queried once
    for a in answers:
        assert a > 2 * 8 and labels[a] == tokens[a] == binding[int(tokens[a - 1])]
    rest = np.ones(length, bool)
    rest[:1 + 16] = False
    rest[answers] = rest[answers - 1] = False
    assert (tokens[rest] == BLANK).all()


@pytest.mark.parametrize("task, needles", [("needle", 1), ("multi_needle", 3)])
def test_needles_are_queried_at_the_end(task, needles):
    rng = np.random.default_rng(7)
    for length in (30, 128, 513):
        tokens, labels = TASKS.example(task, rng, length)
        assert len(tokens) == length and tokens[0] == BOS and tokens[-1] == EOS
        marks = np.nonzero(tokens == NEEDLE)[0]
        assert len(marks) == needles
        binding = {int(tokens[m + 1]): int(tokens[m + 2]) for m in marks}
        queries = np.nonzero(tokens == QUERY)[0]
        assert len(queries) == needles and queries.min() > marks.max()
        assert sorted(int(tokens[q + 1]) for q in queries) == sorted(binding)
        answers = np.nonzero(labels != IGNORE_INDEX)[0]
        assert answers.tolist() == sorted((queries + 2).tolist())
        assert all(labels[a] == binding[int(tokens[a - 1])] for a in answers)
        hay = np.ones(length, bool)
        hay[[0, length - 1]] = False
        for m in (*marks, *queries):
            hay[m:m + 3] = False
        assert (tokens[hay] >= V.word0).all()


def test_eval_sets_are_fixed_and_too_short_lengths_raise():
    a = eval_set(TASKS, "mqar", 64, 3)
    b = eval_set(TASKS, "mqar", 64, 3)
    assert (a["input_ids"] == b["input_ids"]).all()
    shorter, longer = eval_set(TASKS, "needle", 64, 3)["input_ids"], eval_set(TASKS, "needle", 65, 3)["input_ids"]
    assert not (shorter == longer[:, :64]).all()
    with pytest.raises(ValueError, match="too short"):
        TASKS.example("mqar", np.random.default_rng(0), 30)
    with pytest.raises(ValueError, match="unknown recall task 'bogus'; choose from"):
        eval_set(TASKS, "bogus", 64, 3)
    for count in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="count must be an int >= 1"):
            eval_set(TASKS, "mqar", 64, count)


def test_evaluate_leaves_the_model_in_its_mode_when_it_raises():
    import torch

    from hybridlm.eval.recall import evaluate

    model = torch.nn.Linear(2, 2).train()
    with pytest.raises(ValueError, match="unknown recall task"):
        evaluate(model, TASKS, ["bogus"], [64], count=2, device="cpu")
    assert model.training


@pytest.mark.parametrize("task", ["mqar", "needle", "multi_needle"])
def test_validation_and_test_sequences_differ(task):
    """The best checkpoint is picked on a validation stream that shares no sequence with the reported test set."""
    test = eval_set(TASKS, task, 128, 32)["input_ids"]
    val = eval_set(TASKS, task, 128, 32, split="val")["input_ids"]
    assert not (test[:, None, :] == val[None, :, :]).all(-1).any()
    with pytest.raises(ValueError, match="unknown split"):
        eval_set(TASKS, task, 128, 2, split="train")


def test_training_batches_pad_after_the_example_to_one_shape():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    plain = TASKS.batch("mqar", rng_a, 4, 100)
    padded = TASKS.batch("mqar", rng_b, 4, 100, pad_to=160)
    assert padded["input_ids"].shape == (4, 160)
    assert (padded["input_ids"][:, :100] == plain["input_ids"]).all()
    assert (padded["labels"][:, :100] == plain["labels"]).all()
    assert (padded["input_ids"][:, 100:] == 0).all() and (padded["labels"][:, 100:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("length,pairs", [(9, 2), (32, 7), (33, 8), (300, 8)])
def test_short_curriculum_sequences_hold_as_many_mqar_pairs_as_fit(length, pairs):
    tasks = TASKS.for_length(length)
    assert tasks.mqar_pairs == pairs and tasks.needles == TASKS.needles
    tokens, labels = tasks.example("mqar", np.random.default_rng(length), length)
    assert (labels != IGNORE_INDEX).sum() == pairs and len(tokens) == length
    assert TASKS.for_length(10_000) is TASKS
