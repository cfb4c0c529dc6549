"""The `hybridlm` entry point: `--help` lists every command, without importing torch, so it answers at once."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

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
