"""`lazy_exports`: a package's public names, imported on first use (PEP 562).

    _EXPORTS = {"Trainer": "hybridlm.training.trainer", ...}
    __all__ = list(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

Importing such a package costs nothing beyond its own file: `hybridlm --help` imports every command module's package
and must not load torch or transformers for that. The first access of a name imports its module and caches the value
in the package, so later accesses are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for the package named `package`, exporting each name of `exports` from the module
    it maps to."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
