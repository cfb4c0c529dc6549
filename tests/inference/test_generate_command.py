"""`hybridlm generate`: text through our own tokenizer or a transformers one, batched prompts, seeded sampling,
and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridlm.cli import main
from hybridlm.inference import generate
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM
from tests.inference.helpers import count_decoder_steps
from tests.models.falcon_reference import randomize_

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(44)]


def save_model(path: Path, vocab_size: int, **changes) -> HybridForCausalLM:
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
                  mamba_d_state=6, mamba_chunk_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(changes)
    torch.manual_seed(0)
    model = HybridForCausalLM(HybridConfig(**fields)).eval()
    randomize_(model, 0)
    model.save_pretrained(path)
    return model


@pytest.fixture
def word_model(tmp_path) -> tuple[Path, HybridForCausalLM]:
    """A model directory with a transformers word-level tokenizer in it (ids = positions in WORDS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(tmp_path)
    return tmp_path, save_model(tmp_path, len(WORDS), max_position_embeddings=12)


def words(ids) -> str:
    return " ".join(WORDS[i] for i in ids)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_text_matches_the_library(word_model, capsys, monkeypatch):
    path, model = word_model
    steps = count_decoder_steps(monkeypatch)
    code, out, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6)
    assert code == 0, err
    expected = generate(model, torch.tensor([[9, 11, 13]]), max_new_tokens=6, eos_token_id=2)
    new = [t for t, real in zip(expected.sequences[0, 3:].tolist(), expected.attention_mask[0, 3:]) if real]
    words_out = [t for t in new if t >= 4]  # the transformers decode skips special tokens (<pad> <s> </s> <unk>)
    assert len(words_out) >= 3
    assert out == "w5 w7 w9 " + words(words_out) + "\n"  # the word-level decoder joins tokens with spaces
    assert (steps.count > 0) == torch.cuda.is_available()  # by default the fixed-shape step on CUDA alone
    # --graph: the fixed-shape decoding step (a CUDA graph on a GPU, eager here) writes the same text.
    code, graphed, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6, "--graph")
    assert code == 0 and graphed == out, err
    assert steps.count >= 1  # the decoder ran (it is not the dynamic path's output twice)
    counted = steps.count
    code, eager, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6, "--eager")
    assert code == 0 and eager == out and steps.count == counted, err  # --eager: the growing cache, no decoder
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "--model", path, "--prompt", "w5", "--graph", "--eager")
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    # --prefill-chunk: the prompt prefilled a token at a time writes the same text, also in a batch of two lengths.
    code, pieces, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6,
                            "--prefill-chunk", 1)
    assert code == 0 and pieces == out, err
    two = ("--model", path, "--prompt", "w1", "--prompt", "w2 w3 w4 w5", "--max-new-tokens", 4)
    code, at_once, err = run(capsys, *two)
    assert code == 0, err
    assert run(capsys, *two, "--prefill-chunk", 1)[1] == at_once


def test_prompts_batch_and_seeded_sampling_repeats(word_model, capsys):
    path, _ = word_model
    argv = ("--model", path, "--prompt", "w1", "--prompt", "w2 w3 w4 w5", "--max-new-tokens", 5,
            "--temperature", 1.0, "--top-k", 20, "--top-p", 0.9, "--seed", 7)
    code, first, err = run(capsys, *argv)
    assert code == 0, err
    assert run(capsys, *argv)[1] == first
    blocks = first.rstrip("\n").split("\n" + "-" * 40 + "\n")
    assert len(blocks) == 2 and blocks[0].startswith("w1") and blocks[1].startswith("w2 w3 w4 w5")
    # Each prompt of the batch continues as it would alone (greedy, so the comparison is exact).
    _, alone, _ = run(capsys, "--model", path, "--prompt", "w2 w3 w4 w5", "--max-new-tokens", 5)
    _, batched, _ = run(capsys, "--model", path, "--prompt", "w1", "--prompt", "w2 w3 w4 w5", "--max-new-tokens", 5)
    assert batched.rstrip("\n").split("\n" + "-" * 40 + "\n")[1] + "\n" == alone


def test_our_tokenizer_format(tmp_path, capsys):
    from hybridlm.data.tokenizer import train_tokenizer

    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 50)
    tok = train_tokenizer([tmp_path / "corpus.txt"], 1600, tmp_path / "tok")
    model = save_model(tmp_path / "model", tok.vocab_size, eos_token_id=tok.eos_id)
    code, out, err = run(capsys, "--model", tmp_path / "model", "--tokenizer", tmp_path / "tok",
                         "--prompt", "the cat", "--max-new-tokens", 4)
    assert code == 0, err
    ids = torch.tensor([tok.encode("the cat")])
    expected = generate(model, ids, max_new_tokens=4, eos_token_id=tok.eos_id)
    new = [t for t, real in zip(expected.sequences[0, 2:].tolist(), expected.attention_mask[0, 2:]) if real]
    assert out == tok.decode(ids[0].tolist() + [t for t in new if t != tok.eos_id]) + "\n"  # byte-level: exact
    assert "note" not in err  # no tokenizer saved with the model to differ from
    tok.save(tmp_path / "model")  # the model's own, then another one given
    (tmp_path / "corpus.txt").write_text("a dog ran in the park. " * 50)
    train_tokenizer([tmp_path / "corpus.txt"], 1600, tmp_path / "other")
    code, out, err = run(capsys, "--model", tmp_path / "model", "--tokenizer", tmp_path / "other",
                         "--prompt", "the cat", "--max-new-tokens", 2)
    assert code == 0 and err == (f"hybridlm generate: note: --tokenizer {tmp_path / 'other'} is not the tokenizer "
                                 f"saved with the model ({tmp_path / 'model' / 'tokenizer.json'}); the text is "
                                 "encoded and decoded with the one given\n")
    code, out, err = run(capsys, "--model", tmp_path / "model", "--tokenizer", tmp_path / "tok",
                         "--prompt", "the cat", "--max-new-tokens", 2)
    assert code == 0 and err == ""  # the same tokenizer from elsewhere


