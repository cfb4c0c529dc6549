"""CPU smoke runs of `hybridlm bench addition|recall|allocation`: the pipeline, not the accuracy."""

from __future__ import annotations

import json
import math

import pytest

from hybridlm.cli import main

COMMON = ["--steps", "2", "--device", "cpu"]


def _rows(markdown: str, marker: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("| ") and marker in line]


def _png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_addition_smoke_and_resume(tmp_path, capsys):
    out = tmp_path / "addition"
    args = ["bench", "addition", "--models", "fw-1A,fw-3A-same,transformer", "--seeds", "2", "--size", "tiny",
            "--batch-size", "4", "--eval-per-width", "2", "--val-per-width", "1", "--eval-every", "1",
            "--out", str(out), *COMMON]
    assert main(args) == 0
    # the closing line: the report's paths, not a Python list's repr
    assert capsys.readouterr().out.splitlines()[-1] == (f"wrote {out / 'results.md'}, {out / 'results.json'}, "
                                                        f"{out / 'accuracy_vs_width.png'}, "
                                                        f"{out / 'accuracy_by_digit.png'}, {out / 'digit_map.png'}")
    md = (out / "results.md").read_text()
    for name in ("`fw-1A`", "`fw-3A-same`", "`transformer`"):
        assert len(_rows(md, name)) == 3  # Table 3 layout, exact match, per-width
    assert "Acc@d33/d48" in md and "Solved 1..n (token acc. ≥ 99% at every width), per seed" in md
    assert "Sum digits ≥ 99%, least + most significant end, at n=32 / 33 / 48, per seed" in md
    assert all(_png(out / png) for png in ("accuracy_vs_width.png", "accuracy_by_digit.png", "digit_map.png"))
    result = json.loads((out / "results.json").read_text())
    for runs in result["runs"].values():
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert sorted(map(int, r["per_width"])) == list(range(1, 49))
            for v in r["per_width"].values():
                assert 0.0 <= v["token_acc"] <= 1.0 and 0.0 <= v["exact_match"] <= 1.0
                assert math.isclose(sum(v["digit_acc"]) / len(v["digit_acc"]), v["token_acc"], abs_tol=1e-12)
            assert all(0.0 <= r["summary"][k] <= 1.0 for k in ("val_acc", "ood_mean", "acc_at_33", "acc_at_48"))
            assert r["best_step"] in (1, 2)
    assert result["recipe"]["curriculum_steps"] == 0 and result["recipe"]["warmup"] == 1  # scaled to --steps 2
    assert "uniformly from the start" in md
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    capsys.readouterr()
    assert main(args) == 0  # a second run reuses every finished run
    assert "reusing 6 finished run(s)" in capsys.readouterr().out
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}


def test_bench_recall_smoke(tmp_path):
    out = tmp_path / "recall"
    assert main(["bench", "recall", "--models", "hybrid-mamba2,fw-1A", "--seeds", "2", "--size", "tiny",
                 "--batch-size", "2", "--train-min-len", "40", "--train-max-len", "48", "--eval-lens", "48,96",
                 "--eval-count", "2", "--val-count", "1", "--mqar-pairs", "4", "--needles", "2", "--out", str(out),
                 *COMMON]) == 0
    md = (out / "results.md").read_text()
    for task in ("## mqar, answer-token accuracy", "## needle, exact", "## multi_needle, answer-token accuracy"):
        assert task in md
    assert len(_rows(md, "`hybrid-mamba2`")) == 6 and "L=96" in md  # accuracy and exact rate per task
    assert _png(out / "accuracy_vs_length.png")
    result = json.loads((out / "results.json").read_text())
    for runs in result["runs"].values():
        assert [r["seed"] for r in runs] == [0, 1]  # each seed's record joins that seed's task runs
        for run in runs:
            assert sorted(run["results"]) == ["mqar", "multi_needle", "needle"]
            for task, by_len in run["results"].items():
                assert sorted(map(int, by_len)) == [48, 96]
                assert all(0.0 <= v["token_acc"] <= 1.0 for v in by_len.values())
    # a model per task (the default): each run's recipe holds its one task
    specs = {p.stem: json.loads(p.read_text())["spec"] for p in (out / "runs").glob("*.json")}
    assert sorted(specs) == sorted(f"{m}_{t}_seed{seed}" for m in ("hybrid-mamba2", "fw-1A")
                                   for t in ("mqar", "needle", "multi_needle") for seed in (0, 1))
    assert all(spec["seed"] == int(key[-1]) for key, spec in specs.items())
    assert all(spec["recipe"]["tasks"] == [key.split("_seed")[0].split("_", 1)[1]] for key, spec in specs.items())


