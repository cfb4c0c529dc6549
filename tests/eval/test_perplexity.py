"""`evaluate_perplexity` / `hybridlm eval ppl` against a direct per-document computation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hybridlm.cli import main
from hybridlm.data.shards import TokenDataset
from hybridlm.data.tokenizer import HybridTokenizer
from hybridlm.experiments.models import build_model, task_config
from hybridlm.eval.perplexity import (
    evaluate_perplexity,
    packed_batches,
    token_byte_lengths,
    windows,
)


@pytest.fixture(scope="module", params=["hybrid-mamba2", "hybrid-fw-3A"])
def model_dir(request, tmp_path_factory, tokenizer_dir):
    vocab = HybridTokenizer.load(tokenizer_dir).vocab_size
    # a large init std makes the outputs depend strongly on the context (a packing error would show)
    config = task_config(request.param, vocab_size=vocab, size="tiny", initializer_range=0.3)
    model = build_model(config, seed=0).eval()
    out = tmp_path_factory.mktemp(f"ppl_model_{request.param}")
    model.save_pretrained(out)
    return out


def _direct(model, data: TokenDataset, seq_len: int) -> tuple[float, int, list[int]]:
    """Sum of -log p over every token but each document's first, each window run alone."""
    nll, count, targets = 0.0, 0, []
    with torch.no_grad():
        for i in range(data.num_docs):
            doc = torch.from_numpy(data.doc(i))
            for start in range(0, len(doc) - 1, seq_len - 1):
                window = doc[start:start + seq_len]
                logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
                nll -= logp[torch.arange(len(window) - 1), window[1:]].sum().item()
                count += len(window) - 1
                targets += window[1:].tolist()
    return nll, count, targets


def test_byte_lengths_reproduce_utf8_sizes(tokenizer_dir, held_out_docs):
    tok = HybridTokenizer.load(tokenizer_dir)
    lengths = token_byte_lengths(tokenizer_dir)
    assert len(lengths) == tok.vocab_size and lengths[tok.eos_id] == 0
    texts = held_out_docs + [r"\frac{a}{b} \infty 你好 <|end_of_text|> é"]
    for text in texts:
        assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8"))


@pytest.mark.parametrize("seq_len", [512, 17])
def test_matches_the_direct_computation(model_dir, shards_dir, tokenizer_dir, seq_len):
    from hybridlm.models.hf import load_model

    model = load_model(model_dir)
    data = TokenDataset(shards_dir)
    lengths = token_byte_lengths(tokenizer_dir)
    result = evaluate_perplexity(model, data, seq_len=seq_len, batch_size=3, byte_lengths=lengths)
    nll, count, targets = _direct(model, data, seq_len)
    assert count == data.num_tokens - data.num_docs  # every token but each document's first, once
    assert result["tokens"] == count
    assert result["nll_sum"] == pytest.approx(nll, rel=2e-5)
    assert result["loss"] == pytest.approx(nll / count, rel=2e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=2e-5)
    n_bytes = int(lengths[targets].sum())
    assert result["bytes"] == n_bytes and result["bytes_source"] == "tokenizer"
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=2e-5)
    # documents really are kept apart: scoring the raw stream in one piece gives another number
    stream = torch.from_numpy(data.tokens(0, data.num_tokens))
    with torch.no_grad():
        logp = torch.log_softmax(model(stream[None]).logits[0].double(), -1)
    starts = {data.doc_start(i) for i in range(data.num_docs)}
    joined = -sum(logp[t - 1, stream[t]].item() for t in range(1, len(stream)) if t not in starts)
    assert abs(joined - nll) > 20 * 2e-5 * abs(nll)  # far outside the tolerance the match above is held to


def test_manifest_average_without_tokenizer_and_max_tokens(model_dir, shards_dir):
    """`max_tokens=100`: whole documents until 100 tokens are read, the one that reaches them read whole; the model
    is left in the mode it came in (training here)."""
    from hybridlm.models.hf import load_model

    data = TokenDataset(shards_dir)
    model = load_model(model_dir).train()
    result = evaluate_perplexity(model, data, seq_len=64, max_tokens=100)
    assert model.training
    docs, used = [], 0
    while used < 100:
        docs.append(data.doc(len(docs)))
        used += len(docs[-1])
    assert used > 100  # the fixture's documents do cross the 100th token
    assert result["tokens"] == used - len(docs)  # every token read but each document's first
    non_eos = sum(int((doc[1:] != data.eos_id).sum()) for doc in docs)
    per_token = data.manifest["counts"]["bytes"] / (data.num_tokens - data.num_docs)
    assert result["bytes_source"] == "manifest-average"
    assert result["bytes"] == pytest.approx(per_token * non_eos)  # EOS targets: 0 bytes
    model.eval()
    whole = evaluate_perplexity(model, TokenDataset(shards_dir), seq_len=64)
    assert not model.training and whole["tokens"] == data.num_tokens - data.num_docs


