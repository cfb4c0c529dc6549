"""`prepare` and `TokenDataset`: shard layout, determinism, idempotence, resuming, corruption."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from hybridlm.data import shards
from hybridlm.data.errors import DataError
from hybridlm.data.shards import MANIFEST, PROGRESS, TokenDataset, prepare, token_dtype
from hybridlm.fileio import FileLock
from tests.data.corpora import documents, write_jsonl, write_txt_tree

SHARD = 397  # small and odd, so documents cross shard boundaries


@pytest.fixture
def corpus(tmp_path):
    docs = documents(seed=1, n_docs=40, lo=3, hi=40)
    write_txt_tree(tmp_path / "in" / "tree", docs[:25])
    write_jsonl(tmp_path / "in" / "extra.jsonl", docs[25:])
    (tmp_path / "in" / "empty.txt").write_bytes(b"")
    return tmp_path / "in", docs


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("shard_")}


def _run(corpus_dir, tokenizer_dir, out, **kw):
    kw.setdefault("workers", 1)
    return prepare([corpus_dir], tokenizer_dir, out, shard_tokens=SHARD, progress=False, **kw)


def test_layout_manifest_and_documents(corpus, tokenizer_dir, tokenizer, tmp_path):
    corpus_dir, docs = corpus
    result = _run(corpus_dir, tokenizer_dir, tmp_path / "out")
    m = result.manifest
    assert result.status == "created"
    # Document order: files by relative path ("empty.txt" < "extra.jsonl" < "tree/...").
    order = docs[25:] + [docs[i] for p in range(3) for i in range(25) if i % 3 == p]
    expected = [tokenizer.encode(d) + [tokenizer.eos_id] for d in order]
    assert m["num_docs"] == len(expected) and m["num_tokens"] == sum(map(len, expected))
    assert m["dtype"] == "uint16" and m["eos_id"] == 2
    assert m["counts"]["empty_files"] == 1 and m["counts"]["files"] == 27
    sizes = [s["tokens"] for s in m["shards"]]
    assert all(n == SHARD for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD and sum(sizes) == m["num_tokens"]
    for s in m["shards"]:
        raw = (tmp_path / "out" / s["name"]).read_bytes()
        assert len(raw) == 2 * s["tokens"] and hashlib.sha256(raw).hexdigest() == s["sha256"]
    assert sum(s["tokens"] for s in m["sources"]) == m["num_tokens"]
    assert [s["docs"] for s in m["sources"]][:2] == [0, 15]  # empty.txt, extra.jsonl
    ds = TokenDataset(tmp_path / "out")
    assert [ds.doc(i).tolist() for i in range(ds.num_docs)] == expected
    assert tokenizer.decode(ds.doc(3)[:-1]) == order[3]
    flat = np.concatenate([np.fromfile(tmp_path / "out" / s["name"], dtype="<u2") for s in m["shards"]])
    assert flat.tolist() == sum(expected, [])
    assert not (tmp_path / "out" / PROGRESS).exists()


def test_output_does_not_depend_on_workers(corpus, tokenizer_dir, tmp_path):
    corpus_dir, _ = corpus
    a = _run(corpus_dir, tokenizer_dir, tmp_path / "w1", workers=1, batch_docs=3)
    b = _run(corpus_dir, tokenizer_dir, tmp_path / "w2", workers=2, batch_docs=3)
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")
    assert a.manifest["shards"] == b.manifest["shards"]


def test_rerun_is_a_no_op(corpus, tokenizer_dir, tmp_path, monkeypatch):
    corpus_dir, _ = corpus
    _run(corpus_dir, tokenizer_dir, tmp_path / "out")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}

    def no_tokenizing(texts):
        raise AssertionError("a complete dataset was tokenized again")

    monkeypatch.setattr(shards, "_encode", no_tokenizing)
    assert _run(corpus_dir, tokenizer_dir, tmp_path / "out").status == "up_to_date"
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before


def test_interrupted_run_resumes_to_identical_output(corpus, tokenizer_dir, tmp_path, monkeypatch):
    corpus_dir, _ = corpus
    _run(corpus_dir, tokenizer_dir, tmp_path / "whole")
    total_docs = json.loads((tmp_path / "whole" / MANIFEST).read_text())["num_docs"]

    real_write, calls = shards._ShardWriter._write, []

    def crash_on_fourth_shard(self, tokens, end):
        calls.append(end)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real_write(self, tokens, end)

    monkeypatch.setattr(shards._ShardWriter, "_write", crash_on_fourth_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus_dir, tokenizer_dir, tmp_path / "out")
    monkeypatch.setattr(shards._ShardWriter, "_write", real_write)
    out = tmp_path / "out"
    assert not (out / MANIFEST).exists() and (out / PROGRESS).exists()
    assert sorted(p.name for p in out.glob("shard_*.bin")) == [f"shard_0000{i}.bin" for i in range(3)]
    with pytest.raises(DataError, match="has not finished"):
        TokenDataset(out)

    tokenized = []
    real_encode = shards._encode
    monkeypatch.setattr(shards, "_encode", lambda texts: (tokenized.extend(texts), real_encode(texts))[1])
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", 3)
    assert len(tokenized) == total_docs - calls[2]["doc"]  # starts at the document the 3rd shard ended in
    assert calls[2]["offset"] > 0  # ... which it had cut in the middle
    assert _files(out) == _files(tmp_path / "whole")
    assert result.manifest == json.loads((tmp_path / "whole" / MANIFEST).read_text())


def test_failed_write_leaves_no_partial_file(corpus, tokenizer_dir, tmp_path, monkeypatch):
    corpus_dir, _ = corpus
    real_replace = shards.os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("shard_00001.bin"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(shards.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        _run(corpus_dir, tokenizer_dir, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [".prepare.lock", PROGRESS, "shard_00000.bin", "shard_00000.idx"]
    monkeypatch.setattr(shards.os, "replace", real_replace)
    (tmp_path / "out" / "shard_00001.bin.tmp-12345").write_bytes(b"left by a killed run")
    assert _run(corpus_dir, tokenizer_dir, tmp_path / "out").status == "resumed"
    assert not list((tmp_path / "out").glob("*.tmp-*"))
    TokenDataset(tmp_path / "out")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_detected_and_repaired(corpus, tokenizer_dir, tmp_path, damage):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    _run(corpus_dir, tokenizer_dir, out)
    good = _files(out)
    victim = out / "shard_00002.bin"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[5] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-3]))
    else:
        victim.unlink()
    expected = {"flip": "sha256 does not match", "truncate": f"has {2 * SHARD - 3} bytes but the manifest says {2 * SHARD}",
                "delete": "is missing"}[damage]
    with pytest.raises(DataError, match=rf"shard_00002\.bin.*{expected}.*re-run `hybridlm data prepare`"):
        TokenDataset(out)
    if damage == "flip":
        TokenDataset(out, verify="size")  # a size check alone cannot see a flipped bit
    else:
        with pytest.raises(DataError):
            TokenDataset(out, verify="size")
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", 2)
    assert _files(out) == good
    TokenDataset(out)


def test_other_inputs_into_the_same_directory(corpus, tokenizer_dir, tmp_path):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    _run(corpus_dir, tokenizer_dir, out)
    with pytest.raises(DataError, match=r"other inputs or settings \(differs in: shard_tokens\).*--overwrite"):
        prepare([corpus_dir], tokenizer_dir, out, shard_tokens=SHARD + 1, workers=1, progress=False)
    (corpus_dir / "extra.jsonl").write_text('{"text": "changed"}\n')
    with pytest.raises(DataError, match=r"differs in: sources"):
        _run(corpus_dir, tokenizer_dir, out)
    result = _run(corpus_dir, tokenizer_dir, out, overwrite=True)
    assert result.status == "created" and result.manifest["sources"][1]["docs"] == 1
    assert len(list(out.glob("shard_*.bin"))) == len(result.manifest["shards"])


def test_bad_record_stops_before_anything_is_published(tmp_path, tokenizer_dir):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)) + '{"body": "x"}\n')
    with pytest.raises(DataError, match=r"in\.jsonl:31: no text field 'text'"):  # after some shards are written
        prepare([path], tokenizer_dir, tmp_path / "out", shard_tokens=10, workers=1, progress=False, batch_docs=4)
    assert not (tmp_path / "out" / MANIFEST).exists()
    result = prepare([path], tokenizer_dir, tmp_path / "out2", shard_tokens=10, workers=1, progress=False,
                     skip_missing_field=True)
    assert result.manifest["counts"]["missing_field"] == 1 and result.manifest["num_docs"] == 30
    # The file fixed: its shards written before the bad record are another input's, kept unless told
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(31)))
    with pytest.raises(DataError, match=r"holds an unfinished preparation of other inputs or settings \(\d+ shards "
                                        r"written; differs in: sources\); to start over with these, pass --overwrite"):
        prepare([path], tokenizer_dir, tmp_path / "out", shard_tokens=10, workers=1, progress=False)
    fixed = prepare([path], tokenizer_dir, tmp_path / "out", shard_tokens=10, workers=1, progress=False,
                    overwrite=True)
    assert fixed.manifest["num_docs"] == 31


def test_a_run_stopped_before_its_first_shard_leaves_nothing_in_the_way(tmp_path, tokenizer_dir):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "one"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"in\.jsonl:2: no text field 'text'"):
        prepare([path], tokenizer_dir, tmp_path / "out", workers=1, progress=False)
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    result = prepare([path], tokenizer_dir, tmp_path / "out", workers=1, progress=False)
    assert result.status == "created" and result.manifest["num_docs"] == 2


def test_bad_settings_are_refused(corpus, tokenizer_dir, tmp_path):
    for options, message in ((dict(workers=0), "workers must be >= 1"), (dict(shard_tokens=0), "shard_tokens")):
        with pytest.raises(DataError, match=message):
            prepare([corpus[0]], tokenizer_dir, tmp_path / "out", progress=False, **options)


def test_token_dtype_by_vocab_size():
    assert token_dtype(1800) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(262144) == np.uint32


def test_open_rejects_non_datasets(tmp_path):
    with pytest.raises(DataError, match=f"dataset directory {tmp_path / 'nope'} does not exist$"):
        TokenDataset(tmp_path / "nope")
    with pytest.raises(DataError, match=r"dataset directory data/web does not exist \(relative to the current "
                                        rf"directory, {os.getcwd()}\)"):
        TokenDataset("data/web")
    from hybridlm.data.tokenizer import HybridTokenizer

    with pytest.raises(DataError, match=f"tokenizer directory {tmp_path / 'nope'} does not exist"):
        HybridTokenizer.load(tmp_path / "nope")
    with pytest.raises(DataError, match="no manifest.json"):
        TokenDataset(tmp_path)
    (tmp_path / MANIFEST).write_text("{broken")
    with pytest.raises(DataError, match="damaged"):
        TokenDataset(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("shards"), "'shards' missing"),
    (lambda m: m.update(dtype="blah"), "dtype 'blah' is not a numpy dtype"),
    (lambda m: m["shards"][0].pop("sha256"), r"shards\[0\]\.sha256 missing"),
    (lambda m: m["shards"].__setitem__(0, "x"), r"shards\[0\] is not an object"),
])
def test_open_rejects_a_hand_edited_manifest(corpus, tokenizer_dir, tmp_path, edit, message):
    _run(corpus[0], tokenizer_dir, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    edit(manifest)
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"damaged \\({message}"):
        TokenDataset(tmp_path / "out")


def test_parquet_input(tmp_path, tokenizer_dir, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = documents(seed=5, n_docs=12)
    pq.write_table(pa.table({"content": docs}), tmp_path / "d.parquet", row_group_size=5)
    result = prepare([tmp_path / "d.parquet"], tokenizer_dir, tmp_path / "out", text_field="content", workers=1,
                     shard_tokens=SHARD, progress=False)
    ds = TokenDataset(tmp_path / "out")
    assert result.manifest["sources"][0]["format"] == "parquet"
    assert [tokenizer.decode(ds.doc(i)[:-1]) for i in range(ds.num_docs)] == docs


def _interrupt_at_shard(monkeypatch, n: int) -> list:
    """Make the n-th shard write of the next run raise KeyboardInterrupt (Ctrl-C); returns the ends seen."""
    real_write, calls = shards._ShardWriter._write, []

    def write(self, tokens, end):
        calls.append(end)
        if len(calls) == n:
            raise KeyboardInterrupt
        real_write(self, tokens, end)

    monkeypatch.setattr(shards._ShardWriter, "_write", write)
    return calls


def _progress_shards(out) -> list[str]:
    return [s["name"] for s in json.loads((out / PROGRESS).read_text())["shards"]]


def test_interrupted_resume_keeps_the_earlier_shards(corpus, tokenizer_dir, tmp_path, monkeypatch):
    """A resume killed before its first new shard must not forget the shards of the run before it."""
    corpus_dir, _ = corpus
    _run(corpus_dir, tokenizer_dir, tmp_path / "whole")
    out = tmp_path / "out"
    _interrupt_at_shard(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus_dir, tokenizer_dir, out)
    _interrupt_at_shard(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus_dir, tokenizer_dir, out)
    assert _progress_shards(out) == [f"shard_0000{i}.bin" for i in range(3)]
    monkeypatch.undo()
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", 3)
    assert _files(out) == _files(tmp_path / "whole")


def test_interrupted_repair_keeps_the_intact_shards(corpus, tokenizer_dir, tmp_path, monkeypatch):
    """Repairing a complete dataset removes its manifest; progress.json must hold the intact prefix first."""
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    _run(corpus_dir, tokenizer_dir, out)
    good = _files(out)
    victim = out / "shard_00002.bin"
    victim.write_bytes(b"\x00\x00" + victim.read_bytes()[2:])
    _interrupt_at_shard(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        _run(corpus_dir, tokenizer_dir, out)
    assert not (out / MANIFEST).exists() and not victim.exists()
    assert _progress_shards(out) == ["shard_00000.bin", "shard_00001.bin"]
    monkeypatch.undo()
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", 2)
    assert _files(out) == good


@pytest.mark.parametrize("edit", [lambda m: m.pop("num_docs"), lambda m: m.update(complete=False),
                                  lambda m: m.update(num_tokens=1)],
                         ids=["num_docs_missing", "marked_incomplete", "num_tokens_not_the_total"])
def test_damaged_manifest_fields_are_rewritten_keeping_every_shard(corpus, tokenizer_dir, tmp_path, monkeypatch,
                                                                    edit):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    whole = _run(corpus_dir, tokenizer_dir, out).manifest
    good = _files(out)
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"re-run `hybridlm data prepare`.*keeps the intact shards"):
        TokenDataset(out)

    def no_tokenizing(texts):
        raise AssertionError("intact shards were tokenized again")

    monkeypatch.setattr(shards, "_encode", no_tokenizing)
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", len(whole["shards"]))
    assert result.manifest == whole and _files(out) == good
    TokenDataset(out)


def test_damaged_shard_entry_keeps_the_shards_before_it(corpus, tokenizer_dir, tmp_path):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    whole = _run(corpus_dir, tokenizer_dir, out).manifest
    good = _files(out)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["shards"][3]["sha256"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"shards\[3\]\.sha256 missing.*keeps the intact shards"):
        TokenDataset(out)
    result = _run(corpus_dir, tokenizer_dir, out)
    assert (result.status, result.kept_shards) == ("resumed", 3)
    assert result.manifest == whole and _files(out) == good


def test_unreadable_manifest_says_every_shard_is_prepared_again(corpus, tokenizer_dir, tmp_path, caplog):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    _run(corpus_dir, tokenizer_dir, out)
    good = _files(out)
    (out / MANIFEST).write_text('{"format": "hybridlm-sha')  # cut off: the checksums are gone
    with pytest.raises(DataError, match=r"checksums are lost; re-run .* to prepare every shard again"):
        TokenDataset(out)
    with caplog.at_level("WARNING"):
        result = _run(corpus_dir, tokenizer_dir, out)
    assert "manifest.json is not readable JSON" in caplog.text and "preparing every shard again" in caplog.text
    assert (result.status, result.kept_shards) == ("created", 0)
    assert _files(out) == good


def _gapped_tokenizer(directory):
    """A word-level tokenizer whose ids have a gap: 6 tokens, the largest id 70,000 (past uint16)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hybridlm.data.tokenizer import HybridTokenizer

    vocab = {"<|pad|>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, "<unk>": 3, "a": 4, "far": 70_000}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = HybridTokenizer(raw, {"special_tokens": {"pad": 0, "bos": 1, "eos": 2}})
    tok.save(directory)
    return tok


def test_ids_past_the_vocabulary_size_get_a_wide_enough_dtype(tmp_path):
    tok = _gapped_tokenizer(tmp_path / "tok")
    assert (tok.vocab_size, tok.id_limit) == (6, 70_001)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": "a far a"}) + "\n")
    result = prepare([path], tmp_path / "tok", tmp_path / "out", shard_tokens=SHARD, workers=1, progress=False)
    assert result.manifest["dtype"] == "uint32" and result.manifest["vocab_size"] == 70_001
    assert TokenDataset(tmp_path / "out").doc(0).tolist() == [4, 70_000, 4, 2]


def test_writer_refuses_an_id_its_dtype_cannot_hold(tmp_path):
    writer = shards._ShardWriter(tmp_path, np.dtype("<u2"), 4, [], lambda entries: None)
    with pytest.raises(DataError, match=r"token id 70000 does not fit .* uint16 \(ids up to 65535\)"):
        writer.add(0, np.array([5, 70_000, 2, 9], dtype=np.uint32), 4, is_start=True)
    assert not list(tmp_path.iterdir())  # nothing wrapped was written


def test_a_second_prepare_into_a_directory_being_written_is_refused(corpus, tokenizer_dir, tmp_path):
    corpus_dir, _ = corpus
    out = tmp_path / "out"
    out.mkdir()
    held = FileLock(out / shards.LOCK)  # what a running `prepare` in another process holds
    assert held.acquire()
    with pytest.raises(DataError, match=r"another `prepare` is writing to .*out; wait for it to finish"):
        _run(corpus_dir, tokenizer_dir, out)
    assert sorted(p.name for p in out.iterdir()) == [shards.LOCK]  # nothing written
    held.release()
    assert _run(corpus_dir, tokenizer_dir, out).status == "created"
    assert FileLock(out / shards.LOCK).acquire()  # released when prepare returns


def test_ctrl_c_in_data_prepare_is_one_line_and_status_130(corpus, tokenizer_dir, tmp_path, monkeypatch, capsys,
                                                           caplog):
    """The command says how far it got (the shards kept, that a rerun resumes) in one logged line, no traceback."""
    from hybridlm.cli import main

    corpus_dir, _ = corpus
    _interrupt_at_shard(monkeypatch, 3)
    code = main(["data", "prepare", "--input", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--out",
                 str(tmp_path / "out"), "--workers", "1", "--shard-tokens", str(SHARD), "--no-progress"])
    assert code == 130 and capsys.readouterr().err == ""
    said = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert said == ["interrupted after 2 complete shards; run the same command again to resume"], said
