"""Where a serving engine's decoding step spends its time: the GPU's replay against the host's work around it.

    python benchmarks/serve_step_profile.py                          # H200: 125m shape, 3 variants, bf16
    python benchmarks/serve_step_profile.py --rows 64 --variants "h1 fw-1A"

For each variant (`gpu_model.py`'s), the model is saved with `serve_bench.py`'s word-level tokenizer and loaded into
an `Engine` with `--rows` decode rows (CUDA graphs, captured at start-up; with `--compile` a second engine whose step
inductor compiles before the capture), which then serves `--rows` requests of `--prompt-tokens` + `--output-tokens`
tokens at once. Printed, per decoding step with every row running:
- wall: the step's time in the engine (`Engine._decode`), and the whole run's time in prefill and decoding steps;
- replay: the GPU time of the captured graph alone (CUDA events around one replay, median of 30), same shape;
- host split of the wall time: feeding the graph (`SlotStepGraphs.step`), waiting for and sampling the logits
  (`Engine._sample`: the step's one synchronization), and the per-row bookkeeping (`Engine._append`: detokenizing,
  stop checks, the outputs and their callbacks);
- kernels: the CUDA kernels of one fixed-shape step run eagerly (torch.profiler), their count and summed GPU time,
  and the kernels with the most time.
The ratio wall / replay says how much of a step the GPU is busy: near 1, faster kernels are the lever; well above,
the host's work per step is.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from serve_bench import (  # benchmarks/ is on the path when this script runs
    load_local,
    save_model,
)


def timed(store: dict, name: str, fn):
    """`fn` wrapped to add its wall seconds to `store[name]`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append(time.perf_counter() - start)

    return wrapper


