"""Helpers shared by the parallelism tests: gloo processes on the CPU, the tiny model, and the comparisons.

`run_ranks(scenario, world=2, **kwargs)` spawns `world` processes (the environment torchrun would set),
initializes gloo, calls `scenario(rank, world, **kwargs)` and returns what rank 0's call returned (as JSON).
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
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hybridlm.models import get_preset
from hybridlm.models.model import HybridForCausalLM
from hybridlm.parallel.tensor_parallel import segment_permutation, ssm_row_layout
from tests.helpers import free_port

TOL = 1e-5  # parallel against one process, float32
STEPS = 3  # AdamW updates compared
CP_LENGTH = 26  # 13 tokens per cp rank: not a multiple of the chunk size 8, and longer than the conv tail


def tiny_model(seed: int = 0, **overrides) -> HybridForCausalLM:
    """The tiny preset cut down (2 layers, 2 KV heads so tp=2 divides them), float32, seeded weights."""
    fields = {"num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 128, "mamba_chunk_size": 8, "fw_chunk_size": 8}
    fields.update(overrides)
    torch.manual_seed(seed)
    return HybridForCausalLM(get_preset("tiny", **fields)).float()


def _worker(rank: int, world: int, port: int, scenario, kwargs: dict, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = scenario(rank, world, **kwargs)
        if rank == 0:
            Path(result_file).write_text(json.dumps(result))
        # Leave together: a rank that tore the group down while a peer still finished the scenario's last collective
        # would abort that peer ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(scenario, world: int = 2, **kwargs):
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), scenario, kwargs, result_file), nprocs=world, join=True)
        return json.loads(Path(result_file).read_text())


# ------------------------------------------------------------------------------------------------ inputs
def token_batch(rows: int = 4, length: int = 20) -> torch.Tensor:
    """Token ids [rows, length] of the tiny model's 128-token vocabulary (seed 1)."""
    torch.manual_seed(1)
    return torch.randint(0, 128, (rows, length))


def cp_tokens(rows: int = 2, length: int = CP_LENGTH) -> torch.Tensor:
    """Token ids [rows, length] for the context-parallel tests (seed 2)."""
    torch.manual_seed(2)
    return torch.randint(0, 128, (rows, length))


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of whole sequences ([B, T], -100 after the last token): shifting before the cp split
    lets the last token of rank j predict the first token of rank j+1."""
    return F.pad(ids[:, 1:], (0, 1), value=-100)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    """Next-token loss of a chunk ([B, T, V] logits, [B, T] labels), summed and divided by all `count` targets
    of the rows: summed over the cp ranks it is the rows' mean."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count


# ------------------------------------------------------------------------------------------------ comparisons
def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def train_adamw(model, ids: torch.Tensor, steps: int, *, reduce_group=None) -> list[float]:
    """AdamW steps on the next-token loss; with `reduce_group` the reported loss is the mean over its ranks.

    eps=1e-4, not 1e-8: where a gradient entry is ~1e-9 (float32 round-off of a sum in another order), AdamW's
    first update is ~lr g / (|g| + eps), so a tiny eps would turn that round-off into parameter differences of
    ~1e-3 and the compared losses would part by more than the float32 tolerance."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if reduce_group is not None:
            dist.all_reduce(value, group=reduce_group)
            value /= dist.get_world_size(reduce_group)
        losses.append(float(value))
    return losses


def full_view(model, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly head-split) parameter or gradient, in the unsplit model's row order."""
    if not isinstance(tensor, DTensor):
        return tensor
    full = tensor.full_tensor()
    owner_path, _, leaf = name.rpartition(".")
    for suffix in ("ssm.in_proj", "ssm.conv"):
        if owner_path.endswith(suffix):
            mixer = model.get_submodule(owner_path.rpartition(".")[0])
            segments = _full_layout(mixer, tensor.device_mesh.size())[f"{suffix.split('.')[1]}.{leaf}"]
            return full[segment_permutation(segments, tensor.device_mesh.size()).argsort()]
    return full


def _full_layout(mixer, parts: int) -> dict:
    """`ssm_row_layout` of the unsplit mixer, from a split one (its sizes are local: times `parts`)."""
    local = ssm_row_layout(mixer)
    return {k: tuple(s * parts for s in v) if v is not None else None for k, v in local.items()}


def gradient_diff(model, reference) -> float:
    """Max |grad - reference grad| over the parameters `model` holds (names as in the unsplit model)."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        got = full_view(model, name, param.grad)
        worst = max(worst, float((got - ref[name].grad).abs().max()))
    return worst


def decode_diff(model, ids: torch.Tensor, want: torch.Tensor, *, prefill: int = 12, steps: int = 3) -> float:
    """Max |logits - want| of a cached prefill and `steps` one-token decoding steps (the local conv tails and
    SSM / fast-weight states, the local KV heads)."""
    with torch.no_grad():
        cache = model.new_cache()
        logits = [model(ids[:, :prefill], cache=cache).logits]
        logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(prefill, prefill + steps)]
    return float((torch.cat(logits, dim=1) - want[:, : prefill + steps]).abs().max())
