"""The DPO losses against hand-computed ones (float64), and packed SFT rows against per-sequence losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.models.hf import load_model
from hybridlm.training.dpo import PreferenceLoss, reference_log_probs, sequence_log_probs
from hybridlm.training.loop import TokenCrossEntropy
from hybridlm.training.posttraining import ChatRows, Pair, PreferencePairs
from tests.posttraining.helpers import make_model_dir


@pytest.fixture(scope="module", params=["mamba2", "1A"])
def model(request, tmp_path_factory):
    directory = make_model_dir(tmp_path_factory.mktemp(f"dpo-{request.param}"), ssm=request.param)
    return load_model(directory, dtype=torch.float64)


def _alone_log_prob(model, prompt: list[int], response: list[int]) -> tuple[float, int]:
    """log pi(response | prompt), summed over the response's tokens, from one forward of that sequence alone."""
    ids = torch.tensor([prompt + response])
    logp = F.log_softmax(model(ids).logits[0].double(), dim=-1)
    total = sum(float(logp[len(prompt) - 1 + i, t].detach()) for i, t in enumerate(response))
    return total, len(response)


PAIRS = [Pair([5, 6, 7], [8, 9], [10, 11, 12]), Pair([13], [14, 15, 16], [17]), Pair([3, 4], [20], [21, 22])]


@pytest.mark.parametrize("kind", ["sigmoid", "norm"])
def test_dpo_loss_equals_the_hand_computed_one(model, kind):
    source = PreferencePairs(PAIRS, batch_size=3, seed=0, shuffle=False)
    reference = torch.tensor([[-7.5, -9.25], [-11.0, -3.5], [-4.0, -6.0]], dtype=torch.float64)
    source.reference = reference
    beta = 0.7
    loss_fn = PreferenceLoss(beta, kind)
    batch = next(source)
    assert loss_fn.count(batch) == 3
    value = loss_fn(model, batch)

    expected, margins, chosen_rewards = 0.0, [], []
    for pair, (ref_w, ref_l) in zip(PAIRS, reference.tolist()):
        (pw, nw), (pl, nl) = _alone_log_prob(model, pair.prompt, pair.chosen), _alone_log_prob(model, pair.prompt, pair.rejected)
        if kind == "norm":
            pw, ref_w, pl, ref_l = pw / nw, ref_w / nw, pl / nl, ref_l / nl
        z = beta * ((pw - ref_w) - (pl - ref_l))
        expected += math.log1p(math.exp(-z))  # -log sigmoid(z)
        margins.append(z)
        chosen_rewards.append(beta * (pw - ref_w))
    assert value.dtype == torch.float64
    assert abs(float(value) - expected) < 1e-10
    metrics = loss_fn.pop_metrics()
    assert abs(metrics["rewards/margin"] - sum(margins) / 3) < 1e-10
    assert abs(metrics["rewards/chosen"] - sum(chosen_rewards) / 3) < 1e-10
    assert metrics["rewards/accuracy"] == sum(m > 0 for m in margins) / 3
    assert loss_fn.pop_metrics() == {}  # popped


def test_reference_pass_and_frozen_reference_give_zero_rewards_at_the_start(model):
    source = PreferencePairs(PAIRS, batch_size=2, seed=0, shuffle=False)
    table = reference_log_probs(model, source.batch, len(PAIRS), pairs_per_batch=2)
    for i, pair in enumerate(PAIRS):
        assert abs(table[i, 0] - _alone_log_prob(model, pair.prompt, pair.chosen)[0]) < 1e-10
        assert abs(table[i, 1] - _alone_log_prob(model, pair.prompt, pair.rejected)[0]) < 1e-10
    source.reference = table
    batch = next(source)
    precomputed = PreferenceLoss(0.1)(model, batch)
    frozen = PreferenceLoss(0.1, reference_model=model)(model, {k: v for k, v in batch.items() if k != "reference"})
    assert abs(float(precomputed) - 2 * math.log(2)) < 1e-10  # r_w = r_l = 0 for both pairs
    assert abs(float(frozen) - float(precomputed)) < 1e-12


@pytest.mark.parametrize("scored_only,chunked", [(False, True), (True, True), (False, False), (True, False)],
                         ids=["all-chunked", "scored-chunked", "all-logits", "scored-logits"])
def test_packed_sft_rows_equal_per_sequence_losses(model, scored_only, chunked):
    """The token loss on packed rows (the chunked LM-head loss, or `train.lm_head_loss=logits`'s) against each
    sequence's log-probabilities alone, float64."""
    rng = torch.Generator().manual_seed(0)
    samples = []
    for n in (5, 9, 3, 12, 7, 4, 10):
        ids = torch.randint(3, 60, (n,), generator=rng).tolist()
        samples.append((ids, [0] * 2 + [1] * (n - 2)))
    rows = ChatRows(samples, batch_size=2, seq_len=20, seed=0, pad_id=0, shuffle=False)
    batch = next(rows)
    loss = TokenCrossEntropy(scored_only=scored_only, chunked=chunked)
    packed = {"input_ids": batch["input_ids"].reshape(1, -1), "position_ids": batch["position_ids"].reshape(1, -1),
              "cu_seqlens": batch["cu_seqlens"], "labels": batch["labels"].reshape(1, -1)}
    total = loss(model, packed)
    used = [i for row in rows.epoch_rows(0)[:2] for i in row]
    expected = 0.0
    for i in used:
        ids, mask = samples[i]
        logp = F.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        expected -= sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])
    assert loss.count(packed) == sum(sum(samples[i][1][1:]) for i in used)
    assert abs(float(total) - expected) < 1e-9


def test_sequence_log_probs_count_only_scored_labels():
    logits = torch.zeros(1, 5, 4, dtype=torch.float64)
    labels = torch.tensor([[1, -100, 2, 3, -100]])
    sums, counts = sequence_log_probs(logits, labels, torch.tensor([0, 2, 5]))
    assert counts.tolist() == [1.0, 2.0]
    assert torch.allclose(sums, torch.tensor([math.log(0.25), 2 * math.log(0.25)], dtype=torch.float64))
