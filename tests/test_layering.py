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
MAX_LINES = 600
WORKER_SIDE = ("monarch.runtime.commands", "monarch.runtime.codec", "monarch.runtime.worker",
               "monarch.runtime.bootstrap", "monarch.runtime.hosting", "monarch.runtime.shape",
               "monarch.runtime.transport", "monarch.runtime.engine", "monarch.runtime.tensor_service",
               "monarch.runtime.kernels", "monarch.runtime.collectives", "monarch.runtime.telemetry")
TENSOR_MAY_IMPORT = ("monarch.errors", "monarch.config", "monarch.tensor")


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
    source = ("from . import codec\nfrom .shape import Shape\nfrom .. import errors\n"
              "def f():\n    import monarch.graph.trace\n")
    assert [i.module for i in imports_in(PACKAGE / "runtime" / "worker.py", source)] == [
        "monarch.runtime.codec", "monarch.runtime.shape", "monarch.errors", "monarch.graph.trace"]


def test_tensor_imports_only_torch_stdlib_errors_config() -> None:
    def allowed(module: str) -> bool:
        top = module.split(".")[0]
        return top == "torch" or top in sys.stdlib_module_names or within(module, *TENSOR_MAY_IMPORT)

    bad = violations(modules_in("monarch.tensor"), allowed)
    assert not bad, bad


def test_graph_never_imports_runtime() -> None:
    bad = violations(modules_in("monarch.graph"), lambda m: not within(m, "monarch.runtime"))
    assert not bad, bad


def test_worker_side_never_imports_graph() -> None:
    worker_side = modules_in(*WORKER_SIDE)
    assert "monarch.runtime.worker" in worker_side
    bad = violations(worker_side, lambda m: not within(m, "monarch.graph"))
    assert not bad, bad


def test_worker_start_up_loads_neither_compiler_nor_torch() -> None:
    code = ("import monarch.runtime.worker, monarch.runtime.bootstrap, sys\n"
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
