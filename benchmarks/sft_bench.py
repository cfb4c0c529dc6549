"""SFT throughput: `hybridlm sft` (the Trainer) against TRL's `SFTTrainer` on the same model, data and batch.

    python benchmarks/sft_bench.py                                  # H200: the 125m shape, both SSM halves, bf16
    python benchmarks/sft_bench.py --variants "h1 mamba2" --samples 600 --seq-len 2048 --micro-batch 8
    python benchmarks/sft_bench.py --cpu --preset tiny --samples 40 --seq-len 256 --micro-batch 2   # smoke run

For each variant (`gpu_model.py`'s "h1 mamba2" / "h1 fw-1A", random weights) the script saves the model with a
word-level tokenizer (one token per word; `serve_bench.save_model`) and `--samples` prompt-completion records of random words (prompts and
completions of 32..`--max-part` tokens each). Both trainers then run one epoch over the same records: packed into
rows of `--seq-len` tokens (ours: best-fit decreasing, each sample its own document; TRL: `packing=True`, best-fit
decreasing, padding-free), `--micro-batch` rows per update, loss on the completions only, AdamW at the same lr,
gradient clipping 1.0, bf16 autocast over fp32 weights, no compilation, no checkpoints during the run.

Printed per variant: completion-and-prompt tokens per second of the data (padding excluded) over the updates after
the first `--warmup` (their time measured on the device with synchronization at update boundaries), the peak CUDA
memory, and ours over TRL's tokens/s (>1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from serve_bench import SPECIALS, save_model  # benchmarks/ is on the path when this script runs

def write_records(path: Path, count: int, vocab: int, max_part: int, seed: int = 0) -> int:
    """`count` prompt-completion records of random words; returns their total token count (with eos)."""
    rng = random.Random(seed)
    total = 0
    with open(path, "w") as f:
        for _ in range(count):
            p, c = rng.randint(32, max_part), rng.randint(32, max_part)
            words = [f"w{rng.randrange(len(SPECIALS), vocab)}" for _ in range(p + c)]
            f.write(json.dumps({"prompt": " ".join(words[:p]), "completion": " " + " ".join(words[p:])}) + "\n")
            total += p + c + 1
    return total


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(model_dir: Path, data: Path, out: Path, args, updates: int) -> tuple[list[float], float]:
    from hybridlm.training.config import load_config
    from hybridlm.training.trainer import Trainer

    device = "cpu" if args.cpu else "cuda"
    config = load_config(None, [
        f"model.init={model_dir}", f"data.chat={data}", "data.demo=false", f"train.out_dir={out}",
        f"train.steps={updates}", f"batch.seq_len={args.seq_len}", f"batch.micro_batch={args.micro_batch}",
        f"optim.lr={args.lr}", "schedule.kind=constant", "schedule.warmup=0",
        "schedule.decay_shape=linear", "schedule.min_lr_ratio=0.0", "train.save_every=0", "train.samples=0",
        "train.progress=false", f"train.log_every={updates}", f"train.device={device}",
        f"train.dtype={'fp32' if args.cpu else 'bf16'}", "optim.weight_decay=0.0",
    ], task="sft")
    times: list[float] = []
    last = [time.perf_counter()]

    def on_update(trainer, record) -> None:
        sync(device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with Trainer(config, callbacks=[on_update]) as trainer:
        rows = len(trainer.loader.epoch_rows(0))
        assert rows <= updates * args.micro_batch, (rows, updates)
        sync(device)
        last[0] = time.perf_counter()
        trainer.train()
    memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return times, memory


def run_trl(model_dir: Path, data: Path, out: Path, args) -> tuple[list[float], int, float]:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hybridlm.models.hf import load_model

    device = "cpu" if args.cpu else "cuda"
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            times.append(time.perf_counter() - self.began)

    model = load_model(model_dir, dtype=torch.float32).train()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = load_dataset("json", data_files=str(data), split="train")
    config = SFTConfig(
        output_dir=str(out), max_length=args.seq_len, packing=True, per_device_train_batch_size=args.micro_batch,
        num_train_epochs=1, learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        bf16=not args.cpu, use_cpu=args.cpu, logging_steps=1000, save_strategy="no", report_to="none",
        completion_only_loss=True, dataloader_num_workers=0, seed=0,
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Clock()])
    trainer.train()
    memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return times, trainer.state.global_step, memory


def per_second(tokens: int, times: list[float], warmup: int) -> float:
    """Tokens per second over the updates after `warmup`, the epoch's tokens spread evenly over its updates."""
    kept = times[warmup:]
    return tokens * len(kept) / len(times) / sum(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["h1 mamba2", "h1 fw-1A"])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--max-part", type=int, default=700, help="longest prompt / completion, tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=3, help="updates left out of the timing")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = []
    print(f"{'variant':<12} {'ours tok/s':>12} {'TRL tok/s':>12} {'ratio':>7} {'ours GiB':>9} {'TRL GiB':>8} "
          f"{'updates ours/TRL':>17}")
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            vocab = save_model(args.preset, variant, tmp / "model", torch.float32)
            tokens = write_records(tmp / "data.jsonl", args.samples, vocab, args.max_part)
            trl_times, trl_updates, trl_memory = run_trl(tmp / "model", tmp / "data.jsonl", tmp / "trl", args)
            ours_times, ours_memory = run_ours(tmp / "model", tmp / "data.jsonl", tmp / "ours", args,
                                               updates=_our_updates(tmp, args))
            ours, theirs = per_second(tokens, ours_times, args.warmup), per_second(tokens, trl_times, args.warmup)
            print(f"{variant:<12} {ours:>12,.0f} {theirs:>12,.0f} {ours / theirs:>7.2f} {ours_memory:>9.1f} "
                  f"{trl_memory:>8.1f} {len(ours_times):>8}/{trl_updates:<8}", flush=True)
            results.append({"variant": variant, "ours_tokens_per_s": ours, "trl_tokens_per_s": theirs,
                            "ratio": ours / theirs, "ours_gib": ours_memory, "trl_gib": trl_memory,
                            "tokens": tokens, "updates": [len(ours_times), trl_updates]})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))


def _our_updates(tmp: Path, args) -> int:
    """The updates of one epoch of our packing (rows / micro-batch, rounded up)."""
    from hybridlm.data.chat import ChatEncoder, read_records
    from hybridlm.training.posttraining import ChatRows, FitCounts, fit_sample

    encoder = ChatEncoder.from_model_dir(tmp / "model")
    fit = FitCounts()
    samples = [s for r in read_records(tmp / "data.jsonl", kind="sft")
               if (s := fit_sample(*encoder.encode_sft(r.data), args.seq_len, fit))]
    rows = ChatRows(samples, batch_size=args.micro_batch, seq_len=args.seq_len, seed=0, pad_id=0)
    return -(-len(rows.epoch_rows(0)) // args.micro_batch)


if __name__ == "__main__":
    main()
