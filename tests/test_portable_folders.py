"""Portable folders (issue 53): nothing a stage writes names an absolute path, so a folder copied or moved together
with what it names still works: its card's lineage, an index's model folders, a compression run's --resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from deploy_models import make_task_model

from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.distill import run as distill
from encoderkit.compress.stack import CompressConfig
from encoderkit.compress.stack import run as compress
from encoderkit.data.prepare import PrepareConfig
from encoderkit.data.prepare import run as prepare
from encoderkit.inference.export import ExportConfig
from encoderkit.inference.export import run as export
from encoderkit.inference.predictor import Predictor
from encoderkit.io import portable, portable_path, recorded_path
from encoderkit.models.card import lineage
from encoderkit.retrieval.index import IndexConfig
from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.search import Searcher, SearchSettings
from tests.conftest import WORDS

RECIPE = ("task: rerank\nsteps:\n  - {lever: prune, method: ffn, amount: 0.5, importance: magnitude}\n"
          "  - {lever: quantize, method: dynamic-int8}\n")


class Measured:
    """A measure stand-in (the recipe's mechanics, not its figures) that records which folders it measured."""

    def __init__(self) -> None:
        self.folders: list[str] = []

    def __call__(self, folder: Path) -> dict:
        self.folders.append(Path(folder).name)
        return {"quality": 1.0, "params": 1, "bytes": 1, "latency_b1_ms": 1.0, "latency_b32_ms": 1.0}


def _texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 9)) for i in range(n)]


@pytest.fixture(scope="module")
def moved(tmp_path_factory, tiny_tokenizer_dir):
    """Every kind of folder, built with absolute paths in ``a/``, then ``a/`` moved to ``b/``: (a, b, results)."""
    import os

    base = tmp_path_factory.mktemp("portable")
    old_cache = os.environ.get("ENCODERKIT_CACHE")
    os.environ["ENCODERKIT_CACHE"] = str(base / "cache")  # the export cache outside the moved tree
    try:
        a = base / "a"
        a.mkdir()
        teacher = make_task_model(a, tiny_tokenizer_dir, "embed")
        reranker = make_task_model(a, tiny_tokenizer_dir, "rerank")
        (a / "corpus.txt").write_text("\n\n".join(_texts(40)) + "\n", encoding="utf-8")
        (a / "c.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                           for i, t in enumerate(_texts(40))))
        (a / "r.yaml").write_text(RECIPE)
        lists = a / "lists.jsonl"
        lists.write_text("".join(json.dumps({"query": t, "positive": t, "negatives": _texts(3)}) + "\n"
                                 for t in _texts(8)))
        distill(DistillConfig(teacher=str(teacher), out=str(a / "static"), to="static", train=str(a / "corpus.txt"),
                              dims=16, epochs=2, batch_size=8))
        export(ExportConfig(model=str(reranker), out=str(a / "exported")))
        index(IndexConfig(model=str(teacher), corpus=[str(a / "c.jsonl")], out=str(a / "idx"), backend="torch-fp32",
                          first_stage_model=str(a / "static")))
        index(IndexConfig(model=str(teacher), corpus=[str(a / "c.jsonl")], out=str(a / "dense"),
                          backend="torch-fp32"))
        prepare(PrepareConfig(corpus=[str(a / "corpus.txt")], tokenizer=str(teacher), out=str(a / "prep"),
                              seq_len=16, heldout=0.2, doc_split="blank_line"))
        cfg = {"recipe": str(a / "r.yaml"), "model": str(reranker), "dev": str(lists), "out": str(a / "comp"),
               "train": str(lists)}
        compress(CompressConfig(**cfg), measure=Measured())
        b = base / "b"
        shutil.move(a, b)
        yield a, b, cfg
    finally:
        if old_cache is None:
            os.environ.pop("ENCODERKIT_CACHE", None)
        else:
            os.environ["ENCODERKIT_CACHE"] = old_cache


def test_no_written_file_names_an_absolute_path(moved):
    a, b, _ = moved
    written = [p for p in b.rglob("*") if p.suffix in (".json", ".yaml", ".yml") and p.is_file()]
    assert any(p.name == "manifest.json" for p in written) and any(p.name == "meta.json" for p in written)
    assert len([p for p in written if p.name == "encoderkit.json"]) >= 6
    leaks = [str(p.relative_to(b)) for p in written if str(a.parent) in p.read_text(encoding="utf-8")]
    assert not leaks, f"absolute paths in {leaks}"


def test_lineage_follows_relative_parents_in_the_moved_tree(moved):
    _, b, _ = moved
    static = lineage(b / "static")
    assert [Path(c["folder"]).resolve() for c in static] == [(b / "static").resolve(), (b / "tiny_embed").resolve()]
    steps = lineage(b / "comp" / "02-quantize")
    assert [Path(c["folder"]).resolve().name for c in steps] == ["02-quantize", "01-prune", "tiny_rerank"]
    assert json.loads((b / "comp" / "02-quantize" / "encoderkit.json").read_text())["parent"] == "../01-prune"
    assert json.loads((b / "exported" / "encoderkit.json").read_text())["parent"] == "../tiny_rerank"


def test_a_moved_index_finds_its_models_and_searches(moved):
    _, b, _ = moved
    query = _texts(40)[5]
    for name in ("dense", "idx"):  # idx: the tiered index, whose first-stage (static) folder is recorded too
        s = Searcher.open(b / name)
        assert s.predictor.folder.resolve() == (b / "tiny_embed").resolve()
        hits = s.search([query], SearchSettings(k=3))[0].hits
        assert hits[0].doc_id == "d5", name
    assert Searcher.open(b / "idx").tier is not None
    np.testing.assert_allclose(Predictor.load(b / "exported").score_pairs(["a"], ["b"]),
                               Predictor.load(b / "tiny_rerank", backend="onnx-fp32").score_pairs(["a"], ["b"]),
                               atol=1e-4)


def test_a_moved_compression_resumes_without_running_its_steps_again(moved, monkeypatch):
    a, b, cfg = moved
    monkeypatch.setattr("encoderkit.compress.prune.prune", lambda *a, **kw: pytest.fail("a finished step ran again"))
    again = Measured()
    moved_cfg = {k: v.replace(str(a), str(b)) for k, v in cfg.items()}
    res = compress(CompressConfig(**moved_cfg, resume=True), measure=again)
    assert again.folders == []  # the same settings, seen from the moved --out: every step and row is kept
    assert [r["folder"] for r in res.rows] == ["../tiny_rerank", "01-prune", "02-quantize"]
    report = json.loads((b / "comp" / "report.json").read_text())
    assert report["meta"]["model"] == "../tiny_rerank" and str(a.parent) not in json.dumps(report)


def test_paths_are_recorded_relative_and_read_back(tmp_path):
    folder, parent = tmp_path / "x" / "child", tmp_path / "x" / "teacher"
    parent.mkdir(parents=True)
    assert portable_path(parent, folder) == "../teacher"
    assert recorded_path("../teacher", folder) == folder / "../teacher"
    assert recorded_path(str(parent), folder) == parent  # an old card's absolute parent still reads
    assert portable_path("hf:org/name", folder) == "hf:org/name"
    got = portable({"model": str(parent), "task": "embed", "corpus": [str(parent / "c.txt"), "rel.txt"],
                    "route": "/v9/not/a/folder"}, folder)
    assert got == {"model": "../teacher", "task": "embed", "corpus": ["../teacher/c.txt", "rel.txt"],
                   "route": "/v9/not/a/folder"}
