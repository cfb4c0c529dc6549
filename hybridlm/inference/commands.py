"""`hybridlm generate`: text in, continuation out, from a checkpoint directory (ours or official falcon_h1).

    hybridlm generate --model runs/tiny --prompt "Once upon a time"            # greedy, 64 new tokens
    hybridlm generate --model Falcon-H1-0.5B-Base --prompt "2 + 2 =" --max-new-tokens 8
    hybridlm generate --model runs/tiny --tokenizer tok/ --prompt "a" --prompt "longer prompt" \\
        --temperature 0.8 --top-p 0.95 --seed 0                                   # two prompts, one batch

The tokenizer comes from --tokenizer, else from the model directory: a directory written by
`hybridlm tokenizer train` (hybridlm_tokenizer.json), or any transformers tokenizer directory
(tokenizer.json / tokenizer_config.json). Several --prompt values run as one left-padded batch. Decoding
stops per prompt at an eos of the tokenizer, the model's config or its generation_config.json (where instruct
checkpoints keep their end-of-turn ids). Errors (a missing directory, no tokenizer, a
prompt longer than the model's max_position_embeddings, bad sampling settings) are one line on stderr
and exit status 1. On a CUDA device the decoding steps replay a CUDA graph of the step (`hybridlm.models.graphed`:
one launch per token instead of one per operator; --eager runs them op by op); its attention reads the prompt
length + --max-new-tokens slots at every step, so ask for the tokens you need.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridlm.argtypes import positive_int
from hybridlm.models.commands import (
    add_generation_flags,
    add_sampling_flags,
    generation_options,
    sampling_flags_problem,
)

DEFAULT_NEW_TOKENS = 64


class CommandError(Exception):
    """A user-facing error: printed as one line, no traceback."""


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="continue a prompt with a trained or official model",
        description="Generate text from a checkpoint directory with cached decoding (greedy by default).",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (hybridlm or falcon_h1)")
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                   help="the prompt; repeat for a batch of prompts")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the model directory)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help=f"tokens to add (default {DEFAULT_NEW_TOKENS}, or fewer when the model's "
                        "max_position_embeddings leaves less room)")
    add_sampling_flags(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default float32)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prefill in pieces of N tokens per prompt (bounds memory on long prompts)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--graph", action="store_true",
                       help="decode through the fixed-shape step (hybridlm/models/graphed.py): the default on CUDA, "
                            "where a CUDA graph of it replays; on the CPU the same step runs eagerly")
    steps.add_argument("--eager", action="store_true",
                       help="decode op by op over the growing cache, without the fixed-shape step or CUDA graphs")
    add_generation_flags(p)
    p.set_defaults(func=run_generate)

    from hybridlm.inference.chat import add_chat_command

    add_chat_command(subparsers)


def run_generate(args: argparse.Namespace) -> int:
    problem = sampling_flags_problem(args)
    if problem:
        print(f"hybridlm generate: {problem}", file=sys.stderr)
        return 2
    try:
        texts = generate_texts(args)
    except (CommandError, ValueError) as error:
        print(f"hybridlm generate: {error}", file=sys.stderr)
        return 1
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(text)
    return 0


def generate_texts(args: argparse.Namespace) -> list[str]:
    """Each prompt followed by its continuation."""
    import torch

    from hybridlm.devices import parse_device
    from hybridlm.inference import generate
    from hybridlm.models.fuse import prepare_for_generation
    from hybridlm.models.hf import load_model, model_dir_problem

    model_dir = Path(args.model)
    if model_dir.is_file():
        raise CommandError(f"--model takes the checkpoint directory (the folder holding config.json), not the file "
                           f"{model_dir}: pass --model {model_dir.parent}")
    problem = model_dir_problem(model_dir)
    if problem:
        raise CommandError(problem)
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else model_dir)
    if args.tokenizer and _files_differ(Path(args.tokenizer) / "tokenizer.json", model_dir / "tokenizer.json"):
        print(f"hybridlm generate: note: --tokenizer {args.tokenizer} is not the tokenizer saved with the model "
              f"({model_dir / 'tokenizer.json'}); the text is encoded and decoded with the one given", file=sys.stderr)
    device = parse_device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model = load_model(model_dir, dtype=args.dtype).to(device)
    prepare_for_generation(model, **generation_options(args))
    config = model.config

    prompts = [tokenizer.encode(text) for text in args.prompt]
    limit = config.max_position_embeddings
    for i, ids in enumerate(prompts):
        which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise CommandError(f"{which} is empty after tokenization")
        if len(ids) > limit:
            raise CommandError(f"{which} has {len(ids)} tokens, more than the model's max_position_embeddings {limit}")
        if max(ids) >= config.vocab_size:
            raise CommandError(
                f"{which} has token id {max(ids)}, outside the model's vocabulary of {config.vocab_size}; "
                "is this the model's tokenizer?"
            )

    width = max(len(ids) for ids in prompts)
    if width == limit:
        raise CommandError(f"the longest prompt has {width} tokens, the model's whole max_position_embeddings: no "
                           "position is left for a new token; shorten the prompt")
    new_tokens = min(DEFAULT_NEW_TOKENS, limit - width) if args.max_new_tokens is None else args.max_new_tokens
    if width + new_tokens > limit:
        raise CommandError(
            f"the longest prompt ({width} tokens) + --max-new-tokens {new_tokens} = {width + new_tokens} positions, "
            f"more than the model's max_position_embeddings {limit}: ask for at most {limit - width} new tokens"
        )
    eos = _eos_ids(tokenizer.eos_id, config.eos_token_id, _generation_eos(model_dir))
    # what rows get after their eos: the tokenizer's pad id where the model has it (a pad token added past the model's
    # vocabulary never enters it: left padding is packed away), else the config's, else an eos
    pad = next(i for i in (tokenizer.pad_id, config.pad_token_id, *eos, 0)
               if type(i) is int and 0 <= i < config.vocab_size)
    batch = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    out = generate(
        model, batch, attention_mask=mask, max_new_tokens=new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos or None,
        pad_token_id=pad, seed=args.seed, prefill_chunk=args.prefill_chunk,
        graph=args.graph or (device.type == "cuda" and not args.eager),
    )
    texts = []
    for row, (text, ids) in enumerate(zip(args.prompt, prompts)):
        new = [t for t in out.sequences[row, width:][out.attention_mask[row, width:].bool()].tolist() if t not in eos]
        texts.append(text + _continuation(tokenizer, ids, new))
    return texts


def _files_differ(a: Path, b: Path) -> bool:
    """Whether both files exist and their bytes differ."""
    return a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes()


def _continuation(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text the new tokens add after the prompt: decoded together with the prompt, so that the joint
    between them (a space, a merged character) comes out as the tokenizer writes it."""
    head, full = tokenizer.decode(prompt), tokenizer.decode(prompt + new)
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(new)


