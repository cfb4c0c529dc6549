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


@pytest.mark.parametrize("fmt", ["hybridlm", "falcon_h1"])
def test_load_model_takes_a_dtype_or_its_name_in_either_format(tmp_path, fmt):
    """dtype as a torch dtype or its name loads either format in it; a name that is no floating dtype is refused
    (the falcon_h1 path once read a name as a device)."""
    import torch

    from hybridlm import HybridForCausalLM
    from hybridlm.models.presets import get_preset

    HybridForCausalLM(get_preset("tiny")).save_pretrained(tmp_path, format=fmt)
    for dtype in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        assert load_model(tmp_path, dtype=dtype).model.embed_tokens.weight.dtype == torch.bfloat16
    for bad in ("int8", "bogus", torch.int64):
        with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
            load_model(tmp_path, dtype=bad)


def test_falcon_h1_format_refuses_the_arguments_it_cannot_honour(tmp_path):
    """save_pretrained(format="falcon_h1") writes one unsharded file: sharding and the like are refused, not dropped."""
    from hybridlm import HybridForCausalLM
    from hybridlm.models.presets import get_preset

    model = HybridForCausalLM(get_preset("tiny"))
    with pytest.raises(ValueError, match="takes no other arguments; got max_shard_size"):
        model.save_pretrained(tmp_path / "a", format="falcon_h1", max_shard_size="200KB")
    assert not (tmp_path / "a").exists()
