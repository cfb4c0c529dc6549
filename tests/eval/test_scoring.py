"""Teacher-forced scoring on hand-made logits: hits, counts, exact rows, NLL; the addition evaluator on a
model whose predictions are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridlm.eval import addition as A
from hybridlm.eval import scoring

X = -100


def _one_hot_logits(predictions: list[list[int]], vocab: int = 5, high: float = 3.0) -> torch.Tensor:
    logits = torch.zeros(len(predictions), len(predictions[0]), vocab)
    for b, row in enumerate(predictions):
        for t, token in enumerate(row):
            logits[b, t, token] = high
    return logits


def test_hits_counts_exact_and_nll_on_a_hand_made_case():
    # position t predicts labels[t + 1]; row 0 gets both targets right, row 1 one of three
    labels = torch.tensor([[X, X, 3, 4, X], [X, 1, 2, 2, X]])
    predictions = [[0, 3, 4, 0, 0], [1, 1, 0, 2, 0]]
    scores = scoring.target_scores(_one_hot_logits(predictions), labels)
    assert scores["hits"].tolist() == [2, 1]
    assert scores["count"].tolist() == [2, 3]
    right = math.log(1 + 4 * math.exp(-3))  # CE of a target that got the 3-logit (the others 0)
    wrong = math.log(math.exp(3) + 4)
    assert scores["nll"][0].item() == pytest.approx(2 * right, rel=1e-5)
    assert scores["nll"][1].item() == pytest.approx(right + 2 * wrong, rel=1e-5)
    result = scoring.finish(scoring.accumulate(None, scores))
    assert result["token_acc"] == pytest.approx(3 / 5)
    assert result["exact_match"] == pytest.approx(1 / 2)
    assert result["targets"] == 5 and result["examples"] == 2


class _Oracle(torch.nn.Module):
    """Predicts the true next token, except a given wrong digit at one target position of width-3 rows."""

    def __init__(self, sets, wrong_at: int | None):
        super().__init__()
        self.known = {tuple(r.tolist()): r for s in sets for r in s.input_ids}
        self.wrong_at = wrong_at
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, A.MODEL_VOCAB_SIZE)
        nxt = torch.roll(ids, -1, dims=1)
        logits.scatter_(2, nxt[..., None], 10.0)
        width = (ids.shape[1] - 5) // 3
        if self.wrong_at is not None and width == 3:
            t = 2 * width + 3 + self.wrong_at - 1  # the position that predicts sum digit `wrong_at`
            logits[:, t] = 0
            logits[:, t, A.PLUS] = 10.0
        return type("Out", (), {"logits": logits})()


def test_addition_evaluate_counts_digits_only():
    sets = A.eval_sets([2, 3], 16)
    perfect = A.evaluate(_Oracle(sets, None), sets, device="cpu", batch_size=5)
    assert perfect[2]["token_acc"] == 1.0 and perfect[3]["exact_match"] == 1.0
    assert perfect[3]["targets"] == 16 * 4  # n + 1 digits per example, <eos> not counted
    flawed = A.evaluate(_Oracle(sets, 1), sets, device="cpu", batch_size=5)
    assert flawed[2]["token_acc"] == 1.0
    assert flawed[3]["token_acc"] == pytest.approx(3 / 4)  # one of four digits wrong in every row
    assert flawed[3]["exact_match"] == 0.0
    # per digit, in emission order: only sum digit 1 (the second emitted) is wrong, at every width-3 row
    assert flawed[3]["digit_acc"] == [1.0, 0.0, 1.0, 1.0] and flawed[2]["digit_acc"] == [1.0] * 3
    assert perfect[3]["digit_acc"] == [1.0] * 4
    assert np.isfinite(flawed[3]["loss"]) and flawed[3]["loss"] > perfect[3]["loss"]


class _Guesser(torch.nn.Module):
    """Right on the first `known` sum digits of every row, a fixed digit on the rest (right ~1 time in 10)."""

    def __init__(self, known: int):
        super().__init__()
        self.known = known
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, A.MODEL_VOCAB_SIZE)
        logits.scatter_(2, torch.roll(ids, -1, dims=1)[..., None], 10.0)
        width = (ids.shape[1] - 5) // 3
        first = 2 * width + 3
        logits[:, first - 1 + self.known:first + width] = 0
        logits[:, first - 1 + self.known:first + width, A.DIGIT0 + 7] = 10.0
        return type("Out", (), {"logits": logits})()


def test_addition_digit_accuracy_averages_to_token_accuracy_and_shows_the_known_prefix():
    sets = A.eval_sets([5, 12], 64)
    result = A.evaluate(_Guesser(known=4), sets, device="cpu", batch_size=24)
    for s in sets:
        r, digits = result[s.width], s.input_ids[:, 2 * s.width + 3:3 * s.width + 4] - A.DIGIT0  # [N, n + 1]
        assert len(r["digit_acc"]) == s.width + 1
        assert np.mean(r["digit_acc"]) == pytest.approx(r["token_acc"], abs=1e-12)  # every digit has N targets
        assert r["digit_acc"][:4] == [1.0] * 4
        assert r["digit_acc"][4:] == pytest.approx((digits[:, 4:] == 7).double().mean(0).tolist())
        assert A.end_digits_solved(r["digit_acc"]) == (4, 0)  # the guess 7 is never the carry digit (0 or 1)
