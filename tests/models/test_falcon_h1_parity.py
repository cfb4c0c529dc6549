"""Official falcon_h1 checkpoints <-> ours: logits parity both ways, sharded loading, greedy decoding."""

import json

import pytest
import torch
from transformers import FalconH1ForCausalLM

import hybridlm
from hybridlm.models.configuration import HybridLMConfig
from hybridlm.models.falcon_h1 import config_from_falcon_h1, config_to_falcon_h1
from hybridlm.models.model import HybridForCausalLM
from tests.models.falcon_reference import CASES, VOCAB, random_falcon, randomize_

TOL = 1e-4  # max abs logit difference, float32


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_official_checkpoint_loads_with_identical_logits(case, tmp_path):
    reference = random_falcon(seed=1, **CASES[case])
    reference.save_pretrained(tmp_path)
    ours = hybridlm.load_model(tmp_path)
    assert isinstance(ours, HybridForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, ours(ids).logits
    assert expected.abs().max() > 0.1  # not a degenerate comparison
    assert max_diff(got, expected) < TOL
    if CASES[case].get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


@pytest.mark.parametrize("case", list(CASES))
def test_our_model_exports_to_falcon_h1(case, tmp_path):
    config = config_from_falcon_h1(random_falcon(seed=0, **CASES[case]).config)
    torch.manual_seed(2)
    ours = HybridForCausalLM(HybridLMConfig.from_hybrid(config)).eval()
    randomize_(ours, seed=2)
    ours.save_pretrained(tmp_path, format="falcon_h1")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "falcon_h1"
    reference = FalconH1ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(ours(ids).logits, reference(ids).logits) < TOL


def test_sharded_checkpoint(tmp_path):
    reference = random_falcon(seed=3, **CASES["rmsnorm-g2-mup"])
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = hybridlm.load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_diff(ours(ids).logits, reference(ids).logits) < TOL


def test_writing_back_into_a_sharded_checkpoint_dir_replaces_its_shards(tmp_path):
    """Load an official sharded dir, change the model, save it back there: both loaders read the new weights."""
    random_falcon(seed=3, **CASES["rmsnorm-g2-mup"]).save_pretrained(tmp_path, max_shard_size="20KB")
    ours = hybridlm.load_model(tmp_path)
    with torch.no_grad():
        ours.lm_head.weight.mul_(3.0)
    ours.save_pretrained(tmp_path, format="falcon_h1")
    assert not (tmp_path / "model.safetensors.index.json").exists() and not list(tmp_path.glob("model-*"))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(ids).logits
        assert max_diff(hybridlm.load_model(tmp_path)(ids).logits, expected) < TOL
        assert max_diff(FalconH1ForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, expected) < TOL


def test_config_round_trip_keeps_every_falcon_field():
    reference = random_falcon(seed=0, **CASES["rmsnorm-g2-mup"]).config
    config = config_from_falcon_h1(reference)
    assert config.ssm_multiplier_B == 0.7 and config.mlp_multiplier_down == 1.2 and config.rope_theta == 1e11
    back = config_to_falcon_h1(config)
    for key in ("ssm_multipliers", "mlp_multipliers", "rope_parameters", "head_dim", "mamba_n_groups",
                "mamba_rms_norm", "mamba_norm_before_gate", "key_multiplier", "time_step_limit"):
        assert getattr(back, key) == getattr(reference, key), key


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(ssm_mixer="none"), "ssm_mixer"),
        (dict(use_attention=False), "use_attention"),
        (dict(block_arrangement="SAM"), "block_arrangement"),
        (dict(intermediate_size=0), "intermediate_size"),
    ],
)
def test_export_refuses_what_falcon_h1_cannot_express(changes, field):
    config = config_from_falcon_h1(random_falcon().config).replace(**changes)
    with pytest.raises(ValueError, match=field):
        config_to_falcon_h1(config)


def test_greedy_generate_matches_transformers(tmp_path):
    reference = random_falcon(seed=4, **CASES["rmsnorm-g2-mup"])
    reference.save_pretrained(tmp_path)
    ours = hybridlm.load_model(tmp_path)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
    got = ours.generate(prompt, max_new_tokens=12)
    assert got.shape == expected.shape == (2, 19)
    assert torch.equal(got, expected)


def test_left_padded_greedy_generate_matches_transformers(tmp_path):
    """A batch of prompts of different lengths, left-padded: ours (packed prefill) and transformers (masked
    padding) pick the same tokens."""
    reference = random_falcon(seed=4, **CASES["rmsnorm-g2-mup"])
    reference.save_pretrained(tmp_path)
    ours = hybridlm.load_model(tmp_path)
    g = torch.Generator().manual_seed(3)
    batch = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, n in enumerate((7, 3, 5)):
        batch[row, 7 - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, 7 - n :] = 1
    with torch.no_grad():
        expected = reference.generate(batch, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)
    got = ours.generate(batch, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, expected)
    assert not torch.equal(got[1:2, 7:], ours.generate(batch[1:2], max_new_tokens=10)[:, 7:])  # pads matter
