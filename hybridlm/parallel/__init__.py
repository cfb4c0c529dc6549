"""Scale-out for the hybrid model on PyTorch's distributed stack (DeviceMesh, DTensor, FSDP2).

    config = ParallelConfig(tp=2)                 # dp_shard=-1 takes the rest of the world size
    mesh = build_mesh(config, device_type="cuda")
    parallelize(model, mesh, config)              # TP -> compile -> activation checkpointing -> FSDP2
    with context_parallel(model, mesh["cp"].get_group()): ...   # sequence split over the cp ranks
    reduce_context_parallel_grads(model, mesh["cp"].get_group())  # after backward: sum gradients over cp

See README.md in this folder for what is done and what is not.
"""

from hybridlm.parallel.context_parallel import (
    context_parallel,
    gather_sequence,
    reduce_context_parallel_grads,
    shard_sequence,
)
from hybridlm.parallel.mesh import (
    MESH_DIMS,
    ParallelConfig,
    build_mesh,
    data_parallel_mesh,
)
from hybridlm.parallel.mixer_parallel import apply_mixer_parallel, check_mixer_parallel
from hybridlm.parallel.parallelize import parallelize
from hybridlm.parallel.ring_attention import ring_attention
from hybridlm.parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
)

__all__ = [
    "MESH_DIMS", "ParallelConfig", "apply_mixer_parallel", "apply_tensor_parallel", "build_mesh",
    "check_mixer_parallel", "check_tensor_parallel",
    "context_parallel", "data_parallel_mesh", "gather_sequence", "parallelize", "reduce_context_parallel_grads",
    "ring_attention", "shard_sequence",
]
