"""Where retrieval sits: the index application above deploy; what tasks train and score with lives below
them (BEIR reading in data/, IR metrics in evaluate/, exact search and mining in the embed task); the
runtime never imports retrieval (checked on the source)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "encoderkit"
LEAVES = {"data/beir.py", "evaluate/ranking.py"}  # nothing of encoderkit but its errors
MOVED = ("beir", "metrics", "exact", "mining")  # retrieval/ no longer holds these


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("encoderkit")}


def test_retrieval_layers():
    for path in sorted((PKG / "deploy").glob("*.py")):  # every deploy module but the service, which serves /v1/search
        if path.name != "serve.py":
            assert not {m for m in _imports(path) if m.startswith("encoderkit.retrieval")}, path.name
    for path in (PKG / "tasks").rglob("*.py"):  # tasks never reach up into the index application
        assert not {m for m in _imports(path) if m.startswith("encoderkit.retrieval")}, path
    for name in LEAVES:
        assert _imports(PKG / name) <= {"encoderkit.errors"}, name
    for name in ("tasks/embed/exact.py", "tasks/embed/mining.py"):  # below deploy
        assert not {m for m in _imports(PKG / name) if m.startswith("encoderkit.deploy")}, name
    assert not any((PKG / "retrieval" / f"{name}.py").exists() for name in MOVED)  # one home each
    assert not (PKG / "tasks" / "beir.py").exists()
