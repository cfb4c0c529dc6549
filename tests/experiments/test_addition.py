"""The variable-digit addition task: sequence format, reversed sums, widths, the train / held-out split, and the
evaluator on models whose predictions are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridlm.eval.scoring import IGNORE_INDEX
from hybridlm.experiments import addition as A


def _number(digits: np.ndarray) -> int:
    return int("".join(map(str, digits.tolist())))


def test_sequence_format_and_labels():
    a = np.array([[0, 9, 5]], dtype=np.uint8)
    b = np.array([[7, 1, 7]], dtype=np.uint8)
    tokens = A.sequences(a, b)
    assert A.decode(tokens[0]) == "<bos>095+717=2180<eos>"  # 95 + 717 = 0812, reversed
    assert tokens.shape == (1, 3 * 3 + 5)
    train = A.target_labels(tokens, include_eos=True)[0]
    scored = train != IGNORE_INDEX
    assert A.decode(tokens[0][scored]) == "2180<eos>"  # the target suffix only
    digits = A.target_labels(tokens, include_eos=False)[0]
    assert A.decode(tokens[0][digits != IGNORE_INDEX]) == "2180"
    assert A.encode("<bos>095+717=2180<eos>") == tokens[0].tolist()


@pytest.mark.parametrize("width", [1, 2, 7, 19, 48])
def test_reversed_sum_matches_integer_addition(width):
    rng = np.random.default_rng(width)
    a, b = A.sample_digits(rng, width, 200)
    out = A.reversed_sum(a, b)
    assert out.shape == (200, width + 1)
    for x, y, s in zip(a, b, out):
        expected = str(_number(x) + _number(y)).zfill(width + 1)[::-1]
        assert "".join(map(str, s.tolist())) == expected
    # carries happen, and the final carry digit is 1 for some pairs (so the test sees both cases)
    assert 0 < (out[:, -1] == 1).sum() < 200


def test_train_batch_widths_padding_and_targets():
    rng = np.random.default_rng(0)
    counts = np.zeros(33, dtype=int)
    for _ in range(20):
        batch = A.train_batch(rng, 128)
        ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
        assert ids.shape == labels.shape == (128, 3 * 32 + 5)  # one shape for every batch
        for row, lab in zip(ids, labels):
            length = int((row != A.PAD).sum())
            width = (length - 5) // 3
            assert 1 <= width <= 32 and length == 3 * width + 5
            assert (row[length:] == A.PAD).all() and (lab[length:] == IGNORE_INDEX).all()
            text = A.decode(row[:length])
            left, right = text[len("<bos>"):].split("=")
            x, y = left.split("+")
            assert len(x) == len(y) == width
            assert right == str(int(x) + int(y)).zfill(width + 1)[::-1] + "<eos>"
            assert A.decode(lab[lab != IGNORE_INDEX]) == right
            counts[width] += 1
    assert counts[0] == 0 and (counts[1:] > 0).all()
    expected = counts.sum() / 32
    assert np.abs(counts[1:] - expected).max() < 0.5 * expected  # uniform over 1..32 (2560 draws)


def test_train_and_held_out_pairs_never_overlap():
    # width 1 and 2: the held-out set is enumerated; training draws land only in its complement
    for width in (1, 2):
        held_a, held_b = A._held_out_set(width)
        held = {(_number(x), _number(y)) for x, y in zip(held_a, held_b)}
        assert 0 < len(held) < (10**width) ** 2 / 8
        rng = np.random.default_rng(width)
        a, b = A.sample_train_pairs(rng, width, 20000)
        train = {(_number(x), _number(y)) for x, y in zip(a, b)}
        assert not train & held
        if width == 1:
            assert len(train) + len(held) == 100  # every training-side pair is drawn
        ea, eb = A.sample_eval_pairs(width, 10**6, seed=3)
        assert {(_number(x), _number(y)) for x, y in zip(ea, eb)} == held  # all of them, each once
    # a larger width: evaluation pairs are held out and distinct, training draws never are
    ea, eb = A.sample_eval_pairs(9, 300, seed=1)
    assert A.is_held_out(ea, eb).all() and len({x.tobytes() + y.tobytes() for x, y in zip(ea, eb)}) == 300
    rng = np.random.default_rng(1)
    a, b = A.sample_train_pairs(rng, 9, 5000)
    assert not A.is_held_out(a, b).any()
    # the partition keeps about 1/16 of every width, and the width is part of the key ("05" != "5")
    a, b = A.sample_digits(np.random.default_rng(2), 6, 64000)
    assert abs(A.is_held_out(a, b).mean() - 1 / 16) < 0.005
    zero_padded = A.pair_hash(np.array([[0, 5]], np.uint8), np.array([[0, 7]], np.uint8))
    plain = A.pair_hash(np.array([[5]], np.uint8), np.array([[7]], np.uint8))
    assert zero_padded[0] != plain[0]


def test_eval_sets_are_fixed_and_summarized_like_table_3():
    first = A.eval_sets([3, 40], 8)
    again = A.eval_sets([3, 40], 8)
    assert all((x.input_ids == y.input_ids).all() for x, y in zip(first, again))
    per_width = {w: {"token_acc": w / 100, "exact_match": 0.5} for w in range(1, 49)}
    s = A.summarize(per_width)
    assert s["val_acc"] == pytest.approx(np.mean(np.arange(1, 33) / 100))
    assert s["ood_mean"] == pytest.approx(np.mean(np.arange(33, 49) / 100))
    assert s["acc_at_33"] == 0.33 and s["acc_at_48"] == 0.48 and s["val_exact"] == 0.5


def test_solved_width_is_the_widest_prefix_of_widths_at_99_percent():
    def runs(accs):
        return {str(w): {"token_acc": a, "exact_match": 0.0} for w, a in enumerate(accs, start=1)}

    assert A.solved_width(runs([1.0, 1.0, 0.995, 0.98, 1.0])) == 3  # width 5 at 100% does not count past 4
    assert A.solved_width(runs([0.5, 1.0])) == 0
    assert A.solved_width(runs([1.0] * 48)) == 48
    assert A.solved_width(runs([1.0, 0.9]), threshold=0.8) == 2
    recipe = A.AdditionRecipe(size="tiny")
    results = [{"seed": s, "parameters": 1, "best_step": 1, "summary": {"val_acc": 1.0},
                "per_width": runs([1.0] * n + [0.5] * (48 - n))} for s, n in ((0, 32), (1, 19), (2, 0))]
    assert A.aggregate(results, recipe)["solved_width"] == [32, 19, 0]  # per seed, in seed order


def test_end_digits_solved_counts_from_each_end_of_the_sum():
    assert A.end_digits_solved([1.0, 0.995, 0.5, 1.0]) == (2, 1)  # the most significant digit counts apart
    assert A.end_digits_solved([0.2, 1.0, 0.3, 1.0, 1.0]) == (0, 2)  # digit 2 at 100% is in neither run
    assert A.end_digits_solved([1.0] * 5) == (5, 0)  # every digit in the low run, none counted twice
    assert A.end_digits_solved([0.5] * 3) == (0, 0)
    assert A.end_digits_solved([1.0, 0.9], threshold=0.8) == (2, 0)


def _run_with_digits(seed: int, known: dict[int, tuple[int, int]] | None) -> dict:
    """A run whose widths in `known` are right on their lowest low and highest high sum digits and at 10% on the
    rest, every other width right everywhere (no per-digit scores if None)."""
    per_width = {}
    for w in range(1, 49):
        entry = {"token_acc": 0.5, "exact_match": 0.0}
        if known is not None:
            low, high = known.get(w, (w + 1, 0))
            entry["digit_acc"] = [1.0] * low + [0.1] * (w + 1 - low - high) + [1.0] * high
        per_width[str(w)] = entry
    summary = {k: 0.5 for k in ("val_acc", "ood_mean", "acc_at_33", "acc_at_48", "val_exact", "ood_exact")}
    return {"seed": seed, "parameters": 10, "best_step": 2, "summary": summary, "per_width": per_width}


def test_report_gives_per_digit_columns_and_figure_for_runs_that_have_them(tmp_path):
    recipe = A.AdditionRecipe(size="tiny")
    assert A.digit_widths(recipe) == (32, 33, 48)
    new = [_run_with_digits(0, {32: (4, 15), 33: (4, 15), 48: (1, 0)}),
           _run_with_digits(1, {33: (20, 2), 48: (3, 0)})]
    by_model = {"fw-3A": new, "fw-1A": [_run_with_digits(0, None), _run_with_digits(1, {48: (40, 2)})],
                "mamba2": [_run_with_digits(0, None)]}
    report = A.write_report(by_model, recipe, tmp_path)
    stats = report["aggregate"]
    assert stats["mamba2"]["digit_acc"] is None  # its only run predates per-digit scoring
    assert stats["fw-1A"]["digit_acc"]["runs"] == 1  # one run of two predates it: the means are over the other alone
    older = stats["fw-1A"]["digit_acc"]["widths"]
    assert older[48]["end_solved"] == [None, (40, 2)]
    assert [a["mean"] for a in older[48]["acc"][39:42]] == pytest.approx([1.0, 0.1, 0.1])
    digits = stats["fw-3A"]["digit_acc"]["widths"]
    assert digits[48]["end_solved"] == [(1, 0), (3, 0)]
    assert [a["mean"] for a in digits[33]["acc"][3:5]] == pytest.approx([1.0, 0.55])
    assert [a["mean"] for a in digits[33]["acc"][18:22]] == pytest.approx([0.55, 1.0, 0.55, 0.55])
    md = (tmp_path / "results.md").read_text()
    cells = "4+15 / 4+15 / 1+0; 33+0 / 20+2 / 3+0"
    assert next(line for line in md.splitlines() if "`fw-3A`" in line and cells in line).endswith(f"| {cells} |")
    exact_row = {m: next(line for line in md.splitlines() if f"`{m}`" in line and line.count("|") == 6)
                 for m in ("fw-1A", "mamba2")}
    assert exact_row["fw-1A"].endswith("| –; 33+0 / 34+0 / 40+2 |")
    assert exact_row["mamba2"].endswith("| – |")
    assert "Sum digits ≥ 99%, least + most significant end, at n=32 / 33 / 48, per seed" in md
    for png in ("accuracy_by_digit.png", "digit_map.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"`{png}`" in md
        assert str(tmp_path / png) in report["files"]
    # a report of runs without per-digit scores leaves no figure of the earlier runs beside it
    report = A.write_report({"mamba2": [_run_with_digits(0, None)]}, recipe, tmp_path)
    for png in ("accuracy_by_digit.png", "digit_map.png"):
        assert not (tmp_path / png).exists() and str(tmp_path / png) not in report["files"]
        assert png not in (tmp_path / "results.md").read_text()  # nor names one


def test_digit_map_averages_the_scored_runs_by_width_and_digit():
    recipe = A.AdditionRecipe(size="tiny")
    runs = [_run_with_digits(0, {33: (20, 2)}), _run_with_digits(1, {33: (4, 15), 5: (1, 1)}),
            _run_with_digits(2, None)]
    grid, scored = A.digit_map(runs, recipe)
    assert scored == 2 and grid.shape == (48, 49)
    assert np.isnan(grid[4, 6:]).all() and not np.isnan(grid[4, :6]).any()  # width 5 has 6 sum digits
    assert grid[4, :6].tolist() == pytest.approx([1.0, 0.55, 0.55, 0.55, 0.55, 1.0])
    assert grid[32, :34].tolist() == pytest.approx(
        [1.0] * 4 + [0.55] * 15 + [1.0] + [0.55] * 12 + [1.0] * 2)
    assert A.digit_map(runs[2:], recipe) is None


# A two-step recipe: a check that went missing fails the test in seconds, not after a full default training.
_FAST = dict(steps=2, warmup=1, batch_size=2, curriculum_steps=0, eval_per_width=1, val_per_width=1, eval_every=1)


@pytest.mark.parametrize("changes, message", [
    (dict(steps=100, curriculum_steps=100), "curriculum"),
    (dict(eval_per_width=0), "--eval-per-width must be >= 1"),
    (dict(val_per_width=0), "--val-per-width must be >= 1"),
    (dict(batch_size=0), "--batch-size must be >= 1"),
    (dict(size="bogus"), "unknown size 'bogus'"),
    (dict(train_max_width=48), r"--train-max-width \(48\) < --eval-max-width \(48\)"),
    (dict(_FAST, lr=-1.0), "--lr must be a finite number > 0"),
    (dict(_FAST, weight_decay=-0.1), "--weight-decay must be a finite number >= 0"),
    (dict(_FAST, warmup=2), r"--warmup must be >= 0 and below --steps \(2\)"),
    (dict(_FAST, min_lr_ratio=2.0), r"--min-lr-ratio must be in \[0, 1\]"),
    (dict(_FAST, grad_clip=float("nan")), "--grad-clip must be a finite number >= 0"),
    (dict(_FAST, curriculum_steps=-1), "--curriculum-steps must be >= 0"),
    (dict(_FAST, pack_length=-1), "--pack-length must be >= 0"),
    (dict(_FAST, pack_length=100), r"--pack-length 100 cannot hold a 32-digit example \(101 tokens\)"),
])
def test_recipes_that_cannot_run_are_refused_before_training(changes, message, tmp_path):
    recipe = A.AdditionRecipe(**{"size": "tiny", **changes})
    with pytest.raises(ValueError, match=message):
        A.run_addition("transformer", 0, recipe)
    with pytest.raises(ValueError, match=message):  # the benchmark: before any run starts
        A.bench_addition(["transformer"], [0], recipe, tmp_path)
    assert not (tmp_path / "runs").exists()


def test_width_curriculum_grows_the_cap_then_stays_at_the_maximum():
    assert [A.AdditionRecipe(curriculum_steps=0).max_width_at(s) for s in (0, 10, 10_000)] == [32, 32, 32]  # off
    recipe = A.AdditionRecipe(curriculum_steps=100, curriculum_start=4)
    caps = [recipe.max_width_at(s) for s in range(0, 120)]
    assert caps[0] == 4 and caps[50] == 4 + 28 * 50 // 100 and caps[99] == 31 and caps[100:] == [32] * 20
    assert all(a <= b for a, b in zip(caps, caps[1:]))
    batch = A.train_batch(np.random.default_rng(0), 64, max_width=recipe.max_width_at(0), pad_width=32)
    assert batch["input_ids"].shape == (64, 3 * 32 + 5)  # the shape of a full-width batch
    assert int((batch["input_ids"] != A.PAD).sum(1).max()) <= 3 * 4 + 5  # widths still capped at 4


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


def test_run_addition_trains_the_model_it_is_given():
    """`model=`: the run trains that very model (its weights move, its parameter count is reported) under the label
    given, instead of building a fresh one."""
    from hybridlm.experiments import models

    model = models.build_model(models.task_config("transformer", vocab_size=A.MODEL_VOCAB_SIZE, size="tiny",
                                                  num_hidden_layers=1), seed=5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    recipe = A.AdditionRecipe(size="tiny", steps=2, warmup=0, batch_size=4, train_max_width=2, eval_max_width=3,
                              eval_per_width=2, val_per_width=2, eval_every=1, curriculum_steps=0)
    result = A.run_addition("transformer-carried", 0, recipe, model=model)
    assert result["model"] == "transformer-carried"
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert set(result["per_width"]) == {"1", "2", "3"}
