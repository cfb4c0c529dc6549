"""Peak host memory (RSS) per rank while saving and loading a training checkpoint: the full format (gathered on rank
0, read whole by every rank) against the sharded one (torch.distributed.checkpoint: each rank its own shards).

    python benchmarks/checkpoint_memory.py                          # 2, 4 and 8 gloo processes on the CPU
    python benchmarks/checkpoint_memory.py --worlds 2 4 --hidden 768 --layers 6

Each world size is one spawn of gloo processes holding an FSDP2-sharded hybrid model (the `tiny` preset widened,
float32) and AdamW state (step, exp_avg, exp_avg_sq; filled in place, no training). For each phase every rank resets
its peak RSS (`/proc/self/clear_refs`), runs the phase and reports the rise of its peak over the RSS before it:

    full save   `full_model_state_dict` + `full_optimizer_state` (rank 0 gathers), rank 0 writes the safetensors files
    full load   every rank reads the files and cuts its shards (`load_full_model_state_dict` / `_optimizer_state`)
    dcp save    `ShardedCheckpointer.save` (each rank writes its shards)
    dcp load    `load_sharded_checkpoint` (each rank reads the chunks it holds)

The state (weights + two moments) is printed with the table; the full format's peak follows the whole state on rank
0 (save) and every rank (load), the sharded one the state / world size. Linux only (VmHWM in /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(phase) -> float:
    """The rise of this process's peak RSS (MB) over its RSS before `phase()`; every rank enters together."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _rss_mb("VmRSS")
    phase()
    dist.barrier()
    return _rss_mb("VmHWM") - before


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from safetensors.torch import load_file, save_file

    from hybridlm.models import get_preset
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.parallel import ParallelConfig, build_mesh, parallelize
    from hybridlm.parallel.checkpoint import (
        canonical_parameters,
        full_model_state_dict,
        full_optimizer_state,
        load_full_model_state_dict,
        load_full_optimizer_state,
    )
    from hybridlm.training.sharded_checkpoint import ShardedCheckpointer, load_sharded_checkpoint
    from hybridlm.training.tensor_tree import flatten_tree, unflatten_tree

    torch.manual_seed(0)
    config = ParallelConfig(dp_shard=world)
    with torch.device("meta"):
        model = HybridForCausalLM(get_preset("tiny", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                             vocab_size=args.vocab))
    parallelize(model, build_mesh(config), config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(param),
                                  "exp_avg_sq": torch.rand_like(param)}
    names = list(canonical_parameters(model))
    groups = [{"param_names": names, "lr": 1e-3}]
    full_dir, dcp_dir = Path(directory) / "full", Path(directory) / "dcp"

    def full_save():
        model_sd, moments = full_model_state_dict(model), full_optimizer_state(model, optimizer)
        if rank == 0:
            full_dir.mkdir(exist_ok=True)
            save_file(model_sd, str(full_dir / "model.safetensors"))
            tensors, skeleton = flatten_tree(moments)
            save_file(tensors, str(full_dir / "optimizer.safetensors"))
            (full_dir / "optimizer.json").write_text(json.dumps(skeleton))

    def full_load():
        load_full_model_state_dict(model, load_file(str(full_dir / "model.safetensors")))
        skeleton = json.loads((full_dir / "optimizer.json").read_text())
        load_full_optimizer_state(model, optimizer, unflatten_tree(load_file(str(full_dir / "optimizer.safetensors")),
                                                                   skeleton))

    checkpointer = ShardedCheckpointer()
    phases = {
        "full save": full_save,
        "full load": full_load,
        "dcp save": lambda: checkpointer.save(dcp_dir, 1, model=model, optimizer=optimizer, groups=groups,
                                              train_state={}),
        "dcp load": lambda: load_sharded_checkpoint(dcp_dir / "step_00000001", model=model, optimizer=optimizer,
                                                    groups=groups),
    }
    rises = {name: _measure(phase) for name, phase in phases.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, rises)
    if rank == 0:
        state_mb = 3 * sum(p.numel() for p in model.parameters()) * 4 / 2**20
        Path(out).write_text(json.dumps({"ranks": gathered, "state_mb": state_mb}))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="numbers of gloo processes")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores; tiny preset, hidden "
          f"{args.hidden}, {args.layers} layers, vocab {args.vocab}, float32, FSDP2 over every rank")
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as directory:
            out = Path(directory) / "result.json"
            mp.spawn(_worker, args=(world, _port(), args, directory, str(out)), nprocs=world, join=True)
            result = json.loads(out.read_text())
        ranks = result["ranks"]
        worst = {phase: max(r[phase] for r in ranks) for phase in ranks[0]}
        rows.append((world, result["state_mb"], worst))
    print("\nPeak RSS rise per rank (MB, the largest over the ranks); state = weights + 2 AdamW moments\n")
    print("| processes | state (MB) | full save | dcp save | full / dcp | full load | dcp load | full / dcp |")
    print("|---|---|---|---|---|---|---|---|")
    for world, state, w in rows:
        print(f"| {world} | {state:.0f} | {w['full save']:.0f} | {w['dcp save']:.0f} | "
              f"{w['full save'] / max(w['dcp save'], 1):.1f}x | {w['full load']:.0f} | {w['dcp load']:.0f} | "
              f"{w['full load'] / max(w['dcp load'], 1):.1f}x |")


if __name__ == "__main__":
    main()
