"""Chat and preference data for post-training: TRL's record formats, read from JSONL / parquet, rendered with the
model's chat template and tokenized with a mask of the tokens a loss trains on.

    records = read_records("sft.jsonl", kind="sft")           # [Record(where, data)], every record checked
    encoder = ChatEncoder.from_model_dir("runs/demo/final")   # the tokenizer and chat template of the model
    ids, trained = encoder.encode_sft(records[0].data)        # token ids; 1 where the loss trains
    prompt, chosen, rejected = encoder.encode_preference(pair)

Record formats (the ones TRL's SFTTrainer and DPOTrainer take):
- conversational: `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}`;
- prompt-completion: `{"prompt": ..., "completion": ...}`, both strings (plain text: prompt + completion + eos) or
  both message lists (conversational: the completion's messages follow the prompt's in the template);
- preference: `{"prompt": ..., "chosen": ..., "rejected": ...}`, all strings or all message lists.
A record may carry other keys (ids, sources); they are ignored.

Which tokens train (`ChatEncoder.encode_sft`): the assistant's messages (their content and the template's
end-of-turn after it) or the completion, found by rendering prefixes of the conversation: the characters between
`render(messages[:i], add_generation_prompt=True)` and `render(messages[:i + 1])` are message i's, and every token
whose characters overlap them trains. This needs no `{% generation %}` markers, so it works with any template that
renders a conversation's prefix as a prefix of its rendering, which chat templates do; one that does not gets a
`DataError` saying so. The full rendering is tokenized once (a token that straddles the span's edge counts as
inside), so training sees exactly the ids `apply_chat_template` gives at inference.

Bad input: a line that is not a JSON object, a record of no known format, a message without a string role or
content: a `DataError` naming file and line, or, with `skip_bad=True`, skipped and counted (`ReadCounts`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridlm.data.corpus import find_files
from hybridlm.data.errors import DataError

RECORD_FORMATS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Record:
    where: str  # "file:line" (or "file:row N" for parquet): for errors
    data: dict[str, Any]


@dataclass
class ReadCounts:
    records: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records skipped (skip_bad=True)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def read_records(path: str | Path, *, kind: str, skip_bad: bool = False,
                 counts: ReadCounts | None = None) -> list[Record]:
    """Every record of a .jsonl / .parquet file, or of every such file under a directory (sorted), checked for
    `kind` ("sft": conversational or prompt-completion; "preference"). DataError for a bad record (file and line),
    unless `skip_bad` (then counted in `counts`), and for no records at all."""
    if kind not in ("sft", "preference"):
        raise ValueError(f"kind must be 'sft' or 'preference', got {kind!r}")
    counts = counts if counts is not None else ReadCounts()
    files = find_files([path], RECORD_FORMATS)
    records: list[Record] = []
    for file in files:
        for where, raw in raw_records(Path(file.path)):
            try:
                check_record(raw, kind)
            except DataError as err:
                if not skip_bad:
                    raise DataError(f"{where}: {err} (data.skip_bad_records=true skips such records)") from None
                counts.skip(str(err).split(";")[0][:80])
                continue
            records.append(Record(where, raw))
    counts.records = len(records)
    if not records:
        raise DataError(f"{path}: no usable records (expected {_FORMAT_HELP[kind]})")
    return records


def raw_records(path: Path):
    """(where, parsed value) of every non-blank line of a .jsonl file, or every row of a .parquet file."""
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for damaged files
            raise DataError(f"{path}: not a readable parquet file ({err})") from None
        for n, row in enumerate(rows, 1):
            yield f"{path}:row {n}", row
        return
    with open(path, encoding="utf-8-sig", errors="strict") as f:  # (a byte order mark at the start is dropped)
        n = 0
        while True:
            n += 1
            try:
                line = f.readline()
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{n}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None
            if not line:
                return
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                value = _Invalid(DataError(f"not valid JSON ({err.msg} at column {err.colno})"))
            yield f"{path}:{n}", value


class _Invalid:
    """A line that did not parse: `check_record` raises its error (so skip_bad can count it like any other)."""

    def __init__(self, error: DataError) -> None:
        self.error = error


_FORMAT_HELP = {
    "sft": 'records {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"}',
    "preference": 'records {"prompt", "chosen", "rejected"} (strings or message lists)',
}


def check_record(raw: Any, kind: str) -> None:
    """DataError (without the location) unless `raw` is a record of `kind`."""
    if isinstance(raw, _Invalid):
        raise raw.error
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    fields = ("prompt", "chosen", "rejected") if kind == "preference" else None
    if kind == "sft":
        if "messages" in raw:
            fields = ("messages",)
        elif "prompt" in raw or "completion" in raw:
            fields = ("prompt", "completion")
        else:
            raise DataError(f"a record without 'messages' or 'prompt' / 'completion' (keys: {sorted(raw)[:6]}); "
                            f"expected {_FORMAT_HELP[kind]}")
    missing = [k for k in fields if raw.get(k) is None]
    if missing:
        raise DataError(f"a record without {', '.join(repr(k) for k in missing)}; expected {_FORMAT_HELP[kind]}")
    values = [raw[k] for k in fields]
    if all(isinstance(v, str) for v in values):
        if fields == ("messages",):
            raise DataError("'messages' is a string; it must be a list of {\"role\", \"content\"} messages")
        return
    if not all(isinstance(v, list) for v in values):
        raise DataError(f"{', '.join(fields)} must all be strings or all be message lists")
    for name, messages in zip(fields, values):
        if not messages:  # (a template renders no empty conversation: transformers refuses one)
            raise DataError(f"{name!r} is an empty list of messages")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{name}[{i}] is not a message {{\"role\": str, \"content\": str}}")
    if fields == ("messages",) and not any(m["role"] == "assistant" for m in values[0]):
        raise DataError("a conversation without an assistant message (nothing to train on)")
    for name, messages in zip(fields, values):  # the responses are the assistant's
        if name in ("chosen", "rejected", "completion") and messages[-1]["role"] != "assistant":
            raise DataError(f"{name!r} must end with an assistant message (its last is {messages[-1]['role']!r})")


class ChatEncoder:
    """Renders records with a chat template and tokenizes them. `tokenizer`: a transformers tokenizer;
    `chat_template`: a Jinja template (None: the tokenizer's own); `train_on`: "assistant" (the assistant's messages
    / the completion) or "all" (every token)."""

    def __init__(self, tokenizer, chat_template: str | None = None, *, train_on: str = "assistant",
                 source: str = "the tokenizer") -> None:
        if train_on not in ("assistant", "all"):
            raise ValueError(f"train_on must be 'assistant' or 'all', got {train_on!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self.train_on = train_on
        self.source = source
        self.eos_id = tokenizer.eos_token_id

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, chat_template_file: str | Path | None = None,
                       **kwargs) -> ChatEncoder:
        """The tokenizer of a model directory (ours or any transformers one) and its chat template, or the
        template in `chat_template_file`."""
        source = str(model_dir) if chat_template_file is None else f"{chat_template_file} (for {model_dir})"
        return cls(load_tokenizer(model_dir), read_chat_template(chat_template_file), source=source, **kwargs)

    # ------------------------------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        if self.chat_template is None:
            raise DataError(f"{self.source} has no chat template, and conversational records need one: pass "
                            "--chat-template FILE (a Jinja template), or use records whose fields are strings")
        from jinja2 import TemplateError, TemplateSyntaxError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template)
        except TemplateSyntaxError as err:
            raise DataError(f"the chat template of {self.source} does not parse: {err.message} (its line "
                            f"{err.lineno})") from None
        except (TemplateError, ValueError) as err:  # raise_exception(...) in the template: roles it does not take
            raise DataError(f"the chat template of {self.source} refused the messages: {err}") from None

    def prompt_text(self, record: dict[str, Any]) -> str:
        """What a model answers for this record: the conversation up to its last assistant message (or the prompt),
        rendered with the generation prompt; a string prompt as it is."""
        if "messages" in record:
            messages = record["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            return self.render(messages[:last], add_generation_prompt=True)
        if isinstance(record["prompt"], str):
            return record["prompt"]
        return self.render(record["prompt"], add_generation_prompt=True)

    def turn_end(self) -> str:
        """The text the template writes right after an assistant message's content, up to the first whitespace (our
        template's "<|end_of_turn|>", ChatML's "<|im_end|>"); "" without a template or with nothing there."""
        if self.chat_template is None:
            return ""
        marker = "\x00answer\x00"
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}])
        after = text.split(marker, 1)[1].strip() if marker in text else ""
        return after.split()[0] if after else ""

    def stop_ids(self) -> list[int]:
        """The ids that end an assistant's turn: eos, and the turn's end (`turn_end`) where the tokenizer has it as
        one special token. A tokenizer that spells the turn's end in ordinary tokens (a byte-level one without the
        role tokens) needs the text check of `cut_at_turn_end` as well."""
        stops = [self.eos_id] if self.eos_id is not None else []
        ids = self.encode_text(self.turn_end()) if self.turn_end() else []
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        if len(ids) == 1 and ids[0] in special and ids[0] not in stops:
            stops.append(ids[0])
        return stops

    def cut_at_turn_end(self, text: str) -> tuple[str, bool]:
        """(the text before the turn's end, whether it was there)."""
        end = self.turn_end()
        if end and end in text:
            return text[:text.index(end)], True
        return text, False

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_spans(self, messages: list[dict], trained: list[int]) -> tuple[list[int], list[int]]:
        """The conversation's ids, and 1 for the tokens of the messages at indices `trained` (module docstring)."""
        full = self.render(messages)
        spans = []
        for i in trained:
            start = self.render(messages[:i], add_generation_prompt=True)
            end = self.render(messages[: i + 1])
            if not (full.startswith(start) and full.startswith(end) and len(end) > len(start)):
                raise DataError(
                    f"the chat template of {self.source} renders no span for message {i} ({messages[i]['role']}): "
                    "rendering the conversation's first messages does not give a prefix of the whole rendering; "
                    "use a template that renders prefixes as prefixes, or --set data.train_on=all"
                )
            spans.append((len(start), len(end)))
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        mask = [int(any(s < b and e > a for a, b in spans)) for s, e in encoded["offset_mapping"]]
        return ids, mask

    # ------------------------------------------------------------------------------------------ records
    def encode_sft(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(ids, mask) of an SFT record: mask 1 where the loss trains (module docstring)."""
        if "messages" in record:
            messages = record["messages"]
            ids, mask = self._encode_spans(messages, [i for i, m in enumerate(messages) if m["role"] == "assistant"])
        elif isinstance(record["prompt"], str):
            prompt, completion = self.encode_text(record["prompt"]), self.encode_text(record["completion"])
            completion = completion + ([self.eos_id] if self.eos_id is not None else [])
            ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        else:
            messages = record["prompt"] + record["completion"]
            ids, mask = self._encode_spans(messages, list(range(len(record["prompt"]), len(messages))))
        return ids, [1] * len(ids) if self.train_on == "all" else mask

    def encode_preference(self, record: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, chosen ids, rejected ids) of a preference record. Strings: the responses end with eos.
        Message lists: the prompt rendered with the generation prompt, each response the rest of its rendering."""
        if isinstance(record["prompt"], str):
            eos = [self.eos_id] if self.eos_id is not None else []
            return (self.encode_text(record["prompt"]), self.encode_text(record["chosen"]) + eos,
                    self.encode_text(record["rejected"]) + eos)
        prompt = self.render(record["prompt"], add_generation_prompt=True)
        responses = []
        for name in ("chosen", "rejected"):
            full = self.render(record["prompt"] + record[name])
            if not full.startswith(prompt) or len(full) == len(prompt):
                raise DataError(f"the chat template of {self.source} renders no {name} response after the prompt "
                                "(the prompt's rendering is not a prefix of the whole); use another template")
            responses.append(self.encode_text(full[len(prompt):]))
        return self.encode_text(prompt), responses[0], responses[1]


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer of a model directory; DataError if it has none."""
    model_dir = Path(model_dir)
    if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()):
        raise DataError(f"{model_dir} has no tokenizer (tokenizer.json / tokenizer_config.json); copy the tokenizer "
                        "files of the model's training run into it (a `hybridlm train` run's final/ has them)")
    from hybridlm.models.hf import load_auto_tokenizer

    return load_auto_tokenizer(model_dir)


def read_chat_template(path: str | Path | None) -> str | None:
    """The text of a Jinja chat template file (None: None)."""
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        raise DataError(f"chat template {path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise DataError(f"chat template {path} is empty")
    return text


# ---------------------------------------------------------------------------------------------- demo data
_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen").split()
_COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
            "a tomato": "red", "an orange": "orange", "a plum": "purple"}
_WORDS = ("cat dog sun map cup hat pen box bird tree fish moon star rain lamp door book ship").split()


def demo_conversations(count: int = 512, seed: int = 0) -> list[dict[str, Any]]:
    """A small generated conversational set (no download): additions of small numbers, spelling, colours of
    things, reversing words and greetings, each asked a few ways, some with a system message. Learnable in minutes
    by a small model on a CPU, and easy to check by eye in `hybridlm chat`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(9)
            q = rng.choice(["What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} = ?"]).format(a=a, b=b)
            ans = f"{a} plus {b} is {a + b} ({_NUMBER_WORDS[a + b]})."
        elif kind == 1:
            w = rng.choice(_WORDS)
            q = rng.choice(["Spell {w}.", "How do you spell {w}?"]).format(w=w)
            ans = f"{w} is spelled {'-'.join(w.upper())}."
        elif kind == 2:
            thing = rng.choice(sorted(_COLOURS))
            q = rng.choice(["What colour is {t}?", "Which colour does {t} have?"]).format(t=thing)
            ans = f"{thing[0].upper() + thing[1:]} is {_COLOURS[thing]}."
        elif kind == 3:
            w = rng.choice(_WORDS)
            q = rng.choice(["Reverse the word {w}.", "Write {w} backwards."]).format(w=w)
            ans = f"{w} backwards is {w[::-1]}."
        else:
            q = rng.choice(["Hello!", "Hi there.", "Good morning!"])
            ans = "Hello! Ask me to add numbers, spell or reverse a word, or name a colour."
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": "You are a brief, helpful assistant."})
        out.append({"messages": messages})
    return out


def demo_preferences(count: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs over the demo conversations: the right answer chosen, another question's answer rejected."""
    conversations = demo_conversations(count, seed)
    rng = random.Random(seed + 1)
    out = []
    for i, conversation in enumerate(conversations):
        *prompt, answer = conversation["messages"]
        other = conversations[(i + 1 + rng.randrange(count - 1)) % count]["messages"][-1]
        if other["content"] == answer["content"]:
            other = {"role": "assistant", "content": "I do not know."}
        out.append({"prompt": prompt, "chosen": [answer], "rejected": [other]})
    return out
