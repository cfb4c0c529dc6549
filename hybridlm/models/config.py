"""`HybridConfig`: the validated description of a hybrid attention + SSM language model.

Falcon-H1 fields keep the names of transformers' `FalconH1Config` (hidden_size, mamba_d_ssm,
key_multiplier, ...) so official checkpoints map onto it field by field. Two differences:
- the positional multiplier lists of FalconH1Config get one named field per entry:
  `ssm_multipliers = [z, x, B, C, dt]` -> ssm_multiplier_z, _x, _B, _C, _dt and
  `mlp_multipliers = [gate, down]` -> mlp_multiplier_gate, _down (`hybridlm.models.falcon_h1` converts);
- `rope_theta` is a plain field (transformers 5 nests it in `rope_parameters`).
Ours on top: `ssm_mixer` (which SSM channels: "mamba2" | "fast_weight" | "none"), `use_attention`,
`block_arrangement` ("SA_M" | "SAM" | "S_A_M"), `attention_window` (sliding-window attention, read by
`hybridlm.layers.attention`; not expressible as Falcon-H1) and the fast-weight options `fw_*`, read by
`hybridlm.layers.fast_weight`.

Derived sizes left as None are resolved in `__post_init__` (head_dim = hidden_size / heads,
mamba_d_ssm = mamba_expand * hidden_size, mamba_n_heads (see the field), mamba_d_head = mamba_d_ssm / mamba_n_heads,
num_key_value_heads = num_attention_heads), and float fields given as ints become floats (time_step_limit's
entries too). The fast-weight heads stay as given; `fast_weight_heads` derives the unset ones. Derived head widths
stay within the Triton kernels' limits, so that `backend="auto"` never leaves a default model on the torch paths.
Every error is a ValueError that names the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from dataclasses import dataclass, fields
from typing import Any

from hybridlm.ops.fast_weight.options import RULES, SLIDING_RULES
from hybridlm.ops.head_limits import FAST_WEIGHT_MAX_HEAD_DIM as FW_MAX_HEAD_DIM
from hybridlm.ops.head_limits import SSD_MAX_HEAD_DIM

SSM_MIXERS = ("mamba2", "fast_weight", "none")
MAMBA_INITS = ("falcon_h1", "mamba2")
BLOCK_ARRANGEMENTS = ("SA_M", "SAM", "S_A_M")
FW_PAIRINGS = ("shifted", "same_step")
FW_STEP_SIZES = ("nlms", "direct")
FW_READS = ("after", "before")
FW_QK_NORMS = ("rms", "l2", "none")
FW_GATES = ("context", "fixed")
MAMBA_HEADS = 8  # the Mamba-2 head count that mamba_n_heads=None starts from
_UNREAD_FW_WARNED: set[str] = set()  # the warnings of `_warn_unread_fast_weight_options` this process has issued


@dataclass
class HybridConfig:
    # --- sizes (FalconH1Config names) ---
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 640  # MLP inner width; 0 removes the MLP
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    mamba_d_ssm: int | None = None  # None: mamba_expand * hidden_size
    # None: mamba_d_ssm // mamba_d_head where mamba_d_head is set; else 8 heads, or, where heads of mamba_d_ssm / 8
    # channels would be wider than the SSD Triton kernels' 128 (wider ones run the torch chunk path), the fewest
    # multiple of 8 heads that splits mamba_d_ssm evenly into heads of at most 128 (d_ssm 1536: 16 x 96). Multiples
    # of 8 keep tensor-parallel splits over 2, 4, 8 ranks and B/C groups that divide 8.
    mamba_n_heads: int | None = None
    mamba_d_head: int | None = None  # None (or "auto"): mamba_d_ssm // mamba_n_heads
    mamba_n_groups: int = 1
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # clamp of dt after the softplus
    rope_theta: float = 1e11
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    projectors_bias: bool = False  # bias of the SSM out_proj
    attention_dropout: float = 0.0
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192  # informational: RoPE has no table
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # --- muP forward multipliers (Falcon-H1 report, Table 7) ---
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multiplier_z: float = 1.0  # FalconH1Config.ssm_multipliers[0]
    ssm_multiplier_x: float = 1.0  # [1]
    ssm_multiplier_B: float = 1.0  # [2]
    ssm_multiplier_C: float = 1.0  # [3]
    ssm_multiplier_dt: float = 1.0  # [4]
    mlp_multiplier_gate: float = 1.0  # FalconH1Config.mlp_multipliers[0]
    mlp_multiplier_down: float = 1.0  # [1]
    # --- ours: which mixers, how the block is wired ---
    ssm_mixer: str = "mamba2"
    use_attention: bool = True
    block_arrangement: str = "SA_M"
    # Sliding-window attention: a query at position p attends to keys p - W + 1 .. p of its own document (itself and
    # the W - 1 before it). None: full causal attention. With a window the decoding cache keeps O(W) keys per layer
    # instead of the whole context, so a hybrid's memory per sequence is constant (the SSM half carries the long
    # range), as Samba-style hybrids do. Falcon-H1 has no such option: such a model does not export to falcon_h1.
    attention_window: int | None = None
    # How a new model's Mamba-2 mixers start (loaded weights replace it): "falcon_h1", Falcon-H1's release (A = -(1, 2,
    # ..., H), dt_bias = 1: dt = softplus(1) = 1.31 in every head, a state that keeps e^-1.31 = 27% per step in its
    # slowest head and e^-(1.31 H) in its fastest); "mamba2", Mamba-2's reference init (mamba_ssm, transformers'
    # Mamba2): A = -U[1, 16] per head, dt log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1(dt), so the heads start
    # with memories from ~10 to ~10^4 tokens. Both set D = 1. Only initialisation reads it (falcon_h1 exports it away).
    mamba_init: str = "falcon_h1"
    # --- fast-weight SSM channels (read by hybridlm.layers.fast_weight) ---
    fw_rule: str = "1"
    fw_window: int = 1
    fw_pairing: str = "shifted"
    fw_qk_norm: str = "rms"  # "rms" (the paper's default) | "l2" | "none"; True / False read as "rms" / "none"
    fw_step_size: str = "nlms"
    # "context": beta (or eta) and lam from the input (the paper's ctx-beta / ctx-eta, ctx-lambda); "fixed": beta = 1
    # (direct steps: eta = 1, or 1 / E0 for rules 1/2/3) and a fixed per-head lam, RetNet's decays with fw_step_size
    # "direct" (hybridlm.layers.fast_weight)
    fw_gates: str = "context"
    fw_read: str = "after"
    fw_ridge_scaling: bool = False
    # Fast-weight heads, fw_heads x fw_head_dim (K = V), read through `fast_weight_heads`. Unset, they share the
    # Mamba-2 allocation: fw_head_dim alone gives mamba_n_heads heads, fw_heads alone heads of mamba_d_ssm / fw_heads,
    # neither mamba_n_heads heads of mamba_d_ssm / mamba_n_heads, or, where those would be wider than the Triton
    # kernels' 128 (wider ones run the torch chunk path), the fewest multiple of mamba_n_heads heads that splits
    # mamba_d_ssm evenly into heads of at most 128 (a multiple: a tensor-parallel split of mamba_n_heads splits them).
    fw_heads: int | None = None
    fw_head_dim: int | None = None
    fw_conv_size: int = 4
    fw_lam_scale: float | None = None  # None: 1 with fw_ridge_scaling, else the nominal key energy (layer docstring)
    fw_chunk_size: int = 64  # chunk length of the chunk-parallel fast-weight op

    def __post_init__(self) -> None:
        self._resolve()
        self._validate()

    # ------------------------------------------------------------------ derived sizes
    def _resolve(self) -> None:
        # Float fields given as ints (5 for 5.0: legal here, refused by transformers' strict FalconH1Config) become
        # floats, so that a saved config is typed one way; anything else is left for _validate to name.
        for name in FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        if isinstance(self.time_step_limit, (list, tuple)):
            self.time_step_limit = tuple(_as_float("time_step_limit", v) for v in self.time_step_limit)
        if isinstance(self.fw_qk_norm, bool):  # True / False: the norm on ("rms") or off
            self.fw_qk_norm = "rms" if self.fw_qk_norm else "none"
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # Sizes derive only from ints: a wrong type stays as it is for _validate to name.
        if (self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads)
                and self.num_attention_heads > 0):
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.mamba_d_ssm is None and _is_int(self.mamba_expand) and _is_int(self.hidden_size):
            self.mamba_d_ssm = self.mamba_expand * self.hidden_size
        if self.mamba_n_heads is None:
            self.mamba_n_heads = _mamba_heads(self.mamba_d_ssm, self.mamba_d_head)
        if (self.mamba_d_head is None or self.mamba_d_head == "auto") and _is_int(self.mamba_n_heads) \
                and _is_int(self.mamba_d_ssm):
            self.mamba_d_head = self.mamba_d_ssm // self.mamba_n_heads if self.mamba_n_heads > 0 else 0

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("intermediate_size", self.intermediate_size, minimum=0)
        _require_choice("hidden_act", self.hidden_act, ("silu",))
        _require_choice("ssm_mixer", self.ssm_mixer, SSM_MIXERS)
        _require_choice("block_arrangement", self.block_arrangement, BLOCK_ARRANGEMENTS)
        _require_choice("mamba_init", self.mamba_init, MAMBA_INITS)
        _require_bool("use_attention", self.use_attention)
        if not self.use_attention and self.ssm_mixer == "none":
            raise ValueError("use_attention=False with ssm_mixer='none' leaves no sequence mixer; enable one of them")
        if self.attention_window is not None:
            if not _is_int(self.attention_window) or self.attention_window < 1:
                raise ValueError(f"attention_window must be None (full causal attention) or an int >= 1, got "
                                 f"{self.attention_window!r}")
            if not self.use_attention:
                # a window that nothing reads would be silently saved with the model
                raise ValueError(f"attention_window={self.attention_window} needs use_attention=True (this model has "
                                 "no attention heads)")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "projectors_bias", "mamba_conv_bias",
                     "mamba_proj_bias", "mamba_rms_norm", "mamba_norm_before_gate", "fw_ridge_scaling"):
            _require_bool(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            _require_float(name, getattr(self, name), positive=True)
        _require_float("initializer_range", self.initializer_range, positive=False)
        _require_float("attention_dropout", self.attention_dropout, positive=False)
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}")
        for name in self.multiplier_names():
            _require_float(name, getattr(self, name), positive=False)
        # attention: heads, GQA groups, an even head_dim for RoPE
        _require_int("num_attention_heads", self.num_attention_heads, minimum=1)
        _require_int("num_key_value_heads", self.num_key_value_heads, minimum=1)
        _require_int("head_dim", self.head_dim, minimum=2)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (grouped-query attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for the rotary embedding, got {self.head_dim}")
        # mamba-2: d_ssm = heads * d_head, heads split evenly over the B/C groups
        for name in ("mamba_n_heads", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size",
                     "mamba_n_groups"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("mamba_d_ssm", self.mamba_d_ssm, minimum=1)
        _require_int("mamba_d_head", self.mamba_d_head, minimum=1)
        if self.ssm_mixer == "mamba2":
            if self.mamba_n_heads * self.mamba_d_head != self.mamba_d_ssm:
                raise ValueError(
                    f"mamba_d_ssm={self.mamba_d_ssm} must equal mamba_n_heads * mamba_d_head = "
                    f"{self.mamba_n_heads} * {self.mamba_d_head}"
                )
            if self.mamba_n_heads % self.mamba_n_groups != 0:
                raise ValueError(
                    f"mamba_n_groups={self.mamba_n_groups} must divide mamba_n_heads={self.mamba_n_heads}"
                )
        limit = self.time_step_limit
        if not (isinstance(limit, tuple) and len(limit) == 2 and all(_is_number(v) for v in limit)):
            raise ValueError(f"time_step_limit must be a pair (min, max) of floats, got {limit!r}")
        if not 0.0 <= limit[0] <= limit[1]:
            raise ValueError(f"time_step_limit must satisfy 0 <= min <= max, got {limit!r}")
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, minimum=0)
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)) and not eos:
            raise ValueError("eos_token_id must be an id, a non-empty list of ids, or None; got []")
        for value in eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]:
            _require_int("eos_token_id", value, minimum=0)
        # fast-weight options
        _require_choice("fw_rule", self.fw_rule, RULES)
        _require_choice("fw_pairing", self.fw_pairing, FW_PAIRINGS)
        _require_choice("fw_step_size", self.fw_step_size, FW_STEP_SIZES)
        _require_choice("fw_read", self.fw_read, FW_READS)
        _require_choice("fw_qk_norm", self.fw_qk_norm, FW_QK_NORMS)
        _require_choice("fw_gates", self.fw_gates, FW_GATES)
        _require_int("fw_window", self.fw_window, minimum=1)
        if self.fw_window > 1 and self.fw_rule not in SLIDING_RULES:
            raise ValueError(
                f"fw_window={self.fw_window} needs a sliding rule {SLIDING_RULES}; fw_rule={self.fw_rule!r} takes "
                "fw_window=1"
            )
        _require_int("fw_conv_size", self.fw_conv_size, minimum=1)
        _require_int("fw_chunk_size", self.fw_chunk_size, minimum=1)
        if self.fw_lam_scale is not None:
            _require_float("fw_lam_scale", self.fw_lam_scale, positive=True)
        for name in ("fw_heads", "fw_head_dim"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, minimum=1)
        if self.ssm_mixer == "fast_weight" and self.fw_head_dim is None:  # the head width is derived: exactly
            heads, _ = self.fast_weight_heads
            if self.mamba_d_ssm % heads:
                raise ValueError(f"fast_weight: mamba_d_ssm={self.mamba_d_ssm} must be a multiple of the head count "
                                 f"{heads} (fw_heads, else mamba_n_heads), or set fw_head_dim")
        if self.ssm_mixer != "fast_weight":
            _warn_unread_fast_weight_options(self)

    # ------------------------------------------------------------------ views
    @staticmethod
    def multiplier_names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(HybridConfig) if f.name.endswith("_multiplier") or "_multiplier_" in f.name)

    @property
    def ssm_multipliers(self) -> list[float]:
        """FalconH1Config's positional list [z, x, B, C, dt]."""
        return [self.ssm_multiplier_z, self.ssm_multiplier_x, self.ssm_multiplier_B, self.ssm_multiplier_C,
                self.ssm_multiplier_dt]

    @property
    def mlp_multipliers(self) -> list[float]:
        """FalconH1Config's positional list [gate, down]."""
        return [self.mlp_multiplier_gate, self.mlp_multiplier_down]

    @property
    def fast_weight_heads(self) -> tuple[int, int]:
        """(heads H, head width K = V) of the fast-weight mixer: fw_heads and fw_head_dim, the unset ones derived as
        their field comment says (within the Triton kernels' 128 where neither is set)."""
        heads = self.fw_heads
        if heads is None:
            heads = self.mamba_n_heads if self.fw_head_dim is not None else _narrow_heads(
                self.mamba_d_ssm, heads=self.mamba_n_heads, max_width=FW_MAX_HEAD_DIM)
        width = self.fw_head_dim if self.fw_head_dim is not None else self.mamba_d_ssm // heads
        return heads, width

    # ------------------------------------------------------------------ (de)serialization
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HybridConfig:
        """Build from a plain dict; unknown keys raise a ValueError that names them."""
        known = set(cls.field_names())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown HybridConfig field(s): {', '.join(unknown)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field, derived sizes resolved (time_step_limit as a list)."""
        out = {name: getattr(self, name) for name in self.field_names()}
        out["time_step_limit"] = list(self.time_step_limit)
        if isinstance(out["eos_token_id"], tuple):
            out["eos_token_id"] = list(out["eos_token_id"])
        return out

    def replace(self, **changes: Any) -> HybridConfig:
        """A copy with some fields changed (validated again; unknown names raise)."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown HybridConfig field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)


# The scalar float fields (time_step_limit, a pair of floats, is resolved beside them).
FLOAT_FIELDS = tuple(f.name for f in fields(HybridConfig) if f.type in ("float", "float | None"))


def _warn_unread_fast_weight_options(config: HybridConfig) -> None:
    """Warn, once per process and message, that fw_* fields set away from their defaults on a config whose ssm_mixer
    is not "fast_weight" are read by nothing. Not an error: such configs come from legitimate flows that change only
    ssm_mixer, e.g. `channel_allocation` switching the SSM off (ssm_mixer="none") over a fast-weight base, one base of
    fields for several mixers, and saved checkpoints, which record every field (as mamba_* stay free without
    Mamba-2)."""
    changed = [f.name for f in fields(HybridConfig)
               if f.name.startswith("fw_") and getattr(config, f.name) != f.default]
    if not changed:
        return
    settings = ", ".join(f"{name}={getattr(config, name)!r}" for name in changed)
    message = (f"{settings}: ignored with ssm_mixer={config.ssm_mixer!r} (only the fast-weight mixer reads fw_* "
               "options); set ssm_mixer='fast_weight' to use them, or drop them")
    if message not in _UNREAD_FW_WARNED:
        _UNREAD_FW_WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=_outside_stacklevel())


