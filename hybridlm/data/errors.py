"""The one exception the data layer raises for problems a user can fix (bad input, corrupt output)."""

from __future__ import annotations


class DataError(Exception):
    """A problem with input files, a tokenizer directory or prepared shards.

    The message names the file (and line or shard where it applies) and says what to do; the CLI prints
    it without a traceback and exits with status 1.
    """
