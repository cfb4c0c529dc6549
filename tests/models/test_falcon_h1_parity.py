"""Official falcon_h1 checkpoints <-> ours: logits parity both ways, sharded loading, greedy decoding."""

import json
import re

import pytest
import torch
from transformers import FalconH1ForCausalLM

import hybridlm
from hybridlm.models.configuration import HybridTransformersConfig
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
    ours = HybridForCausalLM(config).eval()
    randomize_(ours, seed=2)
    ours.save_pretrained(tmp_path, format="falcon_h1")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "falcon_h1"
    reference = FalconH1ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(ours(ids).logits, reference(ids).logits) < TOL


def test_float_fields_given_as_ints_export(tmp_path):
    """HybridConfig takes ints for its float fields; transformers' FalconH1Config (strict) refuses them, so they must
    be floats by the time they are exported: config.json is typed as transformers writes it, and loads there."""
    ints = {"embedding_multiplier": 5, "key_multiplier": 1, "ssm_multiplier_B": 2, "mlp_multiplier_gate": 1,
            "rms_norm_eps": 1, "initializer_range": 1, "time_step_limit": (0, 10), "rope_theta": 10000,
            "attention_dropout": 0}
    config = config_from_falcon_h1(random_falcon(seed=0).config).replace(**ints)
    torch.manual_seed(2)
    ours = HybridForCausalLM(config).eval()
    randomize_(ours, seed=2)
    ours.save_pretrained(tmp_path, format="falcon_h1")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["ssm_multipliers"] == [1.0, 1.0, 2.0, 1.0, 1.0] and saved["time_step_limit"] == [0.0, 10.0]
    reference = FalconH1ForCausalLM.from_pretrained(tmp_path).eval()
    assert reference.config.embedding_multiplier == 5.0 and reference.config.mlp_multipliers == [1.0, 1.0]
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(ours(ids).logits, reference(ids).logits) < TOL


def test_inputs_embeds_are_not_scaled_as_in_transformers(tmp_path):
    """embedding_multiplier (5 here) scales the embeddings looked up from ids only: inputs_embeds enter as given."""
    reference = random_falcon(seed=1, **CASES["rmsnorm-g2-mup"])
    reference.save_pretrained(tmp_path)
    ours = hybridlm.load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    embeds = ours.model.embed_tokens(ids).detach()
    with torch.no_grad():
        assert max_diff(ours(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits) < TOL
        scaled = ours(inputs_embeds=embeds * ours.model.embedding_multiplier).logits
        assert max_diff(scaled, ours(ids).logits) < 1e-6
        assert max_diff(ours(inputs_embeds=embeds).logits, ours(ids).logits) > 1e-2  # the multiplier matters here


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


def test_our_from_pretrained_on_a_falcon_h1_dir_points_to_load_model(tmp_path):
    random_falcon(seed=0, **CASES["rmsnorm-g2-mup"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"official falcon_h1 config .*hybridlm\.load_model\(path\)"):
        HybridForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="falcon_h1.*hybridlm.load_model"):
        HybridTransformersConfig.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not a hybridlm config"):
        HybridTransformersConfig.from_pretrained(tmp_path)


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_tied_checkpoint_holding_another_head_is_refused(tmp_path, sharded):
    """tie_word_embeddings=true with a file that also holds a DIFFERENT lm_head.weight: tying would drop that
    head silently (transformers keeps it), so loading stops and names the file; an equal copy is fine."""
    reference = random_falcon(seed=9, **CASES["rmsnorm-before-gate-g2-mha-tied"])
    reference.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    index = tmp_path / "model.safetensors.index.json"
    name = json.loads(index.read_text())["weight_map"]["model.embed_tokens.weight"] if sharded else "model.safetensors"
    embeddings = reference.model.embed_tokens.weight.detach().clone()
    _edit_weights(tmp_path / name, lambda w: w.__setitem__("lm_head.weight", embeddings.clone()))
    if sharded:
        config = json.loads(index.read_text())
        config["weight_map"]["lm_head.weight"] = name
        index.write_text(json.dumps(config))
    ours = hybridlm.load_model(tmp_path)  # an equal copy: tied as the config says
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    _edit_weights(tmp_path / name, lambda w: w.__setitem__("lm_head.weight", embeddings + 1e-3))
    expected = re.escape(str(tmp_path / name)) + r": config.json has tie_word_embeddings=true, but .*"
    expected += r"set \"tie_word_embeddings\": false in " + re.escape(str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match=expected):
        hybridlm.load_model(tmp_path)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.pop("model.layers.1.mamba.D"),
         r"do not fit its config\.json \(missing model\.layers\.1\.mamba\.D\)"),
        (lambda w: w.__setitem__("model.layers.0.mamba.extra", torch.zeros(3)),
         r"\(unexpected model\.layers\.0\.mamba\.extra\)"),
        (lambda w: w.__setitem__("model.layers.0.mamba.conv1d.weight", torch.zeros(40, 1, 4)),
         r"\(wrong shape model\.layers\.0\.mamba\.conv1d\.weight \[40, 1, 4\] \(config: \[48, 1, 4\]\)\)"),
        (lambda w: w.__setitem__("model.rotary_emb.inv_freq", torch.zeros(3)),
         r"no falcon_h1 mapping for weight 'model\.rotary_emb\.inv_freq'"),
    ],
    ids=["missing", "unexpected", "shape", "unmapped"],
)
def test_weight_errors_name_the_dir_and_the_checkpoint_names(tmp_path, edit, message):
    random_falcon(seed=0).save_pretrained(tmp_path)
    _edit_weights(tmp_path / "model.safetensors", edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: .*{message}"):
        hybridlm.load_model(tmp_path)


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
    """Our cached generation against the reference's uncached one (a full forward per token): some transformers
    versions' own cached FalconH1 generation departs from their full forwards; the uncached path is the reference's
    math in every version."""
    reference = random_falcon(seed=4, **CASES["rmsnorm-g2-mup"])
    reference.save_pretrained(tmp_path)
    ours = hybridlm.load_model(tmp_path)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                      do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=False)
    got = ours.generate(prompt, max_new_tokens=12, eos_token_id=None)  # as the reference
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
                                      pad_token_id=0, eos_token_id=None, use_cache=False)
    got = ours.generate(batch, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(got, expected)
    assert not torch.equal(got[1:2, 7:], ours.generate(batch[1:2], max_new_tokens=10, eos_token_id=None)[:, 7:])  # pads matter


@pytest.mark.parametrize("field, value, message", [
    ("mamba_n_heads", 5, "mamba_n_heads"),  # does not divide the SSM width: transformers' own check
    ("embedding_multiplier", 2, "embedding_multiplier"),  # an int where the strict config wants a float
])
def test_a_config_transformers_refuses_is_a_value_error_naming_the_file(tmp_path, field, value, message):
    random_falcon(seed=1).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'config.json'))}: .*{message}"):
        hybridlm.load_model(tmp_path)


def test_export_to_falcon_h1_keeps_the_generation_config(tmp_path):
    """Extra eos ids (an instruct model's end of turn) live in generation_config.json: written with the weights."""
    ours = HybridForCausalLM(config_from_falcon_h1(random_falcon(seed=0).config)).eval()
    ours.generation_config.eos_token_id = [ours.config.eos_token_id, 7]
    ours.save_pretrained(tmp_path, format="falcon_h1")
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [
        ours.config.eos_token_id, 7]
