"""`hybridlm serve`'s checks of its options before the model loads: the tokenizer directory (as `generate` checks it),
--port and --prefix-cache-gb (usage errors, exit 2)."""

from __future__ import annotations

import shutil

import pytest

from hybridlm.cli import build_parser, main


@pytest.fixture
def no_engine(monkeypatch):
    """The engine never starts: starting it raises RuntimeError (serve's exit 1, "engine started"), after recording
    the tokenizer directory it was given. No test here may reach the Hub."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = []

    class EngineProcess:
        def __init__(self, model_dir, *, tokenizer_dir=None, **kwargs):
            started.append(tokenizer_dir)

        def start(self):
            raise RuntimeError("engine started")

    def engine(*args, **kwargs):
        raise AssertionError("the model loaded on the engine thread")

    monkeypatch.setattr("hybridlm.serving.process.EngineProcess", EngineProcess)
    monkeypatch.setattr("hybridlm.serving.engine.Engine", engine)
    return started


def test_serve_refuses_a_missing_tokenizer_directory_before_loading(model_dir, tmp_path, no_engine, capsys):
    missing = tmp_path / "nope"
    for mode in ([], ["--engine-thread"]):
        assert main(["serve", "--model", str(model_dir), "--tokenizer", str(missing), *mode]) == 1
        assert f"tokenizer directory {missing} does not exist" in capsys.readouterr().err
    assert no_engine == []


def test_serve_refuses_a_max_model_len_past_the_models_context(model_dir, no_engine, capsys):
    from hybridlm.models.hf import read_model_config

    limit = read_model_config(model_dir).max_position_embeddings
    assert main(["serve", "--model", str(model_dir), "--max-model-len", str(limit + 1)]) == 2
    assert capsys.readouterr().err == f"hybridlm serve: --max-model-len {limit + 1} is longer than the model's " \
                                      f"max_position_embeddings {limit}\n"
    assert no_engine == []
    assert main(["serve", "--model", str(model_dir), "--max-model-len", str(limit)]) == 1  # taken: the engine starts
    assert "engine started" in capsys.readouterr().err


def test_serve_asks_for_tokenizer_when_the_model_directory_has_none(model_dir, tmp_path, no_engine, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    assert main(["serve", "--model", str(bare)]) == 1
    err = capsys.readouterr().err
    assert f"no tokenizer in {bare}" in err and "pass --tokenizer DIR" in err, err
    assert no_engine == []
    # With the tokenizer given, the checks pass and the engine starts with it.
    assert main(["serve", "--model", str(bare), "--tokenizer", str(model_dir)]) == 1
    assert "engine started" in capsys.readouterr().err
    assert no_engine == [str(model_dir)]


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
def test_serve_port_outside_0_to_65535_is_a_usage_error(port, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tmp_path), "--port", port])
    assert exit_.value.code == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["-1", "-0.5", "nan", "inf", "lots"])
def test_serve_prefix_cache_gb_must_be_a_size_of_0_or_more(size, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tmp_path), "--prefix-cache-gb", size])
    assert exit_.value.code == 2
    assert "--prefix-cache-gb" in capsys.readouterr().err


@pytest.mark.parametrize("option,value,minimum", [("--threads", "0", 1), ("--max-num-seqs", "0", 1),
                                                  ("--block-size", "-4", 1), ("--max-prefill-tokens", "0", 1),
                                                  ("--max-model-len", "1", 2), ("--max-num-seqs", "many", 1)])
def test_serve_counts_below_their_minimum_are_usage_errors(option, value, minimum, tmp_path, capsys):
    """Checked while the command line is parsed (exit 2), not by the engine after the model has loaded."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tmp_path), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert option in err and f">= {minimum}" in err, err


def test_serve_takes_port_0_and_prefix_cache_0():
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "0", "--prefix-cache-gb", "0"])
    assert (args.port, args.prefix_cache_gb) == (0, 0.0)
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "65535", "--prefix-cache-gb", "0.25"])
    assert (args.port, args.prefix_cache_gb) == (65535, 0.25)
