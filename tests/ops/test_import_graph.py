"""The import graph of `hybridlm.ops`: every module imports in a fresh interpreter on its own, no two modules import
each other (directly or around a cycle, counting the imports inside functions), and no module imports another's
private (`_name`) names."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "hybridlm" / "ops"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def module_name(path: Path) -> str:
    parts = path.relative_to(OPS.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(OPS.rglob("*.py"))}


def imports_of(path: Path, *, top_level: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) of every `import` and `from ... import` in the file, inside functions too (or with
    `top_level`, only those that run when the module loads)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def edges() -> dict[str, set[str]]:
    """module -> the hybridlm.ops modules it imports (a `from package import submodule` counts the submodule)."""
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for module, names in imports_of(path):
            if module not in MODULES:
                continue
            submodules = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
            targets |= submodules
            if len(submodules) < len(names) or not names:
                targets.add(module)
        graph[name] = targets - {name}
    return graph


def test_no_import_cycles():
    graph = edges()
    assert len(graph) > 30, sorted(graph)
    # Parent packages import their children lazily at most; a child importing its package's __init__ for names that
    # the __init__ re-exports would be a cycle, which this finds as any other.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_private_names_across_modules():
    crossing = [f"{name} imports {module}.{n}" for name, path in MODULES.items()
                for module, names in imports_of(path) if module in MODULES and module != name
                for n in names if n.startswith("_") and n != "__future__"]
    assert not crossing, crossing




def needs_triton() -> set[str]:
    """The modules whose loading imports triton, themselves or through the modules they load."""
    loads = {name: {m for module, names in imports_of(path, top_level=True) for m in [module] + [
        f"{module}.{n}" for n in names]} for name, path in MODULES.items()}
    found = {name for name, modules in loads.items() if any(m == "triton" or m.startswith("triton.") for m in modules)}
    while True:
        more = {name for name, modules in loads.items() if modules & found} - found
        if not more:
            return found
        found |= more

# One interpreter loads torch (and triton) once, then forks a child per module that imports it with no hybridlm
# module loaded yet, and exits with 1 and the error if the import fails.
_EACH_ON_ITS_OWN = """
import os, sys, traceback
import torch
try:
    import triton
except ImportError:
    pass
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(name)
print("failed:", failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="forks a child per module")
def test_every_module_imports_on_its_own():
    """Each module imported first (where triton is missing, the modules that need it are left out)."""
    names = sorted(name for name in MODULES if HAS_TRITON or name not in needs_triton())
    result = subprocess.run([sys.executable, "-c", _EACH_ON_ITS_OWN, *names], capture_output=True, text=True,
                            timeout=600, check=False, cwd=OPS.parent.parent)
    assert result.returncode == 0, result.stdout[-500:] + result.stderr[-3000:]
