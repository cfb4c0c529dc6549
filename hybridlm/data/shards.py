"""Token shards on disk: `prepare` tokenizes corpora into them, `TokenDataset` opens and checks them.

    result = prepare(["corpus/"], "tok/", "data/web", workers=8)
    ds = TokenDataset("data/web")            # verifies sizes and sha256 checksums, then memory-maps
    ds.doc(0)                                # np.int64 token ids of document 0, ending with EOS

Layout of a prepared directory (see README.md in this folder):
    shard_00000.bin   token ids, little-endian uint16 (all ids < 65,536) or uint32, no header; every
                      shard holds exactly `shard_tokens` tokens except the last; documents run on
                      across shard boundaries; every document ends with EOS
    shard_00000.idx   little-endian uint64: the global token offset of every document that starts in
                      this shard
    manifest.json     written last: dtype, counts, shard sizes and sha256, sources; its presence
                      means the dataset is complete
    progress.json     only while a run is unfinished: the shards written so far (for resuming)

Every file is written under a temporary name and renamed into place (os.replace), so a crash leaves
whole files or none. Re-running `prepare` with the same inputs and settings: with a complete, intact
manifest it does nothing; otherwise it keeps the longest prefix of intact shards (checked against the
sizes and sha256 that manifest.json or progress.json lists), re-reads the inputs (skipping the
documents already written, without tokenizing them) and continues from there. Before it deletes
anything (a stale manifest, shards past the intact prefix) it writes progress.json for the kept
prefix, so a run interrupted at any point loses at most the shards it has not finished. A manifest
that is not even JSON has lost its checksums: nothing can be verified, so every shard is rebuilt.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from hybridlm.data.corpus import ReadStats, SourceFile, find_files, iter_documents
from hybridlm.data.errors import DataError, OutputExistsError
from hybridlm.data.tokenizer import TOKENIZER_FILE, HybridTokenizer
from hybridlm.fileio import FileLock, sha256_file, write_atomic

log = logging.getLogger(__name__)

FORMAT = "hybridlm-shards"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
LOCK = ".prepare.lock"
DEFAULT_SHARD_TOKENS = 100_000_000
INDEX_DTYPE = np.dtype("<u8")


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


def index_name(i: int) -> str:
    return f"shard_{i:05d}.idx"


def token_dtype(id_limit: int) -> np.dtype:
    """The shard dtype for ids 0..id_limit-1: uint16 holds ids up to 65,535, uint32 beyond.

    Size it from the largest id + 1 (`HybridTokenizer.id_limit`), not from the number of tokens: a
    vocabulary with gaps in its ids has ids past its size.
    """
    return np.dtype("<u2") if id_limit <= 1 << 16 else np.dtype("<u4")


def _write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2).encode("utf-8"))


def _write_progress(out: Path, settings: dict, shards: list[dict]) -> None:
    _write_json(out / PROGRESS, {"format": FORMAT, "version": VERSION, "complete": False,
                                 "settings": settings, "shards": shards})


def _rerun_hint(directory: Path) -> str:
    return (f"re-run `hybridlm data prepare` with the same inputs and --out {directory}: it keeps the intact "
            f"shards and rebuilds the rest (or delete {directory} and prepare it again)")


def check_shards(directory: Path, shards: Sequence[dict], dtype: np.dtype, *, full: bool = True) -> tuple[int, str]:
    """Check shard files against their manifest entries, in order.

    Returns `(n_good, problem)`: the number of leading shards that are intact and, if one is not, a
    sentence naming it and what is wrong ("" when all are intact). `full=False` checks sizes only.
    """
    for i, entry in enumerate(shards):
        for name, nbytes, digest in (
            (entry["name"], entry["tokens"] * dtype.itemsize, entry["sha256"]),
            (entry["index"], entry["index_docs"] * INDEX_DTYPE.itemsize, entry["index_sha256"]),
        ):
            path = directory / name
            if not path.is_file():
                return i, f"{path} is missing"
            size = path.stat().st_size
            if size != nbytes:
                return i, f"{path} has {size} bytes but the manifest says {nbytes} (truncated or overwritten)"
            if full and sha256_file(path) != digest:
                return i, f"{path} is corrupt: its sha256 does not match the manifest"
    return len(shards), ""


# --- the writer: fixed-size shards, document index, resumable progress -----------------------------

class _ShardWriter:
    """Accumulates documents' tokens and writes each full shard (plus its index) atomically."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, shards: list[dict], on_shard):
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards = shards  # entries of the shards already on disk (kept from an earlier run)
        self.tokens_done = sum(s["tokens"] for s in shards)
        self.chunks: list[np.ndarray] = []
        self.buf_len = 0
        self.starts: list[int] = []  # global offsets of documents starting in the buffer
        self.on_shard = on_shard

    def add(self, doc: int, tokens: np.ndarray, full_len: int, is_start: bool) -> None:
        """Append document `doc` (or its tail: `tokens` are the last len(tokens) of `full_len`)."""
        if is_start:
            self.starts.append(self.tokens_done + self.buf_len)
        self.chunks.append(tokens)
        self.buf_len += len(tokens)
        while self.buf_len >= self.shard_tokens:
            # The buffer held < shard_tokens before this document, so the cut falls inside it.
            data = np.concatenate(self.chunks)
            rest = self.buf_len - self.shard_tokens
            end = {"doc": doc, "offset": full_len - rest} if rest else {"doc": doc + 1, "offset": 0}
            self._write(data[: self.shard_tokens], end)
            self.chunks = [data[self.shard_tokens:]] if rest else []
            self.buf_len = rest

    def finish(self, n_docs: int) -> None:
        if self.buf_len:
            self._write(np.concatenate(self.chunks), {"doc": n_docs, "offset": 0})
            self.chunks, self.buf_len = [], 0

    def _write(self, tokens: np.ndarray, end: dict) -> None:
        i = len(self.shards)
        limit = self.tokens_done + len(tokens)
        starts = [s for s in self.starts if s < limit]
        self.starts = self.starts[len(starts):]
        index = np.asarray(starts, dtype=INDEX_DTYPE)
        # numpy's cast wraps silently (70000 -> 4464 in uint16); a wrong id in a shard is never detected later.
        largest = int(tokens.max()) if len(tokens) else 0
        if largest > np.iinfo(self.dtype).max:
            raise DataError(f"token id {largest} does not fit {self.out}'s shard dtype {self.dtype.name} (ids up to "
                            f"{np.iinfo(self.dtype).max}): the tokenizer produced an id past the largest in its "
                            "vocabulary; check its tokenizer.json, or train it again")
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        entry = {
            "name": shard_name(i),
            "tokens": int(len(data)),
            "sha256": write_atomic(self.out / shard_name(i), memoryview(data).cast("B")),
            "index": index_name(i),
            "index_docs": int(len(index)),
            "index_sha256": write_atomic(self.out / index_name(i), memoryview(index).cast("B")),
            "end": end,
        }
        self.shards.append(entry)
        self.tokens_done = limit
        self.on_shard(self.shards)


