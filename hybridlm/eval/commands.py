"""`hybridlm eval ppl|export-hf`: evaluate a saved model on the command line.

    hybridlm eval ppl --model runs/my-model --data data/val --tokenizer tok/
    hybridlm eval export-hf --model runs/my-model --tokenizer tok/      # prints the lm_eval command

Exit status: 0 done, 1 a bad input (message on stderr), 2 a usage error (an option's value: --device, --batch-size,
--seq-len, --json; found before the evaluation). See hybridlm/eval/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from hybridlm.fileio import write_atomic

DEFAULT_SEQ_LEN = 2048  # `eval ppl`'s window, shortened to a model's max_position_embeddings


def add_commands(subparsers) -> None:
    text = "evaluate a saved model (perplexity) or export it for lm_eval"
    ev = subparsers.add_parser("eval", help=text, description=text)
    ev_sub = ev.add_subparsers(dest="eval_command", metavar="ACTION", required=True)
    text = "token-weighted NLL, perplexity and bits per byte on prepared shards"
    p = ev_sub.add_parser("ppl", help=text, description=text)
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint dir (save_pretrained / falcon_h1)")
    p.add_argument("--data", required=True, metavar="DIR", help="a directory written by `hybridlm data prepare`")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer the shards were made with, for exact bytes (default: the model dir's, else "
                        "the manifest's average bytes per token)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="window length (default 2048, or the model's max_position_embeddings when shorter)")
    p.add_argument("--batch-size", type=int, default=4, metavar="B", help="rows per forward (default 4)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="read whole documents until N tokens are read (the one reaching N whole; default: all)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the numbers to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on stderr, in tok/s)")
    p.set_defaults(func=_eval_ppl)

    text = "make a checkpoint dir loadable by `lm_eval --model hf`"
    p = ev_sub.add_parser("export-hf", help=text, description=text)
    p.add_argument("--model", required=True, metavar="DIR", help="a dir saved by HybridForCausalLM.save_pretrained")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer dir to copy in (lm_eval needs one)")
    p.set_defaults(func=_eval_export)


def _fail(message: str, status: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool):
    """Turn transformers' own progress bars off inside (`--no-progress` means none), restoring the setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _eval_ppl(args: argparse.Namespace) -> int:
    import torch

    from hybridlm.data.errors import DataError
    from hybridlm.data.shards import TokenDataset, check_tokenizer_matches
    from hybridlm.devices import parse_device
    from hybridlm.eval.perplexity import (
        evaluate_perplexity,
        find_tokenizer,
        token_byte_lengths,
    )
    from hybridlm.models.hf import load_model

    try:  # the options themselves: a usage error (exit status 2), before anything is loaded
        device = parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.seq_len is not None and args.seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2 (a window scores its tokens after the first), got {args.seq_len}")
        if args.json and (not Path(args.json).parent.is_dir() or Path(args.json).is_dir()):  # not after the run
            raise ValueError(f"--json {args.json}: needs a file name in an existing directory")
    except ValueError as err:
        return _fail(str(err), status=2)
    try:
        data = TokenDataset(args.data)
        tokenizer_dir = find_tokenizer(args.tokenizer) if args.tokenizer else find_tokenizer(args.model)
        if args.tokenizer is not None and tokenizer_dir is None:
            raise ValueError(f"{args.tokenizer}: no tokenizer.json")
        byte_lengths = None
        if tokenizer_dir is not None:
            check_tokenizer_matches(tokenizer_dir, args.data)
            byte_lengths = token_byte_lengths(tokenizer_dir)
        with _hf_progress_bars(not args.no_progress):  # transformers' "Loading weights" bar
            model = load_model(args.model).to(device)
        limit = model.config.max_position_embeddings
        seq_len = min(DEFAULT_SEQ_LEN, limit) if args.seq_len is None else args.seq_len
        if seq_len > limit:  # an option the model rules out: a usage error
            return _fail(f"--seq-len {seq_len} is longer than the model's max_position_embeddings {limit}", status=2)
        data_vocab = int(data.manifest["vocab_size"])
        if data_vocab > model.config.vocab_size:
            raise ValueError(f"{args.data} was tokenized with {data_vocab:,} ids but the model has "
                             f"{model.config.vocab_size:,}; prepare the data with the model's tokenizer")
        result = evaluate_perplexity(model, data, seq_len=seq_len, batch_size=args.batch_size,
                                     max_tokens=args.max_tokens, byte_lengths=byte_lengths, device=device,
                                     progress=not args.no_progress)
    except (ValueError, DataError, FileNotFoundError) as err:
        return _fail(str(err))
    result["model"] = args.model
    bits = result["bits_per_byte"]
    print(f"tokens {result['tokens']:,}  loss {result['loss']:.4f} nats/token  perplexity {result['perplexity']:.3f}  "
          f"bits/byte {'n/a (every target is an EOS: no bytes)' if bits is None else f'{bits:.4f}'}  "
          f"({result['bytes_per_token']:.3f} bytes/token, {result['bytes_source']})")
    if args.json:  # strict JSON: a perplexity past a float's range is written as null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()}
        write_atomic(Path(args.json), (json.dumps(finite, indent=2, allow_nan=False) + "\n").encode("utf-8"))
    return 0


def _eval_export(args: argparse.Namespace) -> int:
    from hybridlm.eval.harness import export_for_lm_eval, lm_eval_model_args

    try:
        path = export_for_lm_eval(args.model, tokenizer_dir=args.tokenizer)
        model_args = lm_eval_model_args(path)
    except (ValueError, FileNotFoundError) as err:
        return _fail(str(err))
    print(f"{path} is ready: lm_eval --model hf --model_args {model_args} --tasks ...")
    return 0
