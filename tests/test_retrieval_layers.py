"""Where retrieval sits: tasks may use its low modules; the runtime never imports it (checked on the source)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "encoderkit"
LOW = {"beir", "metrics", "exact", "mining"}


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
    for path in (PKG / "tasks").glob("*.py"):
        used = {m.split(".")[2] for m in _imports(path) if m.startswith("encoderkit.retrieval.")}
        assert used <= LOW, (path.name, used)
    for name in ("beir", "metrics"):  # leaves: nothing of encoderkit but its errors
        assert _imports(PKG / "retrieval" / f"{name}.py") <= {"encoderkit.errors"}, name
    for name in LOW:  # the low modules never reach up into deploy
        assert not {m for m in _imports(PKG / "retrieval" / f"{name}.py") if m.startswith("encoderkit.deploy")}, name
    assert not (PKG / "tasks" / "beir.py").exists()  # one home
