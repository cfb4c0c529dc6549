"""Byte-level BPE tokenizer in the Falcon-H1 style, trained with HF `tokenizers`.

    tok = train_tokenizer(["corpus/"], vocab_size=32768, out_dir="tok/")
    tok = HybridTokenizer.load("tok/")
    ids = tok.encode("x = \\frac{1}{2}")          # raw text: "<|end_of_text|>" in it stays plain text
    print(text_stats(tok, held_out_texts))      # fertility, bytes per token

Design (Falcon-H1 report, "Tokenizer Design"; the choices are ours where it leaves them open):
- Byte-level BPE: every byte has a token, so any Unicode string encodes and decodes back exactly
  (no normalizer, no unknown token). A Python str holding a lone UTF-16 surrogate ("\\ud800") is not
  Unicode text (it has no UTF-8 form), so `encode` refuses it with a ValueError rather than change it
  silently; the corpus readers replace such surrogates with U+FFFD (and count them) before encoding.
- Pre-tokenizer: a GPT-4o / Llama-3 style splitting regex (case-aware letter runs, whitespace runs,
  newline runs) changed in two ways the report found to help downstream code and math:
  every digit is its own pre-token (so "2024" is always 4 tokens), and punctuation/symbols are never
  joined to letters or digits (GPT-4o's pattern lets one leading punctuation character join a word,
  e.g. "(word" or "。世界"; English contractions are split too: "don" "'" "t"). A run of punctuation
  can still merge with itself ("...", "}{", "。」").
- LaTeX: common commands (\\frac, \\sqrt, Greek letters, relations, \\begin{equation}, ...) are added
  tokens, matched before pre-tokenization (longest match first, so "\\infty" beats "\\in"; a command
  that merely starts with a listed one, like "\\input", becomes "\\in" + "put"). Training cuts the
  texts at the same matches first, so BPE learns its merges from the text between commands, the only
  text encoding ever gives it (the trainer itself does not apply added tokens).
- Ids are stable in every tokenizer we train: the named special tokens first (pad 0, bos 1, eos 2, chat
  roles, FIM and section sentinels), then 1,024 reserved special tokens, then the LaTeX tokens, then
  the 256 bytes and the learned merges. `vocab_size` is the total size, all of these included.

A tokenizer directory holds `tokenizer.json` (loads with `tokenizers.Tokenizer.from_file` and
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)`), `tokenizer_config.json` (so
`AutoTokenizer.from_pretrained(dir)` knows bos/eos/pad and a chat template) and `hybridlm_tokenizer.json`
(our metadata: special ids, training inputs, settings).

Special-token strings in text, ours vs Hugging Face. `HybridTokenizer.encode` treats its input as raw
text: "<|end_of_text|>" typed in a document is a few ordinary tokens, never id 2; training data is
tokenized this way, and so is `hybridlm generate`'s prompt. A tokenizer that HF loads from the same
files (`tokenizers.Tokenizer.from_file`, `PreTrainedTokenizerFast`, `AutoTokenizer`) follows the HF
default instead and matches the named and reserved special tokens inside text:
`auto.encode("a <|end_of_text|> b", add_special_tokens=False)` gives [.., 2, ..]. We keep that default
on purpose: `apply_chat_template(...)` (tokenize=True is its default) renders the chat to a string and
encodes it, so its role tokens must be matched in text; with `split_special_tokens: true` in
tokenizer_config.json every chat prompt would silently lose them. To get our ids from HF, pass
`split_special_tokens=True` per call (`auto.encode(text, add_special_tokens=False,
split_special_tokens=True) == tok.encode(text)`; with `tokenizers` directly, set
`raw.encode_special_tokens = True`, as `HybridTokenizer` does). For chats whose messages may hold such
strings, `apply_chat_template(..., sanitize_control_tokens=True)` (in recent transformers, e.g. 5.24)
keeps the template's tokens special and encodes the messages as text. LaTeX tokens are not special
and are matched the same way by both.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridlm.data.corpus import ReadStats, find_files, iter_documents
from hybridlm.data.errors import DataError, OutputExistsError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
META_FILE = "hybridlm_tokenizer.json"

# Named special tokens; the position in this tuple is the id. Append new ones by renaming a reserved
# token downstream, never by inserting here (that would move every id after it).
SPECIAL_TOKENS: tuple[tuple[str, str], ...] = (
    ("pad", "<|pad|>"),
    ("bos", "<|begin_of_text|>"),
    ("eos", "<|end_of_text|>"),
    ("system", "<|system|>"),
    ("user", "<|user|>"),
    ("assistant", "<|assistant|>"),
    ("tool", "<|tool|>"),
    ("end_of_turn", "<|end_of_turn|>"),
    ("fim_prefix", "<|fim_prefix|>"),
    ("fim_middle", "<|fim_middle|>"),
    ("fim_suffix", "<|fim_suffix|>"),
    ("section", "<|section|>"),
    ("original_order", "<|original_order|>"),
)
NUM_RESERVED = 1024


def reserved_token(i: int) -> str:
    return f"<|reserved_{i}|>"


# Common LaTeX, chosen from the commands a math-heavy corpus uses most (Greek letters, fractions and
# roots, big operators, relations, arrows, fonts, delimiters, accents, environments).
_GREEK = (
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi pi "
    "varpi rho varrho sigma varsigma tau upsilon phi varphi chi psi omega "
    "Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega"
)
_COMMANDS = (
    "frac dfrac tfrac sqrt sum prod coprod int iint iiint oint lim limsup liminf infty partial nabla "
    "cdot cdots ldots dots vdots ddots times div pm mp circ bullet star ast oplus otimes "
    "leq geq neq approx equiv sim simeq cong propto ll gg prec succ perp parallel mid "
    "in notin ni subset subseteq supset supseteq cup cap bigcup bigcap setminus emptyset varnothing "
    "forall exists nexists neg land lor wedge vee "
    "to rightarrow leftarrow leftrightarrow Rightarrow Leftarrow Leftrightarrow longrightarrow "
    "iff implies mapsto uparrow downarrow "
    "log ln exp sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh max min sup inf arg det "
    "dim ker gcd Pr deg "
    "mathbb mathcal mathrm mathbf mathit mathsf mathfrak boldsymbol text textbf textit texttt emph "
    "operatorname left right big Big bigg Bigg langle rangle lfloor rfloor lceil rceil lvert rvert "
    "lVert rVert vert Vert "
    "hat bar tilde vec dot ddot overline underline widehat widetilde overbrace underbrace "
    "binom pmod bmod mod quad qquad hspace vspace label ref eqref cite section subsection item "
    "begin end displaystyle limits prime ell hbar Re Im aleph"
)
_ENVIRONMENTS = (
    "equation equation* align align* aligned gather gather* multline cases matrix pmatrix bmatrix "
    "vmatrix array itemize enumerate figure table tabular proof theorem lemma definition document"
)


def latex_tokens() -> list[str]:
    """The LaTeX strings added as single tokens, in id order."""
    out = ["\\" + c for c in (_GREEK + " " + _COMMANDS).split()]
    for env in _ENVIRONMENTS.split():
        out += ["\\begin{" + env + "}", "\\end{" + env + "}"]
    assert len(out) == len(set(out)), "duplicate LaTeX token"
    return out


# Pre-tokenizer regex (Oniguruma syntax, as `tokenizers` runs it). Alternatives, first match wins:
#   1-2. an optional leading space + a letter run, split before an upper-case letter that follows
#        lower case (camelCase -> camel Case), marks kept with their letters;
#   3.   one digit (any Unicode number character);
#   4.   an optional leading space + a run of punctuation/symbols (never letters or digits), with the
#        newlines that follow it;
#   5-7. newline runs with their indentation, whitespace not followed by text, other whitespace.
SPLIT_PATTERN = "|".join([
    r" ?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r" ?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"\p{N}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Each message renders as <|role|>content<|end_of_turn|>. The assistant's content and end-of-turn sit inside
# {% generation %} ... {% endgeneration %}, which render nothing: transformers' apply_chat_template(
# return_assistant_tokens_mask=True), hence TRL's `assistant_only_loss`, marks those tokens as the ones to train.
# Template engines outside transformers (llama.cpp, plain jinja2) do not know the tag: `without_generation_tags`.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end_of_turn|>{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end_of_turn|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_GENERATION_TAG = re.compile(r"(\{%[-+]?\s*)(generation|endgeneration)(\s*[-+]?%\})")


def without_generation_tags(template: str) -> str:
    """`template` with transformers' {% generation %} / {% endgeneration %} as {% if true %} / {% endif %}: the same
    rendering (whitespace control kept) in any Jinja engine."""
    return _GENERATION_TAG.sub(lambda m: m[1] + ("if true" if m[2] == "generation" else "endif") + m[3], template)


def _latex_splitter() -> re.Pattern:
    """Matches any LaTeX token; alternatives longest first, so at each position the longest one wins,
    as the added-token matcher of `tokenizers` does (leftmost, then longest)."""
    commands = sorted((t[1:] for t in latex_tokens()), key=len, reverse=True)  # every one starts with "\\"
    return re.compile(r"\\(?:" + "|".join(map(re.escape, commands)) + ")")


def split_at_latex(texts: Iterable[str]) -> Iterable[str]:
    """The pieces of each text between LaTeX tokens, in order (empty pieces dropped).

    Encoding cuts the text at the added LaTeX tokens before pre-tokenization, but the BPE trainer sees the
    whole text: without this cut it spends merges on command names ("frac", "mathbb") and on the pieces
    that straddle a command, which encoding never produces.
    """
    splitter = _latex_splitter()
    for text in texts:
        if "\\" not in text:  # the common case costs one substring search
            yield text
            continue
        yield from (piece for piece in splitter.split(text) if piece)


def build_pipeline(pattern: str = SPLIT_PATTERN) -> Tokenizer:
    """An untrained byte-level BPE with our pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def fixed_tokens(num_reserved: int = NUM_RESERVED) -> list[str]:
    """Every token with a fixed id, in id order: named specials, reserved specials, LaTeX."""
    return [t for _, t in SPECIAL_TOKENS] + [reserved_token(i) for i in range(num_reserved)] + latex_tokens()


