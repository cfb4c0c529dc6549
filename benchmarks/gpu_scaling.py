"""Training throughput of a hybrid preset over 1..N GPUs of one host, per mesh layout: tokens/s, MFU, scaling.

    torchrun --standalone --nproc_per_node 8 benchmarks/gpu_scaling.py --preset hybrid-1b --seq-len 32768 \\
        --layouts 1 dp=8 tp=2,dp=4 tp=8 cp=2,tp=2,dp=2 mixer=on,tp=2,dp=4 cp=8 --ac --json scaling-8gpu.json
    torchrun --standalone --nproc_per_node 4 benchmarks/gpu_scaling.py --cpu --preset tiny --seq-len 64 \\
        --set num_key_value_heads=2 --set mamba_n_groups=2 --layouts 1 dp=4 cp=2,tp=2 mixer=on,cp=2,tp=2   # smoke

Layouts (one argument each, comma-separated key=value; the sizes must multiply to the world size):
    "1"                  the one-GPU baseline: EVERY rank trains its own copy alone, at the same time, with no
                         process group in the step (so N figures at once: their mean, and each rank's in the JSON;
                         GPUs of one host share its CPUs and power, which the mean includes);
    dp=K                 FSDP2 over K ranks (dp_shard; "dp_replicate=R" adds HSDP replicas); missing: the rest;
    tp=K                 tensor parallelism (attention, SSM heads and MLP split; "ssm_tp=0" keeps the SSM whole);
    cp=K                 context parallelism (each row's sequence split over K ranks: ring attention, state passing);
    mixer=on|interleaved Falcon-H1 mixer parallelism over the tp group (tp even);
    ac=0|1               activation checkpointing per block for this layout (default: --ac); never with cp > 1
                         (`hybridlm.parallel.context_parallel` refuses it), so cp layouts run without it.
Each layout: build the preset on every rank from one seed (float32 master weights), `hybridlm.parallel.parallelize`
(TP / mixer -> AC -> compile -> FSDP2), then --warmup untimed and --steps timed training updates, each: a bf16
autocast forward (--autocast: default on CUDA, off with --cpu) of --batch rows per data-parallel rank (cp ranks take their chunk of each row: `shard_rows`),
the mean next-token loss, backward, `reduce_context_parallel_grads` (cp), the trainer's global-norm clip
(`hybridlm.training.distributed.clip_grad_norm`; torch's clip_grad_norm_ fails on these meshes) to 1.0, AdamW
(foreach=False: DTensor and plain parameters mix). Random tokens (the speed does not depend on them).

Reported per layout (printed by rank 0 and written to --json after every layout, so a crash keeps the rest):
    tokens/s             global tokens per update (batch x dp x seq_len) / mean seconds per timed update;
    tokens/s per GPU     tokens/s / world size (for "1": one GPU's tokens/s);
    peak GiB             torch.cuda.max_memory_allocated, the max over ranks (and every rank's, in the JSON);
    MFU                  tokens/s per GPU x F / 989e12 (H200 SXM bf16 dense peak; --peak-tflops to change; a
                         large bf16 GEMM reached ~790 TFLOP/s on these machines), with the model FLOPs per
                         token F below (MFU, not HFU: AC's recomputation is not counted);
    scaling              tokens/s per GPU / the "1" layout's mean tokens/s per GPU (when "1" ran in this call);
    loss                 the last timed update's mean loss over the global batch: layouts that read the same
                         rows (the same dp size) train the same model, so equal losses are a cross-check.

Model FLOPs per token of one training update (forward + backward = 3 x forward), T = seq_len:
    F = 6 P_mm                                   P_mm: weights of every nn.Linear (attention q/k/v/o, SSM in/out
                                                 projections, MLP, the LM head); not the input embedding (a
                                                 lookup), norms, conv or per-head vectors (negligible);
      + 6 sum_attention_layers (Hq d_h) T         attention scores Q K^T and P V, CAUSAL convention: a query
                                                 attends to T/2 keys on average (2 matmuls x 2 d_attn x T/2 x 3);
                                                 PaLM's non-causal 12 L d_attn T is also reported (mfu_noncausal);
      + 3 sum_mamba2_layers [ 2 (Q_c/2) (G N + H P) + 4 H P N ]
                                                 SSD chunked scan forward per token: C B^T within a chunk (G groups,
                                                 state N, chunk Q_c, causal: Q_c/2 keys) and its product with x (H
                                                 heads of P), the chunk state B^T x and the inter-chunk output C h
                                                 (2 H P N each). Fast-weight mixers: their projections only (in P_mm).
For hybrid-1b at T = 32768: 6 P_mm = 6.45 GFLOP, attention 9.66 GFLOP, SSD 0.10 GFLOP: 16.2 GFLOP per token
(100% MFU at 989 TFLOP/s would be 61K tokens/s per GPU; PaLM's non-causal convention gives 25.9 GFLOP).

Failures of one layout (a divisibility error, out of memory) are reported in its row and the next layout
runs; an OOM on one rank of a communicating layout can leave the others waiting in a collective until
--timeout-s (the process group's timeout) ends the run: the JSON written so far stays.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridlm.layers.attention import Attention
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models import get_preset
from hybridlm.models.model import HybridForCausalLM
from hybridlm.parallel import ParallelConfig, build_mesh, parallelize
from hybridlm.parallel.parallelize import wrap_blocks
from hybridlm.training.distributed import (
    DistContext,
    clip_grad_norm,
    context_parallel,
    reduce_context_parallel_grads,
    shard_rows,
)

H200_BF16_TFLOPS = 989.0  # dense (no sparsity), SXM
LAYOUT_KEYS = {"dp": "dp_shard", "dp_shard": "dp_shard", "dp_replicate": "dp_replicate", "cp": "cp", "tp": "tp",
               "mixer": "mixer_parallel", "ssm_tp": "ssm_tensor_parallel", "ac": "activation_checkpointing"}


# ------------------------------------------------------------------------------------------------ layouts
def parse_layout(text: str, world: int, *, default_ac: bool) -> ParallelConfig | None:
    """"1" -> None (one GPU alone); "cp=2,tp=2,dp=2" -> a ParallelConfig resolved against `world`."""
    if text.strip() == "1":
        return None
    fields: dict = {"dp_shard": -1, "activation_checkpointing": default_ac}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in LAYOUT_KEYS:
            raise ValueError(f"layout {text!r}: {item!r} is not one of {sorted(LAYOUT_KEYS)} as key=value")
        name = LAYOUT_KEYS[key]
        if name == "mixer_parallel":
            fields[name] = value
        elif name in ("ssm_tensor_parallel", "activation_checkpointing"):
            fields[name] = value.lower() in ("1", "true", "on", "yes")
        else:
            fields[name] = int(value)
    if fields.get("cp", 1) > 1:
        fields["activation_checkpointing"] = False  # refused by context_parallel (recomputation would re-send)
    return ParallelConfig(**fields).resolved(world)


def describe(config: ParallelConfig | None) -> str:
    if config is None:
        return "1 GPU"
    parts = [f"{k}={getattr(config, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp") if getattr(config, k) > 1]
    if config.mixer_parallel != "off":
        parts.append(f"mixer={config.mixer_parallel}")
    if not config.ssm_tensor_parallel:
        parts.append("ssm_tp=0")
    if config.activation_checkpointing:
        parts.append("ac")
    return ",".join(parts) or "1 rank"


# ------------------------------------------------------------------------------------------------ FLOPs
def model_flops_per_token(model: nn.Module, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of `model` (unparallelized, any device incl. meta) at context `seq_len`: the
    module docstring's formula, by part. 'total' uses the causal attention convention, 'total_noncausal' 12 L d T."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention = ssd = 0.0
    for module in model.modules():
        if isinstance(module, Attention):
            attention += 6.0 * module.num_heads * module.head_dim * seq_len
        elif isinstance(module, Mamba2Mixer):
            h, p, n, g, q = module.num_heads, module.head_dim, module.d_state, module.groups, module.chunk_size
            ssd += 3.0 * (2.0 * (min(q, seq_len) / 2) * (g * n + h * p) + 4.0 * h * p * n)
    dense = 6.0 * matmul
    return {"matmul_params": matmul, "dense": dense, "attention_causal": attention, "ssd": ssd,
            "total": dense + attention + ssd, "total_noncausal": dense + 2 * attention + ssd}


# ------------------------------------------------------------------------------------------------ one layout
class Runner:
    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> None:
        self.args, self.device, self.rank, self.world = args, device, rank, world
        self.fields = dict(args.set)
        self.meshes: dict[tuple[int, ...], object] = {}
        if get_preset(args.preset, **self.fields).max_position_embeddings < args.seq_len:
            self.fields["max_position_embeddings"] = args.seq_len  # informational (RoPE has no table)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def build(self) -> HybridForCausalLM:
        torch.manual_seed(self.args.seed)  # the same weights on every rank
        with torch.device(self.device):
            return HybridForCausalLM(get_preset(self.args.preset, **self.fields))

    def batch(self, dp_rank: int) -> dict:
        """--batch rows of seq_len tokens for one data-parallel rank, labels shifted before any cp split."""
        generator = torch.Generator().manual_seed(1000 + dp_rank)
        vocab = get_preset(self.args.preset, **self.fields).vocab_size
        ids = torch.randint(0, vocab, (self.args.batch, self.args.seq_len + 1), generator=generator)
        ids = ids.to(self.device)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def run(self, config: ParallelConfig | None) -> dict:
        alone = config is None
        if not alone and config.shape not in self.meshes:  # one mesh (and its process groups) per shape
            self.meshes[config.shape] = build_mesh(config, device_type=self.device.type)
        mesh = None if alone else self.meshes[config.shape]
        ctx = (DistContext(device=self.device) if alone else
               DistContext(self.rank, self.world, int(os.environ.get("LOCAL_RANK", "0")), self.device,
                           dist.get_backend(), config, mesh))
        model = self.build()
        names = [name for name, _ in model.named_parameters()]  # canonical names (before any wrapping)
        if alone:  # the single-device part of `parallelize`: AC, then compile, per block
            wrap_blocks(model, activation_checkpointing=self.args.ac, compile=self.args.compile)
        else:
            if self.args.compile and (config.cp > 1 or config.mixer_parallel != "off"):
                raise ValueError("--compile is not combined with cp or mixer parallelism (untested, as in the trainer)")
            parallelize(model, mesh, config, compile=self.args.compile)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        batch = shard_rows(self.batch(ctx.dp_rank), ctx)  # this cp rank's chunk (global positions)
        count = self.args.batch * self.args.seq_len  # targets of the dp rank's rows, over all its cp ranks
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.autocast)

        def step() -> torch.Tensor:
            with autocast, context_parallel(model, ctx):
                logits = model(batch["input_ids"], position_ids=batch.get("position_ids")).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum") / count
            del logits
            loss.backward()
            reduce_context_parallel_grads(model, ctx)  # no-op without cp
            clip_grad_norm(model, 1.0, ctx, names=names)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        for _ in range(self.args.warmup):
            step()
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not alone:
            dist.barrier()
        times, loss = [], None
        for _ in range(self.args.steps):
            self.sync()
            start = time.perf_counter()
            loss = step()
            self.sync()
            times.append(time.perf_counter() - start)
        if alone:
            seconds, tokens, gpus = statistics.mean(times), count, 1
            mean_loss = float(loss)
        else:
            seconds_t = torch.tensor(statistics.mean(times), dtype=torch.float64, device=self.device)
            dist.all_reduce(seconds_t, op=dist.ReduceOp.MAX)  # an update ends when its slowest rank does
            seconds = float(seconds_t)
            tokens, gpus = count * ctx.dp_size, self.world
            # loss: this rank's chunk share; summed over the world it counts every tp rank: / (tp x dp)
            value = loss.double().reshape(1)
            dist.all_reduce(value)
            mean_loss = float(value) / (config.tp * ctx.dp_size)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {"seconds_per_update": seconds, "tokens_per_update": tokens, "gpus": gpus,
                "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / gpus,
                "peak_gib": peak, "loss": mean_loss, "update_seconds": times}


def gather(value, world: int) -> list:
    every = [None] * world
    dist.all_gather_object(every, value)
    return every


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="hybrid-1b")
    parser.add_argument("--set", action="append", default=[], type=_key_value, metavar="FIELD=VALUE",
                        help="override a HybridConfig field of the preset (repeatable)")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1, help="rows per data-parallel rank")
    parser.add_argument("--layouts", nargs="+", default=["1"])
    parser.add_argument("--ac", action="store_true", help="activation checkpointing (layouts without cp)")
    parser.add_argument("--compile", action="store_true", help="torch.compile per block (parallelize's compile)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="per-GPU bf16 dense peak")
    parser.add_argument("--timeout-s", type=float, default=900, help="process group timeout (a hung collective)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no further layout after this many seconds (rank 0's clock; the rows done stay)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                        help="TF32 for float32 matmuls on CUDA (ring attention's float32 block math; default on)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32 unless --autocast (a smoke run)")
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast (default: on with CUDA, off with --cpu)")
    args = parser.parse_args()

    if args.autocast is None:
        args.autocast = not args.cpu
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    runner = Runner(args, device, rank, world)
    with torch.device("meta"):
        flops = model_flops_per_token(HybridForCausalLM(get_preset(args.preset, **runner.fields)), args.seq_len)
    peak = args.peak_tflops * 1e12
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "torch": torch.__version__, "world": world, "preset": args.preset, "overrides": runner.fields,
           "seq_len": args.seq_len, "batch_per_dp_rank": args.batch, "warmup": args.warmup, "steps": args.steps,
           "peak_tflops": args.peak_tflops, "tf32": args.tf32 and device.type == "cuda", "ac": args.ac,
           "autocast_bf16": args.autocast,
           "flops_per_token": flops, "rows": []}
    if rank == 0:
        print(f"{args.preset} ({runner.fields}): {flops['matmul_params'] / 1e9:.3f}B matmul weights, "
              f"{flops['total'] / 1e9:.2f} GFLOP/token at T={args.seq_len} (dense {flops['dense'] / 1e9:.2f}, "
              f"attention {flops['attention_causal'] / 1e9:.2f} causal, SSD {flops['ssd'] / 1e9:.3f}); "
              f"{world} ranks on {out['device']}", flush=True)
        print(f"{'layout':<34}{'tokens/s':>11}{'per GPU':>10}{'peak GiB':>10}{'MFU':>8}{'scaling':>9}{'loss':>10}",
              flush=True)
    baseline, started = None, time.perf_counter()
    try:
        for text in args.layouts:
            over = [args.budget_s is not None and time.perf_counter() - started > args.budget_s]
            dist.broadcast_object_list(over, src=0, device=device if device.type == "cuda" else None)
            if over[0]:
                out["skipped_for_budget"] = args.layouts[args.layouts.index(text):]
                if rank == 0:
                    print(f"budget of {args.budget_s:.0f} s spent: skipped {out['skipped_for_budget']}", flush=True)
                break
            row: dict = {"layout": text}
            try:
                config = parse_layout(text, world, default_ac=args.ac)
                row["config"] = None if config is None else asdict(config)
                row["name"] = describe(config) if config is not None or not args.ac else "1 GPU,ac"
                result = runner.run(config)
                status = None
            except Exception as err:  # noqa: BLE001 -- report the layout and go on with the next
                result, status = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            free_memory(device)
            statuses = gather(status, world)
            results = gather(result, world)
            failed = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s is not None]
            if failed:
                row["error"] = failed[0] + (f" (+{len(failed) - 1} ranks)" if len(failed) > 1 else "")
            else:
                per_rank = [r["tokens_per_s_per_gpu"] for r in results]
                mine = results[0]
                row.update({k: mine[k] for k in ("seconds_per_update", "tokens_per_update", "gpus", "loss")})
                if config is None:  # every rank alone: the mean of the N single-GPU figures
                    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] = statistics.mean(per_rank)
                    row["tokens_per_s_per_gpu_each_rank"] = per_rank
                    row["seconds_per_update"] = statistics.mean(r["seconds_per_update"] for r in results)
                    baseline = row["tokens_per_s_per_gpu"]
                else:
                    row["tokens_per_s"] = mine["tokens_per_s"]
                    row["tokens_per_s_per_gpu"] = mine["tokens_per_s_per_gpu"]
                peaks = [r["peak_gib"] for r in results]
                row["peak_gib"] = None if peaks[0] is None else max(peaks)
                row["peak_gib_each_rank"] = peaks
                row["mfu"] = row["tokens_per_s_per_gpu"] * flops["total"] / peak
                row["mfu_noncausal"] = row["tokens_per_s_per_gpu"] * flops["total_noncausal"] / peak
                row["scaling_efficiency"] = None if baseline is None else row["tokens_per_s_per_gpu"] / baseline
            out["rows"].append(row)
            if rank == 0:
                _print_row(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(out, f, indent=1)
        if baseline is not None:  # also the rows that ran before "1"
            for row in out["rows"]:
                if "error" not in row:
                    row["scaling_efficiency"] = row["tokens_per_s_per_gpu"] / baseline
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        dist.destroy_process_group()


def _print_row(row: dict) -> None:
    name = row.get("name", row["layout"])
    if "error" in row:
        print(f"{name:<34}  failed: {row['error']}", flush=True)
        return
    peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
    scaling = "-" if row["scaling_efficiency"] is None else f"{row['scaling_efficiency']:.2f}"
    print(f"{name:<34}{row['tokens_per_s']:>11.0f}{row['tokens_per_s_per_gpu']:>10.0f}{peak:>10}"
          f"{row['mfu'] * 100:>7.1f}%{scaling:>9}{row['loss']:>10.5f}", flush=True)


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


if __name__ == "__main__":
    main()
