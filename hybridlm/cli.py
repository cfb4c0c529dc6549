"""The `hybridlm` command line: thin entry points over the library.

    hybridlm --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module registers its command group with `add_commands(subparsers)`; imports stay lazy inside them.
COMMAND_MODULES = (
    "hybridlm.models.commands",
    "hybridlm.data.commands",
    "hybridlm.training.commands",
    "hybridlm.eval.commands",
    "hybridlm.inference.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(subparsers)
    return parser


def _version() -> str:
    from hybridlm import __version__

    return f"hybridlm {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except OSError as err:  # a path that is a file where a directory goes, or the reverse; no permission; disk full
        print(f"hybridlm {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
