"""What transformers' machinery (Trainer, TRL, PEFT) asks of the model beyond our own calls: a generation_config,
gradient checkpointing that changes no gradient, `last_hidden_state` from the base model, transformers' keywords."""

import pytest
import torch

import hybridlm
from hybridlm.layers.fast_weight import FastWeightMixer
from tests.models.helpers import VOCAB, make_model


def ids(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_generation_config_is_built_saved_and_loaded(tmp_path):
    model = make_model(eos_token_id=7, pad_token_id=3)
    assert model.generation_config.eos_token_id == 7 and model.generation_config.pad_token_id == 3
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    assert hybridlm.load_model(tmp_path).generation_config.eos_token_id == 7


def test_gradient_checkpointing_changes_no_gradient():
    tokens, position_ids = ids(2, 9), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2)

    def gradients(checkpointing, **options):
        model = make_model(seed=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        calls = []
        model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        model(tokens, position_ids=position_ids, labels=tokens).loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}, model, len(calls)

    plain, _, calls = gradients(False)
    assert calls == 1
    for options in ({"use_reentrant": False}, {"use_reentrant": True}):
        checkpointed, model, calls = gradients(True, **options)
        assert model.model.gradient_checkpointing and calls == 2  # the block ran again in the backward pass
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    mixers = [block.ssm for block in model.model.layers if block.ssm is not None]
    assert mixers and not any(m.recompute for m in mixers)  # the blocks' recomputation covers the mixers'
    model.gradient_checkpointing_disable()
    assert not model.model.gradient_checkpointing  # back to each mixer's default: the fast-weight ones recompute
    assert [m.recompute for m in mixers] == [isinstance(m, FastWeightMixer) for m in mixers]


def test_the_base_model_returns_last_hidden_state_and_logits_to_keep_takes_positions():
    model = make_model()
    tokens = ids(2, 6)
    with torch.no_grad():
        hidden = model.model(tokens, use_cache=False, return_dict=True).last_hidden_state
        logits = model(tokens).logits
        assert hidden.shape == (2, 6, 32)
        torch.testing.assert_close(model.lm_head(hidden) * model.lm_head_multiplier, logits)
        torch.testing.assert_close(model(tokens, logits_to_keep=torch.tensor([1, 4])).logits, logits[:, [1, 4]])
        torch.testing.assert_close(model(tokens, logits_to_keep=2).logits, logits[:, -2:])


def test_generate_refuses_output_logits_it_would_not_return():
    model = make_model(0)
    with pytest.raises(ValueError, match=r"output_logits: this method returns the sequences only.*\.logits"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, output_logits=True)
    assert model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, output_logits=False).shape == (1, 5)
