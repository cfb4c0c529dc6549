"""Time to the first token of each turn of a chat conversation: the session's held cache (each turn prefills only its
new tokens) against a prefill of the whole conversation every turn, the two measured in this one process, turn by turn.

    python benchmarks/chat_turns.py                                   # tiny preset, CPU, 8 turns
    python benchmarks/chat_turns.py --preset small --device cuda --dtype bfloat16 --turns 12 --graph

Both sessions talk to the same model with random weights through the byte tokenizer and the library's chat template,
greedy, so they give the same answers (checked: a turn whose answers differ is marked); every user message has
`--message-chars` characters. The time to the first token runs from `ChatSession.reply`'s call to the end of the
model call whose logits choose the answer's first token (the second call of a reply: the new tokens, then the
prompt's last one); the whole reply's time is shown beside it. Medians over `--repeats` conversations, the two sessions
taking turns. The ratio is held / whole: it falls as the conversation grows, since the whole-prefill session reads the
entire conversation again every turn.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from hybridlm.data.chat import ChatEncoder
from hybridlm.inference.chat import ChatSession
from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset
from hybridlm.training.demo import build_byte_tokenizer

VARIANTS = {"mamba2": dict(), "fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A")}


def conversation_times(model, encoder, args) -> list[dict]:
    """Per turn: the prompt's tokens, the tokens the held session prefilled, and for each session the median seconds
    to the first token and of the whole reply; whether the two answers agreed in every repeat."""
    ends: list[float] = []  # when each model call ended

    def ended(module, inputs, output) -> None:
        sync(model)
        ends.append(time.perf_counter())

    hook = model.register_forward_hook(ended)
    rows = [dict(prompt=0, prefilled=0, same=True, first={"whole": [], "held": []}, reply={"whole": [], "held": []})
            for _ in range(args.turns)]
    for _ in range(args.repeats):
        sessions = {name: ChatSession(model, encoder, max_new_tokens=args.max_new_tokens, graph=args.graph)
                    for name in ("whole", "held")}
        for turn, row in enumerate(list(rows)):
            text = f"Message {turn}: " + "the quick brown fox jumps over the lazy dog " * (args.message_chars // 44 + 1)
            text = text[:args.message_chars]
            answers = {}
            for name, session in sessions.items():
                before = 0 if session.held is None else len(session.held[0])
                if name == "whole":
                    session.held = None  # forget the cache: the whole conversation is prefilled
                sync(model)
                ends.clear()
                start = time.perf_counter()
                try:
                    answers[name] = session.reply(text)
                except ValueError:  # past the model's context: the conversation ends at the turns before
                    del rows[turn:]
                    break
                sync(model)
                row["reply"][name].append(time.perf_counter() - start)
                row["first"][name].append(ends[1] - start)
                if name == "held":  # (op by op the held cache stops before the prompt's last token)
                    row["prompt"] = len(session.held[0]) + (0 if args.graph else 1)
                    row["prefilled"] = row["prompt"] - before  # what this reply's prefill read
            if turn >= len(rows):
                break
            row["same"] = row["same"] and answers["whole"] == answers["held"]
    hook.remove()
    for row in rows:
        for kind in ("first", "reply"):
            row[kind] = {name: statistics.median(times) for name, times in row[kind].items()}
    return rows


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--message-chars", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--graph", action="store_true", help="decode through the CUDA-graphed step (CUDA only)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        build_byte_tokenizer().save(directory)
        encoder = ChatEncoder.from_model_dir(directory)
    print(f"# chat turns: {args.preset} preset, {args.dtype} on {args.device} "
          f"({torch.cuda.get_device_name() if args.device.startswith('cuda') else platform.processor() or 'cpu'}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}; {args.message_chars}-character messages, "
          f"answers of at most {args.max_new_tokens} tokens, median of {args.repeats}\n")
    for variant in args.variants:
        torch.manual_seed(0)
        config = get_preset(args.preset, **VARIANTS[variant])
        if config.vocab_size < encoder.tokenizer.vocab_size:
            parser.error(f"the {args.preset} preset's vocabulary is smaller than the byte tokenizer's")
        model = HybridForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        print(f"## {variant}\n\n| turn | prompt tokens | prefilled (held) | first token ms, whole | held | "
              "held / whole | reply ms, whole | held |\n|---|---|---|---|---|---|---|---|")
        for turn, row in enumerate(conversation_times(model, encoder, args), 1):
            first, reply = row["first"], row["reply"]
            print(f"| {turn} | {row['prompt']} | {row['prefilled']} | {first['whole'] * 1e3:.1f} | "
                  f"{first['held'] * 1e3:.1f} | {first['held'] / first['whole']:.2f} | {reply['whole'] * 1e3:.1f} | "
                  f"{reply['held'] * 1e3:.1f}{'' if row['same'] else ' (answers differ)'} |")
        print()


if __name__ == "__main__":
    main()