class _Tokenizer:
    """The little the command needs from a tokenizer: encode, decode, eos and pad ids."""

    def __init__(self, encode, decode, eos_id: int | None, pad_id: int | None) -> None:
        self.encode, self.decode, self.eos_id, self.pad_id = encode, decode, eos_id, pad_id


def tokenizer_problem(path: Path) -> str | None:
    """What keeps `load_tokenizer` from finding a tokenizer in `path` (a missing directory, no tokenizer files), said
    for the user with what to do; None when its files are there. Reads no file."""
    if not path.is_dir():
        return f"tokenizer directory {path} does not exist"
    if not any((path / name).is_file() for name in ("hybridlm_tokenizer.json", "tokenizer.json",
                                                     "tokenizer_config.json")):
        return f"no tokenizer in {path} (tokenizer.json); pass --tokenizer DIR"
    return None


def load_tokenizer(path: Path) -> _Tokenizer:
    problem = tokenizer_problem(path)
    if problem:
        raise CommandError(problem)
    if (path / "hybridlm_tokenizer.json").is_file():
        from hybridlm.data.errors import DataError
        from hybridlm.data.tokenizer import HybridTokenizer

        try:
            tok = HybridTokenizer.load(path)
        except DataError as error:
            raise CommandError(str(error)) from None
        return _Tokenizer(tok.encode, tok.decode, tok.eos_id, tok.pad_id)
    from hybridlm.models.hf import load_auto_tokenizer

    tok = load_auto_tokenizer(path)
    return _Tokenizer(
        lambda text: tok(text)["input_ids"],
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        tok.eos_token_id,
        tok.pad_token_id,
    )


def _generation_eos(model_dir: Path):
    """The eos id(s) of the model directory's generation_config.json (None without one, or without the field)."""
    import json

    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise CommandError(f"{path}: not a readable generation config ({err})") from None
    if eos is not None and not (isinstance(eos, int) or isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
        raise CommandError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
    return eos


def _eos_ids(*candidates) -> list[int]:
    out: list[int] = []
    for value in candidates:
        for i in ([] if value is None else [value] if isinstance(value, int) else list(value)):
            if i not in out:
                out.append(int(i))
    return out

