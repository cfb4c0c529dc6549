"""A device mesh with named dimensions, built from a small validated config.

    config = ParallelConfig(dp_shard=-1, tp=2)          # -1: whatever the world size leaves
    mesh = build_mesh(config, device_type="cpu")        # DeviceMesh, dims ("dp_replicate", "dp_shard", "cp", "tp")
    mesh["tp"], mesh["cp"], data_parallel_mesh(mesh)    # sub-meshes

Every dimension is always present (size 1 when unused), so code can index `mesh["tp"]` without asking
whether tensor parallelism is on. The order puts tp innermost (neighbouring ranks: the fastest links),
then cp, then the data-parallel dimensions, as torchtitan does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
MIXER_PARALLEL_MODES = ("off", "on", "interleaved")


@dataclass
class ParallelConfig:
    """Sizes of the mesh dimensions; their product must be the world size. `dp_shard=-1` takes the rest.

    dp_replicate: DDP-style replicas (HSDP when combined with dp_shard > 1).
    dp_shard: FSDP2 sharding degree.
    cp: context parallelism (the sequence split over ranks; see `context_parallel`).
    tp: tensor parallelism (attention heads, SSM heads and MLP split; see `tensor_parallel`).
    activation_checkpointing: recompute each block in backward (applied by `parallelize`).
    recompute_mixers: which SSM mixers recompute what feeds their scans in backward: "fast_weight" (the default),
        "all" or "none" (`layers.block.RECOMPUTE_MIXERS`; none under activation_checkpointing).
    ssm_tensor_parallel: split the SSM mixers' heads over tp (True), or keep them replicated (False: e.g. the
        released Falcon-H1 checkpoints, whose mamba_n_groups=1 cannot split B/C over tp ranks).
    mixer_parallel: "off", "on" (attention on the first half of every tp group, the SSM mixer on the second,
        concurrently) or "interleaved" (the halves swap roles every other layer); needs an even tp. See
        `mixer_parallel`.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    activation_checkpointing: bool = False
    recompute_mixers: str = "fast_weight"
    ssm_tensor_parallel: bool = True
    mixer_parallel: str = "off"

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with dp_shard filled in and every size checked against `world_size`."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        for name in ("dp_replicate", "cp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.mixer_parallel not in MIXER_PARALLEL_MODES:
            raise ValueError(
                f"ParallelConfig.mixer_parallel must be one of {MIXER_PARALLEL_MODES}, got {self.mixer_parallel!r}"
            )
        if self.mixer_parallel != "off" and self.tp % 2:
            raise ValueError(
                f"ParallelConfig.mixer_parallel={self.mixer_parallel!r} splits every tp group in two halves "
                f"(attention | SSM): tp must be even, got tp={self.tp}"
            )
        dp_shard = self.dp_shard
        if not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or (dp_shard < 1 and dp_shard != -1):
            raise ValueError(f"ParallelConfig.dp_shard must be an integer >= 1 or -1 (the rest), got {dp_shard!r}")
        fixed = self.dp_replicate * self.cp * self.tp
        if dp_shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"world size {world_size} is not divisible by dp_replicate * cp * tp = "
                    f"{self.dp_replicate} * {self.cp} * {self.tp} = {fixed}; dp_shard=-1 cannot fill the rest"
                )
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ValueError(
                f"dp_replicate * dp_shard * cp * tp = {self.dp_replicate} * {dp_shard} * {self.cp} * {self.tp} = "
                f"{fixed * dp_shard}, but the world size is {world_size}; the product must equal it"
            )
        return replace(self, dp_shard=dp_shard)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes in `MESH_DIMS` order (dp_shard must be resolved)."""
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)


def build_mesh(config: ParallelConfig, *, device_type: str = "cpu", world_size: int | None = None) -> DeviceMesh:
    """The 4-D DeviceMesh (`MESH_DIMS`) for `config` over the initialized default process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialized process group (torchrun + init_process_group)")
    world = dist.get_world_size() if world_size is None else world_size
    resolved = config.resolved(world)
    return init_device_mesh(device_type, resolved.shape, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: ("dp_replicate", "dp_shard") for HSDP, ("dp_shard",) for FSDP, or None
    when both are 1 (no data parallelism)."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    if shard > 1:
        return mesh["dp_shard"]
    return None