def test_errors_are_one_line(word_model, tmp_path, capsys):
    path, _ = word_model
    code, out, err = run(capsys, "--model", tmp_path / "missing", "--prompt", "w1")
    assert code == 1 and out == "" and err == f"hybridlm generate: model directory {tmp_path / 'missing'} does not exist\n"
    code, out, err = run(capsys, "--model", path / "model.safetensors", "--prompt", "w1")
    assert code == 1 and out == "" and err == (
        f"hybridlm generate: --model takes the checkpoint directory (the folder holding config.json), not the file "
        f"{path / 'model.safetensors'}: pass --model {path}\n")
    long_prompt = " ".join(f"w{i}" for i in range(13))
    code, _, err = run(capsys, "--model", path, "--prompt", long_prompt)
    assert code == 1 and "has 13 tokens, more than the model's max_position_embeddings 12" in err
    code, _, err = run(capsys, "--model", path, "--prompt", "w1 w2 w3", "--max-new-tokens", 10)
    assert code == 1 and "= 13 positions, more than the model's max_position_embeddings 12" in err
    assert "at most 9 new tokens" in err
    for flags, message in ((["--temperature", -1], "argument --temperature: must be a finite number >= 0, got -1"),
                           (["--top-p", 1.5], "argument --top-p: must be in (0, 1], got 1.5"),
                           (["--top-k", 0], "argument --top-k: must be >= 1, got 0"),
                           (["--max-new-tokens", 0], "argument --max-new-tokens: must be >= 1, got 0")):
        with pytest.raises(SystemExit) as stopped:  # found while parsing, before the model loads
            run(capsys, "--model", path, "--prompt", "w1", *flags)
        assert stopped.value.code == 2 and message in capsys.readouterr().err
    code, _, err = run(capsys, "--model", path, "--prompt", "w1", "--top-k", 5, "--seed", 1)
    assert code == 2 and err == "hybridlm generate: --top-k, --seed only act when sampling: pass --temperature > 0 " \
                               "with them (0, the default, decodes greedily)\n"
    bare = tmp_path / "bare"
    save_model(bare, len(WORDS))
    code, _, err = run(capsys, "--model", bare, "--prompt", "w1")
    assert code == 1 and f"no tokenizer in {bare}" in err and "--tokenizer" in err
    for device in ("cuda:7", "bogus"):
        code, _, err = run(capsys, "--model", path, "--prompt", "w1", "--device", device)
        assert code == 1 and err.startswith(f"hybridlm generate: --device {device}: ") and err.count("\n") == 1
    (path / "model.safetensors").rename(tmp_path / "weights")  # a directory without its weights
    code, _, err = run(capsys, "--model", path, "--prompt", "w1")
    (tmp_path / "weights").rename(path / "model.safetensors")
    assert code == 1 and "the weights do not load" in err and err.count("\n") == 1


def test_eos_of_the_generation_config_a_pad_past_the_vocabulary_and_a_full_context(word_model, capsys):
    """An eos id kept only in generation_config.json stops decoding there; a tokenizer whose pad token was added past
    the model's vocabulary still generates (rows after their eos get an id of the model's); a prompt that fills the
    whole context is an error that says so."""
    import json

    path, model = word_model
    greedy = generate(model, torch.tensor([[9, 11, 13]]), max_new_tokens=6).sequences[0, 3:].tolist()
    stop = next(t for t in greedy if t >= 4)  # the first word the model writes (ids 0-3 are special)
    code, out, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6)
    assert code == 0 and out.split()[3] == WORDS[stop], (out, err)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop]}))
    code, out, err = run(capsys, "--model", path, "--prompt", "w5 w7 w9", "--max-new-tokens", 6)
    assert code == 0 and out.split() == ["w5", "w7", "w9"], (out, err)  # stopped at that word, which is not shown
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": "end"}))
    code, _, err = run(capsys, "--model", path, "--prompt", "w5")
    assert code == 1 and "generation_config.json: eos_token_id must be an id or a list of ids" in err
    (path / "generation_config.json").write_text(json.dumps(config))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    assert tok.pad_token_id == len(WORDS)  # past the model's vocabulary
    tok.save_pretrained(path / "tok_pad")
    code, out, err = run(capsys, "--model", path, "--tokenizer", path / "tok_pad", "--prompt", "w5 w7 w9",
                         "--prompt", "w1", "--max-new-tokens", 6)
    assert code == 0, err
    code, _, err = run(capsys, "--model", path, "--prompt", " ".join(f"w{i}" for i in range(12)))
    assert code == 1 and "no position is left for a new token" in err