def test_bench_recall_mixed_tasks_trains_one_model_on_every_task(tmp_path):
    out = tmp_path / "recall"
    assert main(["bench", "recall", "--mixed-tasks", "--models", "fw-1A", "--tasks", "mqar,needle", "--size", "tiny",
                 "--batch-size", "2", "--train-min-len", "40", "--train-max-len", "48", "--eval-lens", "48",
                 "--eval-count", "2", "--val-count", "1", "--mqar-pairs", "4", "--out", str(out), *COMMON]) == 0
    runs = sorted((out / "runs").glob("*.json"))
    assert [p.stem for p in runs] == ["fw-1A_seed0"]
    spec = json.loads(runs[0].read_text())["spec"]
    assert spec["recipe"]["tasks"] == ["mqar", "needle"] and "separate_tasks" not in spec["recipe"]
    assert "round robin" in (out / "results.md").read_text()


SMALL_ALLOCATION = ["--hidden-size", "64", "--layers", "1", "--batch-size", "2", "--seq-len", "48"]


def test_bench_allocation_smoke(tmp_path, capsys):
    out = tmp_path / "alloc"
    assert main(["bench", "allocation", "--points", "2,1,5;1,6,1", "--arrangements", "SA_M,S_A_M", "--data",
                 "synthetic", "--val-docs", "4", "--deterministic", "--out", str(out), *SMALL_ALLOCATION,
                 *COMMON]) == 0
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(runs) == 3 and all(run["result"]["deterministic"] is True for run in runs)
    assert capsys.readouterr().out.splitlines()[-1] == (f"wrote {out / 'results.md'}, {out / 'results.json'}, "
                                                        f"{out / 'allocation.png'}")
    md = (out / "results.md").read_text()
    assert len(_rows(md, "| SA_M |")) == 2 and len(_rows(md, "| S_A_M |")) == 1  # S_A_M only at alpha_A = 1/8
    assert _png(out / "allocation.png")
    table = json.loads((out / "results.json").read_text())["table"]
    assert len(table) == 3 and all(math.isfinite(e["val_loss"]["mean"]) and e["val_loss"]["mean"] > 0 for e in table)


def test_bench_allocation_on_the_stdlib_corpus(tmp_path):
    out = tmp_path / "alloc_stdlib"
    assert main(["bench", "allocation", "--points", "2,1,5", "--arrangements", "SAM", "--data-bytes", "1000000",
                 "--val-max-tokens", "3000", "--out", str(out), *SMALL_ALLOCATION, *COMMON]) == 0
    assert (out / "stdlib_data" / "train" / "manifest.json").is_file()
    run = json.loads((out / "runs" / "SAM_215_seed0.json").read_text())
    assert run["spec"]["recipe"]["data"] == "stdlib" and "stdlib_data" not in json.dumps(run["spec"])
    assert 4.0 < run["result"]["val_loss"] < 6.5  # byte tokens: about ln(259) = 5.56 after two steps


# Small settings of each bench (were a check missing, the runs would fail fast or train a few steps of a tiny model).
TINY = {"addition": ["--models", "fw-1A", "--size", "tiny", "--batch-size", "2", "--eval-per-width", "1",
                     "--val-per-width", "1"],
        "recall": ["--models", "fw-1A", "--tasks", "mqar", "--size", "tiny", "--batch-size", "2",
                   "--train-min-len", "40", "--train-max-len", "48", "--eval-lens", "48", "--eval-count", "1",
                   "--val-count", "1", "--mqar-pairs", "4"],
        "allocation": ["--points", "2,1,5", "--arrangements", "SA_M", "--data", "synthetic", "--val-docs", "2",
                       *SMALL_ALLOCATION]}
GIVE_A_DEVICE = "; give cpu, cuda or cuda:N"


def _assert_usage_error(capsys, message: str) -> None:
    """One line on stderr, "error: " + `message`; "..." in `message` stands for text of torch's (its wording)."""
    err = capsys.readouterr().err
    head, *rest = message.split("...")
    assert err.startswith(f"error: {head}") and err.count("\n") == 1, err
    assert not rest or err.endswith(f"{rest[-1]}\n"), err