def _outside_stacklevel() -> int:
    """The `stacklevel` (for a `warnings.warn` in the caller of this function) of the first frame outside this
    package and outside the dataclasses module and its generated `__init__` ("<string>"): the user's line that built
    the config, whether directly, through `get_preset`, `replace` or `from_dict`."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    inside = ("<string>", dataclasses.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename in inside):
        frame, level = frame.f_back, level + 1
    return level


def _mamba_heads(d_ssm: Any, d_head: Any) -> Any:
    """mamba_n_heads left None (see the field); left for validation to name when mamba_d_ssm is not a positive int."""
    if not (_is_int(d_ssm) and d_ssm > 0):
        return MAMBA_HEADS
    if _is_int(d_head) and d_head > 0:
        return max(1, d_ssm // d_head)
    return _narrow_heads(d_ssm, heads=MAMBA_HEADS, max_width=SSD_MAX_HEAD_DIM)


def _narrow_heads(channels: int, *, heads: int, max_width: int) -> int:
    """`heads` where channels / heads <= max_width (or where heads does not divide channels, an error validation
    names), else the fewest multiple of `heads` that splits `channels` evenly into heads of at most `max_width`."""
    if heads < 1 or channels % heads or channels // heads <= max_width:
        return heads
    per_head = channels // heads
    factor = next(m for m in range(2, per_head + 1) if per_head % m == 0 and per_head // m <= max_width)
    return heads * factor


def _as_float(name: str, value: Any) -> Any:
    """An int (not a bool) as a float; any other value unchanged."""
    if not _is_int(value):
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _require_float(name: str, value: Any, *, positive: bool) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
