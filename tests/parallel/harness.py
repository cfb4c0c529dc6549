"""Spawn 2 gloo processes on the CPU that run one scenario function each and report JSON from rank 0.

`run_ranks(scenario, world=2, **kwargs)` spawns `world` processes (the environment torchrun would set),
initializes gloo, calls `scenario(rank, world, **kwargs)` and returns what rank 0's call returned.
Scenarios build the tiny model from a seed, so every rank (and the single-process reference computed in
the same process) starts from the same weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridlm.models import get_preset
from hybridlm.models.configuration import HybridLMConfig
from hybridlm.models.model import HybridForCausalLM
from tests.helpers import free_port


def tiny_model(seed: int = 0, **overrides) -> HybridForCausalLM:
    """The tiny preset cut down (2 layers, 2 KV heads so tp=2 divides them), float32, seeded weights."""
    fields = {"num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 128, "mamba_chunk_size": 8, "fw_chunk_size": 8}
    fields.update(overrides)
    torch.manual_seed(seed)
    return HybridForCausalLM(HybridLMConfig.from_hybrid(get_preset("tiny", **fields))).float()


def _worker(rank: int, world: int, port: int, scenario, kwargs: dict, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = scenario(rank, world, **kwargs)
        if rank == 0:
            Path(result_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(scenario, world: int = 2, **kwargs):
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), scenario, kwargs, result_file), nprocs=world, join=True)
        return json.loads(Path(result_file).read_text())
