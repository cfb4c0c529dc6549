"""The whole model: packed documents == each alone, cached decoding == full forward, our checkpoint format,
the Auto classes, the loss at document boundaries."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import hybridlm
from hybridlm.layers.cache import HybridCache
from hybridlm.models.config import HybridConfig
from hybridlm.models.configuration import HybridLMConfig
from hybridlm.models.model import HybridForCausalLM
from tests.models.falcon_reference import randomize_

VOCAB = 61
ATOL = 1e-5


def make_model(seed: int = 0, **changes) -> HybridForCausalLM:
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=6, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_rms_norm=True, rope_theta=1e4, embedding_multiplier=2.0, key_multiplier=0.5,
        ssm_out_multiplier=0.5, lm_head_multiplier=0.5,
    )
    fields.update(changes)
    torch.manual_seed(seed)
    model = HybridForCausalLM(HybridLMConfig.from_hybrid(HybridConfig(**fields))).eval()
    randomize_(model, seed)
    return model


VARIANTS = {
    "falcon-h1": dict(),
    "sam": dict(block_arrangement="SAM"),
    "s_a_m-plain-gate": dict(block_arrangement="S_A_M", mamba_rms_norm=False),
    "attention-only": dict(ssm_mixer="none"),
    "ssm-only": dict(use_attention=False),
}


def ids(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_documents_equal_each_alone(variant):
    model = make_model(**VARIANTS[variant])
    tokens = ids(1, 18)
    cu = torch.tensor([0, 7, 8, 11, 18])
    with torch.no_grad():
        packed = model(tokens, cu_seqlens=cu).logits
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(tokens[:, start:end]).logits
            torch.testing.assert_close(packed[:, start:end], alone, rtol=ATOL, atol=ATOL)
        assert not torch.allclose(packed[:, 8:], model(tokens).logits[:, 8:], atol=1e-3)


def test_position_ids_restarting_pack_rows_like_cu_seqlens():
    model = make_model()
    tokens = ids(2, 9)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    with torch.no_grad():
        packed = model(tokens, position_ids=position_ids).logits
        for row, (start, end) in [(0, (0, 4)), (0, (4, 7)), (0, (7, 9)), (1, (0, 6)), (1, (6, 9))]:
            alone = model(tokens[row : row + 1, start:end]).logits
            torch.testing.assert_close(packed[row : row + 1, start:end], alone, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_full_forward(variant):
    model = make_model(seed=1, **VARIANTS[variant])
    tokens = ids(2, 13, seed=1)
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.new_cache()
        steps = [model(tokens[:, :5], cache=cache).logits]  # prefill
        for t in range(5, 13):
            steps.append(model(tokens[:, t : t + 1], cache=cache).logits)  # one token at a time
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=ATOL, atol=ATOL)
    assert cache.seq_len == 13


def test_generate_continues_the_cached_logits():
    model = make_model(seed=2)
    prompt = ids(1, 4, seed=2)
    out = model.generate(prompt, max_new_tokens=6)
    with torch.no_grad():
        for t in range(4, 10):  # every generated token is the argmax of the full forward at its position
            assert out[0, t] == model(out[:, :t]).logits[0, -1].argmax()
    eos = int(out[0, 5])
    first = 4 + out[0, 4:].tolist().index(eos)  # decoding stops right after the first eos
    short = model.generate(prompt, max_new_tokens=6, eos_token_id=eos)
    assert torch.equal(short, out[:, : first + 1])


def test_loss_skips_targets_across_documents():
    model = make_model(seed=3)
    tokens = ids(1, 12, seed=3)
    cu = torch.tensor([0, 5, 12])
    with torch.no_grad():
        loss = model(tokens, labels=tokens, cu_seqlens=cu).loss
        total, count = 0.0, 0
        for start, end in ((0, 5), (5, 12)):
            logits = model(tokens[:, start:end]).logits[0, :-1]
            total += F.cross_entropy(logits, tokens[0, start + 1 : end], reduction="sum")
            count += end - start - 1
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_parameter():
    model = make_model(seed=4).train()
    tokens = ids(2, 10, seed=4)
    model(tokens, labels=tokens).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_our_format(tmp_path, tied):
    model = make_model(seed=5, tie_word_embeddings=tied, time_step_limit=(0.0, 2.0))
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    tokens = ids(2, 8, seed=5)
    loaded = hybridlm.load_model(tmp_path)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(auto, HybridForCausalLM) and AutoConfig.from_pretrained(tmp_path).model_type == "hybridlm"
    assert loaded.config.to_hybrid() == model.config.to_hybrid()
    with torch.no_grad():
        expected = model(tokens).logits
        torch.testing.assert_close(loaded(tokens).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(auto(tokens).logits, expected, rtol=0, atol=0)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_load_model_names_a_damaged_checkpoint(tmp_path):
    make_model(seed=5).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:5])
    with pytest.raises(ValueError, match="a weights file is damaged"):
        hybridlm.load_model(tmp_path)
    from safetensors.torch import load_file, save_file

    weights.write_bytes(intact)
    partial = {k: v for k, v in load_file(str(weights)).items() if "q_proj" not in k}
    save_file(partial, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"do not fit its config\.json \(missing model\.layers\.0\.attn\.q_proj"):
        hybridlm.load_model(tmp_path)
    weights.unlink()
    with pytest.raises(ValueError, match="the weights do not load"):
        hybridlm.load_model(tmp_path)
    weights.write_bytes(intact)
    (tmp_path / "config.json").write_text("{\n model_type: hybridlm}")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        hybridlm.load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        hybridlm.load_model(tmp_path)


def test_a_misspelt_config_key_is_refused(tmp_path):
    make_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["fw_windw"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown config key 'fw_windw' \\(did you mean 'fw_window'\\?\\)"):
        hybridlm.load_model(tmp_path)


def test_bad_inputs(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids(2, 6), cu_seqlens=torch.tensor([0, 3, 6]))
    cache = model.new_cache()
    model(ids(1, 3), cache=cache)
    with pytest.raises(ValueError, match="needs an empty cache"):
        model(ids(1, 6), cu_seqlens=torch.tensor([0, 3, 6]), cache=cache)
    with pytest.raises(ValueError, match="cache has 3 layers"):
        model(ids(1, 6), cache=HybridCache(3))
    with pytest.raises(ValueError, match="LEFT padding"):
        model(ids(2, 4), attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="LEFT padding"):
        model(ids(1, 4), attention_mask=torch.tensor([[0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="cannot be combined"):
        model(ids(1, 4), attention_mask=torch.tensor([[0, 1, 1, 1]]), position_ids=torch.arange(4)[None])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type"):
        hybridlm.load_model(tmp_path)


def test_missing_fast_weight_gates_are_initialized_on_load(tmp_path):
    """A checkpoint without the fast-weight gate biases (e.g. from an older layout) loads with the mixer's
    init: b_beta = 0, b_lam = initial_lam_bias(heads), not whatever memory the meta-device build left."""
    from safetensors.torch import load_file, save_file

    from hybridlm.layers.fast_weight import initial_lam_bias

    model = make_model(seed=6, ssm_mixer="fast_weight", fw_heads=4, fw_head_dim=8)
    model.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["model.layers.0.ssm.lam_bias"].abs().sum() > 0
    kept = {k: v for k, v in weights.items() if not k.endswith(("beta_bias", "lam_bias"))}
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = hybridlm.load_model(tmp_path)
    for layer in loaded.model.layers:
        assert torch.equal(layer.ssm.beta_bias, torch.zeros(4))
        assert torch.equal(layer.ssm.lam_bias, initial_lam_bias(4))
    torch.testing.assert_close(loaded.model.layers[1].ssm.in_proj.weight, model.model.layers[1].ssm.in_proj.weight)