# --- tokenizing, in this process or in a pool of worker processes ----------------------------------

_worker_tokenizer: HybridTokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no thread pool on top
    _worker_tokenizer = HybridTokenizer.load(tokenizer_dir)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize a batch in a worker: all ids flat (uint32) and the length of each document."""
    ids = _worker_tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


class _InlineResult:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


@contextlib.contextmanager
def _executor(workers: int, tokenizer_dir: Path, tok: HybridTokenizer):
    """A process pool of `workers` tokenizers, or None (tokenize here, with `tok`) when workers <= 1."""
    global _worker_tokenizer
    if workers <= 1:
        _worker_tokenizer = tok
        yield None
        return
    import multiprocessing as mp

    # spawn, not fork: forking after the Rust tokenizer has started threads is unsafe.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                               initializer=_init_worker, initargs=(str(tokenizer_dir),))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _batches(docs: Iterator[tuple[int, str]], batch_chars: int, batch_docs: int):
    """Group `(global_doc, text)` into lists of at most `batch_docs` documents / about `batch_chars`."""
    batch: list[tuple[int, str]] = []
    chars = 0
    for item in docs:
        batch.append(item)
        chars += len(item[1])
        if chars >= batch_chars or len(batch) >= batch_docs:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# --- prepare ---------------------------------------------------------------------------------------

@dataclass
class PrepareResult:
    manifest: dict
    status: str  # "created", "resumed" or "up_to_date"
    kept_shards: int = 0  # shards reused from an earlier, unfinished run


def _settings(files: Sequence[SourceFile], tokenizer_sha: str, text_field: str, skip_missing_field: bool,
              shard_tokens: int) -> dict:
    return {
        "sources": [f.fingerprint() for f in files],
        "tokenizer_sha256": tokenizer_sha,
        "text_field": text_field,
        "skip_missing_field": skip_missing_field,
        "shard_tokens": shard_tokens,
        "append_eos": True,
    }


def _read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None if the file is missing, unreadable or not an object."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _well_formed(shards) -> tuple[int, str]:
    """The number of leading shard entries with every field `prepare` relies on, and what is wrong with the next."""
    if not isinstance(shards, list):
        return 0, "its 'shards' is not a list"
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            return i, f"its shards[{i}] is not an object"
        for key, kind in _SHARD_FIELDS.items():
            if not isinstance(entry.get(key), kind):
                return i, f"its shards[{i}].{key} is missing or not {kind.__name__}"
        end = entry.get("end")
        if not (isinstance(end, dict) and isinstance(end.get("doc"), int) and isinstance(end.get("offset"), int)):
            return i, f"its shards[{i}].end is missing or not {{doc, offset}}"
        if (entry["name"], entry["index"]) != (shard_name(i), index_name(i)):
            return i, f"its shards[{i}] names {entry['name']}, expected {shard_name(i)}"
    return len(shards), ""


def _our_files(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.name in (MANIFEST, PROGRESS)
            or (p.name.startswith("shard_") and p.suffix in (".bin", ".idx"))]


def prepare(
    inputs: Sequence[str | Path],
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    workers: int | None = None,
    text_field: str = "text",
    skip_missing_field: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    batch_chars: int = 1 << 20,
    batch_docs: int = 1024,
) -> PrepareResult:
    """Tokenize `inputs` (.txt trees, .jsonl, .parquet) into shards in `out_dir`; see the module docstring.

    `workers` processes tokenize (default: all CPUs; 1 tokenizes in this process). Output does not
    depend on `workers`. An `out_dir` that holds a dataset of other inputs or settings is an error
    unless `overwrite=True`, which deletes that dataset's files (only those) first.
    """
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    if workers is not None and workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    tokenizer_dir = Path(tokenizer_dir)
    tok = HybridTokenizer.load(tokenizer_dir)
    files = find_files(inputs)
    settings = _settings(files, sha256_file(tokenizer_dir / TOKENIZER_FILE), text_field, skip_missing_field,
                         shard_tokens)
    dtype = token_dtype(tok.id_limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out / LOCK)
    if not lock.acquire():
        raise DataError(f"another `prepare` is writing to {out}; wait for it to finish")
    with lock:
        for stray in out.glob("*.tmp-*"):  # left by a run that was killed mid-write
            stray.unlink()
        manifest = _read_json(out / MANIFEST)
        earlier = manifest or _read_json(out / PROGRESS)
        for name in (MANIFEST, PROGRESS) if earlier is None else ():
            if (out / name).is_file():  # there but unreadable: its checksums are lost
                log.warning("%s is not readable JSON, so the shards it listed cannot be verified; preparing "
                            "every shard again", out / name)
        if manifest is None and earlier is not None and not earlier.get("shards"):
            earlier = None  # an unfinished run that wrote no shard (e.g. stopped by a bad record): nothing to keep
        if earlier is not None and earlier.get("settings") != settings:
            if not overwrite:
                old = earlier["settings"] if isinstance(earlier.get("settings"), dict) else {}
                differ = ", ".join(sorted(k for k in settings if old.get(k) != settings[k])) or "format"
                if manifest is None:
                    raise OutputExistsError(
                        f"{out} holds an unfinished preparation of other inputs or settings ({len(earlier['shards'])}"
                        f" shards written; differs in: {differ}); to start over with these, pass --overwrite; to "
                        "finish that one, run it again with its own inputs; or use another --out")
                raise OutputExistsError(
                    f"{out} already holds a dataset prepared from other inputs or settings (differs in: {differ}); "
                    "use another --out, or pass --overwrite to replace it")
            earlier = manifest = None
            for p in _our_files(out):
                p.unlink()
        shards = earlier.get("shards") if earlier else []
        n_formed, problem = _well_formed(shards)
        if problem:
            problem = f"{out / (MANIFEST if manifest else PROGRESS)} is damaged ({problem})"
            shards = shards if isinstance(shards, list) else []
        n_good, bad_file = check_shards(out, shards[:n_formed], dtype)
        problem = bad_file or problem
        whole = manifest is not None and manifest.get("complete") and manifest.get("format") == FORMAT \
            and manifest.get("version") == VERSION and not _manifest_problem(manifest)
        if whole and n_good == len(shards):
            log.info("%s is up to date (%d tokens in %d shards)", out, manifest["num_tokens"], len(shards))
            return PrepareResult(manifest, "up_to_date", len(shards))
        if problem:
            log.warning("%s; keeping the %d intact shards before it and rebuilding from there", problem, n_good)
        elif manifest is not None:
            log.warning("%s is damaged or incomplete; keeping its %d intact shards and writing it again",
                        out / MANIFEST, n_good)
        shards = shards[:n_good]
        # Record the kept prefix before deleting anything (the manifest, an old progress file, shards past
        # the prefix): a run interrupted from here on resumes from these shards instead of losing them.
        _write_progress(out, settings, shards)
        keep = {PROGRESS} | {s["name"] for s in shards} | {s["index"] for s in shards}
        for p in _our_files(out):
            if p.name not in keep:
                p.unlink()
        cursor = shards[-1]["end"] if shards else {"doc": 0, "offset": 0}
        status = "resumed" if shards else "created"
        manifest = _run(files, tok, tokenizer_dir, out, settings, dtype, shards, cursor, workers,
                        text_field, skip_missing_field, progress, batch_chars, batch_docs)
        return PrepareResult(manifest, status, n_good)


def _run(files, tok, tokenizer_dir, out, settings, dtype, shards, cursor, workers, text_field,
         skip_missing_field, progress, batch_chars, batch_docs) -> dict:
    from tqdm.auto import tqdm

    stats = ReadStats()
    file_docs = [0] * len(files)
    eos = np.array([tok.eos_id], dtype=np.uint32)

    writer = _ShardWriter(out, dtype, settings["shard_tokens"], shards,
                          lambda entries: _write_progress(out, settings, entries))

    def numbered_docs() -> Iterator[tuple[int, str]]:
        """All documents with their global number; those before the cursor are read but not returned."""
        docs = iter_documents(files, text_field=text_field, skip_missing_field=skip_missing_field, stats=stats)
        for g, (file_index, text) in enumerate(docs):
            file_docs[file_index] += 1
            if g >= cursor["doc"]:
                yield g, text

    def consume(batch: list[tuple[int, str]], result) -> None:
        flat, lengths = result.result()
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        for (g, _), a, b in zip(batch, bounds[:-1], bounds[1:]):
            tokens = np.concatenate([flat[a:b], eos])
            skip = cursor["offset"] if g == cursor["doc"] else 0
            writer.add(g, tokens[skip:], len(tokens), is_start=skip == 0)
        bar.update(int(bounds[-1]) + len(batch))
        bar.set_postfix(docs=batch[-1][0] + 1, shards=len(writer.shards), refresh=False)

    bar = tqdm(total=None, initial=writer.tokens_done, unit="tok", unit_scale=True, desc="tokenizing",
               disable=not progress)
    try:
        with _executor(workers, tokenizer_dir, tok) as pool:
            pending: deque = deque()
            for batch in _batches(numbered_docs(), batch_chars, batch_docs):
                texts = [t for _, t in batch]
                pending.append((batch, pool.submit(_encode, texts) if pool else _InlineResult(_encode(texts))))
                while len(pending) > 2 * max(workers, 1) or (pool is None and pending):
                    consume(*pending.popleft())
            while pending:
                consume(*pending.popleft())
        writer.finish(stats.docs)
        bar.set_postfix(docs=stats.docs, shards=len(writer.shards))  # the last shard is written by finish
    except KeyboardInterrupt:
        log.warning("interrupted after %d complete shards; run the same command again to resume", len(writer.shards))
        raise
    finally:
        bar.close()
    if stats.docs == 0:
        raise DataError(f"no documents in {len(files)} input file(s): every file was empty or skipped")
    manifest = _manifest(out, settings, dtype, tok, writer.shards, stats, files, file_docs)
    _write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    counts = manifest["counts"]
    if counts["invalid_utf8_docs"]:
        log.warning("%d documents had invalid UTF-8 (%d bytes replaced with U+FFFD)",
                    counts["invalid_utf8_docs"], counts["invalid_utf8_bytes"])
    return manifest


class _DocStarts:
    """Global token offset where each document starts, read from the shard index files on demand."""

    def __init__(self, out: Path, shards: list[dict], total_tokens: int):
        self.out, self.shards, self.total = out, shards, total_tokens
        self.first_doc = np.cumsum([0] + [s["index_docs"] for s in shards])
        self.cache: dict[int, np.ndarray] = {}

    def __call__(self, doc: int) -> int:
        if doc >= self.first_doc[-1]:
            return self.total
        s = int(np.searchsorted(self.first_doc, doc, side="right")) - 1
        if s not in self.cache:
            self.cache = {s: np.fromfile(self.out / self.shards[s]["index"], dtype=INDEX_DTYPE)}
        return int(self.cache[s][doc - self.first_doc[s]])


def _manifest(out, settings, dtype, tok, shards, stats, files, file_docs) -> dict:
    num_tokens = sum(s["tokens"] for s in shards)
    start = _DocStarts(out, shards, num_tokens)
    sources, first = [], 0
    for f, n in zip(files, file_docs):
        tokens = start(first + n) - start(first) if n else 0
        sources.append({**f.fingerprint(), "first_doc": first, "docs": n, "tokens": tokens})
        first += n
    return {
        "format": FORMAT,
        "version": VERSION,
        "complete": True,
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": tok.id_limit,  # the ids a model must embed (> the token count if the ids have gaps)
        "eos_id": tok.eos_id,
        "special_tokens": tok.special_ids,
        "num_tokens": num_tokens,
        "num_docs": stats.docs,
        "shard_tokens": settings["shard_tokens"],
        "counts": stats.as_dict(),
        "sources": sources,
        "shards": shards,
        "settings": settings,
    }


# --- reading ---------------------------------------------------------------------------------------

def load_manifest(directory: str | Path) -> dict:
    d = Path(directory)
    if not d.is_dir():
        # (a relative path in a run's config.yaml is read from wherever the run is resumed)
        where = "" if d.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        raise DataError(f"dataset directory {d} does not exist{where}" if not d.exists() else f"{d} is a file; give "
                        "the dataset directory `hybridlm data prepare` wrote (the folder holding manifest.json)")
    if not (d / MANIFEST).is_file():
        if (d / PROGRESS).is_file():
            raise DataError(f"{d}: `prepare` has not finished (progress.json but no manifest.json); "
                            "run the same `hybridlm data prepare` command again to finish it")
        raise DataError(f"{d}: no manifest.json; not a dataset written by `hybridlm data prepare`")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        # Not _rerun_hint: with the checksums gone, prepare cannot verify (so cannot keep) any shard.
        raise DataError(f"{d / MANIFEST} is damaged ({e}) and its shard checksums are lost; re-run `hybridlm data "
                        f"prepare` with the same inputs and --out {d} to prepare every shard again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION \
            or not manifest.get("complete"):
        raise DataError(f"{d / MANIFEST}: not a complete {FORMAT} v{VERSION} manifest; {_rerun_hint(d)}")
    problem = _manifest_problem(manifest)
    if problem:
        raise DataError(f"{d / MANIFEST} is damaged ({problem}); {_rerun_hint(d)}")
    return manifest


_SHARD_FIELDS = {"name": str, "index": str, "sha256": str, "index_sha256": str, "tokens": int, "index_docs": int}
_MANIFEST_FIELDS = {"dtype": str, "num_tokens": int, "num_docs": int, "vocab_size": int, "shards": list}


def _manifest_problem(manifest: dict) -> str:
    """What is wrong with a manifest's structure (a field missing or of the wrong type, totals that are not its
    shards' sums), "" if nothing."""
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} missing or not {kind.__name__}"
    try:
        np.dtype(manifest["dtype"])
    except TypeError:
        return f"dtype {manifest['dtype']!r} is not a numpy dtype"
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            return f"shards[{i}] is not an object"
        for key, kind in _SHARD_FIELDS.items():
            if not isinstance(shard.get(key), kind):
                return f"shards[{i}].{key} missing or not {kind.__name__}"
    for total, part in (("num_tokens", "tokens"), ("num_docs", "index_docs")):
        summed = sum(shard[part] for shard in manifest["shards"])
        if manifest[total] != summed:
            return f"{total} {manifest[total]} is not its shards' total {summed}"
    return ""


