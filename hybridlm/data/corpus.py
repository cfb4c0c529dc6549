"""Input corpora: find .txt / .jsonl / .parquet files and read them as documents, counting bad input.

    files = find_files(["corpus/", "extra.jsonl"])
    stats = ReadStats()
    for file_index, text in iter_documents(files, text_field="text", stats=stats):
        ...

One document is a whole .txt file, one line (JSON object) of a .jsonl file, or one row of a .parquet file.
Bad input is handled so that a long run never dies late on something it could have reported:
- empty documents (nothing but whitespace) are skipped and counted; a file that yields no document at
  all is logged as a warning and counted in `empty_files`;
- invalid UTF-8 is replaced by U+FFFD, counted per document and per byte, and logged once per file;
  a lone UTF-16 surrogate escaped in a .jsonl string ("\\ud83d" without its pair) has no UTF-8 form and
  is treated the same: its 3 surrogate bytes count as invalid and become U+FFFD, as they would in a .txt;
- a UTF-8 byte order mark at the start of a .txt or .jsonl file is dropped;
- a .parquet file whose data cannot be read (damaged page, truncated file) is an error naming the file;
- a .jsonl line that is not a JSON object, or a text value that is not a string, is an error naming the
  file and line;
- a missing text field (or null) is an error naming the file and line, unless `skip_missing_field=True`,
  which skips the record and counts it in `missing_field`.
.parquet needs pyarrow, imported only when a .parquet file is read.
"""

from __future__ import annotations

import codecs
import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from hybridlm.data.errors import DataError

