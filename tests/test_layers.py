"""Layer contracts of the package, checked on its real import graph.

Every ``import`` inside ``encoderkit/`` counts: module level, inside functions (which hide cycles
from Python but not from this check), and module paths given as strings to ``importlib``
(``"encoderkit.train.pretrain"``, the CLI's ``"module:Config:run"``). Every folder is one floor, lowest
first; a module may import its own floor or lower ones, never a higher one; nothing imports the CLI; no
import cycles between modules. No module has a floor of its own: a folder's modules share its floor.

    base (the top-level modules: errors, config, io, progress, seeding, hardware, ray_jobs)
    < models, metrics, web
    < data
    < tasks
    < train, inference, evaluate
    < compress, retrieval, label, adapt
    < deploy (it serves /v1/search, so it sits above retrieval)
    < quickstart, doctor, cli
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "encoderkit"
LAYERS: list[tuple[str, ...]] = [
    ("encoderkit", "encoderkit.errors", "encoderkit.config", "encoderkit.io", "encoderkit.progress",
     "encoderkit.seeding", "encoderkit.hardware", "encoderkit.ray_jobs"),
    ("encoderkit.models", "encoderkit.metrics", "encoderkit.web"),
    ("encoderkit.data",),
    ("encoderkit.tasks",),
    ("encoderkit.train", "encoderkit.inference", "encoderkit.evaluate"),
    ("encoderkit.compress", "encoderkit.retrieval", "encoderkit.label", "encoderkit.adapt"),
    ("encoderkit.deploy",),
    ("encoderkit.quickstart", "encoderkit.doctor", "encoderkit.cli"),
]
NEVER_IMPORTED = ("encoderkit.cli",)
_MODULE_STRING = re.compile(r"^(encoderkit(?:\.\w+)+)(?::\w+)*$")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    nested: bool  # inside a function or class body, not at module level


def module_names(root: Path) -> dict[str, Path]:
    """``encoderkit.x.y`` -> file, for every module of the package under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_edges(root: Path) -> list[Edge]:
    """Every import of a package module by another (see the module docstring)."""
    modules = module_names(root)
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        nested_nodes = {id(n) for f in ast.walk(tree)
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                        for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = _MODULE_STRING.match(node.value)
                targets = [m.group(1)] if m else []
            for target in targets:
                if target in modules and target != name:
                    edges.append(Edge(name, target, getattr(node, "lineno", 0), id(node) in nested_nodes))
    return sorted(set(edges), key=lambda e: (e.importer, e.imported, e.line))


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    """The layer of ``module``: that of the longest listed prefix it falls under."""
    best, level = "", -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, level = p, i
    if level < 0:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS in tests/test_layers.py")
    return level


def violations(edges: list[Edge], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Imports of a higher layer, and of a module nothing may import."""
    out = []
    for e in edges:
        if e.imported in NEVER_IMPORTED:
            out.append(f"{e.importer}:{e.line} imports {e.imported}, which nothing may import")
        elif layer_of(e.imported, layers) > layer_of(e.importer, layers):
            out.append(f"{e.importer}:{e.line} (layer {layer_of(e.importer, layers)}) imports {e.imported} "
                       f"(layer {layer_of(e.imported, layers)}){' inside a function' if e.nested else ''}")
    return out


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (Tarjan's SCCs of size > 1)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _package_only(edges: list[Edge]) -> list[Edge]:
    """Leave out a package's ``__init__`` importing its own sub-modules (its public face, not a layer step)."""
    return [e for e in edges if not e.imported.startswith(e.importer + ".")]


def test_no_module_imports_a_higher_layer_or_the_cli():
    assert violations(_package_only(import_edges(PACKAGE))) == []


def test_no_import_cycles():
    assert cycles(import_edges(PACKAGE)) == []


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "encoderkit"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_checker_catches_a_lower_layer_importing_a_higher_one(tmp_path):
    pkg = _fake_package(tmp_path, {
        "models/__init__.py": "",
        "models/folder.py": "def f():\n    from encoderkit.tasks.classify.features import x\n",  # hidden in a function
        "tasks/__init__.py": "",
        "tasks/classify/__init__.py": "",
        "tasks/classify/features.py": "from ...models import folder\nMODULES = {'a': 'encoderkit.cli:Config:run'}\n",
        "cli.py": "",
    })
    edges = import_edges(pkg)
    assert Edge("encoderkit.models.folder", "encoderkit.tasks.classify.features", 2, True) in edges
    found = violations(edges)
    assert any(v.startswith("encoderkit.models.folder:2 (layer 1) imports encoderkit.tasks.classify.features (layer 3) "
                            "inside a function")
               for v in found)
    assert any("imports encoderkit.cli, which nothing may import" in v for v in found)  # a string for importlib counts
    assert cycles(edges) == [["encoderkit.models.folder", "encoderkit.tasks.classify.features"]]


def test_the_checker_catches_a_cycle_hidden_in_functions(tmp_path):
    pkg = _fake_package(tmp_path, {
        "compress/__init__.py": "",
        "compress/plan.py": "def f():\n    from encoderkit.compress import stack\n",
        "compress/stack.py": "def g():\n    from encoderkit.compress.plan import f\n",
    })
    edges = import_edges(pkg)
    assert violations(edges) == []  # one layer ...
    assert cycles(edges) == [["encoderkit.compress.plan", "encoderkit.compress.stack"]]  # ... but a cycle


def test_every_module_has_a_layer():
    for name in module_names(PACKAGE):
        layer_of(name)


def test_every_listed_prefix_is_a_top_level_folder_or_module():
    """One floor per folder: LAYERS names top-level folders and modules only, never a module inside a folder."""
    for prefixes in LAYERS:
        for p in prefixes:
            assert p.count(".") <= 1, f"{p} gives a module inside a folder a floor of its own"
            assert (p == "encoderkit" or (PACKAGE / p.split(".")[1]).is_dir()
                    or (PACKAGE / f"{p.split('.')[1]}.py").is_file())


@pytest.mark.parametrize("module,layer", [("encoderkit.deploy.serve", 6), ("encoderkit.metrics.scores", 1),
                                          ("encoderkit.evaluate.run", 4), ("encoderkit.models.heads", 1)])
def test_a_module_takes_its_folders_floor(module, layer):
    assert layer_of(module) == layer
