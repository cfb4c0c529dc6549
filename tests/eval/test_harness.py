"""The lm-evaluation-harness path: an exported checkpoint loads through the Auto classes with
trust_remote_code in a fresh process (as `lm_eval --model hf` loads it), its loglikelihoods of a
2-choice task equal a direct computation, an empty context is conditioned on the prefix token (EOS by default), and
the lm_eval arguments name that prefix. (lm_eval itself: test_harness_lm_eval.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridlm.data.tokenizer import HybridTokenizer
from hybridlm.eval.harness import AUTO_MAP, export_for_lm_eval, lm_eval_model_args, loglikelihood
from hybridlm.experiments.models import build_model, task_config

# (context, continuation): two choices per question; the second question's context ends in a space,
# which the harness moves into the continuation
TASK = [("The model reads the", " data"), ("The model reads the", " memory"),
        ("x = ", r"\frac{1}{2}"), ("x = ", "42")]

_LOAD = """
import json, sys
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
assert "hybridlm" not in sys.modules
path, task = sys.argv[1], json.loads(sys.argv[2])
config = AutoConfig.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
from hybridlm.eval.harness import loglikelihood
print(json.dumps({"config": type(config).__name__, "model": type(model).__name__,
                  "results": loglikelihood(model, tokenizer, task)}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_dir):
    vocab = HybridTokenizer.load(tokenizer_dir).vocab_size
    model = build_model(task_config("hybrid-fw-1A", vocab_size=vocab, size="tiny", initializer_range=0.3), seed=1)
    out = tmp_path_factory.mktemp("harness_model")
    model.save_pretrained(out)
    return export_for_lm_eval(out, tokenizer_dir=tokenizer_dir)


def _direct(model, tok: HybridTokenizer, context: str, continuation: str) -> tuple[float, bool]:
    stripped = context.rstrip()
    moved = context[len(stripped):] + continuation
    context_ids, whole = tok.encode(stripped), tok.encode(stripped + moved)
    assert whole[:len(context_ids)] == context_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    positions = range(len(context_ids), len(whole))
    total = sum(logp[t - 1, whole[t]].item() for t in positions)
    greedy = all(logp[t - 1].argmax().item() == whole[t] for t in positions)
    return total, greedy


def test_export_writes_the_auto_map_and_tokenizer(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["model_type"] == "hybridlm"
    assert (exported / "hybridlm_auto.py").is_file() and (exported / "tokenizer.json").is_file()


def test_fresh_process_loads_and_scores_a_two_choice_task(exported, tokenizer_dir, tmp_path):
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(exported), json.dumps(TASK)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["config"] == "HybridTransformersConfig" and loaded["model"] == "HybridForCausalLM"

    from hybridlm.models.hf import load_model

    model = load_model(exported)
    tok = HybridTokenizer.load(tokenizer_dir)
    direct = [_direct(model, tok, c, x) for c, x in TASK]
    for (logprob, greedy), (expected, expected_greedy) in zip(loaded["results"], direct):
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert greedy == expected_greedy
    # the 2-choice decision (argmax of the loglikelihoods) is the same, and not a tie
    for q in (0, 2):
        a, b = loaded["results"][q][0], loaded["results"][q + 1][0]
        assert (a > b) == (direct[q][0] > direct[q + 1][0]) and abs(a - b) > 1e-3


def test_export_refuses_a_dir_without_tokenizer(tmp_path):
    model = build_model(task_config("transformer", vocab_size=32, size="tiny"), seed=0)
    model.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        export_for_lm_eval(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        export_for_lm_eval(tmp_path, tokenizer_dir=tmp_path / "nowhere")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # refused before anything changed


def test_export_refuses_damaged_or_missing_weights(tmp_path, tokenizer_dir):
    vocab = HybridTokenizer.load(tokenizer_dir).vocab_size
    model = build_model(task_config("transformer", vocab_size=vocab, size="tiny"), seed=0)
    model.save_pretrained(tmp_path / "whole")
    weights = tmp_path / "whole" / "model.safetensors"
    cut = weights.read_bytes()[:-8]
    for name, damage, message in (("cut", lambda p: p.write_bytes(cut), "a weights file is damaged"),
                                  ("gone", lambda p: p.unlink(), "the weights file model.safetensors is missing")):
        broken = tmp_path / name
        model.save_pretrained(broken)
        damage(broken / "model.safetensors")
        before = {p.name: p.read_bytes() for p in broken.iterdir()}
        with pytest.raises(ValueError, match=message):
            export_for_lm_eval(broken, tokenizer_dir=tokenizer_dir)
        assert {p.name: p.read_bytes() for p in broken.iterdir()} == before
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    export_for_lm_eval(tmp_path / "sharded", tokenizer_dir=tokenizer_dir)


def test_export_refuses_a_tokenizer_that_does_not_fit_the_model(tmp_path, tokenizer_dir):
    """A tokenizer with more ids than the model's vocabulary, or one that would replace the different tokenizer
    already beside the model: refused, nothing changed; the model's own tokenizer passed again is fine."""
    vocab = HybridTokenizer.load(tokenizer_dir).vocab_size
    small = tmp_path / "small"
    build_model(task_config("transformer", vocab_size=vocab - 1, size="tiny"), seed=0).save_pretrained(small)
    before = {p.name: p.read_bytes() for p in small.iterdir()}
    with pytest.raises(ValueError, match=rf"has {vocab} tokens, more than the model's vocabulary of {vocab - 1}"):
        export_for_lm_eval(small, tokenizer_dir=tokenizer_dir)
    assert {p.name: p.read_bytes() for p in small.iterdir()} == before
    own = tmp_path / "own"
    build_model(task_config("transformer", vocab_size=vocab, size="tiny"), seed=0).save_pretrained(own)
    export_for_lm_eval(own, tokenizer_dir=tokenizer_dir)
    export_for_lm_eval(own, tokenizer_dir=tokenizer_dir)  # the same tokenizer again: nothing to replace
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes().replace(b"  ", b" "))
    before = {p.name: p.read_bytes() for p in own.iterdir()}
    with pytest.raises(ValueError, match="already holds a tokenizer"):
        export_for_lm_eval(own, tokenizer_dir=other)
    assert {p.name: p.read_bytes() for p in own.iterdir()} == before


def test_an_empty_context_is_conditioned_on_the_prefix(exported):
    """lm_eval replaces an empty context by one prefix token; ours is EOS unless prefix_id says otherwise (our documents
    start after an EOS, never a BOS: harness.py's docstring). Non-empty contexts do not use it."""
    from transformers import AutoTokenizer

    from hybridlm.models.hf import load_model

    model, tok = load_model(exported), AutoTokenizer.from_pretrained(exported)
    continuation = " The model reads"
    ids = tok.encode(continuation, add_special_tokens=False)

    def direct(prefix: int) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([[prefix] + ids])).logits[0].double(), -1)
        return sum(logp[t, ids[t]].item() for t in range(len(ids)))

    eos, bos = tok.eos_token_id, tok.bos_token_id
    assert eos != bos
    (default, _), = loglikelihood(model, tok, [("", continuation)])
    assert default == pytest.approx(direct(eos), abs=1e-4)
    for prefix in (bos, eos, 7):
        (logprob, _), = loglikelihood(model, tok, [("", continuation)], prefix_id=prefix)
        assert logprob == pytest.approx(direct(prefix), abs=1e-4)
    (with_bos, _), = loglikelihood(model, tok, [("", continuation)], prefix_id=bos)
    assert abs(with_bos - default) > 1e-3  # the prefix matters
    request = [("The model", " reads the")]
    assert loglikelihood(model, tok, request, prefix_id=7) == loglikelihood(model, tok, request)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="prefix_id must be a token id"):
            loglikelihood(model, tok, [("", continuation)], prefix_id=bad)


