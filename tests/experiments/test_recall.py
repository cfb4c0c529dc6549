"""The recall experiment's recipe: the length curriculum, specs, a model per task, the report."""

from __future__ import annotations

import numpy as np
import pytest


def test_length_curriculum_grows_the_cap_then_stays_at_the_maximum():
    from hybridlm.experiments.recall import RecallRecipe

    assert {RecallRecipe().lengths_at(s) for s in (0, 10, 10_000)} == {(128, 512)}  # off by default
    recipe = RecallRecipe(curriculum_steps=100, curriculum_start_len=32, train_min_len=128, train_max_len=512)
    ranges = [recipe.lengths_at(s) for s in range(0, 130)]
    assert ranges[0] == (32, 32) and ranges[50] == (32, 272) and ranges[99][1] < 512
    assert set(ranges[100:]) == {(128, 512)}
    assert all(a[1] <= b[1] for a, b in zip(ranges, ranges[1:]))


def test_training_batches_follow_the_curriculum():
    """The lengths `training_batch` draws (non-pad tokens per row) stay within the curriculum's range at each step,
    below the cap while it grows and across [train_min_len, train_max_len] after; every batch has one shape."""
    from hybridlm.eval.recall import PAD
    from hybridlm.experiments.recall import RecallRecipe, training_batch

    recipe = RecallRecipe(curriculum_steps=60, curriculum_start_len=32, train_min_len=64, train_max_len=160,
                          batch_size=2, steps=200)
    tasks, rng = recipe.task_params(), np.random.default_rng(0)
    lengths = {}
    for step in range(0, 200, 3):
        batch = training_batch(recipe, tasks, rng, step)
        assert batch["input_ids"].shape == (2, 160)
        lengths[step] = int((batch["input_ids"][0] != PAD).sum())
        shortest, longest = recipe.lengths_at(step)
        assert shortest <= lengths[step] <= longest
    assert max(lengths[s] for s in lengths if s < 10) <= 51 < 64 <= min(lengths[s] for s in lengths if s >= 60)


def test_recipe_specs_without_a_curriculum_leave_its_fields_out():
    """Runs stored with a spec without curriculum fields are reused: the fields stay out of the spec while it is
    off."""
    from hybridlm.experiments.recall import RecallRecipe

    plain = RecallRecipe().to_dict()
    assert "curriculum_steps" not in plain and RecallRecipe.from_dict(plain) == RecallRecipe()
    grown = RecallRecipe(curriculum_steps=300, curriculum_start_len=48)
    assert RecallRecipe.from_dict(grown.to_dict()) == grown


def test_command_line_curriculum_scales_with_the_default_share():
    import argparse

    from hybridlm.experiments.addition import AdditionRecipe
    from hybridlm.experiments.commands import _recipe
    from hybridlm.experiments.recall import RecallRecipe

    args = argparse.Namespace(steps=400, curriculum_steps=None, warmup=None)
    assert _recipe(RecallRecipe, args).curriculum_steps == 0  # recall has none by default
    assert _recipe(AdditionRecipe, args).curriculum_steps == 100  # addition: 2000 of 8000