@torch.no_grad()
def replay_ms(engine, rows: int, span: int, repeats: int = 30) -> float:
    """GPU milliseconds of the (rows, span) graph replayed on rows of span / 2 tokens (median of `repeats`)."""
    entry = engine.step_graphs._entry(rows, span)
    saved = engine.slots.snapshot(rows)
    times = []
    for _ in range(repeats):
        engine.slots.lengths_device[:rows].fill_(span // 2)  # a replay advances every row by one
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        entry.graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    engine.slots.restore(saved)
    return statistics.median(times)


@torch.no_grad()
def kernel_profile(engine, rows: int, span: int, top: int) -> tuple[int, float, list[tuple[str, int, float]]]:
    """The fixed-shape step run eagerly under torch.profiler: kernel count, their GPU ms, the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.step_graphs
    entry = graphs._entry(rows, span)
    saved = engine.slots.snapshot(rows)
    engine.slots.lengths_device[:rows].fill_(span // 2)
    graphs._forward(entry, rows, span)  # warm
    engine.slots.restore(saved)
    engine.slots.lengths_device[:rows].fill_(span // 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(entry, rows, span)
        torch.cuda.synchronize()
    engine.slots.restore(saved)
    per_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name].append(event.device_time_total / 1e3)
    count = sum(len(v) for v in per_name.values())
    total = sum(sum(v) for v in per_name.values())
    ranked = sorted(((name, len(v), sum(v)) for name, v in per_name.items()), key=lambda r: -r[2])
    return count, total, ranked[:top]


def profile_variant(variant: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        vocab = save_model(args.preset, variant, Path(tmp), getattr(torch, args.dtype))
        model, tokenizer = load_local(Path(tmp), args)
    return [profile_engine(model, tokenizer, vocab, f"{variant}, {mode}", args, compile_step=backend)
            for mode, backend in (("graphs", None), ("compiled + graphs", "inductor"))[: 2 if args.compile else 1]]


def profile_engine(model, tokenizer, vocab: int, name: str, args: argparse.Namespace, *, compile_step) -> dict:
    from hybridlm.serving import Engine, SamplingParams

    torch._dynamo.reset()  # dynamo's compilations of the step are per function: start each engine afresh
    engine = Engine(model, tokenizer, max_num_seqs=args.rows, max_model_len=args.prompt_tokens + args.output_tokens,
                    max_prefill_tokens=args.max_prefill_tokens, prefix_cache_bytes=0, compile_step=compile_step)
    start = time.perf_counter()
    captured = engine.warm_up()
    warm_up_s = time.perf_counter() - start
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    engine.generate(prompts, params)  # warm: every path once

    times: dict[str, list[float]] = defaultdict(list)
    engine.step_graphs.step = timed(times, "feed graph", engine.step_graphs.step)
    engine._sample = timed(times, "sync + sample", engine._sample)
    engine._append = timed(times, "bookkeeping", engine._append)
    engine._decode = timed(times, "decode step", engine._decode)
    engine._prefill = timed(times, "prefill", engine._prefill)
    start = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = times["decode step"]
    # the steps with every row running: after the prefill steps, before the rows retire (all at the last step)
    full = steps[1:-1] if len(steps) > 2 else steps
    step_ms = 1e3 * statistics.median(full)

    def per_step(phase: str) -> float:
        return 1e3 * sum(times[phase]) / max(1, len(steps))

    span = next(s for s in engine.step_graphs.spans if s > args.prompt_tokens + args.output_tokens // 2)
    rows = next(b for b in engine.step_graphs.rows if b >= args.rows)
    gpu_ms = replay_ms(engine, rows, span)
    count, kernel_ms, ranked = kernel_profile(engine, rows, span, args.top)
    one_ms = replay_ms(engine, 1, span)
    one_count, one_kernel_ms, _ = kernel_profile(engine, 1, span, 0)
    out = dict(name=name, graphs=captured, warm_up_s=warm_up_s,
               generate_tokens_per_s=args.rows * args.output_tokens / wall, decode_steps=len(steps), step_ms=step_ms,
               replay_ms=gpu_ms, feed_ms=per_step("feed graph"),
               sample_ms=per_step("sync + sample"), bookkeeping_ms=per_step("bookkeeping"), kernels=count,
               kernel_ms=kernel_ms, top=ranked, replay_1_ms=one_ms, kernels_1=one_count, kernel_1_ms=one_kernel_ms)
    print(f"# {name}: {captured} graphs in {warm_up_s:.1f} s; generate {out['generate_tokens_per_s']:.0f} output "
          f"tok/s over {len(steps)} decoding steps: {sum(times['prefill']):.2f} s prefilling, "
          f"{sum(steps):.2f} s decoding, of {wall:.2f} s", flush=True)
    print(f"  step (median, {args.rows} rows): wall {step_ms:.2f} ms, graph replay alone {gpu_ms:.2f} ms "
          f"(wall / replay {step_ms / gpu_ms:.2f}); per step: feed {out['feed_ms']:.2f} ms, sync + sample "
          f"{out['sample_ms']:.2f} ms, bookkeeping {out['bookkeeping_ms']:.2f} ms", flush=True)
    print(f"  eager fixed-shape step at ({rows} rows, span {span}): {count} kernels, {kernel_ms:.2f} ms of kernel "
          f"time; 1 row: replay {one_ms:.2f} ms, {one_count} kernels, {one_kernel_ms:.2f} ms", flush=True)
    for kernel, calls, ms in ranked:
        print(f"    {ms:7.3f} ms {calls:4d}x  {kernel[:110]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--variants", nargs="+", default=["h1 fw-1A", "h1 mamba2", "transformer matched"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="the engine's prefill tokens per step (default: the engine's, 8192 on a GPU, 2048 on a CPU)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    parser.add_argument("--compile", action="store_true",
                        help="also profile the engine with compile_step='inductor' (the step compiled, then captured)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("serve_step_profile.py profiles CUDA graphs: it needs a CUDA device")
    args.device = "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for variant in args.variants:
        profile_variant(variant, args)


if __name__ == "__main__":
    main()