def test_lm_eval_model_args_name_the_eos_prefix(exported, tmp_path):
    eos = json.loads((exported / "config.json").read_text())["eos_token_id"]
    assert lm_eval_model_args(exported) == f"pretrained={exported},trust_remote_code=True,prefix_token_id={eos}"
    config = {"model_type": "hybridlm", "eos_token_id": [5, 9]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert lm_eval_model_args(tmp_path).endswith(",prefix_token_id=5")
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    with pytest.raises(ValueError, match="eos_token_id is None"):
        lm_eval_model_args(tmp_path)
    with pytest.raises(ValueError, match="cannot read the config"):
        lm_eval_model_args(tmp_path / "nowhere")


def test_export_command_prints_the_lm_eval_command_with_the_eos_prefix(exported, tokenizer_dir, capsys):
    from hybridlm.cli import main

    assert main(["eval", "export-hf", "--model", str(exported), "--tokenizer", str(tokenizer_dir)]) == 0
    assert f"--model_args {lm_eval_model_args(exported)} --tasks" in capsys.readouterr().out


def test_export_refuses_what_lm_eval_cannot_take_before_changing_the_directory(tmp_path, tokenizer_dir):
    """No EOS id for prefix_token_id, a comma in the path (lm_eval splits --model_args at commas): refused by the
    export itself, nothing in the directory changed."""
    vocab = HybridTokenizer.load(tokenizer_dir).vocab_size
    model = build_model(task_config("transformer", vocab_size=vocab, size="tiny"), seed=0)
    for name, eos, message in (("no_eos", None, "eos_token_id is None"), ("with,comma", 2, "at commas")):
        directory = tmp_path / name
        model.save_pretrained(directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
        before = {p.name: p.read_bytes() for p in directory.iterdir()}
        with pytest.raises(ValueError, match=message):
            export_for_lm_eval(directory, tokenizer_dir=tokenizer_dir)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_a_continuation_longer_than_max_length_is_refused(exported):
    from transformers import AutoTokenizer

    from hybridlm.models.hf import load_model

    model, tok = load_model(exported), AutoTokenizer.from_pretrained(exported)
    continuation = " The model reads the data"
    n = len(tok.encode(continuation, add_special_tokens=False))
    assert len(loglikelihood(model, tok, [("a", continuation)], max_length=n)) == 1
    with pytest.raises(ValueError, match=f"has {n} tokens, more than max_length {n - 1}"):
        loglikelihood(model, tok, [("a", continuation)], max_length=n - 1)
