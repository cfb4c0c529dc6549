"""The `hybridlm` command line: thin entry points over the library.

    hybridlm --help
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# Each module registers its command group with `add_commands(subparsers)`; imports stay lazy inside them.
COMMAND_MODULES = (
    "hybridlm.models.commands",
    "hybridlm.data.commands",
    "hybridlm.training.commands",
    "hybridlm.experiments.commands",
    "hybridlm.eval.commands",
    "hybridlm.inference.commands",
    "hybridlm.export.commands",
    "hybridlm.serving.commands",
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
    except (FileExistsError, NotADirectoryError) as err:
        # mkdir of an existing file, or a path through one: "[Errno 17] File exists" does not say which option is
        # wrong, the path does. A usage error: the same command fails until the option changes.
        in_the_way = _file_in_the_way(err.filename)
        if in_the_way is None:
            print(f"hybridlm {args.command}: {err}", file=sys.stderr)
            return 1
        print(f"hybridlm {args.command}: {in_the_way} is a file, not a directory; give a directory path "
              "(or move the file away)", file=sys.stderr)
        return 2
    except OSError as err:  # a directory where a file goes; no permission; disk full
        print(f"hybridlm {args.command}: {err}", file=sys.stderr)
        return 1


def _file_in_the_way(path) -> str | None:
    """The first of `path` and its parents that exists as something other than a directory (None: none does, e.g. a
    FileExistsError of a name that is a directory)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    path = Path(os.fsdecode(path))
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return None if candidate.is_dir() else str(candidate)
    return None


if __name__ == "__main__":
    sys.exit(main())
