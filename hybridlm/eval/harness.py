"""lm-evaluation-harness adapter: make a checkpoint dir loadable by `lm_eval --model hf`, and the
loglikelihood computation its multiple-choice tasks use (for tests and quick local checks).

    export_for_lm_eval("runs/my-model", tokenizer_dir="tok/")     # or: hybridlm eval export-hf ...
    lm_eval_model_args("runs/my-model")  # 'pretrained=runs/my-model,trust_remote_code=True,prefix_token_id=2'
    # lm_eval --model hf --model_args pretrained=runs/my-model,trust_remote_code=True,prefix_token_id=2 --tasks piqa

Our classes register with transformers' Auto classes when `hybridlm.models.model` is imported, but
lm_eval's HF backend imports only transformers. `export_for_lm_eval` therefore adds to the directory
(1) `hybridlm_auto.py`, three lines that import our config and model classes from the installed
`hybridlm` package (no model code is copied), (2) an `auto_map` in config.json pointing AutoConfig /
AutoModel / AutoModelForCausalLM at them, and (3) the tokenizer files, so that
`AutoConfig/AutoModelForCausalLM/AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` work in
a fresh process. `hybridlm` must be installed where lm_eval runs.

`loglikelihood` mirrors what lm_eval's HF backend computes for a (context, continuation) request:
trailing spaces of the context move to the continuation; the continuation's tokens are those of
encode(context + continuation) after encode(context)'s tokens (no special tokens added; an empty
context is replaced by one prefix token, `prefix_id`); the model reads (context + continuation)[:-1], at most
`max_length` tokens, left-truncated; the result is (sum of the continuation tokens' log-probs, whether
each was the argmax).

The prefix token. lm_eval conditions an empty context (and the first window of `loglikelihood_rolling`, the
perplexity tasks such as wikitext) on `prefix_token_id`, by default the tokenizer's BOS. Our training data never
holds BOS: `hybridlm data prepare` ends every document with EOS and adds nothing in front, so the token before a
document's first token is always the previous document's EOS and BOS's embedding is never trained. So a hybridlm
checkpoint is evaluated with `prefix_token_id=<eos id>` in lm_eval's `--model_args` (`lm_eval_model_args` writes
them), and `loglikelihood` prefixes the EOS unless told otherwise. Official falcon_h1 checkpoints keep lm_eval's default.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridlm.fileio import write_atomic
from hybridlm.models.hf import check_weight_files

STUB = "hybridlm_auto.py"
_STUB_TEXT = '''"""Loads hybridlm's model classes for transformers' trust_remote_code path (written by hybridlm eval export-hf)."""
from hybridlm.models.configuration import HybridTransformersConfig  # noqa: F401
from hybridlm.models.model import HybridForCausalLM, HybridModel  # noqa: F401
'''
AUTO_MAP = {
    "AutoConfig": "hybridlm_auto.HybridTransformersConfig",
    "AutoModel": "hybridlm_auto.HybridModel",
    "AutoModelForCausalLM": "hybridlm_auto.HybridForCausalLM",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "hybridlm_tokenizer.json")


def export_for_lm_eval(model_dir: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Make `model_dir` (saved by `HybridForCausalLM.save_pretrained`) loadable with trust_remote_code."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        from hybridlm.models.hf import model_dir_problem

        raise FileNotFoundError(model_dir_problem(model_dir))
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON ({err})") from None
    if config.get("model_type") != "hybridlm":
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r}; only 'hybridlm' checkpoints need "
                         "this (official falcon_h1 checkpoints load in lm_eval as they are)")
    # every input checked before the directory changes
    if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer.json")
    if tokenizer_dir is None and not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer files; pass the tokenizer directory (lm_eval needs one)")
    check_weight_files(model_dir)
    _model_args(model_dir, config, config_path)  # what `lm_eval_model_args` then needs of the config and the path
    copy_tokenizer = tokenizer_dir is not None and Path(tokenizer_dir).resolve() != model_dir.resolve()
    if copy_tokenizer:
        _check_tokenizer_fits(Path(tokenizer_dir), model_dir, config)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                write_atomic(model_dir / name, (Path(tokenizer_dir) / name).read_bytes())
    write_atomic(model_dir / STUB, _STUB_TEXT.encode("utf-8"))
    config["auto_map"] = dict(AUTO_MAP)
    write_atomic(config_path, (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return model_dir


def _check_tokenizer_fits(tokenizer_dir: Path, model_dir: Path, config: dict) -> None:
    """Refuse a tokenizer whose ids exceed the model's vocabulary, and one that would replace a different tokenizer
    already beside the model (its own, most likely): ValueError naming both."""
    from tokenizers import Tokenizer

    source = tokenizer_dir / "tokenizer.json"
    try:
        size = Tokenizer.from_file(str(source)).get_vocab_size(with_added_tokens=True)
    except Exception as err:  # the tokenizers library raises its own exception types for a damaged file
        raise ValueError(f"{source}: not a readable tokenizer ({err})") from None
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and size > vocab:
        raise ValueError(f"{tokenizer_dir} has {size} tokens, more than the model's vocabulary of {vocab} "
                         f"({model_dir / 'config.json'}); is this the tokenizer the model was trained with?")
    present = model_dir / "tokenizer.json"
    if present.is_file() and present.read_bytes() != source.read_bytes():
        raise ValueError(f"{model_dir} already holds a tokenizer, not the one in {tokenizer_dir}; leave out "
                         "--tokenizer to use it, or remove its tokenizer files first to replace it")


def lm_eval_model_args(model_dir: str | Path) -> str:
    """`--model_args` for `lm_eval --model hf` on a dir `export_for_lm_eval` made: the path, trust_remote_code and
    prefix_token_id = the config's EOS id (the first when it is a list), which our documents start after (module
    docstring). Add dtype=..., max_length=... to taste."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path}: cannot read the config ({err})") from None
    return _model_args(model_dir, config, config_path)


