"""Time of one training update of the benchmark models on a GPU, with the Transformer's as the baseline.

    python benchmarks/gpu_train_step.py                                   # addition recipe shape, 7 models
    python benchmarks/gpu_train_step.py --models fw-1A transformer --batch-size 256 --json out.json
    python benchmarks/gpu_train_step.py --compile --steps 60             # through torch.compile (CUDA graphs)
    python benchmarks/gpu_train_step.py --compile --ssm-backend chunk    # the torch chunk path in the SSM mixers
    python benchmarks/gpu_train_step.py --models fw-1A --profile          # where an update's GPU time goes
    python benchmarks/gpu_train_step.py --models fw-3A --profile --stacks # ... and which Python lines launched it
    python benchmarks/gpu_train_step.py --packed 480x1024 --conv-backend torch triton  # packed rows, both convs

The models and sequences are those of `hybridlm bench addition` (size "small", 101 tokens); the batch is 256 by
default, the batch of the timings in benchmarks/RESULTS.md (the addition recipe now trains on 1024: --batch-size).
For each model: the median wall time of an update through `train_on_task` (AdamW, clipping, bf16
autocast; the GPU is synchronized at every update, so this is the time of one update alone, with no
overlap of the host's launches and the GPU's work) and its ratio to the Transformer's in the same run.
`--compile` times the updates of `bench addition --compile` (inductor, "reduce-overhead"); the first
updates, which compile and record the graphs, are left out of the median. `--ssm-backend` sets the op backend of
every fast-weight and Mamba-2 mixer ("auto": Triton kernels on CUDA for the rules that have them and for 16-bit SSD).
`--profile` adds, per model, a `torch.profiler` table of 3 updates after the timed ones: the kernels with the most
GPU time, and the count of kernel launches per update; `--stacks` groups that table by the Python stack that launched
each operator (eager mode only: under CUDA graphs the kernels belong to the graph's replay).
`--packed ROWSxLENGTH` trains on packed rows instead (`packed_train_batch`: whole examples end to end, each its own
document, as a language-model batch packs documents). `--conv-backend` sets the short convs' backend
(`causal_conv1d`); given several, every model runs under each, beside the Transformer's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np
import torch
from gpu_ops import kernel_launches  # benchmarks/ is on the path when this script runs

from hybridlm.experiments.addition import MODEL_VOCAB_SIZE, packed_train_batch, train_batch
from hybridlm.experiments.models import build_model, task_config
from hybridlm.experiments.train import train_on_task
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.modules import ShortConvolution

MODELS = ("transformer", "mamba2", "fw-1A", "fw-3A", "fw-1", "hybrid-fw-3A", "hybrid-mamba2")


def timed_run(name: str, *, steps: int, batches: list[dict], compile: bool, ssm_backend: str,
              conv_backend: str = "auto", profile: bool = False, stacks: bool = False) -> float:
    model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="small"), seed=0)
    for module in model.modules():
        if isinstance(module, (FastWeightMixer, Mamba2Mixer)):
            module.backend = ssm_backend
        if isinstance(module, ShortConvolution):
            module.backend = conv_backend
    stamps: list[float] = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA], with_stack=stacks)
    profiled = range(steps, steps + 3) if profile else range(0)

    def batch_fn(step: int) -> dict:
        torch.cuda.synchronize()  # measures the update before this one end to end
        stamps.append(time.perf_counter())
        if step == profiled.start and profile:
            profiler.start()
        return batches[step % len(batches)]

    train_on_task(model, batch_fn, steps=steps + len(profiled), lr=1e-3, device="cuda", compile=compile)
    if profile:
        torch.cuda.synchronize()
        profiler.stop()
        events = profiler.key_averages()
        launches = kernel_launches(events)
        print(f"\n### {name}: 3 updates profiled, {launches / 3:.0f} kernel / graph launches per update")
        print(events.table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
        if stacks:
            by_stack = profiler.key_averages(group_by_stack_n=6)
            print(by_stack.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
        stamps = stamps[:steps]
    deltas = [b - a for a, b in itertools.pairwise(stamps[10:])]  # past compilation
    return 1e3 * statistics.median(deltas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="train through torch.compile (reduce-overhead)")
    parser.add_argument("--ssm-backend", default="auto", choices=["auto", "chunk", "triton"])
    parser.add_argument("--conv-backend", nargs="+", default=["auto"], choices=["auto", "torch", "triton"])
    parser.add_argument("--packed", default=None, metavar="ROWSxLENGTH", help="packed rows instead of padded ones")
    parser.add_argument("--profile", action="store_true", help="print a GPU profile of 3 updates per model")
    parser.add_argument("--stacks", action="store_true", help="with --profile: group by the launching Python stack")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.packed:
        rows, length = (int(n) for n in args.packed.split("x"))
        batches = [packed_train_batch(rng, rows, length) for _ in range(args.steps)]
    else:
        batches = [train_batch(rng, args.batch_size) for _ in range(args.steps)]
    shape = "x".join(str(n) for n in batches[0]["input_ids"].shape)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {'packed ' if args.packed else ''}batch "
          f"{shape} tokens · median of {args.steps - 11} updates"
          + (" · torch.compile reduce-overhead" if args.compile else " · eager") + f" · SSM backend {args.ssm_backend}")
    options = {"steps": args.steps, "batches": batches, "compile": args.compile, "ssm_backend": args.ssm_backend,
               "profile": args.profile, "stacks": args.stacks}
    baseline = timed_run("transformer", **options)
    print(f"{'model':<16}{'conv':>8}{'ms/update':>10}{'/ transformer':>15}")
    rows = []
    for name, conv in itertools.product(args.models, args.conv_backend):
        if name == "transformer" and conv != args.conv_backend[0]:
            continue  # no short conv
        ms = baseline if name == "transformer" else timed_run(name, conv_backend=conv, **options)
        rows.append({"model": name, "compile": args.compile, "ssm_backend": args.ssm_backend, "conv_backend": conv,
                     "batch": shape, "ms_per_update": ms, "ratio_to_transformer": ms / baseline})
        print(f"{name:<16}{conv:>8}{ms:>10.2f}{ms / baseline:>15.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
