"""transformers' own progress bars ("Loading weights", "Writing model shards"), switched for the length of a call.

Our loads and saves (`hybridlm.load_model`, `HybridForCausalLM.save_pretrained`) run with them off: a checkpoint of
the sizes this library trains loads in moments, and a bar on every `hybridlm generate` or trainer export is noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off inside the block; the previous setting is restored after it."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()