log = logging.getLogger(__name__)

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class SourceFile:
    """One input file, identified by its resolved path, size and modification time."""

    path: str
    format: str
    size: int
    mtime_ns: int

    def fingerprint(self) -> dict:
        return {"path": self.path, "format": self.format, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass
class ReadStats:
    """What reading saw; every counter is deterministic for given inputs."""

    files: int = 0
    empty_files: int = 0
    docs: int = 0
    empty_docs: int = 0
    invalid_utf8_docs: int = 0
    invalid_utf8_bytes: int = 0
    missing_field: int = 0
    bytes: int = 0  # UTF-8 bytes of the documents yielded

    def as_dict(self) -> dict:
        return asdict(self)


def _format_of(path: Path, suffixes: Sequence[str] = tuple(FORMATS)) -> str | None:
    suffix = path.suffix.lower()
    return FORMATS.get(suffix) if suffix in suffixes else None


def find_files(inputs: Sequence[str | Path], suffixes: Sequence[str] = tuple(FORMATS)) -> list[SourceFile]:
    """Expand files and directories (recursively, hidden entries skipped) into a sorted, de-duplicated list of the
    files with one of `suffixes` (FORMATS' by default: a directory's other files are skipped, a named one refused).

    Order: inputs in the order given; inside a directory, by relative path. That order fixes document
    numbering, so the same inputs always give the same shards.
    """
    if not inputs:
        raise DataError("no input paths given")
    seen: set[Path] = set()
    out: list[SourceFile] = []
    for raw in inputs:
        root = Path(raw).expanduser()
        if not root.exists():
            raise DataError(f"input {str(raw)!r} does not exist")
        if root.is_dir():
            found = sorted(
                (p for p in root.rglob("*") if p.is_file() and _format_of(p, suffixes)
                 and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                key=lambda p: p.relative_to(root).as_posix(),
            )
            if not found:
                raise DataError(f"directory {str(raw)!r} holds no {', '.join(suffixes)} files")
        elif _format_of(root, suffixes) is None:
            raise DataError(f"{str(raw)!r}: unsupported file type {root.suffix!r}; "
                            f"expected one of {', '.join(suffixes)}")
        else:
            found = [root]
        for p in found:
            resolved = p.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            st = resolved.stat()
            out.append(SourceFile(str(resolved), _format_of(p, suffixes), st.st_size, st.st_mtime_ns))
    return out


# --- UTF-8 decoding that counts what it had to replace ---------------------------------------------

_bad_bytes = threading.local()


def _count_and_replace(exc: UnicodeDecodeError) -> tuple[str, int]:
    _bad_bytes.n += exc.end - exc.start
    return "\ufffd", exc.end


codecs.register_error("hybridlm.count_replace", _count_and_replace)


def decode_utf8(data: bytes) -> tuple[str, int]:
    """Decode UTF-8, replacing each invalid sequence with U+FFFD; returns (text, number of invalid bytes)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    _bad_bytes.n = 0
    text = data.decode("utf-8", errors="hybridlm.count_replace")
    return text, _bad_bytes.n


def replace_lone_surrogates(text: str) -> tuple[str, int]:
    """Make `text` encodable as UTF-8; returns (text, number of invalid bytes replaced).

    A lone surrogate (U+D800..U+DFFF without its pair, which `json.loads` makes from an escape such as
    "\\ud83d") has no UTF-8 encoding, so the tokenizer cannot take it. It is written out as the 3 bytes
    a surrogate-passing encoder gives and decoded like any invalid UTF-8: each byte becomes U+FFFD and
    counts, exactly as those bytes would in a .txt file. Text without surrogates is returned as is.
    """
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return decode_utf8(text.encode("utf-8", "surrogatepass"))


# --- readers: each yields (line or row number, raw value) ------------------------------------------

def _missing(path: str, where: str, text_field: str, detail: str, skip: bool, stats: ReadStats) -> None:
    if skip:
        stats.missing_field += 1
        return
    raise DataError(
        f"{path}:{where}: {detail}; pass --text-field to name the field that holds the text, "
        f"or --skip-missing-field to skip such records"
    )


def _read_txt(path: str, text_field: str, skip: bool, stats: ReadStats) -> Iterator[str | bytes]:
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    yield data


def _read_jsonl(path: str, text_field: str, skip: bool, stats: ReadStats) -> Iterator[str | bytes]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:  # a byte order mark, written by some Windows tools, is not JSON
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            line, bad = decode_utf8(raw)
            if bad:  # invalid bytes inside a JSON string: replace and count like any other text
                stats.invalid_utf8_bytes += bad
                stats.invalid_utf8_docs += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                "each line of a .jsonl file must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            value = record.get(text_field)
            if value is None:
                keys = ", ".join(sorted(map(str, record))[:8]) or "none"
                what = (f"field {text_field!r} is null" if text_field in record
                        else f"no text field {text_field!r} (fields: {keys})")
                _missing(path, str(lineno), text_field, what, skip, stats)
                continue
            if not isinstance(value, str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} is a {type(value).__name__}, not a string")
            value, lone = replace_lone_surrogates(value)
            if lone:  # a "\ud83d" escape without its pair: invalid text, like an invalid byte
                stats.invalid_utf8_bytes += lone
                stats.invalid_utf8_docs += 0 if bad else 1  # the line is one document, counted once
            yield value


def _read_parquet(path: str, text_field: str, skip: bool, stats: ReadStats) -> Iterator[str | bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for damaged files
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        detail = f"no column {text_field!r} (columns: {', '.join(names[:8])})"
        for row in range(pf.metadata.num_rows):
            _missing(path, f"row {row + 1}", text_field, detail, skip, stats)
        return
    row = 0
    for values in _parquet_batches(path, pf, text_field):
        for value in values:
            row += 1
            if value is None:
                _missing(path, f"row {row}", text_field, f"null {text_field!r}", skip, stats)
                continue
            if not isinstance(value, (str, bytes)):
                raise DataError(f"{path}:row {row}: column {text_field!r} holds {type(value).__name__}, not text")
            yield value


def _parquet_batches(path: str, pf, column: str) -> Iterator[list]:
    """The column's values, a batch at a time; pyarrow's errors for damaged data become a DataError naming the file.

    pyarrow reads pages lazily, so a damaged page shows up only here, as an OSError ("Unexpected end of
    stream", "Corrupt snappy compressed data") or an ArrowException that names neither file nor row.
    """
    import pyarrow as pa

    batches = pf.iter_batches(columns=[column], batch_size=1024)
    rows = 0  # yielded so far; the consumer has read them all when it asks for the next batch
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            array = batch.column(0)
            try:
                values = array.to_pylist()
            except UnicodeDecodeError:  # a string column holding invalid UTF-8 (not checked on read): as bytes,
                values = array.cast(pa.large_binary()).to_pylist()  # which iter_documents replaces and counts
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: damaged parquet data, in row {rows + 1} or a later one ({e}); write or download "
                            "the file again, or leave it out of --input") from None
        rows += len(values)
        yield values


_READERS = {"txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_parquet}


def iter_documents(
    files: Sequence[SourceFile],
    *,
    text_field: str = "text",
    skip_missing_field: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[int, str]]:
    """Yield `(file_index, text)` for every non-empty document, in file order; updates `stats` in place."""
    stats = stats if stats is not None else ReadStats()
    for file_index, source in enumerate(files):
        stats.files += 1
        docs_before, bad_before = stats.docs, stats.invalid_utf8_bytes
        for value in _READERS[source.format](source.path, text_field, skip_missing_field, stats):
            if isinstance(value, bytes):
                value, bad = decode_utf8(value)
                if bad:
                    stats.invalid_utf8_bytes += bad
                    stats.invalid_utf8_docs += 1
            if not value.strip():
                stats.empty_docs += 1
                continue
            stats.docs += 1
            stats.bytes += len(value.encode("utf-8"))
            yield file_index, value
        if stats.invalid_utf8_bytes > bad_before:
            log.warning("%s: %d invalid UTF-8 bytes (lone surrogates count 3 each) replaced with U+FFFD",
                        source.path, stats.invalid_utf8_bytes - bad_before)
        if stats.docs == docs_before:
            stats.empty_files += 1
            log.warning("%s: no text (empty file or only empty records); skipped", source.path)
