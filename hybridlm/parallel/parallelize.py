"""`parallelize(model, mesh, config)`: every parallelism applied in one place, in torchtitan's order

    1. tensor parallelism over mesh["tp"]             (apply_tensor_parallel; the model must be unwrapped),
       or mixer parallelism over it                    (config.mixer_parallel "on" | "interleaved":
                                                        apply_mixer_parallel, which also splits the MLP)
    2. torch.compile per block                         (compile=True; compile_mode: torch.compile's mode)
    3. activation checkpointing per block, around it   (config.activation_checkpointing; otherwise the SSM
                                                        mixers recompute what feeds their scans: recompute_mixers)
    4. FSDP2 `fully_shard` per block, then the root    over data_parallel_mesh(mesh) (HSDP with dp_replicate > 1)

Steps 2 and 3 swap torchtitan's order (which compiles the checkpointed block) because a block on packed documents
breaks its graph around attention and the fast-weight op (`HybridBlock`), and dynamo runs a checkpointed region
with a graph break inside entirely eagerly (no graph for such a block; with the checkpoint outside, the compiled
pieces stay compiled). The checkpoint then recomputes the compiled block in the backward.

FSDP2 keeps the root module's parameters unsharded after a forward (the backward usually follows): after a
forward under torch.no_grad() (an evaluation), call `model.reshard()` before the next training step, or that
step's root gradients are not reduce-scattered (tests/parallel/test_tensor_parallel.py checks it).

Context parallelism is not a module transform: wrap the forward in `context_parallel(model, mesh["cp"])`
(hybridlm.parallel.context_parallel). With cp > 1 the parameters are replicated over the cp ranks (FSDP
shards over the data-parallel dims only).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hybridlm.layers.block import HybridBlock, set_mixers_recompute
from hybridlm.parallel.mesh import ParallelConfig, data_parallel_mesh
from hybridlm.parallel.mixer_parallel import apply_mixer_parallel
from hybridlm.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module, mesh: DeviceMesh, config: ParallelConfig, *, compile: bool = False, compile_mode: str = "default"
) -> nn.Module:
    """Apply TP -> compile -> activation checkpointing -> FSDP2 to `model` (a HybridForCausalLM or
    HybridModel already on its device) in place; returns it. `mesh` comes from `build_mesh(config)`."""
    if tuple(mesh.mesh.shape) != config.resolved(mesh.size()).shape:
        raise ValueError(f"mesh shape {tuple(mesh.mesh.shape)} does not match the config {config}")
    if config.mixer_parallel == "off":
        apply_tensor_parallel(model, mesh["tp"], ssm_heads=config.ssm_tensor_parallel)
    else:
        apply_mixer_parallel(model, mesh["tp"], mode=config.mixer_parallel, ssm_heads=config.ssm_tensor_parallel)
    layers = _layer_list(model)  # before wrapping: the wrappers are no HybridBlocks
    wrap_blocks(model, activation_checkpointing=config.activation_checkpointing, compile=compile,
                compile_mode=compile_mode, recompute_mixers=config.recompute_mixers)
    dp_mesh = data_parallel_mesh(mesh)
    if dp_mesh is not None:
        for block in layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def wrap_blocks(
    model: nn.Module, *, activation_checkpointing: bool, compile: bool, compile_mode: str = "default",
    recompute_mixers: str = "fast_weight",
) -> nn.ModuleList | None:
    """Steps 2 and 3 on every block in place (also what one process without a mesh applies); returns the list
    (None when neither is asked for: then any model passes). `compile_mode` is torch.compile's mode ("default",
    "reduce-overhead": CUDA graphs per block, "max-autotune-no-cudagraphs"). `recompute_mixers`: which SSM mixers
    recompute what feeds their scans in the backward (`layers.block.RECOMPUTE_MIXERS`: "fast_weight", "all",
    "none"); none under activation_checkpointing, whose recomputation of the whole block makes it redundant."""
    set_mixers_recompute(model, "none" if activation_checkpointing else recompute_mixers)
    if not (activation_checkpointing or compile):
        return None
    layers = _layer_list(model)
    if compile and activation_checkpointing and torch.cuda.is_available():
        # The first compilation starts CUDA even for a CPU model; inside a checkpointed forward that is an error
        # ("device state was initialized in the forward pass of a Checkpoint"), so start it before.
        torch.cuda.init()
    for index, block in enumerate(list(layers)):
        if compile:
            block.compile(mode=None if compile_mode == "default" else compile_mode)
        if activation_checkpointing:
            block = checkpoint_wrapper(block)  # recompute the (compiled) block in backward
        layers[index] = block
    return layers


def _layer_list(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(b, HybridBlock) for b in layers):
        raise TypeError("parallelize expects a HybridForCausalLM / HybridModel (model.layers of HybridBlock)")
    return layers
