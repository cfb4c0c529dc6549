"""The `tokenizer` and `data` commands, driven through an argparse parser as the CLI builds it."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridlm.data.commands import add_commands
from hybridlm.data.shards import MANIFEST, TokenDataset
from tests.data.corpora import VOCAB_SIZE, documents, write_jsonl, write_txt_tree


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridlm")
    sp = p.add_subparsers(dest="command")
    add_commands(sp)
    return p


def _call(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("argv, flags", [
    (["tokenizer", "train"], ["--input", "--vocab-size", "--out", "--text-field"]),
    (["tokenizer", "stats"], ["--tokenizer", "--input"]),
    (["data", "prepare"], ["--input", "--tokenizer", "--out", "--workers", "--text-field", "--shard-tokens"]),
    (["data", "verify"], ["--data"]),
])
def test_help_lists_the_options(capsys, argv, flags):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv + ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(f in text for f in flags)


def test_missing_required_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["data", "prepare", "--input", "x"])
    assert exit_info.value.code == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_train_stats_prepare_verify(tmp_path, capsys):
    corpus = write_txt_tree(tmp_path / "corpus", documents(seed=3, n_docs=60))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", documents(seed=4, n_docs=10), field="body")
    tok = tmp_path / "tok"
    assert _call(["tokenizer", "train", "--input", str(corpus), "--vocab-size", str(VOCAB_SIZE), "--out", str(tok),
                  "--no-progress"]) == 0
    assert "60 documents" in capsys.readouterr().out
    assert (tok / "tokenizer.json").is_file()

    assert _call(["tokenizer", "stats", "--tokenizer", str(tok), "--input", str(held_out), "--text-field", "body",
                  "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["docs"] == 10 and s["fertility"] > 1.0 and s["bytes_per_token"] > 1.0

    out = tmp_path / "data"
    argv = ["data", "prepare", "--input", str(corpus), "--tokenizer", str(tok), "--out", str(out),
            "--workers", "1", "--shard-tokens", "300", "--no-progress"]
    assert _call(argv) == 0
    first = capsys.readouterr().out
    manifest = json.loads((out / MANIFEST).read_text())
    assert first.startswith(f"wrote {manifest['num_tokens']} tokens, 60 documents") and manifest["shard_tokens"] == 300
    assert _call(argv) == 0
    assert capsys.readouterr().out.startswith("up to date:")

    assert _call(["data", "verify", "--data", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {manifest['num_tokens']} tokens")
    TokenDataset(out)

    # other settings into the same --out: a usage error (exit 2) that leaves the dataset as it was
    kept = (out / MANIFEST).read_bytes()
    assert _call([*argv[:-3], "--shard-tokens", "500", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} already holds a dataset prepared from other inputs or settings (differs in: "
                          "shard_tokens)") and err.count("\n") == 1, err
    assert (out / MANIFEST).read_bytes() == kept


def test_errors_exit_1_with_a_message(tmp_path, tokenizer_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    rc = _call(["data", "prepare", "--input", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"),
                "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "bad.jsonl:2: no text field 'text'" in err and "Traceback" not in err

    assert _call(["data", "verify", "--data", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["tokenizer", "train", "--input", "x", "--out", "t", "--vocab-size", "500"], "vocab_size 500 is too small"),
    (["data", "prepare", "--input", "x", "--tokenizer", "t", "--out", "o", "--workers", "0"], "must be >= 1, got 0"),
    (["data", "prepare", "--input", "x", "--tokenizer", "t", "--out", "o", "--shard-tokens", "-3"], "got -3"),
])
def test_option_values_out_of_range_are_usage_errors(capsys, argv, message):
    """An option's value out of range exits with status 2 (a usage error, as the module documents), naming the
    option, before any input is read; a data problem is status 1."""
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}: " in err and message in err


def test_lone_surrogates_are_counted_not_a_crash(tmp_path, tokenizer_dir, capsys):
    """A "\\ud83d" escape without its pair: every command replaces and counts it instead of a traceback."""
    corpus = tmp_path / "s.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(seed=5, n_docs=30))
                      + '{"text": "hello \\ud83d world"}\n')
    assert _call(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir),
                  "--out", str(tmp_path / "data"), "--workers", "1", "--no-progress"]) == 0
    assert "invalid UTF-8: 1 documents (3 bytes replaced)" in capsys.readouterr().out
    assert _call(["tokenizer", "stats", "--tokenizer", str(tokenizer_dir), "--input", str(corpus), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["docs"] == 31
    assert _call(["tokenizer", "train", "--input", str(corpus), "--vocab-size", str(VOCAB_SIZE),
                  "--out", str(tmp_path / "tok"), "--no-progress"]) == 0
    assert "31 documents" in capsys.readouterr().out


def test_stats_of_an_empty_input_exits_1(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    rc = _call(["tokenizer", "stats", "--tokenizer", str(tokenizer_dir), "--input", str(tmp_path / "empty.jsonl"),
                "--json"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == "" and "no text found in" in captured.err and "empty.jsonl" in captured.err


def test_tokenizer_train_refuses_to_replace_a_tokenizer_without_overwrite(tmp_path, capsys, monkeypatch):
    """Shards prepared with the old tokenizer would silently stop matching a new one: refused before any training, as a
    usage error (exit 2, as `hybridlm train` refuses an existing run), not as a failure (1)."""
    import hybridlm.data.tokenizer as T

    tok = tmp_path / "tok"
    first = write_jsonl(tmp_path / "a.jsonl", documents(seed=6, n_docs=40))
    assert _call(["tokenizer", "train", "--input", str(first), "--vocab-size", str(VOCAB_SIZE), "--out", str(tok),
                  "--no-progress"]) == 0
    kept = (tok / "tokenizer.json").read_bytes()
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking --out")

    second = write_jsonl(tmp_path / "b.jsonl", documents(seed=7, n_docs=40))
    argv = ["tokenizer", "train", "--input", str(second), "--vocab-size", str(VOCAB_SIZE), "--out", str(tok),
            "--no-progress"]
    with monkeypatch.context() as m:
        m.setattr(T, "train_from_texts", no_training)
        assert _call(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tok} already holds a tokenizer") and "--overwrite" in err and err.count("\n") == 1
    assert (tok / "tokenizer.json").read_bytes() == kept
    assert _call([*argv, "--overwrite"]) == 0
    assert json.loads((tok / "hybridlm_tokenizer.json").read_text())["training"]["files"] == [str(second)]


@pytest.mark.parametrize("value", ["0", "-5", "ten"])
def test_tokenizer_train_max_bytes_below_1_is_a_usage_error(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["tokenizer", "train", "--input", "x", "--vocab-size", "1600", "--out", str(tmp_path),
                              "--max-bytes", value])
    assert exit_info.value.code == 2
    assert "--max-bytes" in capsys.readouterr().err
    from hybridlm.data.tokenizer import train_tokenizer

    with pytest.raises(ValueError, match="max_bytes must be >= 1"):  # the library: not "no limit" either
        train_tokenizer([tmp_path], 1600, tmp_path / "tok", max_bytes=0)


def test_an_out_that_is_a_file_is_a_usage_error(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """`--out FILE` (or a path through one): the file named, exit 2, no "[Errno 17]", and no training first."""
    import hybridlm.data.tokenizer as T
    from hybridlm.cli import main

    corpus = write_jsonl(tmp_path / "c.jsonl", documents(seed=8, n_docs=20))
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setattr(T, "train_from_texts", lambda *a, **k: pytest.fail("trained before checking --out"))
    for out in (a_file, a_file / "tok"):
        assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", str(VOCAB_SIZE), "--out", str(out),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err == f"hybridlm tokenizer: {a_file} is a file, not a directory; give a directory path (or move the " \
                      "file away)\n", err
    for out in (a_file, a_file / "data"):
        assert main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                     "--workers", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f": {a_file} is a file, not a directory" in err and "Errno" not in err, err