def _model_args(model_dir: str | Path, config: dict, config_path: Path) -> str:
    """`lm_eval_model_args` of a directory whose config.json holds `config`; ValueError where lm_eval cannot take
    it (no EOS id to use as prefix_token_id, a comma in the path)."""
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if type(eos) is not int or eos < 0:  # (JSON: a bool is not an id)
        raise ValueError(f"{config_path}: eos_token_id is {eos!r}, not a token id; lm_eval needs prefix_token_id=<the "
                         "id that ends the training documents>")
    if "," in str(model_dir):
        raise ValueError(f"{model_dir}: lm_eval splits --model_args at commas; use a path without one")
    return f"pretrained={model_dir},trust_remote_code=True,prefix_token_id={eos}"


def encode_request(tokenizer, context: str, continuation: str, *, prefix_id: int | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split the way lm_eval's HF backend splits them."""
    if not context:
        prefix = _prefix(tokenizer, prefix_id)
        return [prefix], tokenizer.encode(continuation, add_special_tokens=False)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def loglikelihood(model, tokenizer, requests: Sequence[tuple[str, str]], *, max_length: int | None = None,
                  device: str | torch.device | None = None, prefix_id: int | None = None) -> list[tuple[float, bool]]:
    """[(log p(continuation | context), greedy)] for each (context, continuation) request.

    prefix_id: the token an empty context becomes. None (default): the tokenizer's EOS, because our training
    documents start after an EOS and never after a BOS (module docstring); this equals lm_eval run with
    `prefix_token_id=<eos id>`, as our docs run it. lm_eval's own default is the tokenizer's BOS (its EOS when there
    is no BOS): pass `prefix_id=tokenizer.bos_token_id` to reproduce an lm_eval run without prefix_token_id."""
    device = device or next(model.parameters()).device
    max_length = max_length or getattr(model.config, "max_position_embeddings", 2048)
    prefix_id = _prefix(tokenizer, prefix_id)
    out = []
    for context, continuation in requests:
        context_ids, continuation_ids = encode_request(tokenizer, context, continuation, prefix_id=prefix_id)
        if not continuation_ids:
            raise ValueError(f"continuation {continuation!r} encodes to no token")
        if len(continuation_ids) > max_length:
            raise ValueError(f"continuation {continuation[:40]!r}... has {len(continuation_ids)} tokens, more than "
                             f"max_length {max_length}: a window of max_length tokens scores at most that many")
        window = (context_ids + continuation_ids)[-(max_length + 1):][:-1]
        logits = model(torch.tensor([window], device=device)).logits[0].float()  # [T, V]
        scored = torch.log_softmax(logits[-len(continuation_ids):], dim=-1)  # [n, V]
        target = torch.tensor(continuation_ids, device=device)
        logprob = scored.gather(-1, target[:, None]).sum().item()
        greedy = bool((scored.argmax(-1) == target).all())
        out.append((logprob, greedy))
    return out


def _prefix(tokenizer, prefix_id: int | None) -> int:
    """The given prefix id, else the tokenizer's EOS (checked: an id >= 0)."""
    prefix = tokenizer.eos_token_id if prefix_id is None else prefix_id
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        where = "prefix_id" if prefix_id is not None else "the tokenizer's eos_token_id (the default prefix_id)"
        raise ValueError(f"{where} must be a token id >= 0, got {prefix!r}; pass prefix_id=<the id documents start "
                         "after>")
    return prefix
