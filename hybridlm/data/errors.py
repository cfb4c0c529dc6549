"""The one exception the data layer raises for problems a user can fix (bad input, corrupt output)."""

from __future__ import annotations


class DataError(Exception):
    """A problem with input files, a tokenizer directory or prepared shards.

    The message names the file (and line or shard where it applies) and says what to do; the CLI prints
    it without a traceback and exits with status 1.
    """


class OutputExistsError(DataError):
    """--out already holds a result made from other inputs (a tokenizer, a dataset) and replacing it needs
    --overwrite: a usage error, found before any work (the CLI exits with status 2, as `hybridlm train` does)."""
