"""Falcon-H1's Mamba-2 mixer.

    zxbcdt = W_in h  (one fused projection)  -> z [d_ssm], x [d_ssm], B [G N], C [G N], dt [H]
    each piece times its muP multiplier (m_z, m_x, m_B, m_C, m_dt)
    x, B, C = SiLU(causal depthwise conv(x, B, C))                   (K = mamba_d_conv taps)
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)   (float32; float64 stays)
    y = SSD(x, dt, A, B, C) + D x                     (per head: h_t = e^{dt A} h + dt x B^T, y = h C)
    y = gated RMSNorm(y, z)  if mamba_rms_norm  else  y * SiLU(z)
    out = W_out y

Differences from a stock Mamba-2 (what makes it Falcon-H1's): `mamba_d_ssm` may differ from
expand * d, the output norm is optional, and the five multipliers above. The block applies
`ssm_in_multiplier` to the input and `ssm_out_multiplier` to the output. For decoding, a
`LayerCache` carries the conv tail ("conv", [B, K-1, C]) and the SSM state ("ssm", [B, H, P, N], fp32):
a prefill runs the chunked SSD, a single token the recurrence step (the naive step; on CUDA with the backend
"auto" or "triton" its one-kernel form, `hybridlm/ops/ssd/triton/step.py`, which without a gradient to record also
takes the discretization of step 3 and, without the output norm, step 5's gate: `ssd_decoding_step`). In a cache of
fixed addresses (`cache.states_in_place`, what a replayed CUDA graph reads) those step kernels, the conv's and the
SSD's, write the new states over the old.
With `cu_seqlens` and a cache (a packed prefill) the states have one row per packed sequence. `seq_idx` (a
document index per token, training only) marks packed documents without changing any shape: the conv's taps and
the SSD's state restart at each document (the SSD's torch chunk path); the hybrid block uses it when compiled.
Training on the Triton SSD (a gradient, no cache; eager or compiled) recomputes the multipliers, the conv and the
discretization in the backward, not the scan (`hybridlm.ops.recompute`): the conv's output (x, B, C) is not kept, only
the input projection (which holds z for the gate anyway) and the scan's output; eager, values and gradients are the
same bit for bit. Off by default (`recompute = True` on the mixer, or `parallel.recompute_mixers: all`, turns it on):
it saves 1-3% of an update's peak and costs 15-20% of an eager update's time (`layers.block.RECOMPUTE_MIXERS`).
Under tensor parallelism (hybridlm.parallel.tensor_parallel) the head counts here (num_heads, groups, d_ssm,
conv_channels) are the rank's local ones and the per-head parameters are Shard(0) DTensors read through `local_tensor`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.layers.cache import LayerCache
from hybridlm.modules.boundaries import has_restarts, pack_rows
from hybridlm.modules.gated_norm import GatedRMSNorm, gated_output_projection
from hybridlm.modules.linear import AlignedLinear, linear_input
from hybridlm.modules.multiplier import scaled
from hybridlm.modules.short_conv import ShortConvolution
from hybridlm.ops.recompute import recompute_except_kernels
from hybridlm.ops.ssd import runs_triton as ssd_runs_triton
from hybridlm.ops.ssd import ssd, ssd_decoding_step, ssd_step_fuses
from hybridlm.ops.utils import compute_dtype, local_tensor, needs_grad


class Mamba2Mixer(nn.Module):
    """SSM mixer: `forward(hidden [B, T, D], *, cu_seqlens, position_ids, cache, seq_idx) -> [B, T, D]`."""

    @property
    def takes_seq_idx(self) -> bool:
        """Packed documents as a document index per token (the hybrid block's compiled path): the SSD's torch
        backends take it; a mixer set to the Triton kernels keeps cu_seqlens."""
        return self.backend != "triton"

    def __init__(self, config, layer_idx: int) -> None:  # config: HybridConfig
        super().__init__()
        self.layer_idx = layer_idx
        self.d_ssm = config.mamba_d_ssm
        self.num_heads = config.mamba_n_heads
        self.head_dim = config.mamba_d_head
        self.groups = config.mamba_n_groups
        self.d_state = config.mamba_d_state
        self.chunk_size = config.mamba_chunk_size
        self.backend = "auto"  # the ssd op's backend for sequences ("chunk", "triton", ...); "auto": its choice
        self.recompute = False  # True: training on the Triton SSD recomputes `_mix` in the backward (less memory)
        self.time_step_limit = tuple(config.time_step_limit)
        self.multipliers = {
            "z": config.ssm_multiplier_z,
            "x": config.ssm_multiplier_x,
            "B": config.ssm_multiplier_B,
            "C": config.ssm_multiplier_C,
            "dt": config.ssm_multiplier_dt,
        }
        bc_width = self.groups * self.d_state
        self.conv_channels = self.d_ssm + 2 * bc_width  # conv runs on (x, B, C)
        self.in_proj = AlignedLinear(
            config.hidden_size, 2 * self.d_ssm + 2 * bc_width + self.num_heads, bias=config.mamba_proj_bias
        )
        self.conv = ShortConvolution(
            self.conv_channels, config.mamba_d_conv, bias=config.mamba_conv_bias, activation="silu"
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = (
            GatedRMSNorm(
                self.d_ssm, groups=self.groups, eps=config.rms_norm_eps, norm_before_gate=config.mamba_norm_before_gate
            )
            if config.mamba_rms_norm
            else None
        )
        self.out_proj = nn.Linear(self.d_ssm, config.hidden_size, bias=config.projectors_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,  # only their restarts at 0 (document starts) matter here
        cache: LayerCache | None = None,
        restarts_resolved: bool = False,  # the caller (the model) packed any document restarts already
        seq_idx: torch.Tensor | None = None,  # [B, T] document index per token; replaces cu_seqlens (then ignored)
        projected: torch.Tensor | None = None,  # in_proj(hidden), computed by the caller (a fused GEMM)
    ) -> torch.Tensor:
        if seq_idx is not None:
            if cache is not None:
                raise ValueError("Mamba2Mixer: seq_idx (documents marked per token) takes no cache")
            cu_seqlens = None  # seq_idx marks the same documents, keeping the rows' shapes
        resolved = restarts_resolved or seq_idx is not None
        if cu_seqlens is None and position_ids is not None and not resolved and has_restarts(position_ids):
            if cache is not None:
                raise ValueError("Mamba2Mixer: a decoding cache cannot be combined with packed documents (restarts)")
            packed, cu_seqlens, _ = pack_rows(hidden, position_ids)  # documents packed inside rows
            return self(packed, cu_seqlens=cu_seqlens).reshape(hidden.shape[0], hidden.shape[1], -1)
        # 1. Fused input projection, split (the muP multipliers of x, B, C, dt in `_mix`, the gate's below).
        zxbcdt = self.in_proj(hidden) if projected is None else projected  # [B, T, 2 d_ssm + 2 G N + H]
        z, xbc, dt = zxbcdt.split([self.d_ssm, self.conv_channels, self.num_heads], dim=-1)
        documents = dict(cu_seqlens=cu_seqlens, seq_idx=seq_idx)
        if self._recomputes(xbc, cache, seq_idx):  # training on the Triton kernels: keep the projection only
            y = recompute_except_kernels(lambda *inputs: self._mix(*inputs, **documents, cache=None)[0], xbc, dt)
        else:
            # a plain gate rides on a decoding step's kernel (`ssd_decoding_step`), which then returns y gated
            gate = (z, self.multipliers["z"]) if self.norm is None and cache is not None else None
            y, gated = self._mix(xbc, dt, **documents, cache=cache, gate=gate)
            if gated:
                return self.out_proj(linear_input(y, hidden.dtype))

        # 5. Gate (through the grouped norm, or a plain SiLU gate: float32 math, the 16-bit y and z kept for the
        # backward), output projection (the gated output recomputed in the backward).
        z = scaled(z, self.multipliers["z"])
        return gated_output_projection(y, z, self.out_proj, self.norm, hidden.dtype)

    def _mix(self, xbc, dt, *, cu_seqlens, seq_idx, cache, gate=None) -> tuple[torch.Tensor, bool]:
        """The rest of step 1 and steps 2-4: the multipliers of x, B, C and dt, the conv, the discretization and the
        SSD scan on the projection's pieces -> (y [B, T, d_ssm], whether y is gated); the conv tail and the scan's
        state go into `cache`. `gate` (z, m_z): a decoding step on its one kernel also takes step 5's plain gate."""
        batch, length, _ = xbc.shape
        bc_width = self.groups * self.d_state
        m = self.multipliers
        if (m["x"], m["B"], m["C"]) != (1.0, 1.0, 1.0):
            x, b, c = xbc.split([self.d_ssm, bc_width, bc_width], dim=-1)
            xbc = torch.cat([x * m["x"], b * m["B"], c * m["C"]], dim=-1)  # [B, T, d_ssm + 2 G N]
        dt = scaled(dt, m["dt"])  # [B, T, H]

        # 2. Short causal conv + SiLU on (x, B, C); the conv tail carries across calls.
        conv_state = cache.ssm.get("conv") if cache is not None else None
        in_place = cache is not None and cache.states_in_place  # the step kernels may write over the cached states
        xbc, conv_state = self.conv(
            xbc, initial_state=conv_state, output_final_state=cache is not None, cu_seqlens=cu_seqlens, seq_idx=seq_idx,
            state_in_place=in_place,
        )
        x, b, c = xbc.split([self.d_ssm, bc_width, bc_width], dim=-1)
        x = x.reshape(batch, length, self.num_heads, self.head_dim)  # [B, T, H, P]
        b, c = (t.reshape(batch, length, self.groups, self.d_state) for t in (b, c))  # [B, T, G, N]
        if cache is not None and self._steps_in_one_kernel(x, b, dt, cache, cu_seqlens, seq_idx):
            # A decoding step's discretization (3.) and recurrence (4.) as one kernel (`ssd_decoding_step`)
            gated = gate is not None and gate[0].dtype == x.dtype
            y, cache.ssm["ssm"] = ssd_decoding_step(
                x, dt, local_tensor(self.A_log), b, c, dt_bias=local_tensor(self.dt_bias),
                dt_limit=self.time_step_limit, D=local_tensor(self.D), initial_state=cache.ssm.get("ssm"),
                gate=gate if gated else None, state_in_place=in_place)
            cache.ssm["conv"] = conv_state
            return y.reshape(batch, length, self.d_ssm), gated

        # 3. Discretization inputs in float32 (float64 stays float64).
        dtype = compute_dtype(dt.dtype)
        dt = F.softplus(dt.to(dtype) + local_tensor(self.dt_bias).to(dtype))
        if self.time_step_limit != (0.0, math.inf):  # softplus is >= 0: the default limits change no value or gradient
            dt = dt.clamp(min=self.time_step_limit[0], max=self.time_step_limit[1])  # [B, T, H]
        A = -torch.exp(local_tensor(self.A_log).to(dtype))  # [H]

        # 4. SSD scan (state in float32), D skip inside.
        y, ssm_state = ssd(
            x,
            dt,
            A,
            b,
            c,
            D=local_tensor(self.D),
            chunk_size=self.chunk_size,
            initial_state=cache.ssm.get("ssm") if cache is not None else None,
            output_final_state=cache is not None,
            cu_seqlens=cu_seqlens,
            seq_idx=seq_idx,
            # one decoding step: the recurrence itself ("auto": on CUDA its one-kernel form, the op's choice)
            backend=self.backend if length > 1 or self.backend in ("auto", "triton") else "naive",
        )
        if cache is not None:
            cache.ssm["conv"], cache.ssm["ssm"] = conv_state, ssm_state
        return y.reshape(batch, length, self.d_ssm), False  # [B, T, d_ssm]

    def _steps_in_one_kernel(self, x, b, dt, cache, cu_seqlens, seq_idx) -> bool:
        """Whether a cached step runs its discretization and recurrence as one kernel: one token per row, no packed
        documents, no gradient to record (through the inputs, the parameters or the carried state), and the op's
        step kernel taking the step."""
        if x.shape[1] != 1 or cu_seqlens is not None or seq_idx is not None:
            return False
        if needs_grad(x, b, dt, self.A_log, self.dt_bias, self.D, cache.ssm.get("ssm")):
            return False
        return ssd_step_fuses(x, b, backend=self.backend)

    def _recomputes(self, xbc: torch.Tensor, cache: LayerCache | None, seq_idx: torch.Tensor | None) -> bool:
        """Whether the forward recomputes `_mix` in the backward (`recompute_except_kernels`): `self.recompute`
        (`parallel.recompute_mixers`), training (a gradient, no cache; eager or compiled), and the scan on its
        Triton kernels, which keep their outputs (the torch paths, which `seq_idx` takes, would run again whole)."""
        if xbc.shape[1] == 1 or not self.recompute or cache is not None:
            return False
        if not (torch.is_grad_enabled() and xbc.requires_grad):
            return False
        bc_width = self.groups * self.d_state
        x = xbc[..., : self.d_ssm].unflatten(-1, (self.num_heads, self.head_dim))
        b = xbc[..., self.d_ssm : self.d_ssm + bc_width].unflatten(-1, (self.groups, self.d_state))
        return ssd_runs_triton(x, b, seq_idx=seq_idx, backend=self.backend)