def test_bench_recall_refuses_a_bad_recipe_before_any_run(tmp_path):
    from hybridlm.experiments.recall import RecallRecipe, bench_recall

    with pytest.raises(ValueError, match="curriculum"):
        bench_recall(["fw-1A"], [0], RecallRecipe(steps=5, curriculum_steps=5), tmp_path / "out", devices=["cpu"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes,message", [
    (dict(curriculum_steps=100, steps=100), "curriculum"),
    (dict(curriculum_steps=100, curriculum_start_len=20), "too short for the tasks"),  # 4 needles (the default) need 26
    (dict(train_min_len=10, curriculum_steps=0), "too short for the tasks"),
    (dict(train_max_len=60, train_min_len=40), "too short for 16 MQAR pairs"),
    (dict(tasks=("mqar", "copy")), "unknown recall task"),
    (dict(tasks=("mqar",), eval_lens=(512, 12)), r"--eval-lens 12 is too short for mqar \(at least 65"),
    (dict(tasks=("multi_needle",), eval_lens=(20,)), r"--eval-lens 20 is too short for multi_needle \(at least 26"),
    (dict(eval_count=0), "--eval-count must be >= 1"),
    (dict(batch_size=0), "--batch-size must be >= 1"),
    (dict(size="bogus"), "unknown size 'bogus'"),
    (dict(lr=0.0), "--lr must be a finite number > 0"),
    (dict(warmup=4000), r"--warmup must be >= 0 and below --steps \(4000\)"),
    (dict(eval_every=-1), "--eval-every must be >= 0"),
    (dict(mqar_pairs=0), "--mqar-pairs must be between 1 and 128"),
    (dict(needles=200), "--needles must be between 1 and 128"),
])
def test_recipes_that_cannot_run_are_refused(changes, message):
    from hybridlm.experiments.recall import RecallRecipe, check_recipe

    recipe = RecallRecipe(**changes)
    with pytest.raises(ValueError, match=message):
        check_recipe(recipe, recipe.task_params())
    check_recipe(RecallRecipe(), RecallRecipe().task_params())  # the default recipe runs


def test_a_model_per_task_unless_mixed():
    from hybridlm.experiments.recall import RecallRecipe

    recipe = RecallRecipe(tasks=("mqar", "needle"))
    assert {t: r.tasks for t, r in recipe.per_task().items()} == {"mqar": ("mqar",), "needle": ("needle",)}
    mixed = RecallRecipe(tasks=("mqar", "needle"), separate_tasks=False)
    assert mixed.per_task() == {"": mixed}
    assert "separate_tasks" not in mixed.to_dict()  # the spec stored runs of tasks trained together have
    for r in (recipe, mixed):
        assert RecallRecipe.from_dict(r.to_dict()) == r
    alone = RecallRecipe(tasks=("mqar",))  # one task trains alone either way: the mixed form's spec and run name
    assert alone.per_task() == {"": RecallRecipe(tasks=("mqar",), separate_tasks=False)}


def _task_run(model, seed, task, acc):
    by_len = {"48": {"token_acc": acc, "exact_match": acc, "loss": 1.0}}
    return {"model": model, "seed": seed, "parameters": 1000, "train": {"steps": 1}, "best_step": 1,
            "results": {task: by_len}}


def test_task_runs_merge_and_a_missing_one_leaves_a_gap(tmp_path):
    from hybridlm.experiments.recall import RecallRecipe, merge_task_runs, write_report

    merged = merge_task_runs([_task_run("fw-1A", 0, "mqar", 1.0), _task_run("fw-1A", 0, "needle", 0.25)])
    assert sorted(merged["results"]) == ["mqar", "needle"] and merged["train"]["needle"] == {"steps": 1}
    assert merged["best_step"] == {"mqar": 1, "needle": 1} and merged["seed"] == 0
    recipe = RecallRecipe(tasks=("mqar", "needle"), eval_lens=(48,))
    seed1 = merge_task_runs([_task_run("fw-1A", 1, "mqar", 0.5)])  # its needle run was stopped
    report = write_report({"fw-1A": [merged, seed1]}, recipe, tmp_path, missing=["fw-1A_needle_seed1"])
    stats = report["aggregate"]["fw-1A"]
    assert stats["runs"] == {"mqar": 2, "needle": 1}
    assert stats["acc"]["mqar"][48]["mean"] == pytest.approx(0.75) and stats["acc"]["needle"][48]["mean"] == 0.25
    md = (tmp_path / "results.md").read_text()
    assert "a model trained per task" in md
    needle = md[md.index("## needle, answer-token accuracy"):]
    assert "| 25.0 | 1 |" in needle.splitlines()[4]