def check_vocab_size(vocab_size: int, num_reserved: int = NUM_RESERVED) -> None:
    """DataError unless `vocab_size` holds the fixed tokens and the 256 bytes with room for one merge."""
    smallest = len(fixed_tokens(num_reserved)) + 256 + 1
    if vocab_size < smallest:
        raise DataError(
            f"vocab_size {vocab_size} is too small: {len(SPECIAL_TOKENS)} named + {num_reserved} reserved special "
            f"tokens, {len(latex_tokens())} LaTeX tokens and 256 bytes take {smallest - 1}; use at least {smallest}"
        )


def train_from_texts(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    num_reserved: int = NUM_RESERVED,
    pattern: str = SPLIT_PATTERN,
    progress: bool = False,
) -> Tokenizer:
    """Train the BPE on an iterable of documents and return the `tokenizers.Tokenizer`."""
    check_vocab_size(vocab_size, num_reserved)
    fixed = fixed_tokens(num_reserved)
    tok = build_pipeline(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=fixed,  # the trainer gives these ids 0..len(fixed)-1, in order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(split_at_latex(texts), trainer)
    # LaTeX tokens are ordinary text: mark them non-special so decoding never drops them.
    spec = json.loads(tok.to_str())
    latex = set(latex_tokens())
    for added in spec["added_tokens"]:
        if added["content"] in latex:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    for i, content in enumerate(fixed):  # the layout every user of the ids relies on
        if tok.token_to_id(content) != i:
            raise RuntimeError(f"tokenizer training moved {content!r} to id {tok.token_to_id(content)}, expected {i}")
    return tok


class HybridTokenizer:
    """A trained tokenizer plus our metadata; `encode` treats its input as raw text.

    Raw text means special-token strings in it stay text, which is not what a HF tokenizer loaded from
    the same files does by default (see "Special-token strings in text" in the module docstring).
    """

    def __init__(self, tokenizer: Tokenizer, meta: dict):
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True  # "<|eos|>" typed in a document is text, not EOS
        self.meta = meta
        self.special_ids: dict[str, int] = dict(meta["special_tokens"])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def id_limit(self) -> int:
        """One more than the largest id: the ids a model must embed. Equals `vocab_size` for every tokenizer we
        train; a tokenizer whose ids have gaps has more."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def eos_id(self) -> int:
        return self.special_ids["eos"]

    @property
    def bos_id(self) -> int:
        return self.special_ids["bos"]

    @property
    def pad_id(self) -> int:
        return self.special_ids["pad"]

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no BOS/EOS added). ValueError if `text` holds a lone surrogate."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # what `tokenizers` raises for a str it cannot convert to UTF-8
            _check_encodable([text])
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        texts = list(texts)
        try:
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        except TypeError:
            _check_encodable(texts)
            raise

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        names = dict(SPECIAL_TOKENS)
        hf_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": names["bos"],
            "eos_token": names["eos"],
            "pad_token": names["pad"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        }
        _atomic_write_text(d / TOKENIZER_FILE, self.tokenizer.to_str(pretty=True))
        _atomic_write_text(d / HF_CONFIG_FILE, json.dumps(hf_config, indent=2))
        _atomic_write_text(d / META_FILE, json.dumps(self.meta, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "HybridTokenizer":
        d = Path(directory)
        if not d.exists():
            raise DataError(f"tokenizer directory {d} does not exist")
        for name in (TOKENIZER_FILE, META_FILE):
            if not (d / name).is_file():
                raise DataError(f"{d}: no {name}; not a tokenizer directory written by `hybridlm tokenizer train`")
        try:
            tok = Tokenizer.from_file(str(d / TOKENIZER_FILE))
            meta = json.loads((d / META_FILE).read_text())
        except Exception as e:  # damaged JSON from either library
            raise DataError(f"{d}: cannot read the tokenizer ({e}); train it again") from None
        return cls(tok, meta)


def _check_encodable(texts: Sequence[str]) -> None:
    """ValueError naming the first text with a lone surrogate, which no tokenizer can take (no UTF-8 form)."""
    for n, text in enumerate(texts):
        if not isinstance(text, str):
            return  # the caller's TypeError says what is wrong
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text {n} holds a lone UTF-16 surrogate U+{ord(text[e.start]):04X} at index {e.start}, which has no "
                "UTF-8 form and cannot be tokenized; replace it first, e.g. with "
                "hybridlm.data.corpus.replace_lone_surrogates(text) or "
                "text.encode('utf-8', 'surrogatepass').decode('utf-8', 'replace')") from None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse, before hours of training, an `out` that cannot take the result: a file where the directory (or one of
    its parents) goes, or a tokenizer already there (without `overwrite`)."""
    for candidate in (out, *out.parents):
        if os.path.lexists(candidate):
            if not candidate.is_dir():  # the CLI reports it as "<path> is a file, not a directory"
                raise NotADirectoryError(errno.ENOTDIR, f"{candidate} is a file, not a directory", str(candidate))
            break
    if not overwrite and any((out / name).exists() for name in (TOKENIZER_FILE, META_FILE)):
        raise OutputExistsError(f"{out} already holds a tokenizer; data prepared with it would no longer match a new "
                                "one. Use another --out, or pass --overwrite to replace it")


def train_tokenizer(
    inputs: Sequence[str | Path],
    vocab_size: int,
    out_dir: str | Path,
    *,
    text_field: str = "text",
    skip_missing_field: bool = False,
    min_frequency: int = 2,
    max_bytes: int | None = None,
    num_reserved: int = NUM_RESERVED,
    progress: bool = False,
    overwrite: bool = False,
) -> HybridTokenizer:
    """Train on .txt / .jsonl / .parquet inputs (at most `max_bytes` of text) and save to `out_dir`.

    An `out_dir` that already holds a tokenizer is a DataError unless `overwrite=True`: data prepared with the old
    one would silently stop matching. Checked, like `max_bytes`, before any training."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 (None: all the text), got {max_bytes}")
    out = Path(out_dir)
    check_out_dir(out, overwrite=overwrite)
    files = find_files(inputs)
    stats = ReadStats()

    def texts() -> Iterable[str]:
        for _, text in iter_documents(files, text_field=text_field, skip_missing_field=skip_missing_field,
                                      stats=stats):
            yield text
            if max_bytes is not None and stats.bytes >= max_bytes:
                return

    tok = train_from_texts(texts(), vocab_size, min_frequency=min_frequency, num_reserved=num_reserved,
                           progress=progress)
    if stats.docs == 0:
        raise DataError(f"no text found in {', '.join(map(str, inputs))}")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size < vocab_size:
        log.warning("the corpus supports only %d tokens (asked for %d): it has too few distinct merges "
                    "with min_frequency=%d", size, vocab_size, min_frequency)
    latex = latex_tokens()
    fixed = len(SPECIAL_TOKENS) + num_reserved
    meta = {
        "format": "hybridlm-tokenizer",
        "version": 1,
        "vocab_size": size,
        "requested_vocab_size": vocab_size,
        "special_tokens": {name: i for i, (name, _) in enumerate(SPECIAL_TOKENS)},
        "reserved_tokens": {"first_id": len(SPECIAL_TOKENS), "count": num_reserved},
        "latex_tokens": {"first_id": fixed, "count": len(latex)},
        "split_pattern": SPLIT_PATTERN,
        "digits": "individual",
        "training": {
            "files": [f.path for f in files],
            "docs": stats.docs,
            "bytes": stats.bytes,
            "max_bytes": max_bytes,
            "min_frequency": min_frequency,
            "text_field": text_field,
            "read": stats.as_dict(),
        },
        "tokenizers_version": tokenizers.__version__,
    }
    hybrid = HybridTokenizer(tok, meta)
    hybrid.save(out)
    return hybrid


def text_stats(tok: HybridTokenizer, texts: Iterable[str]) -> dict:
    """Fertility (tokens per whitespace-separated word) and UTF-8 bytes per token over `texts`.

    Lower fertility / higher bytes per token mean shorter sequences. Fertility is not meaningful for
    scripts written without spaces (Chinese, Japanese, Thai): a whole sentence counts as one "word".
    """
    docs = words = n_bytes = n_tokens = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_tokens
        n_tokens += sum(len(ids) for ids in tok.encode_batch(batch))
        batch.clear()

    for text in texts:
        docs += 1
        words += len(text.split())
        n_bytes += len(text.encode("utf-8"))
        batch.append(text)
        if len(batch) >= 256:
            flush()
    flush()
    return {
        "docs": docs,
        "words": words,
        "bytes": n_bytes,
        "tokens": n_tokens,
        "fertility": n_tokens / words if words else float("nan"),
        "bytes_per_token": n_bytes / n_tokens if n_tokens else float("nan"),
    }


def stats(tokenizer_dir: str | Path, inputs: Sequence[str | Path], *, text_field: str = "text",
          skip_missing_field: bool = False) -> dict:
    """`text_stats` of the tokenizer in `tokenizer_dir` on held-out .txt / .jsonl / .parquet inputs."""
    tok = HybridTokenizer.load(tokenizer_dir)
    files = find_files(inputs)
    out = text_stats(tok, (t for _, t in iter_documents(files, text_field=text_field,
                                                        skip_missing_field=skip_missing_field)))
    if out["docs"] == 0:  # else fertility and bytes per token would be NaN
        raise DataError(f"no text found in {', '.join(map(str, inputs))}")
    out["vocab_size"] = tok.vocab_size
    return out