def check_tokenizer_matches(tokenizer_dir: str | Path, directory: str | Path) -> None:
    """DataError unless `tokenizer_dir` holds the tokenizer.json the shards in `directory` were prepared with."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"{tokenizer_dir} holds no tokenizer.json")
    expected = load_manifest(directory).get("settings", {}).get("tokenizer_sha256")
    actual = sha256_file(file)
    if expected and actual != expected:
        raise DataError(f"{file} is not the tokenizer {directory} was prepared with (sha256 {actual[:12]}... vs the "
                        f"manifest's {expected[:12]}...); pass that tokenizer's directory")


class TokenDataset:
    """A prepared directory, memory-mapped; documents addressed by number.

    `verify="full"` (default) checks every file's size and sha256 on open, `"size"` only sizes (fast,
    for very large datasets); any mismatch raises DataError naming the file and what to do.
    """

    def __init__(self, directory: str | Path, *, verify: str = "full"):
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory)
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        shards = self.manifest["shards"]
        n_good, problem = check_shards(self.directory, shards, self.dtype, full=verify == "full")
        if problem:
            raise DataError(f"{problem}; {_rerun_hint(self.directory)}")
        self._tokens = [np.memmap(self.directory / s["name"], dtype=self.dtype, mode="r") for s in shards]
        self._index = [np.memmap(self.directory / s["index"], dtype=INDEX_DTYPE, mode="r") if s["index_docs"]
                       else np.empty(0, dtype=INDEX_DTYPE) for s in shards]
        self._shard_first_token = np.cumsum([0] + [s["tokens"] for s in shards])
        self._shard_first_doc = np.cumsum([0] + [s["index_docs"] for s in shards])
        if self._shard_first_doc[-1] != self.num_docs or self._shard_first_token[-1] != self.num_tokens:
            raise DataError(f"{self.directory / MANIFEST}: shard totals disagree with the manifest; "
                            f"{_rerun_hint(self.directory)}")

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def num_docs(self) -> int:
        return int(self.manifest["num_docs"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.manifest["special_tokens"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest["settings"]["tokenizer_sha256"]

    def doc_start(self, i: int) -> int:
        if i == self.num_docs:
            return self.num_tokens
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        s = int(np.searchsorted(self._shard_first_doc, i, side="right")) - 1
        return int(self._index[s][i - self._shard_first_doc[s]])

    def doc_lengths(self) -> np.ndarray:
        """[num_docs] int64: every document's token count, EOS included."""
        starts = np.concatenate([*(np.asarray(index, dtype=np.int64) for index in self._index), [self.num_tokens]])
        return np.diff(starts)

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document `i` (int64, EOS included)."""
        return self.tokens(self.doc_start(i), self.doc_start(i + 1))

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Token ids in the global range [start, end) as int64, across shard boundaries."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"token range [{start}, {end}) outside [0, {self.num_tokens})")
        parts = []
        s = int(np.searchsorted(self._shard_first_token, start, side="right")) - 1
        while start < end:
            lo = start - self._shard_first_token[s]
            take = min(end - start, self._shard_first_token[s + 1] - start)
            parts.append(np.asarray(self._tokens[s][lo:lo + take], dtype=np.int64))
            start += take
            s += 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
