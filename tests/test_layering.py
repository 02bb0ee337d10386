"""The import rules of ARCHITECTURE §2, checked by parsing every module of monarch with `ast`.

Imports at any depth count (inside functions and `if TYPE_CHECKING:` too); relative imports are resolved.
Also: the worker entry point loads neither the compiler nor torch, and every module is documented and short.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "monarch"
MAX_LINES = 450  # no module longer (ARCHITECTURE §6)
MAX_MODULES = 12  # no folder holds more modules directly
MAX_SHARE = 0.30  # no folder holds more of the package's lines directly
BASE = ("monarch.errors", "monarch.config")  # what every layer may import
CORE = ("monarch.tensor", "monarch.program", "monarch.shape")  # torch, the standard library, BASE, each other
WORKER_SIDE = ("monarch.runtime.control", "monarch.runtime.actors", "monarch.runtime.engine",
               "monarch.runtime.telemetry", "monarch.cluster")  # never the compiler nor the tensor session
COMPILER_USERS = ("monarch.graph", "monarch.runtime.session", "monarch", "monarch.parallel")  # may import graph
LAZY_DOWNWARD = {("monarch.runtime.control.worker", "monarch.runtime.engine.service"),
                 ("monarch.__main__", "monarch.runtime.telemetry.top")}  # lazy imports that point down a layer

@dataclass(frozen=True)
class Import:
    """One imported module, resolved to its absolute name, and where the import is."""
    module: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: imports {self.module}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def base_of(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads from."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """Modules an import statement loads; `from pkg import mod` counts as `pkg.mod` when that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = base_of(node, importer, is_package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports_in(path: Path, source: str | None = None) -> list[Import]:
    """Every import in the module at `path` (or in `source`, read as if it were that module)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    module, is_package = module_name(path), path.name == "__init__.py"
    nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return [Import(target, path, node.lineno) for node in nodes for target in targets(node, module, is_package)]


def violations(importers: list[str], allowed: Callable[[str], bool]) -> str:
    """One line per import of `importers` that `allowed` rejects: file, line and imported module."""
    return "\n".join(str(imp) for m in importers for imp in imports_in(MODULES[m]) if not allowed(imp.module))


def modules_in(*packages: str) -> list[str]:
    return [m for m in MODULES if within(m, *packages)]


def test_resolves_relative_and_nested_imports() -> None:
    source = ("from . import codec\nfrom .commands import Hello\nfrom ... import errors\n"
              "def f():\n    import monarch.graph.trace\n")
    assert [i.module for i in imports_in(PACKAGE / "runtime" / "control" / "worker.py", source)] == [
        "monarch.runtime.control.codec", "monarch.runtime.control.commands", "monarch.errors", "monarch.graph.trace"]


def stdlib_or_torch(module: str) -> bool:
    top = module.split(".")[0]
    return top == "torch" or top in sys.stdlib_module_names


def test_core_imports_only_torch_stdlib_errors_config_and_each_other() -> None:
    bad = violations(modules_in(*CORE), lambda m: stdlib_or_torch(m) or within(m, *BASE, *CORE))
    assert not bad, bad


def test_graph_imports_core_fx_and_networkx_never_runtime() -> None:
    def allowed(m: str) -> bool:
        return stdlib_or_torch(m) or m.split(".")[0] == "networkx" or within(m, *BASE, *CORE, "monarch.graph")

    bad = violations(modules_in("monarch.graph"), allowed)
    assert not bad, bad


def test_worker_side_never_imports_graph_or_session() -> None:
    worker_side = modules_in(*WORKER_SIDE)
    assert "monarch.runtime.control.worker" in worker_side
    bad = violations(worker_side, lambda m: not within(m, "monarch.graph", "monarch.runtime.session"))
    assert not bad, bad


def test_only_the_session_and_the_user_facing_modules_import_graph() -> None:
    others = [m for m in MODULES if not any(m == p or within(m, p) and p != "monarch" for p in COMPILER_USERS)]
    bad = violations(others, lambda m: not within(m, "monarch.graph"))
    assert not bad, bad


def test_checkpoint_reaches_the_mesh_through_the_session_never_the_compiler() -> None:
    """monarch.checkpoint plans on the controller (torch, the tensor API, the session); the workers' side
    of it is monarch.runtime.engine.checkpoint, whose job types it builds."""
    def allowed(m: str) -> bool:
        return stdlib_or_torch(m) or within(m, *BASE, *CORE, "monarch.checkpoint", "monarch.runtime.session",
                                            "monarch.runtime.engine.checkpoint")

    bad = violations(modules_in("monarch.checkpoint"), allowed)
    assert not bad, bad


def test_no_import_cycles() -> None:
    import networkx as nx
    graph = nx.DiGraph()
    for m, path in MODULES.items():
        for imp in imports_in(path):
            if imp.module in MODULES and imp.module != m and (m, imp.module) not in LAZY_DOWNWARD:
                graph.add_edge(m, imp.module)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_no_folder_is_too_big() -> None:
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    total = sum(lines.values())
    folders: dict[Path, list[str]] = {}
    for m, p in MODULES.items():
        if p.name != "__init__.py":
            folders.setdefault(p.parent, []).append(m)
    for folder, mods in folders.items():
        where = folder.relative_to(ROOT)
        assert len(mods) <= MAX_MODULES, f"{where}: {len(mods)} modules, more than {MAX_MODULES}"
        share = sum(lines[m] for m in mods) / total
        assert share <= MAX_SHARE, f"{where}: {share:.0%} of the package's lines, more than {MAX_SHARE:.0%}"


def test_worker_start_up_loads_neither_compiler_nor_torch() -> None:
    code = ("import monarch.runtime.control.worker, monarch.runtime.control.bootstrap, sys\n"
            "bad = sorted(m for m in sys.modules if m.startswith('monarch.graph') or m == 'torch')\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_has_docstring_and_is_short(module: str) -> None:
    path = MODULES[module]
    text = path.read_text()
    assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)}:1: no module docstring"
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines, more than {MAX_LINES}"
