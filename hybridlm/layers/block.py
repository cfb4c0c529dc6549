"""The hybrid block: attention heads and SSM heads side by side, then the MLP (Falcon-H1).

Arrangements (`config.block_arrangement`), with N, N_A, N' RMSNorms and m_* the muP multipliers:

    "SA_M" (default, Falcon-H1):  n = N(x)
                                  h = x + m_ssm_out ssm(m_ssm_in n) + m_attn_out attn(m_attn_in n)
                                  out = h + mlp(N'(h))
    "SAM"  (fully parallel):      n = N(x)
                                  out = x + m_ssm_out ssm(m_ssm_in n) + m_attn_out attn(m_attn_in n) + mlp(n)
    "S_A_M" (sequential):         h1 = x + m_ssm_out ssm(m_ssm_in N(x))
                                  h2 = h1 + m_attn_out attn(m_attn_in N_A(h1))
                                  out = h2 + mlp(N'(h2))

Either mixer may be off (`use_attention=False`, `ssm_mixer="none"`); `intermediate_size=0` drops
the MLP. The SSM half comes from `build_ssm_mixer`, keyed by `config.ssm_mixer`.

Mixer contract (every sequence mixer, e.g. `Mamba2Mixer`, `Attention`, and the fast-weight mixer
`hybridlm.layers.fast_weight.FastWeightMixer(config, layer_idx)`):

    mixer(hidden,                 # [B, T, D], already normalized and scaled by the input multiplier
          *,
          cu_seqlens=None,        # [N + 1] int offsets of packed documents (B == 1): no mixing across them
          position_ids=None,      # [B, T] or [1, T] positions (restart at 0 per document); RoPE uses them
          cache=None,             # hybridlm.layers.cache.LayerCache of this layer, read and updated in place
          restarts_resolved=False)  # True: the caller already packed any restarts of position_ids into
                                    # cu_seqlens, so the mixer need not look for them (a host synchronization)
        -> [B, T, D]              # before the output multiplier (the block applies it)

A mixer whose `takes_seq_idx` is True (Mamba-2 on the SSD's torch backends, the fast-weight mixer) also takes
`seq_idx=[1, T]`, each token's document, beside `cu_seqlens`: the same result, with the rows' shapes wherever it
can (Mamba-2 throughout; the fast-weight mixer whole where its op restarts documents in place, `seq_idx_in_place`,
else all but its op, which then steps outside the graphs). A compiled block calls it that way (given `seq_idx`,
which the model computes once per forward), so the mixer compiles and replays as CUDA graphs; the other mixers
(attention) run packed documents outside the compiled graphs (`_packed_mix`). A mixer whose `prefers_seq_idx` is
True (the fast-weight mixer) is called that way outside torch.compile too: restarting documents in place on the
row's shape keeps no copy padded to the longest document.

Attention also takes `rotary=(cos, sin)`, its RoPE tables at position_ids, which the model computes once per
forward for all its layers (each layer would otherwise compute the same tables: a few kernels per layer in every
decoding step). An SSM mixer keeps its decoding state in `cache.ssm` (a dict it owns). The block applies the
ssm_in/ssm_out and attention_in/attention_out multipliers; mixers apply only their internal ones.

Calls without a gradient run fewer, larger kernels with the same values:
- `projected=` (generation: a cache too): a mixer (and the MLP) takes its input projection(s) computed by the block,
  which multiplies once by the weights `hybridlm.models.fuse.fuse_projections` concatenated (q, k, v, with the SSM's
  in_proj where both mixers read N(x); the MLP's up and gate) and hands each its slice;
- `deferred`: the block leaves its last residual adds to the caller, so that they run inside the next norm's launch
  (`add_and_norm`), as a mixer's output is added inside the launch of the norm after it within the block;
- `concurrent_mixers` (set by `hybridlm.models.fuse.prepare_for_generation` on CUDA): in a decoding step (one token
  per row) of a parallel block being captured into a CUDA graph (over a cache of fixed addresses,
  `cache.states_in_place`: `GraphedDecoder`'s and the serving engine's steps), the SSM half is recorded on a second
  CUDA stream while attention is recorded on the caller's; the eager warm-up step before the capture
  (`capturing_soon`) takes the side stream too, so that the libraries' lazy set-up for it (cuBLAS's workspace per
  stream) happens outside the capture. The two halves read the same N(x) and neither reads the
  other, so the replayed graph keeps two branches the GPU may run at once; a step at a small batch is a chain of
  kernels each too small to fill the GPU. The same kernels on the same inputs, their outputs added in the same order:
  the same values. Steps run eagerly (over the growing cache, or the static step without a graph) stay on one
  stream: there the host's launches, not the GPU, set a step's time, and switching streams only adds to them
  (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

import torch
from torch import nn

from hybridlm.layers.attention import Attention
from hybridlm.layers.cache import LayerCache
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.layers.mlp import GatedMLP
from hybridlm.modules.fused_linear import FusedLinear
from hybridlm.modules.multiplier import scaled
from hybridlm.modules.norm import RMSNorm, add_and_norm

# Which SSM mixers recompute what feeds their scans in the backward (`parallel.recompute_mixers`). "fast_weight", the
# default and each mixer's own: the fast-weight mixers recompute (it saves ~1 GiB of a 16K row's ~11 at the 125m
# shape, for 1-7% of an eager update) and Mamba-2 keeps its activations (recomputing saves 1-3% of the peak and costs
# 15-20% of an eager update, host time: benchmarks/RESULTS.md, "Activation memory per token").
RECOMPUTE_MIXERS = ("fast_weight", "all", "none")


def set_mixers_recompute(model: nn.Module, which: str) -> list[nn.Module]:
    """Set `recompute` (what feeds the scans recomputed in the backward, `hybridlm.ops.recompute`) on every SSM mixer
    of `model` as `which` says (`RECOMPUTE_MIXERS`); returns those mixers."""
    if which not in RECOMPUTE_MIXERS:
        raise ValueError(f"recompute_mixers must be one of {RECOMPUTE_MIXERS}, got {which!r}")
    mixers = [m for m in model.modules() if isinstance(m, (FastWeightMixer, Mamba2Mixer))]
    for mixer in mixers:
        mixer.recompute = which == "all" or (which == "fast_weight" and isinstance(mixer, FastWeightMixer))
    return mixers


def build_ssm_mixer(config, layer_idx: int) -> nn.Module | None:
    """The SSM half of a block for `config.ssm_mixer` ("mamba2" | "fast_weight" | "none")."""
    if config.ssm_mixer == "none":
        return None
    if config.ssm_mixer == "mamba2":
        return Mamba2Mixer(config, layer_idx)
    if config.ssm_mixer == "fast_weight":
        return FastWeightMixer(config, layer_idx)
    raise ValueError(f"unknown ssm_mixer {config.ssm_mixer!r}; choose 'mamba2', 'fast_weight' or 'none'")


class HybridBlock(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:  # config: HybridConfig
        super().__init__()
        self.layer_idx = layer_idx
        self.arrangement = config.block_arrangement
        self.ssm_in_multiplier = config.ssm_in_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier
        self.attn_in_multiplier = config.attention_in_multiplier
        self.attn_out_multiplier = config.attention_out_multiplier
        eps = config.rms_norm_eps
        self.ssm = build_ssm_mixer(config, layer_idx)
        self.attn = Attention(config, layer_idx) if config.use_attention else None
        self.mlp = GatedMLP(config) if config.intermediate_size > 0 else None
        # N: before the mixers (S_A_M: before the SSM only, or before attention if the SSM is off).
        self.norm = RMSNorm(config.hidden_size, eps=eps)
        sequential = self.arrangement == "S_A_M" and self.ssm is not None and self.attn is not None
        self.attn_norm = RMSNorm(config.hidden_size, eps=eps) if sequential else None
        mlp_needs_norm = self.mlp is not None and self.arrangement != "SAM"
        self.mlp_norm = RMSNorm(config.hidden_size, eps=eps) if mlp_needs_norm else None
        # The projections that read one input as one GEMM each (`hybridlm.models.fuse.fuse_projections`), for calls
        # with a cache and no gradient (`_fuses`): q, k, v (with the SSM's in_proj when both mixers read N(x) unscaled)
        # and the MLP's up and gate. None: each projection apart.
        self.fused_input: FusedLinear | None = None
        self.fused_mlp: FusedLinear | None = None
        self.concurrent_mixers = False  # the module docstring; `prepare_for_generation` sets it on CUDA

    def forward(
        self,
        x: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        restarts_resolved: bool = False,
        seq_idx: torch.Tensor | None = None,  # [1, T] with cu_seqlens: each token's document, on the device
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # attention's RoPE (cos, sin) of position_ids
    ) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        h, pending = self.deferred(x, (), cu_seqlens=cu_seqlens, position_ids=position_ids, cache=cache,
                                   restarts_resolved=restarts_resolved, seq_idx=seq_idx, rotary=rotary)
        for out in pending:
            h = h + out
        return h

    def deferred(self, x: torch.Tensor, residuals: tuple[torch.Tensor, ...], *, cu_seqlens=None, position_ids=None,
                 cache: LayerCache | None = None, restarts_resolved: bool = False, seq_idx=None,
                 rotary=None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The block on x + residuals[0] + ... with its last residual adds left to the caller: (h, pending), the
        block's output being h + pending[0] + ... (at most two). A model chains its blocks this way in generation,
        so that each block's adds run inside the next block's norm, and the last block's inside the final norm
        (`add_and_norm`: one launch where the inference norm runs); inside a block, a mixer's output is added in the
        launch of the norm after it. The same values as `forward`'s, added in the same order. The keywords are
        `forward`'s."""
        if seq_idx is not None and cu_seqlens is None:
            raise ValueError("HybridBlock: seq_idx marks the documents of a packed row and needs its cu_seqlens")
        mix = dict(cu_seqlens=cu_seqlens, position_ids=position_ids, cache=cache, restarts_resolved=restarts_resolved)
        fuses = self._fuses(mix)
        x, n = add_and_norm(x, residuals, self.norm) if residuals else (x, self.norm(x))
        if self.arrangement == "S_A_M":
            h, pending = x, ()
            if self.ssm is not None:
                pending = (self._ssm(n, mix, seq_idx, {}),)  # its in_proj alone reads N(x): nothing to fuse with
            if self.attn is not None:
                if self.attn_norm is not None:
                    h, a = add_and_norm(h, pending, self.attn_norm)
                    pending = ()
                else:  # no SSM: attention reads N(x)
                    a = n
                pending = (*pending, self._attn(a, mix, rotary, fuses, {}))
            return self._mlp_after(h, pending, fuses)
        shared = self.fused_input is not None and "ssm.in_proj" in self.fused_input.names
        parts = self._project(self.fused_input, n, fuses) if shared else {}  # both mixers' projections of N(x)
        pending = ()
        if self._side_by_side(n, mix):
            pending = self._mixers_side_by_side(n, mix, rotary, fuses, parts)
        else:
            if self.ssm is not None:
                pending = (self._ssm(n, mix, seq_idx, parts),)
            if self.attn is not None:
                pending = (*pending, self._attn(n, mix, rotary, fuses, parts))
        if self.arrangement == "SAM" and self.mlp is not None:
            h = x
            if len(pending) == 2:
                h, pending = h + pending[0], pending[1:]
            return h, (*pending, self._mlp(n, fuses))
        return self._mlp_after(x, pending, fuses)

    def _side_by_side(self, n: torch.Tensor, mix: dict) -> bool:
        """Whether this call runs its two mixers on two streams (`concurrent_mixers`): a decoding step on CUDA over a
        fixed-address cache with both mixers, no gradient, no packed documents, outside torch.compile (which traces
        one stream), being captured into a CUDA graph (the module docstring)."""
        return (self.concurrent_mixers and self.ssm is not None and self.attn is not None and n.is_cuda
                and n.shape[1] == 1 and mix["cache"] is not None and mix["cache"].states_in_place
                and mix["cu_seqlens"] is None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and (_CAPTURING_SOON.get() or torch.cuda.is_current_stream_capturing()))

    def _mixers_side_by_side(self, n: torch.Tensor, mix: dict, rotary, fuses: bool,
                             parts: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(ssm, attention) outputs, the SSM half enqueued on a side stream after everything the caller's stream
        holds so far (N(x), the fused projections), and the caller's stream made to wait for it before it goes on.
        Memory stays safe without `record_stream`: the side stream's next allocations come after its next wait on
        the caller's stream, so after every read of this step's SSM output; and the caller's stream reads nothing of
        the SSM's before this wait. The wait comes whatever either half raises: a capture left with unjoined work
        would hide the error, and the memory of N(x) must not return to the caller's stream under a running SSM."""
        main = torch.cuda.current_stream(n.device)
        side = _side_stream(n.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                s = self._ssm(n, mix, None, parts)
            a = self._attn(n, mix, rotary, fuses, parts)
        finally:
            main.wait_stream(side)
        return s, a

    def _mlp_after(self, h: torch.Tensor, pending: tuple[torch.Tensor, ...],
                   fuses: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """h + pending, then the MLP on N'(h + pending) with its output pending (the mixers' adds inside N''s launch);
        (h, pending) itself without an MLP."""
        if self.mlp is None:
            return h, pending
        h, m = add_and_norm(h, pending, self.mlp_norm) if pending else (h, self.mlp_norm(h))
        return h, (self._mlp(m, fuses),)

    def _fuses(self, mix: dict) -> bool:
        """Whether this call takes the fused projections (`fused_input`, `fused_mlp`): generation's calls (a cache,
        no packed documents, no gradient: the fused weights are buffers, which record none)."""
        return (mix["cache"] is not None and mix["cu_seqlens"] is None and not torch.is_grad_enabled()
                and (self.fused_input is not None or self.fused_mlp is not None))

    def _project(self, fused: FusedLinear | None, x: torch.Tensor, fuses: bool) -> dict[str, torch.Tensor]:
        """The parts of `fused` this block still holds (`FusedLinear.reads`) applied to x in one GEMM, by their paths
        ("attn.q_proj", ...); {} where the call does not fuse, or where the SSM's and attention's projections would
        read N(x) scaled by input multipliers that are not 1 (`fold_multipliers` makes them 1)."""
        if not fuses or fused is None:
            return {}
        if "ssm.in_proj" in fused.names and (self.ssm_in_multiplier, self.attn_in_multiplier) != (1.0, 1.0):
            return {}
        return fused(x, {name: functools.reduce(getattr, path, self) for name, path in zip(fused.names, fused.paths)}
                     ) or {}

    def _mlp(self, x: torch.Tensor, fuses: bool) -> torch.Tensor:
        parts = self._project(self.fused_mlp, x, fuses)
        return self.mlp(x, projected=(parts["mlp.up_proj"], parts["mlp.gate_proj"]) if parts else None)

    def _ssm(self, n: torch.Tensor, mix: dict, seq_idx: torch.Tensor | None, parts: dict) -> torch.Tensor:
        n = scaled(n, self.ssm_in_multiplier)
        if mix["cu_seqlens"] is None:
            out = self.ssm(n, **mix, **({"projected": parts["ssm.in_proj"]} if "ssm.in_proj" in parts else {}))
        elif (seq_idx is not None and mix["cache"] is None and getattr(self.ssm, "takes_seq_idx", False)
              and (torch.compiler.is_compiling() or getattr(self.ssm, "prefers_seq_idx", False))):
            out = self.ssm(n, cu_seqlens=mix["cu_seqlens"], position_ids=mix["position_ids"], seq_idx=seq_idx,
                           restarts_resolved=True)
        else:
            out = _packed_mix(self.ssm, n, mix)
        return scaled(out, self.ssm_out_multiplier)

    def _attn(self, n: torch.Tensor, mix: dict, rotary: tuple[torch.Tensor, torch.Tensor] | None, fuses: bool,
              parts: dict) -> torch.Tensor:
        """`parts`: q, k, v's projections if the block computed them with the SSM's; else q, k, v fused alone."""
        n = scaled(n, self.attn_in_multiplier)
        mix = {**mix, "rotary": rotary}
        if self.fused_input is not None and "ssm.in_proj" not in self.fused_input.names:
            parts = self._project(self.fused_input, n, fuses)
        if "attn.q_proj" in parts:
            mix["projected"] = (parts["attn.q_proj"], parts["attn.k_proj"], parts["attn.v_proj"])
        out = self.attn(n, **mix) if mix["cu_seqlens"] is None else _packed_mix(self.attn, n, mix)
        return scaled(out, self.attn_out_multiplier)


_SIDE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_CAPTURING_SOON = contextvars.ContextVar("capturing_soon", default=False)


@contextlib.contextmanager
def capturing_soon():
    """The eager warm-up step before a CUDA graph capture (`hybridlm.models.graphed.capture_step`): the blocks run as
    they will in the capture, their SSM halves on the side stream (the module docstring)."""
    token = _CAPTURING_SOON.set(True)
    try:
        yield
    finally:
        _CAPTURING_SOON.reset(token)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device and thread for `HybridBlock._mixers_side_by_side`, made on first use. One for
    all blocks: each block's SSM half waits for the caller's stream anyway, so the halves of two blocks never overlap.
    Per thread: streams and captures are the caller's thread's own, and a side stream shared by two threads' steps
    would join one's kernels to the other's capture and order neither's memory. Taken from torch's pool of
    high-priority streams: the warm-up and capture streams that graph captures take from the default-priority pool
    cycle through it and would, now and then, be this very stream (still correct, but one stream again)."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    key = (device, threading.get_ident())
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[key]


@torch.compiler.disable
def _packed_mix(mixer: nn.Module, hidden: torch.Tensor, mix: dict) -> torch.Tensor:
    """A mixer on packed documents runs outside torch.compile's graphs. Its shapes follow the documents (each batch
    pads them to its own [N, max_len], from host offsets read with `.tolist()`): traced, every new batch would be a
    graph break and a recompilation, and after eight of those the block would fall back to eager for good. The block's
    norms, MLP and residuals stay compiled; plain rows (no cu_seqlens) compile the mixers too, and so do packed
    documents given `seq_idx` for a mixer that `takes_seq_idx` (Mamba-2, and the fast-weight mixer whole or all but
    its op)."""
    return mixer(hidden, **mix)
