"""What `load_model` and the commands that take --model say when the path is not a model directory."""

from __future__ import annotations

import pytest

from hybridlm.cli import main
from hybridlm.models.hf import load_model, model_dir_problem


def test_a_path_that_is_not_a_model_directory_is_named_with_what_it_is(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    assert model_dir_problem(run / "final") == ""
    assert model_dir_problem(tmp_path / "nope") == f"model directory {tmp_path / 'nope'} does not exist"
    assert model_dir_problem(weights).startswith(f"{weights} is a file; give the model directory")
    assert model_dir_problem(run) == f"{run} is a training run, not a model directory; its model is {run / 'final'}"
    assert model_dir_problem(tmp_path / "empty") == f"{tmp_path / 'empty'} has no config.json; not a model directory"
    with pytest.raises(FileNotFoundError, match="is a training run, not a model directory; its model is"):
        load_model(run)
    model = ["--model", str(run)]
    for command in (["generate", *model, "--prompt", "a"], ["serve", *model], ["chat", *model, "--prompt", "a"],
                    ["eval", "export-hf", *model]):
        assert main(command) == 1, command
        assert f"its model is {run / 'final'}" in capsys.readouterr().err, command
