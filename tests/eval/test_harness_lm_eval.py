"""lm-evaluation-harness itself (skipped where lm_eval is not installed; it is not a dependency): its HF backend on
our model gives `harness.loglikelihood`'s numbers with `prefix_token_id=<eos>` (and with BOS without it), and its
`generate_until` runs through `HybridForCausalLM.generate` (transformers' keywords, stop strings) and returns our
greedy decoding cut at the stop string."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from hybridlm.eval.harness import loglikelihood  # noqa: E402
from hybridlm.experiments.models import build_model, task_config  # noqa: E402
from hybridlm.inference import generate  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = task_config("hybrid-mamba2", vocab_size=len(tok), size="tiny", initializer_range=0.3,
                         max_position_embeddings=128)
    return build_model(config, seed=2).eval(), tok


def _lm(model, tok, **options) -> HFLM:
    return HFLM(pretrained=model, tokenizer=tok, batch_size=3, device="cpu", **options)


def _instances(kind: str, requests) -> list[Instance]:
    return [Instance(kind, {}, request, i) for i, request in enumerate(requests)]


def test_lm_eval_loglikelihood_equals_the_harness(model_and_tokenizer):
    model, tok = model_and_tokenizer
    requests = [("The model reads the", " data"), ("x = ", "42"), ("", "The model"), ("a", " b c d"),
                ("The cat sat on the mat and " * 30, " the")]  # longer than max_length 128: left-truncated
    ours = loglikelihood(model, tok, requests)
    got = _lm(model, tok, prefix_token_id=tok.eos_token_id).loglikelihood(_instances("loglikelihood", requests),
                                                                          disable_tqdm=True)
    for (logprob, greedy), (expected, expected_greedy) in zip(got, ours):
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    # without prefix_token_id lm_eval prefixes the tokenizer's BOS, which our training data never holds
    (bos_default, _), = _lm(model, tok).loglikelihood(_instances("loglikelihood", [("", "The model")]),
                                                       disable_tqdm=True)
    (with_bos, _), = loglikelihood(model, tok, [("", "The model")], prefix_id=tok.bos_token_id)
    assert bos_default == pytest.approx(with_bos, abs=1e-4) and abs(bos_default - ours[2][0]) > 1e-3


def test_lm_eval_generate_until_runs_our_generate(model_and_tokenizer, monkeypatch):
    """lm_eval calls `model.generate` with max_length, a StoppingCriteriaList of its stop strings, pad_token_id,
    use_cache and do_sample=False. A left-padded batch without a stop in reach gives our greedy decoding of each prompt
    alone (stopping at eos); a stop string halfway through a continuation ends the decoding there (fewer tokens than
    max_gen_toks) and the answer is our decoding cut at it."""
    model, tok = model_and_tokenizer
    contexts = ("The model", "x = 3 +", "The cat sat on the")
    free, cut = {}, {}
    for context in contexts:
        prompt = torch.tensor([tok.encode(context, add_special_tokens=False)])
        new = generate(model, prompt, max_new_tokens=12, eos_token_id=tok.eos_token_id).sequences[0, prompt.shape[1]:]
        free[context] = tok.decode(new.tolist(), skip_special_tokens=True)
        # the stop: the text of a plain token (the random model also picks reserved ones) among the first 9
        pieces = [tok.decode([t]) for t in new.tolist()[1:9]]
        cut[context] = next(p for p in pieces if p.strip() and p.isprintable() and "<|" not in p and "\ufffd" not in p)
    batch = [(context, {"until": ["\u2603"], "max_gen_toks": 12, "do_sample": False}) for context in contexts]
    alone = [(context, {"until": [cut[context]], "max_gen_toks": 12, "do_sample": False}) for context in contexts]
    calls = []
    original = type(model).generate

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append((sorted(kwargs), kwargs["input_ids"].shape[0], out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    monkeypatch.setattr(type(model), "generate", recorded)
    answers = _lm(model, tok).generate_until(_instances("generate_until", batch + alone), disable_tqdm=True)
    assert answers[:3] == [free[context] for context in contexts]
    assert answers[3:] == [free[context].split(cut[context])[0] for context in contexts]
    assert all({"max_length", "stopping_criteria", "use_cache", "pad_token_id"} <= set(keys) for keys, _, _ in calls)
    # the three prompts in one left-padded batch, then one call per stop string, each ending before 12 tokens
    assert sorted((rows, made < 12) for _, rows, made in calls) == [(1, True)] * 3 + [(3, False)]
    sampled = _lm(model, tok).generate_until(_instances("generate_until", [
        ("The model", {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": True, "temperature": 0.7})]),
        disable_tqdm=True)
    assert isinstance(sampled[0], str)
