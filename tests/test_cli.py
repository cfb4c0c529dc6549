"""The `hybridlm` entry point: `--help` lists every command, without importing torch, so it answers at once."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")
_SCRIPT = f"""
import contextlib, io, json, sys
from hybridlm.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--help"])
print(json.dumps({{"help": out.getvalue(), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


@functools.cache
def _help_in_fresh_interpreter() -> dict:
    """`hybridlm --help` in a new interpreter: {"help": its text, "heavy": the HEAVY modules it imported}."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_lists_every_command():
    text = _help_in_fresh_interpreter()["help"]
    for command in ("models", "tokenizer", "data", "train", "mup-check", "bench", "eval", "generate", "export"):
        assert f"    {command}" in text, text


def test_help_imports_neither_torch_nor_transformers():
    assert _help_in_fresh_interpreter()["heavy"] == []


@pytest.mark.parametrize("argv, message", [
    (["checkpoint", "export", "--run", "r", "--out", "o", "--step", "-1"], "argument --step: must be >= 0, got -1"),
    (["tokenizer", "train", "--input", "c", "--vocab-size", "2000", "--out", "t", "--min-frequency", "-3"],
     "argument --min-frequency: must be >= 1, got -3"),
    (["generate", "--model", "m", "--prompt", "p", "--prefill-chunk", "0"], "argument --prefill-chunk: must be >= 1"),
    (["chat", "--model", "m", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["chat", "--model", "m", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
])
def test_an_option_value_out_of_range_is_a_usage_error_before_anything_runs(argv, message, capsys):
    from hybridlm.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
