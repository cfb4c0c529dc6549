"""The whole model: packed documents == each alone, cached decoding == full forward, `generate` with transformers'
keywords and eos default, our checkpoint format, the Auto classes, the loss at document boundaries."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import hybridlm
from hybridlm.layers.cache import HybridCache
from hybridlm.models.config import HybridConfig
from hybridlm.models.configuration import HybridTransformersConfig
from hybridlm.models.model import HybridForCausalLM
from tests.models.helpers import VOCAB, make_model

ATOL = 1e-5

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


@pytest.mark.parametrize("inputs", ["rows", "packed", "cached step"])
def test_rope_tables_computed_once_per_forward(monkeypatch, inputs):
    """The model computes attention's RoPE tables once per forward and hands them to every layer: the same logits as
    each layer computing its own from the positions."""
    from hybridlm.modules import rotary

    model = make_model(num_hidden_layers=3)
    tokens = ids(1, 12)
    kwargs = {"packed": dict(cu_seqlens=torch.tensor([0, 5, 12]))}.get(inputs, {})
    calls = []
    tables = rotary.rotary_cos_sin
    monkeypatch.setattr(rotary, "rotary_cos_sin", lambda *a, **k: calls.append(1) or tables(*a, **k))
    with torch.no_grad():
        cache = model.new_cache() if inputs == "cached step" else None
        if cache is not None:
            model(tokens[:, :11], cache=cache)
            tokens = tokens[:, 11:]
        calls.clear()
        shared = model(tokens, cache=cache.copy() if cache else None, **kwargs).logits
        assert len(calls) == 1
        monkeypatch.setattr(model.model, "rotary", None)  # every layer from position_ids itself
        own = model(tokens, cache=cache, **kwargs).logits
    assert len(calls) == 1 + len(model.model.layers)
    assert torch.equal(shared, own)


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
    out = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    with torch.no_grad():
        for t in range(4, 10):  # every generated token is the argmax of the full forward at its position
            assert out[0, t] == model(out[:, :t]).logits[0, -1].argmax()
    eos = int(out[0, 5])
    first = 4 + out[0, 4:].tolist().index(eos)  # decoding stops right after the first eos
    short = model.generate(prompt, max_new_tokens=6, eos_token_id=eos)
    assert torch.equal(short, out[:, : first + 1])


def test_generate_stops_at_the_config_eos_like_transformers():
    """`HybridForCausalLM.generate` (transformers' entry point) stops at config.eos_token_id unless told otherwise;
    `hybridlm.inference.generate` stops only at an eos it is given."""
    from hybridlm.inference import generate

    model = make_model(seed=6)
    prompt = ids(1, 4, seed=6)
    free = generate(model, prompt, max_new_tokens=6).sequences
    eos = int(free[0, 5])  # the second new token, not the first
    assert eos != int(free[0, 4])
    model.config.eos_token_id = eos
    assert torch.equal(model.generate(prompt, max_new_tokens=6), free[:, :6])
    assert torch.equal(model.generate(prompt, max_new_tokens=6, eos_token_id=None), free)
    assert torch.equal(generate(model, prompt, max_new_tokens=6).sequences, free)
    model.config.eos_token_id = [VOCAB + 3, eos]  # a list of ids too
    assert torch.equal(model.generate(prompt, max_new_tokens=6), free[:, :6])


class _StopAfter:
    """A fake stopping criterion, called the way transformers calls one: (input_ids, scores) -> [B] bool."""

    def __init__(self, prompt_len: int, counts: list[int]) -> None:
        self.prompt_len, self.counts, self.calls = prompt_len, torch.tensor(counts), 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return input_ids.shape[1] - self.prompt_len >= self.counts


def test_generate_takes_transformers_keywords():
    """What lm_eval's generate_until passes (max_length, stopping_criteria, pad_token_id, use_cache, do_sample) and
    what other transformers callers do (num_beams=1, temperature=None, top_k=0)."""
    from transformers import StoppingCriteriaList

    from hybridlm.inference import generate

    model = make_model(seed=5)
    batch, mask = ids(3, 6, seed=5), torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    greedy = generate(model, batch, attention_mask=mask, max_new_tokens=5, eos_token_id=None).sequences
    plain = dict(attention_mask=mask, eos_token_id=None)
    assert torch.equal(model.generate(batch, max_length=11, **plain), greedy)
    assert torch.equal(model.generate(batch, max_length=11, max_new_tokens=5, **plain), greedy)  # agreeing
    assert torch.equal(model.generate(batch, max_length=11, max_new_tokens=None, **plain), greedy)
    assert torch.equal(model.generate(batch, max_length=6, **plain), batch)
    assert torch.equal(model.generate(batch, max_new_tokens=5, do_sample=False, temperature=0.8, top_k=0, **plain),
                       greedy)
    assert torch.equal(model.generate(batch, max_new_tokens=5, temperature=None, use_cache=False, num_beams=1, **plain),
                       greedy)
    sampled = generate(model, batch, attention_mask=mask, max_new_tokens=5, temperature=1.0, seed=3).sequences
    assert not torch.equal(sampled, greedy)
    assert torch.equal(model.generate(batch, max_new_tokens=5, do_sample=True, seed=3, **plain), sampled)
    assert torch.equal(model.generate(batch, max_new_tokens=5, do_sample=True, top_k=0, seed=3, **plain), sampled)

    # lm_eval's call: rows stop when its criteria say so (here after 1, 3 and 2 new tokens), filler after
    criterion = _StopAfter(6, [1, 3, 2])
    out = model.generate(input_ids=batch, attention_mask=mask, max_length=11,
                         stopping_criteria=StoppingCriteriaList([criterion]), pad_token_id=0, use_cache=True,
                         do_sample=False)
    assert out.shape == (3, 9) and criterion.calls == 3
    for row, count in enumerate((1, 3, 2)):
        assert torch.equal(out[row, : 6 + count], greedy[row, : 6 + count])
        assert out[row, 6 + count :].eq(0).all()
    # any callable works as a criterion, a plain bool answer stops every row
    out = model.generate(batch, max_new_tokens=5, stopping_criteria=lambda input_ids, scores: input_ids.shape[1] >= 8,
                         **plain)
    assert torch.equal(out, greedy[:, :8])


@pytest.mark.parametrize(
    "options,error,message",
    [
        (dict(max_length=9, max_new_tokens=3), ValueError, r"max_length=9 \(a prompt of 5 \+ 4 .*=3 disagree"),
        (dict(max_length=3), ValueError, "max_length counts the prompt"),
        (dict(do_sample=True, temperature=0.0), ValueError, "do_sample=True needs a temperature > 0"),
        (dict(do_sample="yes"), ValueError, "do_sample"),
        (dict(num_beams=4), NotImplementedError, "beam search"),
        (dict(num_beams=0), ValueError, "num_beams"),
        (dict(stopping_criteria=lambda ids, scores: False, stop=lambda ids, logits: False), ValueError, "not both"),
        (dict(repetition_penalty=1.2), TypeError, "repetition_penalty; supported: .*max_new_tokens.*max_length"),
        (dict(return_dict_in_generate=True, output_scores=True), TypeError, "output_scores, return_dict_in_generate"),
    ],
)
def test_generate_refuses_what_it_cannot_do(options, error, message):
    model = make_model()
    with pytest.raises(error, match=message):
        model.generate(ids(2, 5), **options)


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


def test_a_model_builds_from_a_hybrid_config(tmp_path):
    """`HybridForCausalLM(HybridConfig(...))` builds the model its transformers face builds (same seed: the same
    weights and logits), keeps that face as `model.config` with the HybridConfig one call away, and round-trips
    through save_pretrained / from_pretrained; any other config type is a TypeError that says what to pass."""
    from transformers import FalconH1Config

    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4,
                          mamba_d_state=6, mamba_chunk_size=4, embedding_multiplier=2.0)
    torch.manual_seed(7)
    direct = hybridlm.HybridForCausalLM(config).eval()
    torch.manual_seed(7)
    via_face = HybridForCausalLM(HybridTransformersConfig.from_hybrid(config)).eval()
    assert isinstance(direct.config, HybridTransformersConfig) and direct.config.to_hybrid() == config
    state, face_state = direct.state_dict(), via_face.state_dict()
    assert state.keys() == face_state.keys() and all(torch.equal(state[k], face_state[k]) for k in state)
    tokens = ids(2, 9, seed=7)
    with torch.no_grad():
        expected = via_face(tokens).logits
        assert torch.equal(direct(tokens).logits, expected)
        torch.manual_seed(7)
        assert hybridlm.HybridModel(config)(tokens).last_hidden_state.shape == (2, 9, 32)
    direct.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.to_hybrid() == config
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, expected)
    with pytest.raises(TypeError, match="HybridForCausalLM takes a HybridConfig, got dict"):
        HybridForCausalLM(config.to_dict())
    with pytest.raises(TypeError, match="official falcon_h1 config: convert it with"):
        hybridlm.HybridModel(FalconH1Config())


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


@pytest.mark.parametrize("bars_on", [True, False])
def test_our_saves_and_loads_print_no_progress_bar(tmp_path, capfd, bars_on):
    """transformers' "Writing model shards" and "Loading weights" bars stay off around save_pretrained and
    load_model, and the caller's setting is what it was after them."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if bars_on else hf_logging.disable_progress_bar)()
    try:
        make_model().save_pretrained(tmp_path)
        assert hf_logging.is_progress_bar_enabled() == bars_on
        hybridlm.load_model(tmp_path)
        assert hf_logging.is_progress_bar_enabled() == bars_on
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err


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
    with pytest.raises(ValueError, match="leave position_ids out"):
        model(ids(1, 6), cu_seqlens=torch.tensor([0, 3, 6]), position_ids=torch.arange(6)[None],
              cache=model.new_cache())
    with pytest.raises(ValueError, match="cache has 3 layers"):
        model(ids(1, 6), cache=HybridCache(3))
    with pytest.raises(ValueError, match="one contiguous run of tokens"):
        model(ids(2, 4), attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="at least one token"):
        model(ids(1, 4), attention_mask=torch.tensor([[0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="cannot be combined"):
        model(ids(1, 4), attention_mask=torch.tensor([[0, 1, 1, 1]]), position_ids=torch.arange(4)[None])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type"):
        hybridlm.load_model(tmp_path)


@pytest.mark.parametrize("inputs, message", [
    (dict(input_ids=torch.arange(5)), r"integer token ids \[B, T\], got torch.int64 \[5\] \(one sequence"),
    (dict(input_ids=torch.zeros(2, 5)), r"integer token ids \[B, T\], got torch.float32 \[2, 5\]$"),
    (dict(input_ids=torch.tensor([[3, VOCAB]])), rf"outside the model's vocabulary \[0, {VOCAB}\): min 3, max {VOCAB}"),
    (dict(input_ids=torch.tensor([[-1, 3]])), r"outside the model's vocabulary .*min -1, max 3"),
    (dict(inputs_embeds=torch.zeros(2, 5, 16)), r"\[B, T, D\] with D = hidden_size = 32, got \[2, 5, 16\]"),
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), position_ids=torch.arange(4)[None]),
     r"position_ids must be \[B or 1, T\] or \[T\] with B, T = 2, 5, got \[1, 4\]"),
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), position_ids=torch.zeros(3, 5, dtype=torch.long)),
     r"got \[3, 5\]"),
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)),
     r"labels \(2, 4\) must have the inputs' shape \[B, T\] = \[2, 5\]"),
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), logits_to_keep=-1), "logits_to_keep=-1: pass n > 0"),
    (dict(input_ids=torch.zeros(1, 3, dtype=torch.long), labels=torch.tensor([[-100, 5, VOCAB + 2]])),
     rf"labels hold ids outside the model's vocabulary \[0, {VOCAB}\): min 5, max {VOCAB + 2} \(-100 marks"),
    (dict(input_ids=torch.zeros(1, 3, dtype=torch.long), shift_labels=torch.tensor([[-5, 1, -100]])),
     r"shift_labels hold ids outside the model's vocabulary .*min -5, max 1"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), r"no positions \(\[B, T\] = \[1, 0\]\)"),
    (dict(inputs_embeds=torch.zeros(2, 0, 32)), r"no positions \(\[B, T\] = \[2, 0\]\)"),
])
def test_malformed_inputs_are_named(inputs, message):
    with pytest.raises(ValueError, match=message):
        make_model()(**inputs)


def test_one_dimensional_position_ids_number_every_row():
    model, tokens = make_model(), ids(2, 6)
    positions = torch.tensor([0, 1, 2, 0, 1, 2])  # two documents per row
    expected = model(tokens, position_ids=positions[None].expand(2, 6)).logits
    torch.testing.assert_close(model(tokens, position_ids=positions).logits, expected, rtol=0, atol=0)


def test_missing_fast_weight_gates_are_initialized_on_load(tmp_path):
    """A checkpoint that lacks the fast-weight gate biases loads with the mixer's
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