def test_bad_arguments_fail_cleanly(tmp_path, capsys):
    assert main(["bench", "addition", "--models", "fw-9", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "unknown model name" in capsys.readouterr().err
    assert main(["bench", "allocation", "--points", "4,4,0", "--out", str(tmp_path), "--device", "cpu"]) == 2
    capsys.readouterr()
    for args in (["addition", "--models", "fw-1A", "--device", "tpu"], ["recall", "--eval-lens", "64,abc"],
                 ["allocation", "--points", "a,b"]):
        assert main(["bench", *args, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    (tmp_path / "file").write_text("")  # an --out that is a file: a usage error naming it, no "[Errno 17]"
    assert main(["bench", "addition", "--models", "fw-1A", "--device", "cpu", "--steps", "1", "--size", "tiny",
                 "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridlm bench: {tmp_path / 'file'} is a file, not a directory"), err
    assert err.count("\n") == 1 and "Errno" not in err, err


@pytest.mark.parametrize("bench, options, message", [
    ("addition", ["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    ("addition", ["--lr", "nan"], "--lr must be a finite number > 0"),
    ("addition", ["--warmup", "-1"], "--warmup must be >= 0"),
    ("addition", ["--curriculum-steps", "-1"], "--curriculum-steps must be >= 0"),
    ("addition", ["--eval-every", "-2"], "--eval-every must be >= 0"),
    ("recall", ["--warmup", "5", "--steps", "5"], "--warmup must be >= 0 and below --steps (5), got 5"),
    ("recall", ["--lr", "inf"], "--lr must be a finite number > 0"),
    ("recall", ["--mqar-pairs", "0"], "--mqar-pairs must be between 1 and 128"),
    ("allocation", ["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    ("allocation", ["--warmup", "3", "--steps", "2"], "--warmup must be >= 0 and below --steps (2)"),
    ("allocation", ["--hidden-size", "0"], "--hidden-size must be >= 1"),
    ("allocation", ["--steps", "0"], "--steps must be >= 1"),
])
def test_recipe_values_that_cannot_train_are_usage_errors_before_any_run(tmp_path, capsys, bench, options, message):
    """Found up front (exit 2, the option named), not as "1 run(s) failed" with the cause only in a run's log."""
    steps = [] if "--steps" in options else ["--steps", "3"]
    out = tmp_path / "out"
    assert main(["bench", bench, *TINY[bench], *steps, "--device", "cpu", "--out", str(out), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("bench, options, message", [
    # model lists
    ("addition", ["--models", "nope"], "unknown model name 'nope'; use transformer, mamba2, mamba2-ref, fw-<rule>"),
    ("recall", ["--models", "fw-9"], "unknown model name 'fw-9'; use transformer, mamba2, mamba2-ref, fw-<rule>"),
    ("addition", ["--models", ","], "the model list is empty; give --models names, e.g. fw-3A,transformer"),
    ("recall", ["--models", " "], "the model list is empty; give --models names, e.g. fw-3A,transformer"),
    ("addition", ["--models", "fw-1A,fw-1A"], "the model list repeats a name: fw-1A; give each model once"),
    ("recall", ["--models", "hybrid-mamba2,hybrid:mamba2"],  # one model: their runs' names would collide
     "the model list repeats a name: hybrid-mamba2 and hybrid:mamba2 (one model); give each model once"),
    ("addition", ["--models", "fw-1A-xx"], "model 'fw-1A-xx': unknown option 'xx' (w<B>, same, shifted, eta, nlms)"),
    ("addition", ["--models", "fw-1A-w2"], "model 'fw-1A-w2': a window needs a sliding rule (3 or 3A), not 1A"),
    ("addition", ["--models", "fw-3A-w0"], "model 'fw-3A-w0': the window of -w<B> must be >= 1, got 'w0'"),
    ("allocation", ["--ssm", "fw-3A-w0"], "model 'fw-3A-w0': the window of -w<B> must be >= 1, got 'w0'"),
    # --device
    ("addition", ["--device", "tpu"], "--device tpu: ..." + GIVE_A_DEVICE),
    ("recall", ["--device", "cuda:-1"], "--device cuda:-1: ..." + GIVE_A_DEVICE),
    ("allocation", ["--device", "meta"], "--device meta: torch has no meta device here" + GIVE_A_DEVICE),
    ("addition", ["--device", ","], "--device ',' names no device; give cpu, cuda or a list cuda:0,cuda:1"),
    # counts and the time budget
    ("addition", ["--seeds", "0"], "--seeds must be >= 1, got 0"),
    ("allocation", ["--seeds", "-1"], "--seeds must be >= 1, got -1"),
    ("recall", ["--per-device", "0"], "--per-device must be >= 1, got 0"),
    ("addition", ["--steps", "-5"], "--steps must be >= 1, got -5"),  # not the --curriculum-steps derived from it
    ("addition", ["--time-budget", "0"], "--time-budget must be a number of seconds > 0, got 0.0"),
    ("recall", ["--time-budget", "-1"], "--time-budget must be a number of seconds > 0, got -1.0"),
    ("allocation", ["--time-budget", "nan"], "--time-budget must be a number of seconds > 0, got nan"),
    # widths and lengths
    ("addition", ["--train-max-width", "48"],
     "need 1 <= --min-width (1) <= --train-max-width (48) < --eval-max-width (48)"),
    ("addition", ["--min-width", "33"],
     "need 1 <= --min-width (33) <= --train-max-width (32) < --eval-max-width (48)"),
    ("recall", ["--train-min-len", "50"], "need 1 <= --train-min-len (50) <= --train-max-len (48)"),
    # recall's tasks and lengths
    ("recall", ["--tasks", ","], "--tasks names no task; give some of mqar,needle,multi_needle, comma-separated"),
    ("recall", ["--tasks", "mqar,mqar"], "--tasks repeats a task: mqar; give each once"),
    ("recall", ["--eval-lens", "48,x"], "--eval-lens '48,x': a comma-separated list of integers"),
    ("recall", ["--eval-lens", ","],
     "--eval-lens names no length; give context lengths, comma-separated, e.g. 512,1024"),
    ("recall", ["--eval-lens", "48,48"], "--eval-lens repeats a length: 48; give each once"),
    ("recall", ["--curriculum-steps", "1", "--curriculum-start-len", "100000"],
     "--curriculum-start-len 100000 is longer than --train-max-len"),
    ("addition", ["--curriculum-steps", "1", "--curriculum-start", "40"],
     "--curriculum-start 40 is wider than --train-max-width"),
    # allocation's points and data
    ("allocation", ["--points", "a,b"], "--points: 'a,b' is not three integers like 2,1,5"),
    ("allocation", ["--points", "4,4,0"], "allocation '4,4,0' is not on the grid: three eighths >= 1 that sum to 8"),
    ("allocation", ["--points", ";"], "no allocation left to run (check --points against --arrangements)"),
    ("allocation", ["--points", "2,2,4", "--arrangements", "SAM"],
     "no allocation left to run (check --points against --arrangements)"),
    ("allocation", ["--arrangements", "XX"], "unknown block arrangement 'XX'; choose from ('SA_M', 'SAM', 'S_A_M')"),
    ("allocation", ["--val-data", "/nonexistent/val"],
     "--val-data goes with --data DIR (prepared training and held-out shards), and only there"),
    ("allocation", ["--data", "/nonexistent/train", "--val-data", "/nonexistent/val"],
     "--data /nonexistent/train: neither stdlib, shakespeare, synthetic nor a directory of prepared shards"),
    ("allocation", ["--data", "Synthetic"],
     "--data Synthetic: neither stdlib, shakespeare, synthetic nor a directory of prepared shards"),
    ("allocation", ["--data", "/"], "--data / (prepared shards) needs --val-data DIR, the held-out shards"),
    ("allocation", ["--data", "/", "--val-data", "/"],
     "--val-data is --data: the held-out score would be taken on the training data"),
    ("allocation", ["--data", "/", "--val-data", "/nonexistent/val"],
     "--data: /: no manifest.json; not a dataset written by `hybridlm data prepare`"),
    ("allocation", ["--data", "stdlib", "--data-bytes", "10"],
     "--data-bytes: the demo corpus's 10 bytes hold 1 files, fewer than one held-out file per 20: raise the byte "
     "limit"),
])
def test_bad_arguments_are_usage_errors_before_any_run(tmp_path, capsys, bench, options, message):
    """Every bad argument: exit 2 and one line naming it and the way out, before any run starts or --out is written
    (not exit 1, not a run per model failing with the cause in its log, not a report of nothing)."""
    out = tmp_path / "out"
    assert main(["bench", bench, *TINY[bench], "--steps", "3", "--device", "cpu", "--out", str(out), *options]) == 2
    _assert_usage_error(capsys, message)
    assert not out.exists()


@pytest.mark.parametrize("bench", ["addition", "recall", "allocation"])
@pytest.mark.parametrize("gpus, device, message", [
    (0, "cuda", "--device cuda, but torch sees no GPU; use --device cpu"),
    (0, "cuda:7", "--device cuda:7: torch sees 0 GPU(s) here; use --device cpu"),
    (2, "cuda:7", "--device cuda:7: torch sees 2 GPU(s) here; use cuda:0 to cuda:1, or cuda for all of them"),
    (1, "cuda:0,cuda:1", "--device cuda:1: torch sees 1 GPU(s) here; use --device cuda:0"),
])
def test_devices_this_machine_lacks_are_usage_errors(tmp_path, capsys, monkeypatch, bench, gpus, device, message):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # the same answer on any machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    out = tmp_path / "out"
    assert main(["bench", bench, *TINY[bench], "--steps", "3", "--device", device, "--out", str(out)]) == 2
    _assert_usage_error(capsys, message)
    assert not out.exists()


def _tree(path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, p.is_file() and p.read_bytes())
            for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("bench, key, options", [
    ("addition", "fw-1A_seed0", []),
    ("recall", "fw-1A_seed0", []),
    ("allocation", "SA_M_215_seed0", ["--data", "stdlib", "--data-bytes", "1000000"]),  # not prepared in --out first
])
def test_another_recipes_finished_run_in_out_is_a_usage_error(tmp_path, capsys, bench, key, options):
    """A finished run of another recipe where this one's would go: exit 2 before anything is written to --out."""
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    stored = out / "runs" / f"{key}.json"
    stored.write_text(json.dumps({"spec": {"task": bench, "seed": 0, "recipe": {"steps": 999}}, "result": {}}))
    before = _tree(out)
    assert main(["bench", bench, *TINY[bench], "--steps", "3", "--device", "cpu", "--out", str(out), *options]) == 2
    _assert_usage_error(capsys, f"{stored} holds a finished run of another recipe (differs in ...); write this one to "
                                "another --out, or move that file away to replace it")
    assert _tree(out) == before


@pytest.mark.parametrize("bench, example", [("addition", "hybridlm bench addition --models"),
                                            ("recall", "hybridlm bench recall --models"),
                                            ("allocation", "hybridlm bench allocation --out")])
def test_bench_help_describes_the_benchmark_with_an_example(capsys, bench, example):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", bench, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert "results.md, results.json and" in text and f"Example: {example}" in text


@pytest.mark.parametrize("bench", ["addition", "allocation"])
def test_an_earlier_versions_checkpoint_in_out_stops_the_bench_with_the_files_to_delete(tmp_path, capsys, bench):
    """One line naming the files, exit status 1, before any run trains or the corpus is prepared."""
    runs = tmp_path / "runs"
    runs.mkdir()
    key = "fw-1A_seed0" if bench == "addition" else "SA_M_215_seed0"
    (runs / f"{key}.ckpt.json").write_text("{}")
    (runs / f"{key}.ckpt.step00000002.safetensors").write_bytes(b"tensors")
    assert main(["bench", bench, *TINY[bench], "--steps", "2", "--device", "cpu", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {runs / key}.ckpt.json, {runs / key}.ckpt.step00000002.safetensors: in-progress "
                          "checkpoint(s) in the format of an earlier hybridlm version") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and len(list(runs.iterdir())) == 2


def test_ctrl_c_outside_the_runs_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C while a bench prepares its corpus (before the runs' own stop handling): no traceback."""
    from hybridlm.experiments import allocation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(allocation, "prepare_builtin", interrupted)
    out = tmp_path / "out"
    assert main(["bench", "allocation", "--points", "2,1,5", "--arrangements", "SA_M", "--data", "stdlib",
                 "--data-bytes", "1000000", *SMALL_ALLOCATION, "--steps", "2", "--device", "cpu", "--out",
                 str(out)]) == 130
    assert capsys.readouterr().err == ("stopped (Ctrl-C); run the same command again to continue where it "
                                       "stopped\n")
