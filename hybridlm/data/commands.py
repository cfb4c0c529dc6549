"""`hybridlm tokenizer ...` and `hybridlm data ...`: command-line front ends of the data layer.

`hybridlm/cli.py` calls `add_commands(subparsers)` with what `ArgumentParser.add_subparsers()` returned;
each command's `func(args)` returns an exit status (0 ok, 1 a DataError: bad input or output,
explained on stderr without a traceback; 2 a usage error: an option's value out of range (a count below 1, a
--vocab-size too small for the fixed tokens; argparse reports those), or `tokenizer train` or `data prepare` into an
--out that holds a tokenizer or a dataset from other inputs, without --overwrite, as `hybridlm train` refuses an
existing run).

    hybridlm tokenizer train --input corpus/ --vocab-size 32768 --out tok/
    hybridlm tokenizer stats --tokenizer tok/ --input heldout.jsonl
    hybridlm data prepare --input corpus/ --tokenizer tok/ --out data/web --workers 8
    hybridlm data verify --data data/web
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridlm.argtypes import positive_int
from hybridlm.data.errors import DataError, OutputExistsError


def add_commands(subparsers) -> None:
    """Register the `tokenizer` and `data` command groups."""
    tok = subparsers.add_parser("tokenizer", help="train a BPE tokenizer or measure one",
                                description="Train a byte-level BPE tokenizer or measure one on held-out text.")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)

    p = tok_sub.add_parser("train", help="train a tokenizer on .txt/.jsonl/.parquet files",
                           description="Train a byte-level BPE tokenizer (digits split, punctuation split, LaTeX "
                                       "tokens, 1,024 reserved special tokens) and save it to a directory.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files or directories (searched recursively) of .txt, .jsonl and .parquet")
    p.add_argument("--vocab-size", type=_vocab_size, required=True, metavar="N",
                   help="total vocabulary size, special, reserved and LaTeX tokens included (at least 1561)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write tokenizer.json and metadata to")
    _add_text_options(p)
    p.add_argument("--min-frequency", type=positive_int, default=2, metavar="K",
                   help="merge only pairs seen at least K times (default 2)")
    p.add_argument("--max-bytes", type=positive_int, default=None, metavar="B",
                   help="train on at most about B bytes of text, B >= 1 (default: all)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer already in --out (data prepared with it will no longer match)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_tokenizer_train)

    p = tok_sub.add_parser("stats", help="fertility and bytes per token on held-out text",
                           description="Tokenize held-out text and report fertility (tokens per whitespace "
                                       "word) and UTF-8 bytes per token.")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a directory written by `tokenizer train`")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="held-out .txt/.jsonl/.parquet files or directories")
    _add_text_options(p)
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    p.set_defaults(func=_tokenizer_stats)

    data = subparsers.add_parser("data", help="tokenize corpora into training shards",
                                 description="Tokenize corpora into binary shards and check them.")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    p = data_sub.add_parser("prepare", help="tokenize .txt/.jsonl/.parquet into binary shards",
                            description="Tokenize documents in parallel, append EOS to each, and write fixed-size "
                                        "token shards, a document index and manifest.json. Re-running the same "
                                        "command does nothing when the output is complete and resumes it when not.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files or directories (searched recursively) of .txt, .jsonl and .parquet")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a directory written by `tokenizer train`")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for shards and manifest.json")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="tokenizer processes (default: number of CPUs; 1 = in this process)")
    _add_text_options(p)
    p.add_argument("--shard-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per shard; every shard but the last has exactly N (default 100,000,000)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset in --out that was prepared from other inputs or settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_data_prepare)

    p = data_sub.add_parser("verify", help="check a prepared dataset's sizes and sha256 checksums",
                            description="Check every shard and index file against manifest.json.")
    p.add_argument("--data", required=True, metavar="DIR", help="a directory written by `data prepare`")
    p.set_defaults(func=_data_verify)


def _vocab_size(text: str) -> int:
    """argparse type of `tokenizer train --vocab-size`: a size too small for the fixed tokens and the bytes is a usage
    error (exit 2), found before the input is read."""
    from hybridlm.data.tokenizer import check_vocab_size  # loads `tokenizers`: only when the command is parsed

    value = positive_int(text)
    try:
        check_vocab_size(value)
    except DataError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _add_text_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-field", default="text", metavar="F",
                   help="field (.jsonl) or column (.parquet) holding the text (default: text)")
    p.add_argument("--skip-missing-field", action="store_true",
                   help="skip and count records without the text field (default: stop with an error naming file and line)")


def _run(fn, args, *, interrupted: str | None = "interrupted (Ctrl-C)") -> int:
    """`fn(args)` with its errors as one line on stderr; Ctrl-C is exit status 130 and `interrupted` (None: the
    command has said what it kept)."""
    try:
        return fn(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, OutputExistsError) else 1
    except KeyboardInterrupt:
        if interrupted:
            print(interrupted, file=sys.stderr)
        return 130


def _tokenizer_train(args) -> int:
    from hybridlm.data.tokenizer import train_tokenizer

    def run(a):
        tok = train_tokenizer(a.input, a.vocab_size, a.out, text_field=a.text_field,
                              skip_missing_field=a.skip_missing_field, min_frequency=a.min_frequency,
                              max_bytes=a.max_bytes, progress=not a.no_progress, overwrite=a.overwrite)
        t = tok.meta["training"]
        print(f"trained a {tok.vocab_size}-token tokenizer on {t['docs']} documents ({t['bytes']} bytes) -> {a.out}")
        return 0

    return _run(run, args)


def _tokenizer_stats(args) -> int:
    from hybridlm.data.tokenizer import stats

    def run(a):
        s = stats(a.tokenizer, a.input, text_field=a.text_field, skip_missing_field=a.skip_missing_field)
        if a.json:
            print(json.dumps(s))
        else:
            print(f"documents        {s['docs']}\nwords            {s['words']}\nbytes            {s['bytes']}\n"
                  f"tokens           {s['tokens']}\nfertility        {s['fertility']:.4f}  (tokens per word)\n"
                  f"bytes per token  {s['bytes_per_token']:.4f}")
        return 0

    return _run(run, args)


def _data_prepare(args) -> int:
    from hybridlm.data.shards import prepare

    def run(a):
        shard_tokens = {} if a.shard_tokens is None else {"shard_tokens": a.shard_tokens}
        r = prepare(a.input, a.tokenizer, a.out, workers=a.workers, text_field=a.text_field,
                    skip_missing_field=a.skip_missing_field, overwrite=a.overwrite,
                    progress=not a.no_progress, **shard_tokens)
        m, c = r.manifest, r.manifest["counts"]
        what = {"created": "wrote", "resumed": f"resumed after {r.kept_shards} shards and wrote",
                "up_to_date": "up to date:"}[r.status]
        print(f"{what} {m['num_tokens']} tokens, {m['num_docs']} documents, {len(m['shards'])} shards ({m['dtype']}) "
              f"in {a.out}\nskipped: {c['empty_files']} empty files, {c['empty_docs']} empty documents, "
              f"{c['missing_field']} records without {a.text_field!r}; invalid UTF-8: {c['invalid_utf8_docs']} "
              f"documents ({c['invalid_utf8_bytes']} bytes replaced)")
        return 0

    return _run(run, args, interrupted=None)  # prepare logs the shards it kept and that a rerun resumes


def _data_verify(args) -> int:
    from hybridlm.data.shards import TokenDataset

    def run(a):
        ds = TokenDataset(a.data, verify="full")
        print(f"ok: {ds.num_tokens} tokens, {ds.num_docs} documents, {len(ds.manifest['shards'])} shards")
        return 0

    return _run(run, args)
