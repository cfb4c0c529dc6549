"""The Falcon fast-weight mixer: the SSM half of a hybrid block written by one of the six Falcon rules.

    qkv, z, b, l = W_in h                          (one fused projection, no bias)
    q, k, v = SiLU(causal depthwise conv(q, k, v))          (K = fw_conv_size taps)
    q, k = QKNorm(q), QKNorm(k)                    per head: "rms" u / sqrt(|u|^2 / d + eps) (paper 4.1, no
                                                   learned scale), "l2" u / sqrt(|u|^2 + eps), or "none"
    beta = 2 sigmoid(b + b_beta)                   NLMS gain in (0, 2)          (step_size "nlms")
    eta  = (2 / E0) sigmoid(b + b_beta)            the step itself, ctx-eta      (step_size "direct")
    lam  = lam_scale sigmoid(l + b_lam)            ridge >= 0 per head          (paper C.1)
    (fw_gates "fixed": no b, l; beta = 1, eta = 1 (1 / E0 for rules 1/2/3), lam_h = 2^(-5-h): RetNet's decays)
    o = fast_weight_attention(q, k, v, beta or eta, lam; rule, window, pairing, read, ridge_scaling)
    y = W_out GatedRMSNorm(o, z)                   per-head RMSNorm, then * SiLU(z)

Shapes: heads H = fw_heads, K = V = fw_head_dim (derived where unset: `HybridConfig.fast_weight_heads`); beta is
[B, T, H] ([B, T, H, V] for the per-column rules "2"/"2A"), lam is [B, T, H]. E0 is the nominal energy |x|^2 of a
normalized key: head_dim for "rms" (and "none"), 1 for "l2".

Decisions (documented here because they are choices, not the paper's prescriptions):
- QK norm "rms" has no learned scale: the paper's RMSNorm operator (4.1) has none, and the NLMS step is
  invariant to a uniform rescaling of the key anyway (C.1). `fw_qk_norm` is "rms" | "l2" | "none" (the
  config also reads a bool: True -> "rms", False -> "none"). E0 for "none" is a nominal value only
  (unnormalized keys have no fixed energy).
- "direct" step sizes are sigmoid-scaled, eta = (2 / E0) sigmoid(.), so eta E0 covers (0, 2) like the NLMS
  gain does: the regression rules stay stable for keys of nominal energy, without the live normalizer.
  (A softplus would leave eta unbounded and let rules 1/2/3 diverge.)
- lam_scale = `fw_lam_scale` when set; when None, 1 with `fw_ridge_scaling` (lam is then
  the dimensionless base ridge, the actual ridge being lam |x|^2) and E0 without (so that lam / |x|^2 has
  the same range either way and the initial decay does not depend on the switch).
- Init: b_beta = 0, so beta starts near 1 (the NLMS step that fits the current pair exactly) and eta E0
  near 1; b_lam spreads over the heads so that sigmoid(b_lam) runs log-uniformly from 1e-3 to 1e-1, i.e.
  per-step decay fractions alpha ~ beta lam / (E + lam) from about 1e-3 to 1e-1: memory horizons of ~10 to
  ~1000 tokens, in the spirit of Mamba-2's spread of A. The projections keep torch's defaults (the model's
  initializer overwrites them with N(0, initializer_range)); the short conv keeps its own; no biases
  elsewhere (paper B.1).
- No muP multipliers inside: q and k are normalized, and the block applies ssm_in / ssm_out.
- `fw_gates="fixed"` drops the gate logits and biases: beta = 1 and lam_h = 2^(-5-h) for head h = 0..H-1. With
  step_size "direct" and rule 1A this is RetNet's retention, S_t = gamma_h S_{t-1} + k_t v_t^T with
  gamma_h = 1 - 2^(-5-h) (Sun et al. 2023's schedule): no write normalization, no input-dependent gate. The
  regression rules (1, 2, 3) take eta = 1 / E0 there instead: their residual feeds the state back, and a step
  of eta E0 outside (0, 2) diverges (eta = 1 with rms-normalized keys is eta E0 = head_dim), while eta E0 = 1 is
  the step that fits a pair of nominal energy exactly, as beta = 1 does with NLMS steps. Not supported under
  tensor parallelism (the fixed decays are indexed by the global head).

Training on the Triton kernels (a gradient, no cache; eager or compiled) recomputes steps 2-4 but the op's scans in
the backward (`hybridlm.ops.recompute`): the mixer keeps its input projection (which holds z for the gated norm anyway)
and the op's output, not the conv's output, the normalized q and k or the write events (benchmarks/RESULTS.md,
"Activation memory per token"), for a conv, two norms and the write preparation run again; eager, values and
gradients are the same bit for bit. `recompute = False` on the mixer keeps them instead.

Packed documents (`cu_seqlens`, or `position_ids` that restart at 0) reach both the conv and the op, so
nothing crosses a document boundary. With `seq_idx` as well (the compiled hybrid block's call) the conv takes the
document index per token, keeping the rows' shapes; so does the op where it restarts documents in place
(`seq_idx_in_place`: the chunk and Triton backends, a read after the write, shifted pairing for the regression
rules), and otherwise it runs outside the compiled graphs on `cu_seqlens`.
Decoding: `cache.ssm` holds the conv tail ("conv" [B, K-1, C]) and the `FastWeightState` fields ("S"
[B, H, K, V] fp32, "last_k" [B, H, K], and for the sliding rules "tail_x", "tail_v", "tail_len"); a prefill
runs the chunk-parallel path, each later token the recurrent step. Where that step runs on the op's step kernel
(no gradient, learned gates; `fast_weight_step_fuses`), steps 2-5 between the two projections run as one kernel
after a prefill (`fast_weight_mixer_decoding_step`: the conv's step, the QK norm, the gains, the rule's step and the
gated norm, with the roundings of those steps apart; heads of up to 128 x 128), else the QK norm and the gains run
inside the op's step kernel (`fast_weight_decoding_step`, the same values as steps 2-4 up to float32 rounding)
beside the conv's; in a cache of fixed addresses (`cache.states_in_place`, what a replayed CUDA graph reads) these
kernels write the new states over the old. With `cu_seqlens` and a cache (a
packed prefill) the states have one row per packed sequence.
Under tensor parallelism (hybridlm.parallel.tensor_parallel) num_heads, width, beta_width and conv_channels
are the rank's local ones and beta_bias / lam_bias are Shard(0) DTensors read through `local_tensor`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridlm.layers.cache import LayerCache
from hybridlm.modules.boundaries import has_restarts, pack_rows
from hybridlm.modules.gated_norm import GatedRMSNorm, gated_output_projection
from hybridlm.modules.linear import AlignedLinear, is_plain, linear_input
from hybridlm.modules.norm import rms_normalize
from hybridlm.modules.short_conv import ShortConvolution
from hybridlm.ops.fast_weight import (
    PER_COLUMN_RULES,
    REGRESSION_RULES,
    FastWeightState,
    fast_weight_attention,
    fast_weight_decoding_step,
    fast_weight_mixer_decoding_step,
    fast_weight_mixer_step_fuses,
    fast_weight_step_fuses,
    runs_triton,
    seq_idx_in_place,
)
from hybridlm.ops.recompute import recompute_except_kernels
from hybridlm.ops.utils import compute_dtype, local_tensor, needs_grad

_STATE_FIELDS = ("S", "last_k", "tail_x", "tail_v", "tail_len")  # FastWeightState fields kept in cache.ssm
_QK_EPS = 1e-6
_LAM_INIT_RANGE = (1e-3, 1e-1)  # sigmoid(b_lam) over the heads, log-uniform


class FastWeightMixer(nn.Module):
    """SSM mixer: `forward(hidden [B, T, D], *, cu_seqlens, position_ids, cache, seq_idx) -> [B, T, D]`."""

    takes_seq_idx = True  # the hybrid block's compiled packed path: the conv (and where it can, the op) on seq_idx
    # ... and its eager one: documents restarted in place on the row's shape (`seq_idx_in_place`; else the op runs on
    # cu_seqlens) keep no copies padded to the longest document.
    prefers_seq_idx = True

    def __init__(self, config, layer_idx: int) -> None:  # config: a validated HybridConfig
        super().__init__()
        self.layer_idx = layer_idx
        self.rule = config.fw_rule
        self.window = config.fw_window
        self.pairing = config.fw_pairing
        self.read = config.fw_read
        self.step_size = config.fw_step_size
        self.ridge_scaling = config.fw_ridge_scaling
        self.qk_norm = config.fw_qk_norm
        self.gates = config.fw_gates
        self.chunk_size = config.fw_chunk_size
        self.backend = "auto"  # "naive" | "chunk" | "triton" to force one; "auto": the op's choice
        self.recompute = True  # training on the Triton kernels: steps 2-4 recomputed in the backward (less memory)

        # Heads: fw_heads x fw_head_dim; by default the SSM channel allocation: mamba_d_ssm channels over
        # mamba_n_heads heads (so the alpha_S allocation sizes either SSM half), or a multiple of them where those
        # would be wider than the Triton kernels take (HybridConfig.fast_weight_heads).
        self.num_heads, self.head_dim = config.fast_weight_heads
        if self.head_dim < 1:
            raise ValueError(
                f"FastWeightMixer: mamba_d_ssm={config.mamba_d_ssm} gives {self.num_heads} heads no channels; "
                "set fw_head_dim"
            )
        H, K = self.num_heads, self.head_dim
        V = K
        self.width = H * V  # inner width of the mixer (the per-head outputs, concatenated)
        self.feature_energy = 1.0 if self.qk_norm == "l2" else float(K)  # E0: nominal |x|^2 of a normalized key
        lam_scale = config.fw_lam_scale
        if lam_scale is None:
            lam_scale = 1.0 if self.ridge_scaling else self.feature_energy
        self.lam_scale = float(lam_scale)

        # Projection layout: q [H K], k [H K], v [H V] (through the conv), z [H V], beta logits, lam logits [H]
        # (no logits with fixed gates: beta_width = lam_width = 0).
        fixed = self.gates == "fixed"
        self.beta_width = 0 if fixed else H * V if self.rule in PER_COLUMN_RULES else H
        self.lam_width = 0 if fixed else H
        self.conv_channels = 2 * H * K + H * V
        self.in_proj = AlignedLinear(config.hidden_size, self.conv_channels + H * V + self.beta_width + self.lam_width,
                                     bias=False)
        self.conv = ShortConvolution(self.conv_channels, config.fw_conv_size, bias=False, activation="silu")
        self.beta_bias = None if fixed else nn.Parameter(torch.empty(self.beta_width))
        self.lam_bias = None if fixed else nn.Parameter(torch.empty(H))
        # RetNet's per-head decay fractions 2^(-5-h) (fixed gates), derived from the config: not saved.
        self.register_buffer("fixed_lam", fixed_retention_decays(H) if fixed else None, persistent=False)
        self.norm = GatedRMSNorm(self.width, groups=H, eps=config.rms_norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.width, config.hidden_size, bias=config.projectors_bias)
        self.reset_gate_parameters()

    def reset_gate_parameters(self) -> None:
        """beta (or eta E0) starts near 1 (b_beta = 0); b_lam = `initial_lam_bias(heads)`. Fixed gates: nothing."""
        if self.gates == "fixed":
            return
        with torch.no_grad():
            self.beta_bias.zero_()
            self.lam_bias.copy_(initial_lam_bias(self.num_heads))

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        restarts_resolved: bool = False,  # the caller (the model) packed any document restarts already
        seq_idx: torch.Tensor | None = None,  # [1, T] with cu_seqlens: the compiled block's static packed path
        projected: torch.Tensor | None = None,  # in_proj(hidden), computed by the caller (a fused GEMM)
    ) -> torch.Tensor:
        batch, length, _ = hidden.shape
        if seq_idx is not None and (cu_seqlens is None or cache is not None):
            raise ValueError("FastWeightMixer: seq_idx comes with the packed row's cu_seqlens and without a cache")
        if cu_seqlens is None and position_ids is not None and not restarts_resolved and has_restarts(position_ids):
            # Documents packed inside rows: run the rows end to end as one packed row with offsets.
            if cache is not None:
                raise ValueError(
                    "FastWeightMixer: a decoding cache cannot be combined with packed documents (position_ids restarts)"
                )
            packed, cu_seqlens, _ = pack_rows(hidden, position_ids)  # [1, B T, D]
            return self(packed, cu_seqlens=cu_seqlens).reshape(batch, length, -1)
        # 1. Fused input projection and split.
        proj = self.in_proj(hidden) if projected is None else projected
        if cache is not None and self._whole_step_in_one_kernel(proj, cache, cu_seqlens, seq_idx):
            return self._decoding_step(proj, cache, hidden.dtype)
        qkv, z, beta_logits, lam_logits = proj.split(
            [self.conv_channels, self.width, self.beta_width, self.lam_width], dim=-1
        )
        documents = dict(cu_seqlens=cu_seqlens, seq_idx=seq_idx)
        if self._recomputes(qkv, cache, seq_idx):  # training on the Triton kernels: keep the projection only
            o = recompute_except_kernels(lambda *inputs: self._mix(*inputs, **documents, cache=None), qkv,
                                         beta_logits, lam_logits)
        else:
            o = self._mix(qkv, beta_logits, lam_logits, **documents, cache=cache)

        # 5. Per-head gated RMSNorm [B, T, H V], output projection (the norm's output recomputed in the backward).
        return gated_output_projection(o.reshape(batch, length, self.width), z, self.out_proj, self.norm, hidden.dtype)

    def _mix(self, qkv, beta_logits, lam_logits, *, cu_seqlens, seq_idx, cache) -> torch.Tensor:
        """Steps 2-4: the conv, the QK norm, the gains and the op on the projection's pieces -> o [B, T, H, V]; the
        conv tail and the op's state go into `cache`."""
        batch, length, _ = qkv.shape
        H, K, V = self.num_heads, self.head_dim, self.head_dim

        # 2. Short causal conv + SiLU on (q, k, v); the conv tail carries across calls.
        conv_state = cache.ssm.get("conv") if cache is not None else None
        in_place = cache is not None and cache.states_in_place  # the step kernels may write over the cached states
        qkv, conv_state = self.conv(  # with seq_idx, the rows' shapes (compiled); else the conv's own packing
            qkv, initial_state=conv_state, output_final_state=cache is not None,
            cu_seqlens=cu_seqlens if seq_idx is None else None, seq_idx=seq_idx, state_in_place=in_place,
        )
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        v = v.reshape(batch, length, H, V)  # [B, T, H, V], the activation dtype (bf16 under autocast)
        if cache is not None and self._steps_in_one_kernel(q, v, beta_logits, lam_logits, cache, cu_seqlens, seq_idx):
            # A decoding step's QK norm, gains (3.) and recurrence (4.) as one kernel (`fast_weight_decoding_step`)
            o, state = fast_weight_decoding_step(
                q.reshape(batch, length, H, K), k.reshape(batch, length, H, K), v,
                beta_logits.unflatten(-1, (H, V)) if self.rule in PER_COLUMN_RULES else beta_logits, lam_logits,
                gates=(local_tensor(self.beta_bias), local_tensor(self.lam_bias), *self._gain_scales()),
                qk_norm=self.qk_norm, qk_eps=_QK_EPS, rule=self.rule, pairing=self.pairing, read=self.read,
                step_size=self.step_size, ridge_scaling=self.ridge_scaling, initial_state=_load_state(cache),
                state_in_place=in_place)
            cache.ssm["conv"] = conv_state
            _store_state(cache, state)
            return o
        # Normalized with float32 math (`_normalize`), handed over in the activations' dtype: the op computes its
        # statistics, step sizes and state in float32 itself, and its GPU kernels take bf16 operands.
        q = self._normalize(q.reshape(batch, length, H, K)).to(v.dtype)  # [B, T, H, K]
        k = self._normalize(k.reshape(batch, length, H, K)).to(v.dtype)

        # 3. Gains and ridge in the compute dtype (float32 under autocast).
        beta, lam = self._gains(beta_logits, lam_logits)

        # 4. The fast-weight recurrence (state in float32, or float64 for float64 inputs). Given seq_idx, the op
        # restarts the documents in place (inside the compiled graphs) where it can; otherwise it runs outside the
        # graphs on cu_seqlens.
        options = dict(rule=self.rule, window=self.window, pairing=self.pairing, read=self.read)
        op, documents = fast_weight_attention, dict(cu_seqlens=cu_seqlens)
        if seq_idx is not None:
            in_place = seq_idx_in_place(q, v, **options, backend=self.backend)
            op, documents = (fast_weight_attention, dict(seq_idx=seq_idx)) if in_place else (_packed_op, documents)
        o, state = op(
            q, k, v, beta, lam, **options, step_size=self.step_size, ridge_scaling=self.ridge_scaling,
            initial_state=_load_state(cache), output_final_state=cache is not None, **documents,
            chunk_size=self.chunk_size, backend=self.backend,
            check_lam=False, check_beta=False,  # both scaled sigmoids (or fixed): in range, NaN reaches the guard
        )  # o [B, T, H, V]
        if cache is not None:
            cache.ssm["conv"] = conv_state
            _store_state(cache, state)
        return o

    def _decoding_step(self, proj: torch.Tensor, cache: LayerCache, dtype: torch.dtype) -> torch.Tensor:
        """Steps 2-5 of one token in one kernel (`fast_weight_mixer_decoding_step`), then the output projection."""
        y, conv_state, state = fast_weight_mixer_decoding_step(
            proj, conv_weight=local_tensor(self.conv.weight), conv_bias=local_tensor(self.conv.bias),
            conv_state=cache.ssm["conv"], norm_weight=local_tensor(self.norm.weight), norm_eps=self.norm.eps,
            gates=(local_tensor(self.beta_bias), local_tensor(self.lam_bias), *self._gain_scales()),
            qk_norm=self.qk_norm, qk_eps=_QK_EPS, rule=self.rule, pairing=self.pairing, read=self.read,
            step_size=self.step_size, ridge_scaling=self.ridge_scaling, initial_state=_load_state(cache),
            state_in_place=cache.states_in_place)
        cache.ssm["conv"] = conv_state
        _store_state(cache, state)
        return self.out_proj(linear_input(y, dtype))

    def _whole_step_in_one_kernel(self, proj, cache, cu_seqlens, seq_idx) -> bool:
        """Whether a cached step runs steps 2-5 as one kernel: what `_steps_in_one_kernel` asks (of the projection and
        the conv's and norm's parameters), a state to continue (the conv's and the op's, after a prefill), the conv
        and the norm as the mixer builds them on backends that take kernels, and heads that fit the kernel
        (`fast_weight_mixer_step_fuses`)."""
        if "conv" not in cache.ssm or "S" not in cache.ssm or self.conv.kernel_size < 2:
            return False
        if not (is_plain(self.conv, ShortConvolution) and is_plain(self.norm, GatedRMSNorm)
                and self.conv.backend != "torch" and self.norm.backend != "torch"):
            return False
        H, K = self.num_heads, self.head_dim
        q = proj[..., : H * K].unflatten(-1, (H, K))
        v = proj[..., 2 * H * K: self.conv_channels].unflatten(-1, (H, K))
        return (self._decoding_step_allowed(cache, cu_seqlens, seq_idx, proj, self.conv.weight, self.conv.bias,
                                            self.norm.weight)
                and fast_weight_mixer_step_fuses(q, v, rule=self.rule, window=self.window, backend=self.backend))

    def _steps_in_one_kernel(self, q, v, beta_logits, lam_logits, cache, cu_seqlens, seq_idx) -> bool:
        """Whether a cached step runs its QK norm, gains and recurrence as one kernel: `_decoding_step_allowed` on
        its inputs, and the op's step kernel taking the step."""
        if not self._decoding_step_allowed(cache, cu_seqlens, seq_idx, q, v, beta_logits, lam_logits):
            return False
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        return fast_weight_step_fuses(q, v, rule=self.rule, window=self.window, backend=self.backend)

    def _decoding_step_allowed(self, cache, cu_seqlens, seq_idx, *tensors) -> bool:
        """A fused decoding step's common terms: one token per row (`tensors[0]` [B, T, ...]), no packed documents,
        learned gates, and no gradient to record through `tensors`, the gains' biases or the carried state."""
        if tensors[0].shape[1] != 1 or cu_seqlens is not None or seq_idx is not None or self.gates == "fixed":
            return False
        return not needs_grad(*tensors, self.beta_bias, self.lam_bias,
                              *(cache.ssm.get(name) for name in _STATE_FIELDS))

    def _recomputes(self, qkv: torch.Tensor, cache: LayerCache | None, seq_idx: torch.Tensor | None) -> bool:
        """Whether the forward recomputes steps 2-4 in the backward (`recompute_except_kernels`): `self.recompute`
        (`parallel.recompute_mixers`), training (a gradient, no cache), and the op on its Triton kernels, whose
        scans keep their outputs (the torch paths would run again whole); compiled, not where packed documents take
        the op outside the graphs (`_packed_op`: a graph break inside the region would run it all eagerly)."""
        if not self.recompute or cache is not None or not (torch.is_grad_enabled() and qkv.requires_grad):
            return False
        q = qkv[..., : self.num_heads * self.head_dim].unflatten(-1, (self.num_heads, self.head_dim))
        options = dict(rule=self.rule, window=self.window, backend=self.backend)
        if (seq_idx is not None and torch.compiler.is_compiling()
                and not seq_idx_in_place(q, **options, pairing=self.pairing, read=self.read)):
            return False
        return runs_triton(q, **options)

    def _normalize(self, u: torch.Tensor) -> torch.Tensor:
        """QK normalization over the head dim: rms u / sqrt(mean u^2 + eps), l2 u / sqrt(sum u^2 + eps), both
        `rms_normalize` (float32 math; a bfloat16 CUDA tensor comes back in bfloat16, under autocast too, l2's
        1/sqrt(K) scale rounding once more; the caller casts to the values' dtype). l2 is rms with eps / K, times
        1/sqrt(K). The mixer's backend picks the norm's: "auto" and "triton" the same (the Triton kernels keep the
        normalized output, not the conv's, which is freed after the forward; in training `_mix` recomputes both),
        the op's torch paths ("naive", "chunk") and torch.compile's graphs (inductor fuses it) torch's
        `F.rms_norm`."""
        if self.qk_norm == "none":
            return u
        dim = u.shape[-1]
        taken = self.backend in ("auto", "triton") and not torch.compiler.is_compiling()
        backend = self.backend if taken else "torch"
        if self.qk_norm == "rms":
            return rms_normalize(u, eps=_QK_EPS, backend=backend)
        return rms_normalize(u, eps=_QK_EPS / dim, backend=backend) * dim**-0.5

    def _gains(self, beta_logits: torch.Tensor, lam_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> beta [B, T, H] (or [B, T, H, V]) and lam [B, T, H] >= 0."""
        dtype = compute_dtype(beta_logits.dtype)
        if self.gates == "fixed":  # beta = 1 or eta = 1 (1 / E0 for the regression rules), lam_h = 2^(-5-h)
            lam = self.fixed_lam.to(dtype).expand(*beta_logits.shape[:-1], self.num_heads)
            width = (self.num_heads, self.head_dim) if self.rule in PER_COLUMN_RULES else (self.num_heads,)
            step = 1.0 / self.feature_energy if self.step_size == "direct" and self.rule in REGRESSION_RULES else 1.0
            return torch.full((*beta_logits.shape[:-1], *width), step, dtype=dtype, device=lam.device), lam
        gate = torch.sigmoid(beta_logits.to(dtype) + local_tensor(self.beta_bias).to(dtype))
        if self.rule in PER_COLUMN_RULES:
            gate = gate.unflatten(-1, (self.num_heads, self.head_dim))  # [B, T, H, V]
        beta_scale, lam_scale = self._gain_scales()
        lam = lam_scale * torch.sigmoid(lam_logits.to(dtype) + local_tensor(self.lam_bias).to(dtype))
        return beta_scale * gate, lam

    def _gain_scales(self) -> tuple[float, float]:
        """The learned gains' scales: beta's (2 for NLMS steps, 2 / E0 for direct ones) and lam's."""
        return (2.0 if self.step_size == "nlms" else 2.0 / self.feature_energy), self.lam_scale

    def extra_repr(self) -> str:
        return (
            f"rule={self.rule!r}, window={self.window}, pairing={self.pairing!r}, read={self.read!r}, "
            f"step_size={self.step_size!r}, gates={self.gates!r}, ridge_scaling={self.ridge_scaling}, "
            f"qk_norm={self.qk_norm!r}, "
            f"heads={self.num_heads}, head_dim={self.head_dim}, lam_scale={self.lam_scale:g}"
        )


@torch.compiler.disable
def _packed_op(*args, **options):
    """`fast_weight_attention` on packed documents outside torch.compile's graphs (the rest of the mixer stays in
    them, given seq_idx): its kernels pad every document to the longest, shapes that change with every batch."""
    return fast_weight_attention(*args, **options)


def initial_lam_bias(num_heads: int) -> torch.Tensor:
    """[H] float32 logits whose sigmoids run log-uniformly over [1e-3, 1e-1] (one head: their geometric mean)."""
    low, high = (math.log(p) for p in _LAM_INIT_RANGE)
    fractions = torch.linspace(0.0, 1.0, num_heads) if num_heads > 1 else torch.tensor([0.5])
    p = torch.exp(low + (high - low) * fractions)
    return torch.log(p) - torch.log1p(-p)  # logit(p)


def fixed_retention_decays(num_heads: int) -> torch.Tensor:
    """[H] float32: RetNet's per-head decay fractions 2^(-5-h), h = 0..H-1 (gamma_h = 1 - 2^(-5-h))."""
    return torch.pow(2.0, -5.0 - torch.arange(num_heads, dtype=torch.float32))


def _load_state(cache: LayerCache | None) -> FastWeightState | None:
    """The carried state of this layer, or None for a fresh sequence (no cache, or nothing in it yet)."""
    if cache is None or "S" not in cache.ssm:
        return None
    return FastWeightState(**{name: cache.ssm.get(name) for name in _STATE_FIELDS})


def _store_state(cache: LayerCache, state: FastWeightState) -> None:
    for name in _STATE_FIELDS:
        value = getattr(state, name)
        if value is None:
            cache.ssm.pop(name, None)
        else:
            cache.ssm[name] = value
