"""hybridlm: hybrid attention + state-space language models (Falcon-H1 blocks, Falcon fast-weight attention)."""

__version__ = "0.1.0"
