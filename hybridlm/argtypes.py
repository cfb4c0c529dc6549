"""argparse types shared by the commands: a bad option value is a usage error (exit status 2) found while the command
line is parsed, before a model, tokenizer or dataset loads."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """The argparse type of an integer option >= `minimum` (a count: `at_least(1)`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = at_least(1)


def non_negative_float(text: str) -> float:
    """The argparse type of a finite float >= 0 (a temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


non_negative_float.__name__ = "number >= 0"


def probability(text: str) -> float:
    """The argparse type of a probability mass in (0, 1] (top-p)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


probability.__name__ = "number in (0, 1]"
