"""What a request asks of the engine: how many tokens, how to choose them, when to stop.

    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=0, stop=["\\n\\n"])

The fields and their meaning follow OpenAI's completion parameters (and vLLM's `ignore_eos` extension): a request
finishes with finish_reason "stop" at an end-of-sequence token (unless `ignore_eos`) or a stop string (which the text
does not include), else "length" after `max_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridlm.models.sampling import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0: greedy
    top_p: float | None = None  # None: no nucleus filter
    top_k: int | None = None  # None: no top-k filter
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, cut from the text
    seed: int | None = None  # the same seed gives the same tokens, whatever else runs beside the request
    ignore_eos: bool = False  # decode past end-of-sequence tokens (benchmarks)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request like an eos (kept even with ignore_eos)

    def __post_init__(self) -> None:
        """ValueError naming the field when a setting is out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2^63, 2^64), got {self.seed!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
