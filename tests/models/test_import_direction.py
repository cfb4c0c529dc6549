"""Imports flow one way: ops <- modules <- layers <- models <- {inference, training, eval, ...} <- cli.

Every module under hybridlm/ is parsed (not imported) and each of its import statements checked, those inside
functions too (a lazy import is a dependency all the same). `hybridlm/fileio.py`, `hybridlm/devices.py`,
`hybridlm/lazy.py`, `hybridlm/argtypes.py` and `hybridlm/ops/` sit at the bottom, importable by every layer; the package root `hybridlm/__init__.py` (the public
front door) sits at the top with the CLI. Packages on one level may import each other. A new package under
hybridlm/ must be given its level in `LEVELS` before this test passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridlm

PACKAGE = Path(hybridlm.__file__).parent

# First name under hybridlm/ -> level; a module may import from its own level and those below.
LEVELS = {
    "ops": 0, "fileio": 0, "devices": 0, "lazy": 0, "argtypes": 0,
    "modules": 1,
    "layers": 2,
    "models": 3,
    **dict.fromkeys(("inference", "training", "eval", "experiments", "parallel", "data", "serving", "export"), 4),
    "cli": 5, "__init__": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def level_of(module: str) -> int:
    """The level of a hybridlm module by its dotted name; the root package is `__init__`."""
    parts = module.split(".")
    return LEVELS[parts[1] if len(parts) > 1 else "__init__"]


def is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:])
    return (PACKAGE / relative).is_dir() or (PACKAGE / relative).with_suffix(".py").is_file()


def imported_modules(source: str, module: str, *, package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted hybridlm module) of every import in `source`, the text of `module` (a package's __init__ when
    `package`), at any depth; `from hybridlm import x` names the submodule x when there is one, else the root."""
    here = module if package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return [(line, name) for line, name in found if name == "hybridlm" or name.startswith("hybridlm.")]


def upward_imports(source: str, module: str, *, package: bool = False) -> list[str]:
    """The imports of `source` (the text of `module`) from a level above its own."""
    return [f"line {line}: {name} (level {level_of(name)})"
            for line, name in imported_modules(source, module, package=package) if level_of(name) > level_of(module)]


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_level():
    unknown = sorted({module_name(p).split(".")[1] for p in MODULES if module_name(p) != "hybridlm"} - set(LEVELS))
    assert not unknown, f"give these hybridlm packages a level in LEVELS: {unknown}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_flow_downward(path):
    importer = module_name(path)
    upward = upward_imports(path.read_text(encoding="utf-8"), importer, package=path.name == "__init__.py")
    assert not upward, f"{importer} (level {level_of(importer)}) imports from a higher level: {'; '.join(upward)}"


def test_the_check_sees_lazy_relative_and_root_imports():
    source = """
import torch
from hybridlm.layers.cache import HybridCache
from hybridlm.ops import utils
def generate():
    from hybridlm.inference import generate
    from ..training import trainer
    from . import config
    import hybridlm
"""
    assert upward_imports(source, "hybridlm.models.model") == [
        "line 6: hybridlm.inference (level 4)", "line 7: hybridlm.training.trainer (level 4)",
        "line 9: hybridlm (level 5)",
    ]
    assert upward_imports(source, "hybridlm.cli") == []
