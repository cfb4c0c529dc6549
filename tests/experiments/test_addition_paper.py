"""The paper's protocol of the addition bench (`--protocol paper`): its sampler, its loss mask, its columns, its
model names and sizes, its spec beside the curriculum protocol's, and the paper's numbers in the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridlm.cli import main
from hybridlm.eval.scoring import IGNORE_INDEX
from hybridlm.experiments import addition as A
from hybridlm.experiments.models import build_model, describe, model_fields, task_config

RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "addition_runs"


def test_paper_sampler_draws_widths_uniformly_in_1_to_32_from_the_first_update():
    recipe = A.PaperAdditionRecipe(batch_size=4096)
    assert recipe.max_width_at(0) == 32
    batch = recipe.batch(np.random.default_rng(0), 0)  # update 0
    lengths = (batch["input_ids"] != A.PAD).sum(1).numpy()
    widths = (lengths - 5) // 3
    assert ((3 * widths + 5) == lengths).all() and widths.min() == 1 and widths.max() == 32
    counts = np.bincount(widths, minlength=33)[1:]
    chi2 = ((counts - 4096 / 32) ** 2 / (4096 / 32)).sum()
    assert chi2 < 62.0  # the 0.999 quantile of chi-square with 31 degrees of freedom


def test_paper_loss_scores_the_target_suffix_only():
    """A hand-built row, <bos>095+717=2180<eos>: the labels keep "2180<eos>" only, and the model's loss is the
    cross-entropy of exactly those tokens, each predicted from the position before it."""
    tokens = A.sequences(np.array([[0, 9, 5]], np.uint8), np.array([[7, 1, 7]], np.uint8))
    labels = A.target_labels(tokens, include_eos=True)
    expected = np.full_like(tokens, IGNORE_INDEX)
    expected[0, 9:] = A.encode("2180<eos>")  # positions 9..13 of the 14 tokens
    assert A.decode(tokens[0]) == "<bos>095+717=2180<eos>" and (labels == expected).all()
    model = build_model(task_config("fw-1A.3", vocab_size=A.MODEL_VOCAB_SIZE, size="tiny"), seed=0)
    ids, lab = torch.from_numpy(tokens), torch.from_numpy(labels)
    loss = model(ids, labels=lab).loss
    logits = model(ids).logits[0]
    by_hand = torch.nn.functional.cross_entropy(logits[8:13], ids[0, 9:14])  # logits at t predict token t + 1
    torch.testing.assert_close(loss, by_hand)


def test_paper_columns_on_a_hand_built_prediction_set():
    """Val. acc = mean token accuracy over widths 1..32, Mean = over 33..48, Acc@d33 / Acc@d48 the two widths."""
    per_width = {w: {"token_acc": 1.0 if w <= 16 else 0.5, "exact_match": 0.0} for w in range(1, 33)}
    per_width |= {w: {"token_acc": (w - 32) / 16, "exact_match": 0.0} for w in range(33, 49)}
    s = A.summarize(per_width)
    assert s["val_acc"] == pytest.approx(0.75)
    assert s["ood_mean"] == pytest.approx(np.mean([(w - 32) / 16 for w in range(33, 49)]))
    assert (s["acc_at_33"], s["acc_at_48"]) == (1 / 16, 1.0)


def test_paper_model_names_map_to_the_papers_definitions():
    l2, rms = dict(fw_qk_norm="l2"), dict(fw_qk_norm="rms")
    common = dict(ssm_mixer="fast_weight", fw_pairing="shifted", fw_ridge_scaling=True, fw_gates="context")
    expected = {"fw-1A.1": dict(common, fw_rule="1A", fw_step_size="nlms", **l2),
                "fw-1A.2": dict(common, fw_rule="1A", fw_step_size="direct", **l2),
                "fw-1A.3": dict(common, fw_rule="1A", fw_step_size="direct", **rms),
                "fw-3A.3": dict(common, fw_rule="3A", fw_window=4, fw_step_size="direct", **rms),
                "retnet": dict(fw_rule="1A", fw_pairing="same_step", fw_step_size="direct", fw_gates="fixed",
                               fw_qk_norm="none")}
    for name, fields in expected.items():
        got = model_fields(name)
        assert {k: got[k] for k in fields} == fields and got["use_attention"] is False
    assert describe("fw-1A.3") == "Falcon-1A.3 (QK-RMSNorm, ctx-eta / ctx-lambda)"
    assert model_fields("hybrid-fw-3A.3")["use_attention"] is True
    config = task_config("fw-1A.3", vocab_size=16, size="lm130m", **A.PaperAdditionRecipe().model_overrides())
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.mamba_d_ssm) == (
        768, 12, 2048, 768)
    assert config.tie_word_embeddings


def test_retnet_has_fixed_gates_with_retnets_decays():
    model = build_model(task_config("retnet", vocab_size=16, size="tiny"), seed=0)
    mixer = model.model.layers[0].ssm
    assert mixer.beta_bias is None and mixer.lam_bias is None and mixer.beta_width == mixer.lam_width == 0
    beta, lam = mixer._gains(torch.zeros(2, 5, 0), torch.zeros(2, 5, 0))
    assert beta.shape == lam.shape == (2, 5, mixer.num_heads) and (beta == 1).all()
    decays = 1 - beta * lam  # gamma = 1 - eta lam with eta = beta (step_size "direct")
    assert decays[0, 0].tolist() == pytest.approx([1 - 2.0 ** (-5 - h) for h in range(mixer.num_heads)])


def test_protocols_name_themselves_and_the_curriculum_spec_is_unchanged():
    paper, curriculum = A.PaperAdditionRecipe(), A.AdditionRecipe()
    assert paper.to_dict()["protocol"] == "paper" and "protocol" not in curriculum.to_dict()
    assert A.recipe_from_dict(paper.to_dict()) == paper and A.recipe_from_dict(curriculum.to_dict()) == curriculum
    stored = json.loads((RECORDED / "fw-1A_seed0.json").read_text())["spec"]["recipe"]
    assert stored.keys() == curriculum.to_dict().keys()  # the recorded runs stay this protocol's, reusable
    assert (paper.size, paper.curriculum_steps, paper.eval_every, paper.steps) == ("lm130m", 0, 100, 3000)
    assert paper.steps > max(row["best_step"] for row in A.PAPER_TABLE3.values())
    with pytest.raises(ValueError, match="--protocol paper samples widths uniformly"):
        A.check_recipe(A.PaperAdditionRecipe(curriculum_steps=10))


def test_bench_addition_paper_protocol_smoke(tmp_path):
    out = tmp_path / "paper"
    args = ["bench", "addition", "--protocol", "paper", "--models", "fw-1A.3,hybrid-fw-1A", "--seeds", "1",
            "--size", "tiny", "--steps", "2", "--batch-size", "2", "--eval-per-width", "1", "--val-per-width", "1",
            "--eval-every", "1", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    run = json.loads((out / "runs" / "fw-1A.3_seed0.json").read_text())
    assert run["result"]["protocol"] == "paper" and run["spec"]["recipe"]["protocol"] == "paper"
    assert json.loads((out / "results.json").read_text())["protocol"] == "paper"
    md = (out / "results.md").read_text()
    row = next(line for line in md.splitlines() if "`fw-1A.3`" in line and "Rank" not in line)
    assert "(paper 1900)" in row and "(paper 99.8)" in row and "(paper 85.9)" in row
    assert "(paper 100.0) / " in row and "(paper 69.0)" in row and row.endswith("| 1 / 1 |")
    hybrid = next(line for line in md.splitlines() if "`hybrid-fw-1A`" in line and "Rank" not in line)
    assert "paper" not in hybrid and hybrid.endswith("| – |")  # no Table 3 row for it


def _packed_examples(batch):
    """(row, start, tokens, labels) of every example of a packed batch, found from its position restarts."""
    found = []
    for row, (ids, labels, positions) in enumerate(zip(batch["input_ids"], batch["labels"], batch["position_ids"])):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for start, stop in zip(starts[:-1], starts[1:]):
            found.append((row, start, ids[start:stop].tolist(), labels[start:stop].tolist()))
    return found


def test_packed_batch_holds_whole_correct_examples_with_restarted_positions():
    """Rows of 1024 tokens: every segment between position restarts is one example "<bos>a+b=sum<eos>" with the right
    reversed sum and labels on the sum and <eos> only, or the row's <pad> tail (shorter than the next example would
    need); widths cover 1..32; the same generator state gives the same batch."""
    batch = A.packed_train_batch(np.random.default_rng(3), 64, 1024)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (64, 1024) for k in batch}
    widths, examples = [], _packed_examples(batch)
    for i, (row, _, ids, labels) in enumerate(examples):
        if ids[0] == A.PAD:  # a row's tail: too short for the example that opens the next row (greedy filling)
            assert set(ids) == {A.PAD} and set(labels) == {IGNORE_INDEX}
            assert i + 1 == len(examples) or (examples[i + 1][0] == row + 1 and len(examples[i + 1][2]) > len(ids))
            continue
        text = A.decode(ids)
        a, rest = text.removeprefix("<bos>").split("+")
        b, total = rest.split("=")
        assert total.endswith("<eos>") and len(a) == len(b)
        assert total.removesuffix("<eos>")[::-1] == str(int(a) + int(b)).zfill(len(a) + 1)
        first = 2 * len(a) + 3
        assert labels[:first] == [IGNORE_INDEX] * first and labels[first:] == ids[first:]
        widths.append(len(a))
    assert set(widths) == set(range(1, 33)) and len(widths) > 64 * 1024 / 60
    exact = A.packed_train_batch(np.random.default_rng(0), 2, 16, min_width=1, max_width=1)  # 8-token examples
    assert exact["position_ids"].tolist() == [list(range(8)) * 2] * 2 and (exact["input_ids"] != A.PAD).all()
    again = A.packed_train_batch(np.random.default_rng(3), 64, 1024)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    with pytest.raises(ValueError, match="--pack-length >= 101"):
        A.packed_train_batch(np.random.default_rng(0), 2, 100)


@pytest.mark.parametrize("name", ["transformer", "fw-1A.3", "mamba2"])
def test_packed_batch_loss_is_the_loss_of_the_examples_run_one_by_one(name):
    """Nothing crosses from one packed example to the next: the model's loss on packed rows equals the mean token
    loss of the same examples run one at a time (float64, tiny model)."""
    torch.manual_seed(0)
    model = build_model(task_config(name, vocab_size=A.MODEL_VOCAB_SIZE, size="tiny"), seed=0).double().eval()
    batch = A.packed_train_batch(np.random.default_rng(1), 2, 120, max_width=8)
    packed = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"]).loss
    total, count = 0.0, 0
    for _, _, ids, labels in _packed_examples(batch):
        if ids[0] == A.PAD:
            continue
        logits = model(torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        total = total + torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((targets != IGNORE_INDEX).sum())
    torch.testing.assert_close(packed, total / count, rtol=1e-10, atol=1e-10)


def test_packing_is_a_recipe_option_that_old_specs_do_not_carry():
    recipe = A.PaperAdditionRecipe(pack_length=1024, batch_size=3)
    assert recipe.to_dict()["pack_length"] == 1024 and A.recipe_from_dict(recipe.to_dict()) == recipe
    assert "pack_length" not in A.PaperAdditionRecipe().to_dict()  # the recorded paper runs' specs stay equal
    stored = json.loads((RECORDED / "paper" / "transformer_seed0.json").read_text())["spec"]["recipe"]
    assert A.recipe_from_dict(stored).pack_length == 0 and stored == A.recipe_from_dict(stored).to_dict()
    batch = recipe.batch(np.random.default_rng(0), 0)
    assert batch["input_ids"].shape == (3, 1024) and "position_ids" in batch
