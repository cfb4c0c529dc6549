"""The rule table's names and the options of one fast-weight call, validated once and passed to every backend."""

from __future__ import annotations

from dataclasses import dataclass

RULES = ("1", "2", "3", "1A", "2A", "3A")
REGRESSION_RULES = ("1", "2", "3")
PER_COLUMN_RULES = ("2", "2A")
SLIDING_RULES = ("3", "3A")
PAIRINGS = ("shifted", "same_step")
READS = ("after", "before")
STEP_SIZES = ("nlms", "direct")


def restarts_in_place(*, rule: str, pairing: str, read: str) -> bool:
    """Whether the write preparation (`chunk.prepare_writes(..., seq_idx=)` and the fused Triton one) restarts
    documents exactly: for a read after the write (a read before it would see the last document's state at a
    document's first step), and for the regression rules only with shifted pairing (a same-step write's residual
    there would fit that state)."""
    return read == "after" and (rule not in REGRESSION_RULES or pairing == "shifted")


@dataclass(frozen=True)
class FastWeightOptions:
    """A rule and its options (README.md of this folder; `fast_weight_attention` documents each), checked on
    construction: every backend takes one of these instead of the options one by one.

    Attributes:
        rule: "1" | "2" | "3" | "1A" | "2A" | "3A".
        window: the sliding window of rules "3" / "3A" (1 for the other rules).
        pairing: "shifted" writes (k_{t-1}, v_t); "same_step" writes (k_t, v_t).
        read: "after" reads S_t; "before" reads S_{t-1}.
        step_size: "nlms" (eta = beta / (E_t + lam + eps)) or "direct" (eta = beta).
        ridge_scaling: the actual ridge is lam * E_t (E_t the rule's statistic, detached).
        eps: the NLMS stabilizer (> 0). eps_gamma: the decay fraction is clamped at 1 - eps_gamma (in (0, 1]).
        chunk_size: the chunk length of the chunk-parallel backends (>= 1; the cost only, never the result).
    """

    rule: str
    window: int = 1
    pairing: str = "shifted"
    read: str = "after"
    step_size: str = "nlms"
    ridge_scaling: bool = False
    eps: float = 1e-6
    eps_gamma: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; choose one of {RULES}")
        for name, value, choices in (("pairing", self.pairing, PAIRINGS), ("read", self.read, READS),
                                     ("step_size", self.step_size, STEP_SIZES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of {choices}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if self.window > 1 and self.rule not in SLIDING_RULES:
            raise ValueError(f"window = {self.window} only applies to the sliding rules {SLIDING_RULES}; rule "
                             f"{self.rule!r} needs 1")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not 0 < self.eps_gamma <= 1:
            raise ValueError(f"eps_gamma must be in (0, 1], got {self.eps_gamma}")

    @property
    def shifted(self) -> bool:
        """The write pair is (k_{t-1}, v_t)."""
        return self.pairing == "shifted"

    @property
    def read_after(self) -> bool:
        """o_t reads S_t (else S_{t-1})."""
        return self.read == "after"

    @property
    def regression(self) -> bool:
        """A regression rule (1, 2, 3): the write is the residual y - S^T x."""
        return self.rule in REGRESSION_RULES

    @property
    def restarts_in_place(self) -> bool:
        """Documents given by `seq_idx` restart exactly on the rows' shapes (`restarts_in_place`)."""
        return restarts_in_place(rule=self.rule, pairing=self.pairing, read=self.read)

    @property
    def per_column(self) -> bool:
        """Rules 2 and 2A: a step size and a decay per value column."""
        return self.rule in PER_COLUMN_RULES
