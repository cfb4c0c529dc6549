"""The canonical-layout checkpoint helpers in one process: tied weights saved once load back."""

from __future__ import annotations

import torch

from hybridlm.parallel.checkpoint import full_model_state_dict, load_full_model_state_dict
from tests.parallel.harness import tiny_model


def test_tied_embeddings_load_from_the_one_saved_name():
    source = tiny_model(seed=0, tie_word_embeddings=True)
    state = full_model_state_dict(source)
    assert source.lm_head.weight is source.model.embed_tokens.weight
    state.pop("model.embed_tokens.weight", None)  # safetensors' save_model keeps one name of a tied pair
    assert "lm_head.weight" in state
    target = tiny_model(seed=1, tie_word_embeddings=True)
    missing, unexpected = load_full_model_state_dict(target, state)
    assert missing == [] and unexpected == []
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_a_key_missing_under_every_alias_is_reported():
    state = full_model_state_dict(tiny_model(seed=0))
    state.pop("model.norm.weight")
    missing, _ = load_full_model_state_dict(tiny_model(seed=1), state)
    assert missing == ["model.norm.weight"]
