"""Teacher-forced scoring on hand-made logits: hits, counts, exact rows, NLL."""

from __future__ import annotations

import math

import pytest
import torch

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
