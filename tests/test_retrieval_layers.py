"""What retrieval leaves below it (BEIR reading in data/, IR metrics in metrics/, exact search and mining in
the embed task), each with one home; the floors themselves are tests/test_layers.py's."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "encoderkit"
LEAVES = {"data/beir.py": {"encoderkit.errors", "encoderkit.io", "encoderkit.data.files"},  # errors and the readers
          "metrics/ranking.py": {"encoderkit.errors"}}
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
    for name, allowed in LEAVES.items():
        assert _imports(PKG / name) <= allowed, name
    assert not any((PKG / "retrieval" / f"{name}.py").exists() for name in MOVED)  # one home each
    assert not (PKG / "tasks" / "beir.py").exists()
