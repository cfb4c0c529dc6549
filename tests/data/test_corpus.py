"""Reading input files: discovery order, formats, and every kind of bad input."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from hybridlm.data.corpus import ReadStats, decode_utf8, find_files, iter_documents
from hybridlm.data.errors import DataError
from tests.data.corpora import write_jsonl


def _read(paths, **kw):
    stats = ReadStats()
    docs = [t for _, t in iter_documents(find_files(paths), stats=stats, **kw)]
    return docs, stats


def test_find_files_is_recursive_sorted_and_deduplicated(tmp_path):
    for rel in ["b/2.txt", "a/10.jsonl", "a/1.txt", ".hidden/x.txt", "a/.secret.txt", "a/notes.csv"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    files = find_files([tmp_path, tmp_path / "a" / "1.txt"])
    assert [f.path for f in files] == [str((tmp_path / r).resolve()) for r in ["a/1.txt", "a/10.jsonl", "b/2.txt"]]
    assert [f.format for f in files] == ["txt", "jsonl", "txt"]


def test_find_files_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        find_files([tmp_path / "nope"])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        find_files([tmp_path / "x.csv"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="holds no"):
        find_files([tmp_path / "empty_dir"])


def test_txt_and_jsonl_documents_in_order(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", ["second", "third 你好"])
    docs, stats = _read([tmp_path])
    assert docs == ["first document\nwith two lines", "second", "third 你好"]
    assert (stats.files, stats.docs, stats.bytes) == (2, 3, sum(len(d.encode()) for d in docs))


def test_empty_files_and_documents_are_skipped_warned_and_counted(tmp_path, caplog):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("  \n\t ")
    (tmp_path / "ok.txt").write_text("text")
    with open(tmp_path / "mixed.jsonl", "w") as f:
        f.write(json.dumps({"text": ""}) + "\n\n" + json.dumps({"text": "kept"}) + "\n")
    with caplog.at_level(logging.WARNING):
        docs, stats = _read([tmp_path])
    assert docs == ["kept", "text"]
    assert (stats.empty_files, stats.empty_docs) == (2, 3)
    assert "blank.txt" in caplog.text and "empty.txt" in caplog.text and "ok.txt" not in caplog.text


def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path, caplog):
    (tmp_path / "bad.txt").write_bytes(b"caf\xc3\xa9 \xff\xfe ok \xe2\x82")  # 2 stray bytes, 1 truncated sequence
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "x \xff y"}\n')
    with caplog.at_level(logging.WARNING):
        docs, stats = _read([tmp_path])
    assert docs == ["x \ufffd y", "caf\u00e9 \ufffd\ufffd ok \ufffd"]
    assert (stats.invalid_utf8_docs, stats.invalid_utf8_bytes) == (2, 1 + 4)
    assert "bad.txt: 4 invalid UTF-8 bytes" in caplog.text


def test_decode_utf8_counts_bytes():
    assert decode_utf8("ok é".encode()) == ("ok é", 0)
    assert decode_utf8(b"\x80\x80a") == ("\ufffd\ufffda", 2)


def test_utf8_bom_is_dropped_from_txt(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
    assert _read([tmp_path])[0] == ["hello"]


def test_missing_text_field_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: no text field 'text' \(fields: body\).*--skip-missing-field"):
        _read([path])
    path.write_text(json.dumps({"text": None}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'text' is null; pass --text-field"):
        _read([path])


def test_missing_text_field_can_be_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"text": "a"}, {"body": "b"}, {"text": None}, {"text": "c"}]))
    docs, stats = _read([path], skip_missing_field=True)
    assert docs == ["a", "c"] and stats.missing_field == 2


def test_other_text_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["one", "two"], field="content")
    assert _read([path], text_field="content")[0] == ["one", "two"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a"', r"d\.jsonl:2: not valid JSON"),
    ('["text"]', r"d\.jsonl:2: expected a JSON object, got list"),
    ('{"text": 5}', r"d\.jsonl:2: field 'text' is a int, not a string"),
])
def test_malformed_jsonl_lines(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        _read([path])


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"d\.parquet: reading \.parquet files needs pyarrow"):
        _read([tmp_path])


def test_parquet_rows_nulls_and_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["row one", None, "row 三", ""], "n": [1, 2, 3, 4]}), tmp_path / "d.parquet",
                   row_group_size=2)
    with pytest.raises(DataError, match=r"d\.parquet:row 2: null 'text'"):
        _read([tmp_path / "d.parquet"])
    docs, stats = _read([tmp_path / "d.parquet"], skip_missing_field=True)
    assert docs == ["row one", "row 三"] and (stats.missing_field, stats.empty_docs) == (1, 1)
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text, n\)"):
        _read([tmp_path / "d.parquet"], text_field="body")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="broken.parquet: not a readable parquet file"):
        _read([tmp_path / "broken.parquet"])


def test_lone_surrogates_in_jsonl_are_replaced_counted_and_reported(tmp_path, caplog):
    """json.loads turns an unpaired "\\ud83d" escape into a str no tokenizer can take; it becomes U+FFFD."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"text": "hello \\ud83d world"}\n'
                     b'{"text": "pair \\ud83d\\ude00 ok"}\n'  # a valid pair is one character, not an error
                     b'{"text": "low \\udfff and \xff"}\n')  # a surrogate and a bad byte: one document, counted once
    with caplog.at_level(logging.WARNING):
        docs, stats = _read([path])
    assert docs == ["hello \ufffd\ufffd\ufffd world", "pair \U0001f600 ok", "low \ufffd\ufffd\ufffd and \ufffd"]
    assert (stats.invalid_utf8_docs, stats.invalid_utf8_bytes) == (2, 3 + 3 + 1)  # as the bytes would count in .txt
    assert stats.bytes == sum(len(d.encode("utf-8")) for d in docs)
    assert "s.jsonl: 7 invalid UTF-8 bytes" in caplog.text


def test_utf8_bom_is_dropped_from_jsonl(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert _read([tmp_path])[0] == ["first", "second"]


def _damage_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def test_damaged_parquet_data_names_the_file_and_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"document {i} " + "alpha beta gamma delta " * 5 for i in range(3000)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts}), path, compression="snappy", row_group_size=1000, data_page_size=4096)
    _damage_middle(path)  # the footer is intact, so the file opens and fails only when that page is read
    with pytest.raises(DataError, match=r"d\.parquet: damaged parquet data, in row \d+ or a later one \(.+\); "
                                        r"write or download the file again"):
        _read([path])


def test_parquet_string_column_with_invalid_utf8_is_replaced_and_counted(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    raw = pa.array([b"ok", b"bad \xff x"], type=pa.binary())
    # A string column whose bytes are not UTF-8 (another writer's bug); pyarrow does not check it on read.
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())}), tmp_path / "d.parquet")
    docs, stats = _read([tmp_path / "d.parquet"])
    assert docs == ["ok", "bad \ufffd x"] and (stats.invalid_utf8_docs, stats.invalid_utf8_bytes) == (1, 1)
