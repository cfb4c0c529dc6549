"""Tensor, mixer and context parallelism on GPUs (NCCL): exactness against one GPU, then training throughput.

    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_parallel.py --json parallel.json

1. Exactness, float32: the tiny hybrid (attention + Mamba-2, SA_M) and a fast-weight 3A hybrid, from one seed
   on every rank. Each rank first computes the single-GPU reference on the whole batch (logits and the losses
   of 3 AdamW steps), then the same under tp=2 (heads split), mixer parallelism ("on": attention on rank 0,
   the SSM on rank 1) and cp=2 (sequence split; ring attention, state passing), and reports the largest
   differences.
2. Throughput, bf16 autocast: a ~0.3B hybrid at T tokens per sequence; tokens per second of a full training
   update (forward, backward, AdamW) on one GPU (each rank alone, same model) and on the 2 GPUs with tp=2,
   mixer parallelism and cp=2. Tokens/s counts the global batch once.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridlm.models import get_preset
from hybridlm.models.model import HybridForCausalLM
from hybridlm.parallel import ParallelConfig, build_mesh, context_parallel, parallelize, shard_sequence
from hybridlm.parallel.context_parallel import reduce_context_parallel_grads

MODES = ("tp", "mixer", "cp")
DEVICE = "cuda"  # "cpu" (gloo) with --cpu: a smoke run of this script without GPUs


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build(seed: int, dtype=torch.float32, **fields) -> HybridForCausalLM:
    torch.manual_seed(seed)
    model = HybridForCausalLM(get_preset("tiny", **fields))
    return model.to(device=DEVICE, dtype=dtype)


def parallel_config(mode: str, world: int) -> ParallelConfig:
    if mode == "tp":
        return ParallelConfig(tp=world)
    if mode == "mixer":
        return ParallelConfig(tp=world, mixer_parallel="on")
    return ParallelConfig(cp=world)


def token_loss(logits: torch.Tensor, ids: torch.Tensor, *, start: int, total: int) -> torch.Tensor:
    """This chunk's share of the mean next-token loss of the whole sequence: logits [B, Q, V] of global
    positions start..start+Q-1, ids [B, T] the whole batch; sum over the chunk / all B (T - 1) targets."""
    batch, local = logits.shape[:2]
    targets = ids[:, start + 1 : start + local + 1]  # the last global position has no target
    kept = targets.shape[1]
    nll = F.cross_entropy(logits[:, :kept].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return nll / (batch * (total - 1))


def train_losses(model, ids, *, mode: str | None, mesh, steps: int, autocast: bool = False) -> tuple[list[float], torch.Tensor, float]:
    """Losses of `steps` AdamW updates on `ids` [B, T], the first forward's logits (this rank's positions) and
    the seconds per update after the first."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # DTensor and plain params mix
    losses, first_logits, times = [], None, []
    total = ids.shape[1]
    for step in range(steps):
        sync()
        start_time = time.perf_counter()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            if mode == "cp":
                group = mesh["cp"].get_group()
                local, positions = shard_sequence(ids, group)
                with context_parallel(model, group):
                    logits = model(local, position_ids=positions).logits
                loss = token_loss(logits, ids, start=int(positions[0, 0]), total=total)
            else:
                logits = model(ids).logits
                loss = token_loss(logits, ids, start=0, total=total)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if mode == "cp":
            reduce_context_parallel_grads(model, mesh["cp"].get_group())
        optimizer.step()
        reported = loss.detach().clone()
        if mode == "cp":
            dist.all_reduce(reported, group=mesh["cp"].get_group())
        sync()
        times.append(time.perf_counter() - start_time)
        losses.append(float(reported))
        if first_logits is None:
            first_logits = logits.detach().float()
            if hasattr(first_logits, "full_tensor"):
                first_logits = first_logits.full_tensor()
    return losses, first_logits, sum(times[1:]) / max(1, len(times) - 1)


def exactness(rank: int, world: int, out: dict) -> None:
    models = {"hybrid-mamba2": dict(num_key_value_heads=2, mamba_n_groups=2),
              "hybrid-fw-3A": dict(num_key_value_heads=2, ssm_mixer="fast_weight", fw_rule="3A", fw_window=3)}
    for name, fields in models.items():
        ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        ref_losses, ref_logits, _ = train_losses(build(0, **fields), ids, mode=None, mesh=None, steps=3)
        for mode in MODES:
            config = parallel_config(mode, world)
            mesh = build_mesh(config, device_type=DEVICE)
            model = build(0, **fields)
            parallelize(model, mesh, config)
            losses, logits, _ = train_losses(model, ids, mode=mode, mesh=mesh, steps=3)
            if mode == "cp":
                chunk = ids.shape[1] // world
                reference = ref_logits[:, rank * chunk : (rank + 1) * chunk]
            else:
                reference = ref_logits
            logit_diff = torch.tensor((logits - reference).abs().max().item(), device=DEVICE)
            dist.all_reduce(logit_diff, op=dist.ReduceOp.MAX)
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            row = {"model": name, "mode": mode, "max_logit_diff": logit_diff.item(), "max_loss_diff": loss_diff,
                   "losses": losses, "reference_losses": ref_losses}
            out.setdefault("exactness", []).append(row)
            if rank == 0:
                print(f"exact {name:<14} {mode:<6} logits {row['max_logit_diff']:.2e}  losses {loss_diff:.2e}",
                      flush=True)


def throughput(rank: int, world: int, out: dict, *, seq_len: int, steps: int) -> None:
    fields = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, mamba_d_ssm=1536, mamba_n_heads=24,
                  mamba_d_head=64, mamba_n_groups=2, mamba_d_state=128, mamba_chunk_size=128,
                  max_position_embeddings=max(seq_len, 2048))
    if DEVICE == "cpu":
        fields = dict(num_key_value_heads=2, mamba_n_groups=2)
    ids = torch.randint(0, fields.get("vocab_size", 512), (1, seq_len), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    _, _, alone = train_losses(build(0, **fields), ids, mode=None, mesh=None, steps=steps, autocast=True)
    params = sum(p.numel() for p in build(0, **fields).parameters())
    rows = [{"mode": "1 GPU", "tokens_per_s": seq_len / alone, "tokens_per_s_per_gpu": seq_len / alone}]
    for mode in MODES:
        config = parallel_config(mode, world)
        mesh = build_mesh(config, device_type=DEVICE)
        model = build(0, **fields)
        parallelize(model, mesh, config)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, _, seconds = train_losses(model, ids, mode=mode, mesh=mesh, steps=steps, autocast=True)
        rows.append({"mode": f"{mode}={world}", "tokens_per_s": seq_len / seconds,
                     "tokens_per_s_per_gpu": seq_len / seconds / world,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None})
    out["throughput"] = {"parameters": params, "seq_len": seq_len, "rows": rows}
    if rank == 0:
        print(f"throughput: {params / 1e6:.0f}M parameters, 1 x {seq_len} tokens per update (bf16 autocast)")
        for row in rows:
            print(f"  {row['mode']:<8} {row['tokens_per_s']:>10.0f} tokens/s  "
                  f"({row['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x one GPU)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run; tiny throughput model)")
    args = parser.parse_args()
    global DEVICE
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        DEVICE = "cpu"
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cudnn.allow_tf32 = False  # float32 exactness: the Mamba-2 conv runs through cuDNN
        dist.init_process_group("nccl")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    out: dict = {"device": name, "torch": torch.__version__, "world": world}
    try:
        exactness(rank, world, out)
        throughput(rank, world, out, seq_len=args.seq_len, steps=args.steps)
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
