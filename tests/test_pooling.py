"""Pooling is owned by encoderkit.models.pooling: its names, its defaults per kind of head, and the one rule
for a folder's recorded pooling against --pooling. evaluate --pooling changes what an embed folder is scored
with, and is refused where the pooling is part of the trained model or where nothing is pooled."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.errors import EncoderkitError
from encoderkit.evaluate.run import EvaluateConfig
from encoderkit.evaluate.run import run as evaluate
from encoderkit.models.folder import ModelFolder
from encoderkit.models.heads import HEADS
from encoderkit.models.pooling import (
    CLASSIFIER,
    DEFAULTS,
    FLAG_CHOICES,
    POOLINGS,
    SENTENCE,
    STATIC,
    default_pooling,
    resolve_pooling,
    task_pooling,
)

PACKAGE = Path(__file__).resolve().parents[1] / "encoderkit"
OWNER = PACKAGE / "models" / "pooling.py"


def test_the_names_and_the_defaults_of_each_kind_of_head():
    assert POOLINGS == ("first", "mean") and set(FLAG_CHOICES) == {"auto", *POOLINGS}
    kinds = (CLASSIFIER, SENTENCE, STATIC)
    assert tuple(default_pooling(kind) for kind in kinds) == ("first", "mean", "mean")
    assert {head.pooling for head in HEADS.values()} - {None} <= set(DEFAULTS)


def test_the_one_rule_asked_beats_recorded_beats_the_default():
    for asked in (None, "", "auto"):
        assert resolve_pooling(None, asked, head_kind=SENTENCE) == "mean"
        assert resolve_pooling(None, asked, head_kind=CLASSIFIER) == "first"
        assert resolve_pooling("first", asked, head_kind=SENTENCE) == "first"
    assert resolve_pooling("first", "mean", head_kind=SENTENCE) == "mean"  # training a new head: asked, silently
    assert resolve_pooling("first", "mean", head_kind=CLASSIFIER) == "mean"
    assert resolve_pooling("first", "cls", head_kind=SENTENCE) == "first"  # the old word for it
    with pytest.raises(EncoderkitError, match="pooling 'max' is not supported"):
        resolve_pooling(None, "max", head_kind=SENTENCE)
    # scoring a saved model: an embedding is pooled as asked; a classifier's or a static table's pooling is fixed
    assert resolve_pooling("mean", "first", head_kind=SENTENCE, scoring=True) == "first"
    assert resolve_pooling("mean", "mean", head_kind=STATIC, scoring=True) == "mean"
    with pytest.raises(EncoderkitError, match="clf records first pooling.*cannot be scored with --pooling mean"):
        resolve_pooling("first", "mean", head_kind=CLASSIFIER, scoring=True, where="clf")
    with pytest.raises(EncoderkitError, match="static embedding is the mean"):
        resolve_pooling("mean", "first", head_kind=STATIC, scoring=True)


def _beir(tmp_path: Path) -> Path:
    """A BEIR folder: 12 documents, each the query of its own judged pair with words added."""
    words = ["movie", "film", "story", "python", "code", "data", "model", "love", "fun", "dull", "boring", "great"]
    docs = {f"d{i}": f"the {w} was {words[(i + 3) % 12]} and {words[(i + 5) % 12]} {w}" for i, w in enumerate(words)}
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                               for k, v in docs.items()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"a {w}"}) + "\n"
                                                for i, w in enumerate(words)))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                             + "".join(f"q{i}\td{i}\t1\n" for i in range(len(words))))
    return beir


def test_evaluate_pooling_changes_what_an_embed_folder_is_scored_with(tmp_path_factory, tiny_tokenizer_dir, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    assert ModelFolder.open(folder).pooling == "mean"
    data = f"{_beir(tmp_path)}#test"

    def metrics(pooling: str) -> dict:
        got = evaluate(EvaluateConfig(model=str(folder), data=data, max_length=16, pooling=pooling)).metrics
        return {k: v for k, v in got.items() if k not in ("queries", "documents")}

    first, mean = metrics("first"), metrics("mean")
    assert first != mean  # the first token's vectors rank the corpus otherwise than the mean's
    assert metrics("auto") == mean  # auto: the pooling the folder records


def test_evaluate_pooling_is_refused_for_a_classifier_and_a_task_that_pools_nothing(tmp_path_factory,
                                                                                    tiny_tokenizer_dir, tmp_path):
    root = tiny_root(tmp_path_factory)
    classify, ner = (make_task_model(root, tiny_tokenizer_dir, task) for task in ("classify", "ner"))
    missing = str(tmp_path / "no-such-data.tsv")  # refused before the data is read
    with pytest.raises(EncoderkitError, match=r"classify model .*tiny_classify records first pooling.*--pooling mean"):
        evaluate(EvaluateConfig(model=str(classify), data=missing, pooling="mean"))
    with pytest.raises(EncoderkitError, match="--pooling first: a ner model pools nothing"):
        evaluate(EvaluateConfig(model=str(ner), data=missing, pooling="first"))
    assert task_pooling(ModelFolder.open(classify), "classify", "first", scoring=True) == "first"  # its own: scored
    assert task_pooling(ModelFolder.open(classify), "embed") == "mean"  # a classifier's pooling is not an embedding's


def _pooling_decisions(tree: ast.AST) -> list[str]:
    """What only models/pooling.py may hold: a tuple/list/set of the pooling names, an ``or "mean"`` style
    fallback, a ``pooling`` parameter defaulting to a name literal, or ``--pooling`` choices written out."""
    names = set(POOLINGS)

    def literal(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and names <= {
                e.value for e in node.elts if isinstance(e, ast.Constant)}:
            found.append(f"line {node.lineno}: the pooling names listed")
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and literal(node.values[-1]):
            found.append(f"line {node.lineno}: an `or {node.values[-1].value!r}` fallback")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True) if d]
            found += [f"line {node.lineno}: {a.arg}={d.value!r} default" for a, d in pairs
                      if "pooling" in a.arg and literal(d)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and "pooling" in node.target.id \
                and node.value is not None and literal(node.value):
            found.append(f"line {node.lineno}: {node.target.id} = {node.value.value!r} default")
    return found


def test_pooling_names_and_defaults_are_defined_only_in_models_pooling():
    assert _pooling_decisions(ast.parse(OWNER.read_text())), "the checker finds the owner's own definitions"
    assert _pooling_decisions(ast.parse('def f(pooling: str = "mean"):\n    return x.pooling or "first"\n'))
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != OWNER and (found := _pooling_decisions(ast.parse(path.read_text(encoding="utf-8")))):
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"ask encoderkit.models.pooling instead: {offenders}"
