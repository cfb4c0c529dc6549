"""`hybridlm chat`: talk to a model through its chat template, in the terminal.

    hybridlm chat --model runs/sft/final                          # interactive: /reset, /exit, /quit (below)
    hybridlm chat --model runs/sft/final --prompt "Spell cat."   # one answer, then exit
    hybridlm chat --model M --system "You are brief." --temperature 0.7 --top-p 0.9 --seed 0

Every turn renders the whole conversation with the model directory's chat template (or --chat-template FILE) and
the generation prompt, and decodes the answer with the model's cache, printing tokens as they come (the decoded
text grows; only the new characters are printed). The model reads only what is new: the session keeps the cache of
the last prompt, and when the new prompt's tokens go on from it (the template renders earlier turns the same way)
only the answer and the new message are prefilled; otherwise the whole conversation is. An answer ends at eos or at
the special token the template writes after an assistant message (our template's <|end_of_turn|>), or at
--max-new-tokens. On a CUDA device each answer's decoding steps replay a CUDA graph of the step
(`hybridlm.models.graphed`; --eager runs them op by op).
Interactive, a line is a message or a command: /reset starts over, /exit or /quit leaves (as Ctrl-D does), and
Ctrl-C stops an answer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from hybridlm.argtypes import positive_int
from hybridlm.models.commands import (
    add_generation_flags,
    add_sampling_flags,
    generation_options,
    sampling_flags_problem,
)


def add_chat_command(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a fine-tuned model in the terminal (its chat template)",
                              description=__doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[2],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="model directory with tokenizer and chat template")
    p.add_argument("--prompt", metavar="TEXT", help="answer this one message and exit (default: interactive)")
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the model's")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens per answer at most (256)")
    add_sampling_flags(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="parameter dtype")
    p.add_argument("--eager", action="store_true",
                   help="decode op by op over the growing cache (default on CUDA: a CUDA graph of the fixed-shape step "
                        "replays once per token, hybridlm/models/graphed.py)")
    add_generation_flags(p)
    p.set_defaults(func=run_chat)


class ChatSession:
    """A conversation with a model: `reply(text, on_text)` adds the user's message, generates the answer (calling
    `on_text(new_characters)` as it grows) and keeps it; `reset()` forgets all but the system message.

    The cache of the last prompt is kept (`held`: its ids and the cache): a prompt whose ids start with them continues
    it (`generate(cache=...)`), so each turn prefills only its new tokens, with the logits of a prefill of the whole
    conversation (to float rounding). Decoding op by op continues a copy (the held cache stays at the prompt but its
    last token, which the copy reads); the graphed decoder steps a static copy of its own, so the held cache itself
    reads the last token (the whole prompt is held) and no other copy is made. A prompt that does not (the template
    rendered an earlier turn differently, an answer's tokens encode differently as text, or the messages changed)
    is prefilled from the start."""

    def __init__(self, model, encoder, *, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, graph: bool = False) -> None:
        import torch

        from hybridlm.models.sampling import check_sampling

        check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        self.model, self.encoder = model, encoder
        self.system = system
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.max_new_tokens = max_new_tokens
        self.graph = graph  # decode through `GraphedDecoder` (`generate(graph=True)`)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.limit = model.config.max_position_embeddings
        self.messages: list[dict[str, str]] = []
        self.held: tuple[list[int], object] | None = None  # (ids, the HybridCache filled with exactly them)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.held = None

    def reply(self, text: str, on_text: Callable[[str], None] = lambda s: None) -> str:
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self.encoder.encode_text(self.encoder.render(messages, add_generation_prompt=True))
        room = min(self.max_new_tokens, self.limit - len(prompt))
        if room < 1:
            raise ValueError(f"the conversation has {len(prompt)} tokens, the model's context is {self.limit}")
        cache = self._cache_of(prompt[:-1])
        if self.graph:  # the decoder steps a static copy: only the prompt's last token goes into the held cache
            self.held = None  # (until it is there)
        final = answer(self.model, self.encoder, prompt, max_new_tokens=room, on_text=on_text,
                       generator=self.generator, graph=self.graph, cache=cache if self.graph else cache.copy(),
                       **self.sampling)
        if self.graph:
            self.held = (list(prompt), cache)
        self.messages = messages + [{"role": "assistant", "content": final}]
        return final

    def _cache_of(self, ids: list[int]):
        """A cache filled with `ids`: the held one continued where they go on from its ids, else a new one; held for
        the next turn. Forgotten while it is being filled: an interrupted prefill leaves no cache that is not what its
        ids say."""
        import torch

        from hybridlm.models.generation import prefill

        held, self.held = self.held, None
        if held is None or held[0] != ids[:len(held[0])]:
            held = ([], self.model.new_cache())
        done, cache = held
        if len(ids) > len(done):
            prefill(self.model, torch.tensor([ids], device=self.device), cache=cache)
        self.held = (list(ids), cache)
        return cache


def answer(model, encoder, prompt: list[int], *, max_new_tokens: int, on_text: Callable[[str], None] = lambda s: None,
           generator=None, graph: bool = False, cache=None, **sampling) -> str:
    """The model's answer to a rendered prompt's ids, streamed to `on_text` as it grows: decoding ends at eos, at the
    turn's end (`ChatEncoder.stop_ids`, or its text where the tokenizer spells it in ordinary tokens: then text that
    could be the start of it is held back until it is known not to be) or after `max_new_tokens`. `cache`: one filled
    with the prompt's first tokens, continued in place (`generate`'s)."""
    import torch

    from hybridlm.models.generation import generate

    stops = encoder.stop_ids()
    end = encoder.turn_end()
    shown = [""]

    def visible(ids: list[int]) -> tuple[str, bool]:
        text, ended = encoder.cut_at_turn_end(encoder.tokenizer.decode([t for t in ids if t not in stops],
                                                                       skip_special_tokens=True))
        if not ended:
            text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet waits
            for k in range(min(len(end) - 1, len(text)), 0, -1):  # the start of the turn's end waits
                if end.startswith(text[-k:]):
                    text = text[:-k]
                    break
        return text, ended

    def show(text: str) -> None:
        if text.startswith(shown[0]) and len(text) > len(shown[0]):
            on_text(text[len(shown[0]):])
            shown[0] = text

    def stream(sequences: torch.Tensor, logits: torch.Tensor) -> bool:
        text, ended = visible(sequences[0, len(prompt):].tolist())
        show(text)
        return ended

    device = next(model.parameters()).device
    out = generate(model, torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens,
                   eos_token_id=stops or None, generator=generator, stop=stream, graph=graph, cache=cache, **sampling)
    final, _ = encoder.cut_at_turn_end(encoder.tokenizer.decode(
        [t for t in out.sequences[0, len(prompt):].tolist() if t not in stops], skip_special_tokens=True))
    show(final)
    return final


def run_chat(args: argparse.Namespace) -> int:
    from hybridlm.data.errors import DataError

    problem = sampling_flags_problem(args)
    if problem:
        print(f"hybridlm chat: {problem}", file=sys.stderr)
        return 2
    try:
        session = _session(args)
    except (ValueError, OSError) as err:
        print(f"hybridlm chat: {err}", file=sys.stderr)
        return 1

    def show(text: str) -> None:
        print(text, end="", flush=True)

    if args.prompt is not None:
        try:
            session.reply(args.prompt, show)
        except (ValueError, DataError) as err:  # too long for the context; a template that refuses the messages
            print(f"hybridlm chat: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print()
            return 130
        print()
        return 0
    print("chat: /reset starts over, Ctrl-C stops an answer, /exit, /quit or Ctrl-D leave", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            session.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        try:
            session.reply(text, show)
        except (ValueError, DataError) as err:  # the message is not kept: the conversation goes on without it
            print(f"\n{err}; /reset starts over", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # the answer stops; the conversation goes on without this exchange
            print("\n(answer stopped; this exchange is not kept)", file=sys.stderr)
            continue
        print()


def _session(args: argparse.Namespace) -> ChatSession:
    import torch

    from hybridlm.data.chat import ChatEncoder
    from hybridlm.data.errors import DataError
    from hybridlm.devices import parse_device
    from hybridlm.models.fuse import prepare_for_generation
    from hybridlm.models.hf import load_model, model_dir_problem

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(model_dir_problem(model_dir))
    try:
        encoder = ChatEncoder.from_model_dir(model_dir, args.chat_template)
    except DataError as err:
        raise ValueError(str(err)) from None
    if encoder.chat_template is None:  # said now, before the model loads
        raise ValueError(f"{model_dir} has no chat template: pass --chat-template FILE (a Jinja template), or use "
                         "`hybridlm generate` for plain text")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    try:
        encoder.render([*opening, {"role": "user", "content": "hi"}], add_generation_prompt=True)
    except DataError as err:  # a template that does not parse, or refuses a plain user turn (or a system message)
        what = "a system message and a user message" if args.system else "a user message"
        raise ValueError(f"the chat template does not render {what}: {err}") from None
    device = parse_device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model = load_model(model_dir, dtype=args.dtype).to(device)
    prepare_for_generation(model, **generation_options(args))
    return ChatSession(model, encoder, system=args.system, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       graph=device.type == "cuda" and not args.eager)
