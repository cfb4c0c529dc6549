"""The chunk grid that every fast-weight kernel and launcher shares: the runtime sizes (no recompilation per sequence
length), the tuning key and launch of the chunk-parallel kernels, and `ChunkPlan`, the sizes and buffers a launcher
derives from one call. Needs triton (imported by the kernel and launcher modules only).

Layouts: q, x `[N, T, H, K]`; y, o `[N, T, H, V]`; eta, log_gamma `[N, T, H]` (rules 2A and 2: `[N, T, H, V]`); the
chunk-local cumulative log decays L `[N * H, T_pad]` (`[N * H, T_pad, V]` per value column; T_pad = n_chunks * BT);
per-chunk states `[N * H, n_chunks, K, V]`.
"""

from __future__ import annotations

import functools

import torch

from hybridlm.ops.triton_utils import MAX_GRID_YZ, autotune, block

SIZES = ["T", "T_pad", "n_chunks"]  # runtime sizes: `do_not_specialize`, no recompilation per sequence length
# The kernels that read x and y from tensors of T_xy >= T rows (their first T rows; rule 3A's delayed writes are the
# first T of its T + W - 1 pairs) take T_xy as one more runtime size.
XY_SIZES = [*SIZES, "T_xy"]
KEY = ["K", "V", "BT", "READ_AFTER"]  # the tuning key of the chunk-parallel kernels
# The chunk-parallel kernels' autotuner; with autotuning off they launch with 8 warps (`grad_qxy_kernel` names its
# own launches).
autotuned = functools.partial(autotune, fixed_warps=8)
# Elements of the [BT, BT, BV] decay tensors of the per-column kernels (rules 2A and 2): their value tile shrinks as
# the chunk grows.
TILE_3D = 8192


class ChunkPlan:
    """What every chunked launcher derives from one call: sizes, the chunk grid, the matmul precision, and the
    buffer of per-chunk states (`state_dtype`: float32 unless a rule's plan says otherwise). The rules' plans add
    their block shapes and stages."""

    def __init__(self, q: torch.Tensor, y: torch.Tensor, chunk_size: int, read_after: bool):
        self.N, self.T, self.H, self.K = q.shape
        self.V = y.shape[-1]
        self.T_xy = y.shape[1]  # rows of x and y: T, or more where only their first T are the writes (rule 3A)
        self.NH = self.N * self.H
        self.BT = chunk_size
        self.n_chunks = -(-self.T // self.BT)
        self.T_pad = self.n_chunks * self.BT
        self.read_after = read_after
        if self.n_chunks > MAX_GRID_YZ or self.NH > MAX_GRID_YZ:
            raise ValueError(f"the Triton launch grids put the chunks ({self.n_chunks}) and the rows x heads "
                             f"({self.NH}) on axes limited to {MAX_GRID_YZ}: call fast_weight_attention (it splits "
                             "the batch) or use a longer chunk")
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: exact products (no TF32)
        self.device = q.device
        self.sizes = {"K": self.K, "V": self.V, "BT": self.BT}
        self.state_dtype = torch.float32

    def state_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N * H, n_chunks, K, V]: one state per chunk, in `dtype` (default `state_dtype`)."""
        return torch.empty(self.NH, self.n_chunks, self.K, self.V, dtype=dtype or self.state_dtype,
                           device=self.device)

    def column_tile(self) -> int:
        """The value tile of the per-column kernels' [BT, BT, BV] work (`TILE_3D` elements at most)."""
        return block(self.V, max(16, TILE_3D // (self.BT * self.BT)))
