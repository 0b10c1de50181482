"""`plan` with absolute constraints (--max-ms, --max-mb, --min-quality, --labels, --train-minutes), the seeds' rules,
and `plan --run` delivering a folder that meets them or naming the constraint that cannot hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.compress.measure import StepMeasurer
from encoderkit.compress.plan import Limits, PlanConfig, make_plan, search_recipe
from encoderkit.compress.plan import run as plan_run
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS, tiny_bert_config


def _plan(**kw):
    return make_plan(PlanConfig(**kw))


def _quant(plan):
    return plan.quantization()


# -- the seeds' rules -------------------------------------------------------------------------------
def test_no_training_budget_on_a_cpu_is_post_training_quantization() -> None:
    for kw in ({"goal": "latency"}, {"max_mb": 5}, {"max_ms": 3}, {"max_mb": 5, "labels": "no"}):
        plan = _plan(budget="none", hardware="cpu", teacher=True, **kw)
        assert plan.levers() and not {"distill", "qat", "prune"} & set(plan.levers()), kw
        assert _quant(plan).lever in ("quantize", "gptq")


def test_int4_is_qat_with_a_budget_and_labels_else_gptq() -> None:
    qat = _plan(max_mb=5, train_minutes=30, labels="yes", hardware="cpu")
    step = _quant(qat)
    assert (step.lever, step.params["bits"]) == ("qat", 4) and "budget and labels" in step.reason
    no_labels = _quant(_plan(max_mb=5, train_minutes=30, labels="no", hardware="cpu"))
    assert (no_labels.lever, no_labels.params["bits"]) == ("gptq", 4) and "no labels" in no_labels.reason
    no_budget = _quant(_plan(max_mb=5, labels="yes", hardware="cpu"))
    assert (no_budget.lever, no_budget.params["bits"]) == ("gptq", 4) and "no training budget" in no_budget.reason


def test_two_four_only_where_sparse_tensor_cores_exist() -> None:
    for hardware in ("cpu", "cpu-vnni"):
        plan = _plan(budget="some", teacher=True, hardware=hardware, max_ms=5)
        assert all(s.params.get("method") != "2:4" for s in plan.steps), hardware
    sparse = _plan(budget="some", teacher=True, hardware="gpu-sparse", max_ms=5)
    assert any(s.params.get("method") == "2:4" for s in sparse.steps)


def test_max_mb_alone_plans_for_memory_and_max_ms_for_latency() -> None:
    assert "vocab" in _plan(budget="none", hardware="cpu", max_mb=5).levers()
    assert "vocab" not in _plan(budget="none", hardware="cpu", max_ms=5, goal="memory").levers()


@pytest.mark.parametrize(("kw", "msg"), [({"min_quality": 1.5}, "--min-quality"), ({"max_mb": -1}, "--max-mb"),
                                         ({"train_minutes": -2}, "--train-minutes")])
def test_bad_limits_are_refused(kw, msg) -> None:
    with pytest.raises(EncoderkitError, match=msg):
        PlanConfig(**kw)


def test_search_backs_off_until_every_limit_holds_and_keeps_a_step_that_meets_them() -> None:
    recipe = {"steps": [{"lever": "vocab"}, {"lever": "gptq", "bits": 4, "embeddings": "int8"}]}

    def evaluate(r, tag):  # 4-bit is small and lossy; vocab alone is 3 MB at full quality
        rows = [{"quality": 1.0, "bytes": 10e6}]
        for s in r["steps"]:
            rows.append({"quality": 0.8 if s.get("bits") == 4 else 1.0, "folder": f"{tag}/{s['lever']}",
                         "bytes": 1e6 if s.get("bits") == 4 else 2e6 if s["lever"] == "gptq" else 3e6})
        return rows

    res = search_recipe(recipe, evaluate, 0.95, limits=Limits(0.95, max_mb=2.5))
    assert res.ok and res.row["bytes"] == 2e6 and res.recipe["steps"][-1]["bits"] == 8
    # 2.9 MB cannot be met at full quality if 8-bit is not tried: the vocab-only step (3 MB) is the closest
    res = search_recipe(recipe, evaluate, 0.95, max_backoff=0, limits=Limits(0.95, max_mb=2.9))
    assert not res.ok and res.row["folder"] == "try0/vocab" and res.missed == ["--max-mb: 3.000 MB > 2.9 MB"]
    # a budget that only the vocabulary step meets: the later lever dropped
    res = search_recipe(recipe, evaluate, 0.95, max_backoff=0, limits=Limits(0.95, max_mb=3.5))
    assert res.ok and [s["lever"] for s in res.recipe["steps"]] == ["vocab"] and res.row["folder"] == "try0/vocab"


# -- plan --run on a tiny classifier ------------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_tokenizer_dir) -> tuple[Path, Path]:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("plan_clf")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(3)
    cfg = tiny_bert_config(len(tok), num_hidden_layers=2, num_labels=2, id2label={0: "neg", 1: "pos"},
                           label2id={"neg": 0, "pos": 1})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():  # decisions that depend on the input
        model.classifier.weight.mul_(50.0)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    g = torch.Generator().manual_seed(1)
    texts = [" ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,), generator=g)) for _ in range(48)]
    with torch.no_grad():
        pred = model.eval()(**tok(texts, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    dev = out / "dev.tsv"  # labelled with the model's own predictions: its accuracy is 1.0
    dev.write_text("sentence\tlabel\n"
                   + "".join(f"{t}\t{['neg', 'pos'][y]}\n" for t, y in zip(texts, pred)))
    return out / "model", dev


def test_plan_run_delivers_a_folder_within_max_mb_and_min_quality(classifier, tmp_path) -> None:
    model, dev = classifier
    start = StepMeasurer(str(dev), model=str(model), seq_len=32, repeats=1)(model)
    max_mb = round(0.5 * start["bytes"] / 1e6, 4)
    res = plan_run(PlanConfig(budget="none", hardware="cpu", max_mb=max_mb, min_quality=0.9, labels="no", run=True,
                              model=str(model), dev=str(dev), train=str(dev), out=str(tmp_path / "out"), seq_len=32))
    assert res.backoff.ok
    folder = tmp_path / "out" / res.backoff.row["folder"]  # named relative to --out
    assert folder.is_dir() and folder.parent.parent == tmp_path / "out"
    again = StepMeasurer(str(dev), model=str(model), seq_len=32, repeats=1)(folder)  # measured afresh
    assert again["bytes"] / 1e6 <= max_mb and again["quality"] >= 0.9 * start["quality"]
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert record["ok"] and record["delivered"]["folder"] == res.backoff.row["folder"] and record["max_mb"] == max_mb


def test_plan_run_names_the_constraint_that_cannot_hold(classifier, tmp_path) -> None:
    model, dev = classifier
    cfg = PlanConfig(budget="none", hardware="cpu", max_mb=0.0001, min_quality=0.9, labels="no", run=True,
                     model=str(model), dev=str(dev), train=str(dev), out=str(tmp_path / "out"), seq_len=32,
                     max_backoff=1)
    with pytest.raises(EncoderkitError, match=r"Cannot hold: .*--max-mb: [\d.]+ MB > 0.0001 MB.*closest plan") as e:
        plan_run(cfg)
    record = json.loads((tmp_path / "out" / "plan.json").read_text())  # the tries are kept
    assert not record["ok"] and record["closest"]["folder"] in str(e.value)
    assert any("--max-mb" in m for m in record["missed"])