def test_a_diverged_model_and_eos_only_targets_give_strict_json(model_dir, shards_dir, tokenizer_dir, tmp_path,
                                                                 capsys):
    """A loss past exp's range: perplexity inf (printed), null in --json; targets that are all EOS: no bits per
    byte (n/a, null). The JSON parses without the NaN / Infinity extensions."""
    from hybridlm.data.shards import prepare
    from hybridlm.models.hf import load_model
    from tests.data.corpora import write_jsonl

    model = load_model(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    model.save_pretrained(tmp_path / "diverged")
    write_jsonl(tmp_path / "letters" / "val.jsonl", ["a", "b"])
    prepare([tmp_path / "letters" / "val.jsonl"], tokenizer_dir, tmp_path / "eos_only", workers=1, progress=False)

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))

    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--model", str(tmp_path / "diverged"), "--data", str(shards_dir), "--device", "cpu",
                 "--no-progress", "--json", str(out)]) == 0
    assert "perplexity inf" in capsys.readouterr().out
    result = strict(out.read_text())
    assert result["perplexity"] is None and result["loss"] > 710
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(tmp_path / "eos_only"), "--tokenizer",
                 str(tokenizer_dir), "--device", "cpu", "--no-progress", "--json", str(out)]) == 0
    assert "bits/byte n/a (every target is an EOS" in capsys.readouterr().out
    result = strict(out.read_text())
    assert result["tokens"] == 2 and result["bytes"] == 0 and result["bits_per_byte"] is None


def test_packing_keeps_windows_whole():
    class FakeData:
        num_docs = 3
        docs = (np.arange(10, 15), np.arange(20, 22), np.arange(30, 41))

        def doc(self, i):
            return self.docs[i]

    pieces = list(windows(FakeData(), seq_len=6))
    assert [p.tolist() for p in pieces] == [list(range(10, 15)), [20, 21], list(range(30, 36)), list(range(35, 41))]
    batches = list(packed_batches(iter(pieces), seq_len=8, batch_size=2))
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    pos = torch.cat([b["position_ids"] for b in batches])
    assert ids[0].tolist() == [10, 11, 12, 13, 14, 20, 21, 0] and pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    assert labels[0].tolist() == [-100, 11, 12, 13, 14, -100, 21, -100]
    assert (labels != -100).sum() == 4 + 1 + 5 + 5


def test_eval_ppl_command(model_dir, shards_dir, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(shards_dir), "--tokenizer",
                 str(tokenizer_dir), "--seq-len", "17", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "bits/byte" in printed and result["bytes_source"] == "tokenizer"
    from hybridlm.models.hf import load_model

    direct = evaluate_perplexity(load_model(model_dir), TokenDataset(shards_dir), seq_len=17,
                                 byte_lengths=token_byte_lengths(tokenizer_dir))
    assert result["loss"] == pytest.approx(direct["loss"], rel=1e-6)
    # a tokenizer the shards were not made with is refused
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text() + " ")
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(shards_dir), "--tokenizer", str(other),
                 "--device", "cpu"]) == 1
    assert "not the tokenizer" in capsys.readouterr().err
    # a --tokenizer without tokenizer.json is refused (a bad input, status 1), not replaced by the model dir's
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(shards_dir), "--tokenizer",
                 str(tmp_path), "--device", "cpu"]) == 1
    assert "no tokenizer.json" in capsys.readouterr().err


def test_eval_ppl_windows_default_to_a_short_models_context(model_dir, shards_dir, tmp_path):
    import shutil

    short = tmp_path / "short"
    shutil.copytree(model_dir, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 24  # under the default window of 2048
    (short / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--model", str(short), "--data", str(shards_dir), "--device", "cpu", "--no-progress",
                 "--json", str(out)]) == 0
    from hybridlm.models.hf import load_model

    direct = evaluate_perplexity(load_model(short), TokenDataset(shards_dir), seq_len=24)
    assert json.loads(out.read_text())["loss"] == pytest.approx(direct["loss"], rel=1e-6)


def test_eval_ppl_option_values_are_usage_errors(model_dir, shards_dir, tmp_path, capsys):
    """A bad option value is a usage error, exit status 2 as the command documents (1 is a bad input), found
    before the evaluation: a --json with no directory, a --seq-len the model cannot take, --batch-size, --device."""
    for option, message in ((["--json", str(tmp_path / "nowhere" / "ppl.json")], "needs a file name in an existing"),
                            (["--seq-len", "100000"], "longer than the model's max_position_embeddings"),
                            (["--seq-len", "1"], "--seq-len must be >= 2"),
                            (["--batch-size", "0"], "--batch-size must be >= 1"),
                            (["--max-tokens", "-5"], "--max-tokens"),
                            (["--device", "tpu"], "--device tpu")):
        device = [] if option[0] == "--device" else ["--device", "cpu"]
        assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(shards_dir), *device, *option]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.err.count("\n") == 1 and "perplexity" not in captured.out


def test_eval_ppl_shows_progress_on_stderr_unless_told_not_to(model_dir, shards_dir, capsys):
    argv = ["eval", "ppl", "--model", str(model_dir), "--data", str(shards_dir), "--seq-len", "17", "--device", "cpu"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "eval ppl" in captured.err and "tok/s" in captured.err  # the bar, with its rate
    assert captured.out.startswith("tokens ") and captured.out.count("\n") == 1 and "tok/s" not in captured.out
    assert main([*argv, "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == captured.out


def test_eval_ppl_refuses_data_with_more_ids_than_the_model(shards_dir, tmp_path, capsys):
    small = build_model(task_config("hybrid-mamba2", vocab_size=64, size="tiny"), seed=0)
    small.save_pretrained(tmp_path / "small")
    assert main(["eval", "ppl", "--model", str(tmp_path / "small"), "--data", str(shards_dir), "--device", "cpu"]) == 1
    assert "the model has 64" in capsys.readouterr().err
