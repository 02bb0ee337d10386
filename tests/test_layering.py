"""The import rules of ARCHITECTURE §2, checked by parsing every module of monarch with `ast`.

Imports at any depth count (inside functions and `if TYPE_CHECKING:` too); relative imports are resolved, and
`import_module` of a literal name (a declared doorway) counts as an import. The folders are ordered (`LAYERS`):
a lower folder never imports a higher one, except the lazy imports of `LAZY_DOWNWARD`. Also: the worker entry
point loads neither the compiler nor torch, and every module is documented and short.
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
               "monarch.runtime.telemetry", "monarch.runtime.debug", "monarch.runtime.worker",
               "monarch.cluster")  # never the compiler nor the tensor session
WORKER_ENTRY = "monarch.runtime.worker"  # `python -m` of it is every rank's process
COMPILER_USERS = ("monarch.graph", "monarch.runtime.session", "monarch", "monarch.parallel")  # may import graph
USER_FACING = ("monarch.rdma", "monarch.cluster", "monarch.checkpoint", "monarch.parallel", "monarch.spmd",
               "monarch.dtensor", "monarch.job", "monarch.actor", "monarch.__main__", "monarch")
LAYERS = (("monarch.runtime.telemetry",), ("monarch.runtime.control",),
          ("monarch.runtime.engine", "monarch.runtime.actors", "monarch.runtime.debug"),
          ("monarch.runtime.session", WORKER_ENTRY), USER_FACING)  # low to high; a layer's folders are siblings
LAZY_DOWNWARD = {  # the only imports of a higher folder or a sibling (downward in the data flow), each lazy
    ("monarch.runtime.control.client", "monarch.runtime.session.api"):
        "tensor_api(): ProcMesh.activate/rank load the tensor API on first use, so workers load no torch before",
    ("monarch.runtime.control.controller", "monarch.runtime.debug.admin"):
        "the controller starts the admin socket only when MONARCH_ADMIN is set",
    ("monarch.runtime.actors.proc_mesh", "monarch.cluster.workspace"):
        "ProcMesh.sync_workspace (Monarch's name) loads workspace sync only when called",
    ("monarch.runtime.actors.proc_mesh", "monarch.spmd"):
        "ProcMesh.run_spmd loads the torchrun-style runner only when called",
}


@dataclass(frozen=True)
class Import:
    """One imported module, resolved to its absolute name, and where the import is."""
    module: str
    path: Path
    line: int
    lazy: bool = False  # inside a function: runs on the first call, not when the importing module loads

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


def doorway(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The module that `import_module(NAME)` loads, when NAME is a literal or a module-level string constant."""
    if not (isinstance(node, ast.Call) and node.args and ast.unparse(node.func).endswith("import_module")):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return constants.get(arg.id) if isinstance(arg, ast.Name) else None


def string_constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def imports_in(path: Path, source: str | None = None) -> list[Import]:
    """Every import in the module at `path` (or in `source`, read as if it were that module)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    module, is_package = module_name(path), path.name == "__init__.py"
    constants, found = string_constants(tree), []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend(Import(t, path, node.lineno, lazy) for t in targets(node, module, is_package))
        elif (target := doorway(node, constants)) is not None:
            found.append(Import(target, path, node.lineno, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def violations(importers: list[str], allowed: Callable[[str], bool]) -> str:
    """One line per import of `importers` that `allowed` rejects and `LAZY_DOWNWARD` does not declare."""
    return "\n".join(str(imp) for m in importers for imp in imports_in(MODULES[m])
                     if not allowed(imp.module) and not declared(m, imp))


def declared(importer: str, imp: Import) -> bool:
    return imp.lazy and any(importer == a and within(imp.module, b) for a, b in LAZY_DOWNWARD)


def modules_in(*packages: str) -> list[str]:
    return [m for m in MODULES if within(m, *packages)]


def test_resolves_relative_and_nested_imports() -> None:
    source = ("from . import codec\nfrom .commands import Hello\nfrom ... import errors\nAPI = 'monarch.spmd'\n"
              "def f():\n    import monarch.graph.trace\n    import_module(API)\n")
    found = imports_in(PACKAGE / "runtime" / "control" / "worker.py", source)
    assert [(i.module, i.lazy) for i in found] == [
        ("monarch.runtime.control.codec", False), ("monarch.runtime.control.commands", False),
        ("monarch.errors", False), ("monarch.graph.trace", True), ("monarch.spmd", True)]


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
    assert WORKER_ENTRY in worker_side
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


def folder_of(module: str) -> tuple[int, str] | None:
    """(layer, folder) of a module in LAYERS; `monarch` names the package's own __init__ only."""
    for layer, folders in enumerate(LAYERS):
        for folder in folders:
            if module == folder or folder != "monarch" and module.startswith(folder + "."):
                return layer, folder
    return None


def short(folder: str) -> str:
    return folder.removeprefix("monarch.").replace(".", "/") if folder != "monarch" else "monarch/__init__"


def test_a_lower_folder_never_imports_a_higher_one_nor_a_sibling() -> None:
    """telemetry < control < {engine, actors, debug} < {session, the worker entry} < the user-facing modules."""
    bad = []
    for m, path in MODULES.items():
        here = folder_of(m)
        for imp in imports_in(path) if here else ():
            there = folder_of(imp.module)
            if there is None or there[1] == here[1] or declared(m, imp):
                continue
            if there[0] > here[0] or there[0] == here[0] < len(LAYERS) - 1:
                what = "a higher folder" if there[0] > here[0] else "a sibling folder"
                bad.append(f"{path.relative_to(ROOT)}:{imp.line}: {short(here[1])} imports {short(there[1])} "
                           f"({imp.module}), {what}")
    assert not bad, "imports against the folder order (ARCHITECTURE §2):\n" + "\n".join(bad)


def test_the_declared_exceptions_exist_and_are_lazy() -> None:
    """An exception that no longer matches an import goes; one that runs when its module loads is no exception."""
    for (importer, imported), reason in LAZY_DOWNWARD.items():
        found = [i for i in imports_in(MODULES[importer]) if within(i.module, imported)] if importer in MODULES else []
        assert found, f"{importer} no longer imports {imported}: drop it from LAZY_DOWNWARD ({reason})"
        eager = [str(i) for i in found if not i.lazy]
        assert not eager, f"not lazy, so not an exception ({reason}):\n" + "\n".join(eager)


def test_no_import_cycles() -> None:
    import networkx as nx
    graph = nx.DiGraph()
    for m, path in MODULES.items():
        for imp in imports_in(path):
            if imp.module in MODULES and imp.module != m and not declared(m, imp):
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
    code = (f"import {WORKER_ENTRY}, monarch.runtime.control.bootstrap, sys\n"
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
