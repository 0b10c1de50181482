"""What the quality-against-peers benches share (bench/quality_*.py, bench/few_label.py,
bench/multilabel_questions.py, gathered by bench/quality_peers.py): the peers' own venv, one peer job in its own
process, and a result row (a task on one data set: encoderkit's metric and the peer's per seed, both wall times).

Each task bench takes ``--summary FILE`` and writes its rows there as JSON (``write_rows``); quality_peers.py runs
the benches, reads the rows and prints one table and one RESULT line. A row's verdict: encoderkit's mean is at
least the peer's, or below it by no more than the seeds' spread (the larger of the two sides' max-min), and its
mean wall time is at most the peer's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed_peers import venv_python  # the peer-venv maker, shared

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
# The trainers users would reach for instead, in one venv of their own (never encoderkit's pins): torch first,
# pinned to the CPU wheel as the Makefile does, then the libraries unpinned, as a user would install them.
TRAINERS_INSTALL = [["torch==2.13.0"],
                    ["transformers", "accelerate", "datasets", "seqeval", "evaluate", "sentence-transformers[train]"]]


def trainers_python(venvs: str | Path = "/work/venvs", make: bool = True) -> Path | None:
    """The python of the peers' venv (``<venvs>/trainers``), made when missing."""
    return venv_python(Path(venvs), "trainers", make, TRAINERS_INSTALL)


def run_peer(python: Path, worker: Path, job: dict[str, Any], timeout: float = 7200) -> dict[str, Any]:
    """One peer job in its own process under the peer's python: the job as JSON on stdin, the worker's last
    stdout line as JSON back (its other output goes to stderr, shown when it fails)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true")
    env.pop("PYTHONPATH", None)  # the peer never sees encoderkit
    proc = subprocess.run([str(python), str(worker)], input=json.dumps(job), capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{worker.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def spread(values: list[float]) -> float:
    return float(max(values) - min(values)) if len(values) > 1 else 0.0


def show(values: list[float], digits: int = 4) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


@dataclass
class Row:
    """One task on one data set. ``ours``/``peer``: the metric per seed; ``ours_s``/``peer_s``: training wall time
    per seed (each side's whole training call; what is counted is said in the bench's docstring)."""

    task: str
    data: str
    metric: str
    peer_name: str
    seeds: list[int] = field(default_factory=list)
    ours: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)
    ours_s: list[float] = field(default_factory=list)
    peer_s: list[float] = field(default_factory=list)
    note: str = ""
    name: str = ""  # the data set's short name in RESULT keys (default: from ``data``)

    @property
    def key(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", f"{self.task}_{self.name or self.data}".lower()).strip("_")

    def verdict(self) -> str:
        """'ok', 'below' (metric beyond the spread), 'slower' (metric ok, more wall time) or '-' (a side missing)."""
        if not self.ours or not self.peer:
            return "-"
        tolerance = max(spread(self.ours), spread(self.peer))
        if np.mean(self.ours) < np.mean(self.peer) - tolerance - 1e-9:
            return "below"
        if self.ours_s and self.peer_s and np.mean(self.ours_s) > np.mean(self.peer_s):
            return "slower"
        return "ok"

    def table_line(self) -> str:
        secs = lambda v: f"{np.mean(v):.0f}" if v else "-"
        return (f"| {self.task} | {self.data} | {self.metric} | {len(self.seeds)} | {show(self.ours)} | "
                f"{self.peer_name} | {show(self.peer)} | {secs(self.ours_s)} | {secs(self.peer_s)} | "
                f"{self.verdict()} |")

    def fields(self) -> list[str]:
        out = []
        if self.ours:
            out.append(f"{self.key}_ours={np.mean(self.ours):.4f}")
        if self.peer:
            out.append(f"{self.key}_peer={np.mean(self.peer):.4f}")
        if self.ours_s and self.peer_s:
            out.append(f"{self.key}_time_ratio={np.mean(self.ours_s) / max(np.mean(self.peer_s), 1e-9):.2f}")
        out.append(f"{self.key}_verdict={self.verdict()}")
        return out


TABLE_HEAD = ("| task | data | metric | seeds | encoderkit | peer | peer's | encoderkit s | peer s | verdict |\n"
              "|---|---|---|---|---|---|---|---|---|---|")


def write_rows(path: str | Path | None, rows: list[Row]) -> None:
    if path:
        Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8")


def read_rows(path: str | Path) -> list[Row]:
    return [Row(**r) for r in json.loads(Path(path).read_text(encoding="utf-8"))]


def print_rows(rows: list[Row]) -> None:
    print(TABLE_HEAD)
    for r in rows:
        print(r.table_line())


def finish(rows: list[Row], summary: str | Path | None, fields: str, hardware: str) -> None:
    """A task bench's end: the table, the rows to ``summary``, and the RESULT line: ``fields``, each row's, then
    ``hardware`` (the bench's ``result_field()``)."""
    print_rows(rows)
    write_rows(summary, rows)
    print(f"RESULT {fields} {' '.join(f for r in rows for f in r.fields())} {hardware}")
