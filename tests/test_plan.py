"""Planner: the recipe chosen for each situation, reasons for what is left out, backoff search."""

from __future__ import annotations

import pytest

from encoderkit.compress.plan import PlanConfig, backoff_variants, make_plan, run_recipe_for_plan, search_recipe
from encoderkit.compress.plan import run as plan_run
from encoderkit.compress.stack import QUANT_LEVERS, load_recipe, validate_recipe
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import CudaDevice, Hardware


def _plan(**kw):
    return make_plan(PlanConfig(**kw))


def _left_out(plan) -> dict[str, str]:
    return dict(plan.left_out)


def test_no_budget_on_cpu_is_post_training_quantization_only():
    plan = _plan(budget="none", teacher=True, hardware="cpu", goal="latency")
    assert plan.levers() == ["quantize"]
    assert plan.steps[0].params["method"] == "dynamic-int8"
    out = _left_out(plan)
    assert "no training budget" in out["distill"] and "no training budget" in out["qat"]
    assert "CPU" in out["prune 2:4"]
    assert "storage" in out["prune unstructured"] and "CPU time" in out["prune unstructured"]


def test_budget_teacher_sparse_gpu_is_distill_then_2_4_then_int8():
    plan = _plan(budget="some", teacher=True, hardware="gpu-sparse", goal="latency")
    assert plan.levers() == ["distill", "prune", "quantize"]
    assert plan.steps[1].params["method"] == "2:4" and plan.steps[1].params["recovery_steps"] > 0
    assert "2:4" in plan.steps[1].reason


def test_budget_teacher_cpu_latency_is_distill_structured_prune_int8():
    plan = _plan(budget="some", teacher=True, hardware="cpu-vnni", goal="latency")
    assert plan.levers() == ["distill", "prune", "quantize"]
    prune = plan.steps[1].params
    assert prune["method"] == "structured" and prune["ffn"] > 0 and 0 < prune["heads"] < 0.5
    assert "prune heads" not in _left_out(plan)
    assert "VNNI" in plan.steps[2].reason and plan.steps[2].params["per_channel"] is True
    assert "no sparse hardware" in _left_out(plan)["prune 2:4"]


def test_tight_quality_floor_prunes_ffn_neurons_only():
    plan = _plan(budget="some", teacher=True, hardware="cpu", goal="latency", max_quality_drop=0.005)
    prune = next(s for s in plan.steps if s.lever == "prune").params
    assert prune["ffn"] > 0 and "heads" not in prune
    assert "under 1 point" in _left_out(plan)["prune heads"]


def test_memory_goal_prunes_vocabulary_and_uses_low_bit_weights():
    plan = _plan(budget="none", hardware="cpu", goal="memory", has_calibration_data=True)
    assert plan.levers() == ["vocab", "gptq"]
    assert plan.steps[1].params["bits"] == 4 and plan.steps[1].params["embeddings"] == "int8"
    no_data = _plan(budget="none", hardware="cpu", goal="memory", has_calibration_data=False)
    assert no_data.levers() == ["quantize"] and no_data.steps[0].params["method"] == "rtn"
    assert "calibration" in _left_out(no_data)["gptq"]


def test_no_teacher_means_no_distillation_and_tight_floor_adds_qat():
    plan = _plan(budget="some", teacher=False, hardware="cpu", goal="latency", max_quality_drop=0.005)
    assert "distill" not in plan.levers() and "teacher" in _left_out(plan)["distill"]
    assert plan.levers()[-1] == "qat"
    assert "quantize" not in plan.levers() and "QAT already quantizes" in _left_out(plan)["quantize dynamic-int8"]


@pytest.mark.parametrize("budget", ["none", "some"])
@pytest.mark.parametrize("hardware", ["cpu", "cpu-vnni", "gpu-sparse"])
@pytest.mark.parametrize("goal", ["latency", "memory"])
def test_every_planned_recipe_is_a_valid_recipe(budget, hardware, goal):
    plan = _plan(budget=budget, teacher=True, hardware=hardware, goal=goal)
    assert plan.steps, "every situation gets at least one lever"
    steps = validate_recipe(plan.recipe(), source="planned")
    assert [s.lever for s in steps] == plan.levers()
    assert all(s.reason for s in plan.steps)
    for _, variant in backoff_variants(plan.recipe()):
        validate_recipe(variant, source="variant")


@pytest.mark.parametrize("budget", ["none", "some"])
@pytest.mark.parametrize("hardware", ["cpu", "cpu-vnni", "gpu-sparse"])
@pytest.mark.parametrize("goal", ["latency", "memory"])
@pytest.mark.parametrize("drop, calib", [(0.03, True), (0.005, True), (0.03, False), (0.005, False)])
def test_no_plan_quantizes_twice(budget, hardware, goal, drop, calib):
    plan = _plan(budget=budget, teacher=True, hardware=hardware, goal=goal, max_quality_drop=drop,
                 has_calibration_data=calib)
    quantizers = [lever for lever in plan.levers() if lever in QUANT_LEVERS]
    assert len(quantizers) <= 1, plan.levers()
    assert plan.quantization() is (next(s for s in plan.steps if s.lever in QUANT_LEVERS) if quantizers else None)
    validate_recipe(plan.recipe(), source="planned")  # the runner refuses a second quantization step


def test_sparse_gpu_memory_plan_takes_gptq_instead_of_int8_on_top():
    plan = _plan(budget="some", teacher=True, hardware="gpu-sparse", goal="memory", labels="no")  # INT4: GPTQ
    assert plan.levers() == ["distill", "prune", "vocab", "gptq"]
    why = _left_out(plan)["quantize dynamic-int8"]
    assert "already quantizes" in why and "alternatives" in why and "4-bit" in why
    latency = _plan(budget="some", teacher=True, hardware="gpu-sparse", goal="latency")
    assert latency.levers() == ["distill", "prune", "quantize"]
    assert "quantizes once" in latency.steps[-1].reason


def test_a_recipe_with_two_quantization_steps_is_refused_before_anything_runs():
    with pytest.raises(EncoderkitError, match=r"step 2 \(lever 'quantize'\): step 1 \(gptq\) already quantizes"):
        validate_recipe({"steps": [{"lever": "gptq", "bits": 4}, {"lever": "quantize", "method": "dynamic-int8"}]},
                        source="r.yaml")


AVX2 = "model name\t: AMD EPYC 7B12\nflags\t\t: sse4_2 fma avx avx2\n"
VNNI = "model name\t: Intel Xeon 8259CL\nflags\t\t: avx2 avx512f avx512_vnni\n"


@pytest.mark.parametrize("hw, kind, reason", [
    (Hardware.from_cpuinfo(AVX2), "cpu", "AVX2 only"),
    (Hardware.from_cpuinfo(VNNI), "cpu-vnni", "AVX512-VNNI"),
    (Hardware.from_cpuinfo(AVX2, cuda=(CudaDevice(0, "T4", (7, 5)),)), "cpu", "no 2:4 sparse tensor cores"),
    (Hardware.from_cpuinfo(AVX2, cuda=(CudaDevice(0, "A100", (8, 0)),)), "gpu-sparse", "A100"),
])
def test_hardware_auto_plans_for_the_detected_machine(hw, kind, reason):
    cfg = PlanConfig(budget="some", teacher=True, goal="latency")
    assert cfg.hardware == "auto"
    plan = make_plan(cfg, hw=hw)
    given = _plan(budget="some", teacher=True, goal="latency", hardware=kind)
    assert plan.hardware == kind and plan.recipe() == given.recipe()
    text = plan.describe()
    assert text.startswith(f"Hardware: {kind} (auto: ") and reason in text
    assert "Quantization lever on " + kind + ": quantize(method=dynamic-int8" in text
    assert ("2:4" in str(plan.recipe())) is (kind == "gpu-sparse")


def test_the_planner_and_the_runner_have_no_import_cycle():
    import ast
    from pathlib import Path

    from encoderkit.compress import stack

    tree = ast.parse(Path(stack.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "encoderkit.compress.plan" not in imported


def test_plan_writes_a_recipe_file_that_the_runner_accepts(tmp_path):
    path = tmp_path / "r.yaml"
    res = plan_run(PlanConfig(budget="some", teacher=True, hardware="cpu", write=str(path)))
    steps = load_recipe(path)
    assert [s.lever for s in steps] == ["distill", "prune", "quantize"]
    text = res.summary()
    assert "why:" in text and "Left out:" in text and str(path) in text


def test_plan_run_needs_model_dev_and_out():
    with pytest.raises(EncoderkitError, match="--model"):
        PlanConfig(run=True, dev="d", out="o")


def _fake_quality(recipe) -> float:
    """A stand-in for running a recipe: pruning costs quality in proportion to its fractions,
    4-bit costs 2 points, int8 embeddings 1 point."""
    q = 0.90
    for s in recipe["steps"]:
        if s["lever"] == "prune":
            q -= 0.1 * (s.get("heads", 0) + s.get("ffn", 0))
        if s["lever"] == "gptq":
            q -= 0.02 if s.get("bits") == 4 else 0.0
            q -= 0.01 if s.get("embeddings") == "int8" else 0.0
    return q


def test_backoff_halves_pruning_until_the_floor_holds():
    plan = _plan(budget="some", teacher=True, hardware="cpu", goal="latency")  # ffn 0.4 + heads 0.25 -> -0.065
    calls = []

    def evaluate(recipe, tag):
        calls.append(tag)
        return _fake_quality(recipe)

    res = search_recipe(plan.recipe(), evaluate, floor=0.86)
    assert res.ok and len(calls) == 2  # as planned (0.835) fails, halved (0.8675) holds
    prune = next(s for s in res.recipe["steps"] if s["lever"] == "prune")
    assert prune["ffn"] == pytest.approx(0.2) and prune["heads"] == pytest.approx(0.125)
    assert res.tried[0]["ok"] is False and res.tried[1]["what"] == "halved the structured pruning fractions"


def test_backoff_keeps_embeddings_in_full_precision_then_8_bit():
    plan = _plan(budget="none", hardware="cpu", goal="memory")
    res = search_recipe(plan.recipe(), lambda r, tag: _fake_quality(r), floor=0.895)
    assert res.ok
    gptq = next(s for s in res.recipe["steps"] if s["lever"] == "gptq")
    assert gptq["embeddings"] == "fp32" and gptq["bits"] == 8
    assert [t["ok"] for t in res.tried] == [False, False, True]


def test_backoff_says_when_no_variant_holds():
    plan = _plan(budget="some", teacher=True, hardware="cpu", goal="latency")
    res = search_recipe(plan.recipe(), lambda r, tag: 0.5, floor=0.8, max_backoff=4)
    assert not res.ok and len(res.tried) == 5
    assert "no variant tried holds the floor" in res.summary()


def test_cli_plan_prints_the_recipe(capsys):
    from encoderkit.cli import main

    assert main(["plan", "--budget", "none", "--hardware", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "1. quantize" in printed and "distill: no training budget" in printed
    assert "Hardware: cpu (given by --hardware)" in printed
    assert main(["plan", "--budget", "none"]) == 0  # --hardware auto: this machine
    assert "Hardware: " in (printed := capsys.readouterr().out) and "(auto: " in printed


def test_plan_run_backs_off_on_real_levers(tmp_path, tiny_tokenizer_dir):
    """`plan --run` on a tiny model: the levers really run (vocab + GPTQ); a stand-in measurer
    scores 4-bit folders low, so the search must end at 8-bit with fp32 embeddings."""
    import json

    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from tests.conftest import WORDS, tiny_bert_config

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tok), num_labels=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "train.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{WORDS[i]} {WORDS[-i]} \t{i % 2}\n" for i in range(1, 40)))

    def fake_measure(folder):
        quant = json.loads((folder / "config.json").read_text()).get("encoderkit_quantization") or {}
        layers = quant.get("layers", {})
        q = 1.0 - 0.3 * any(m.get("bits") == 4 for m in layers.values())
        q -= 0.05 * any("word_embeddings" in name for name in layers)
        return {"quality": q, "metric": "accuracy", "params": 1, "bytes": 1}

    cfg = PlanConfig(budget="none", goal="memory", run=True, model=str(model_dir), dev=str(data), train=str(data),
                     out=str(tmp_path / "out"), max_quality_drop=0.03)
    res = run_recipe_for_plan(make_plan(cfg).recipe(), cfg, measure=fake_measure)
    assert res.ok and [t["ok"] for t in res.tried] == [False, False, True]
    gptq = res.recipe["steps"][-1]
    assert gptq["bits"] == 8 and gptq["embeddings"] == "fp32"
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert record["ok"] and record["floor"] == pytest.approx(0.97)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plan.json", "try0", "try1", "try2"]
    assert (tmp_path / "out" / "try2" / "02-gptq" / "encoderkit.json").is_file()
    assert (tmp_path / "out" / "try2" / "report.md").is_file()


# -- the planner knows the task ---------------------------------------------------------------------

CPU_ONLY = Hardware.from_cpuinfo(AVX2)


def test_rerank_seed_scenario_budget_teacher_sparse_gpu_is_distill_2_4_int8_per_query_top_100():
    """The seeds' scenario: a cross-encoder reranker with a budget, a teacher and a sparse GPU."""
    plan = make_plan(PlanConfig(task="rerank", budget="some", teacher=True, hardware="gpu-sparse", goal="latency"),
                     hw=CPU_ONLY)
    assert plan.levers() == ["distill", "prune", "quantize"]
    assert plan.steps[1].params["method"] == "2:4" and plan.steps[2].params["method"] == "dynamic-int8"
    assert plan.latency_unit == (100, "one query's top 100 candidates (100 query-passage pairs in one batch)")
    assert "top 100 candidates" in plan.steps[0].reason and "top 100 candidates" in plan.steps[1].reason
    # a cut cross-encoder starts from chance: it is trained back at 3e-4 (docs/compress.md), other tasks keep the
    # default
    assert plan.steps[0].params["lr"] == 3e-4 and "no better than chance" in plan.steps[0].reason
    assert plan.steps[0].params["pseudo_queries"] == 1000 and plan.steps[0].params["fresh_pseudo_queries"] is True
    assert "new corpus titles each epoch as label-free queries" in plan.steps[0].reason
    classify = make_plan(PlanConfig(task="classify", budget="some", teacher=True, hardware="cpu", goal="latency"),
                         hw=CPU_ONLY)
    assert "lr" not in classify.steps[0].params and "pseudo_queries" not in classify.steps[0].params
    text = plan.describe()
    assert "Task: rerank; latency planned per one query's top 100 candidates" in text and "(batch 100)" in text
    # this machine (no CUDA) gets told that 2:4 buys no time here
    assert "2:4 sparsity buys no time" in text
    assert plan.recipe()["task"] == "rerank"
    assert [s.lever for s in validate_recipe(plan.recipe(), source="planned")] == plan.levers()


def test_rerank_on_a_cpu_with_budget_and_teacher_keeps_the_depth_and_is_taught_back_by_the_unpruned_model():
    """The seeds' scenario on a CPU: width pruning, then the recipe's start teaches the pruned model (the
    measured best: docs/compress.md, "Keep the depth, cut the width")."""
    plan = make_plan(PlanConfig(task="rerank", budget="some", teacher=True, hardware="cpu", goal="latency"),
                     hw=CPU_ONLY)
    assert plan.levers() == ["prune", "distill", "quantize"]
    prune, distill, quant = plan.steps
    assert prune.params["method"] == "structured" and (prune.params["heads"], prune.params["ffn"]) == (0.5, 0.75)
    assert ("recovery_steps" not in prune.params and distill.params["teacher"] == "start"
            and "layers" not in distill.params)
    assert distill.params["lr"] == 3e-4 and distill.params["fresh_pseudo_queries"] is True
    assert quant.params["method"] == "dynamic-int8" and "top 100 candidates" in prune.reason
    assert [s.lever for s in validate_recipe(plan.recipe(), source="planned")] == plan.levers()
    # a floor under 1 point: no deep cut, the layer-distillation plan with its light FFN prune
    tight = make_plan(PlanConfig(task="rerank", budget="some", teacher=True, hardware="cpu", goal="latency",
                                 max_quality_drop=0.005), hw=CPU_ONLY)
    assert tight.levers()[0] == "distill" and "teacher" not in tight.steps[0].params
    assert "heads" not in next(s for s in tight.steps if s.lever == "prune").params
    classify = make_plan(PlanConfig(task="classify", budget="some", teacher=True, hardware="cpu", goal="latency"),
                         hw=CPU_ONLY)
    assert classify.levers()[0] == "distill" and "teacher" not in classify.steps[0].params


def test_rerank_seed_scenario_no_budget_cpu_is_ptq_only():
    plan = make_plan(PlanConfig(task="rerank", budget="none", teacher=True, hardware="cpu", goal="latency"),
                     hw=CPU_ONLY)
    assert plan.levers() == ["quantize"] and plan.steps[0].params["method"] == "dynamic-int8"
    assert plan.latency_unit[0] == 100 and not plan.notes


def test_the_task_comes_from_the_model_folder(tmp_path, tiny_tokenizer_dir):
    from deploy_models import make_task_model

    reranker = make_task_model(tmp_path, tiny_tokenizer_dir, "rerank")
    plan = make_plan(PlanConfig(model=str(reranker), budget="none", hardware="cpu"), hw=CPU_ONLY)
    assert plan.task == "rerank" and plan.latency_unit[0] == 100
    embedder = make_task_model(tmp_path, tiny_tokenizer_dir, "embed")
    plan = make_plan(PlanConfig(model=str(embedder), budget="none", hardware="cpu"), hw=CPU_ONLY)
    assert plan.task == "embed" and "a single query" in plan.latency_unit[1]
    assert make_plan(PlanConfig(budget="none", hardware="cpu"), hw=CPU_ONLY).task is None  # no model: unknown


def test_plan_run_measures_a_reranker_over_the_miners_candidates(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """`plan --run` on a rerank model with a BEIR --dev measures nDCG@10 over --miner's candidates (the
    compress measurer's settings pass through), and names --miner when it is missing."""
    import json

    from deploy_models import make_task_model
    from test_finetune import _beir

    from encoderkit.compress.plan import run_recipe_for_plan

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    ce, miner = (make_task_model(tmp_path, tiny_tokenizer_dir, "rerank"),
                 make_task_model(tmp_path, tiny_tokenizer_dir, "embed"))
    beir = f"{_beir(tmp_path)}#test"
    common = {"budget": "none", "hardware": "cpu", "run": True, "model": str(ce), "dev": beir, "max_quality_drop": 0.99}
    with pytest.raises(EncoderkitError, match="--miner"):
        cfg = PlanConfig(**common, out=str(tmp_path / "no-miner"))
        run_recipe_for_plan(make_plan(cfg).recipe(), cfg)
    cfg = PlanConfig(**common, miner=str(miner), candidates=20, dev_limit=12, out=str(tmp_path / "out"))
    res = run_recipe_for_plan(make_plan(cfg).recipe(), cfg)
    assert res.ok
    steps = json.loads((tmp_path / "out" / "try0" / "report.json").read_text())["steps"]
    assert {r["metric"] for r in steps} == {"ndcg@10"} and {r["latency_unit"] for r in steps} == {"query (top 100)"}
    assert {r["dev_examples"] for r in steps} == {12}


# -- the static tier ----------------------------------------------------------------------------------

def test_an_embed_model_with_a_speed_goal_beyond_quantization_gets_the_static_tier_when_the_floor_allows():
    plan = _plan(task="embed", budget="some", hardware="cpu", speedup=30, max_quality_drop=0.05)
    assert plan.levers() == ["distill"] and plan.steps[0].params["to"] == "static"
    assert plan.steps[0].params["fit_texts"] > 0 and "96%" in plan.steps[0].reason
    assert "re-measures it on --dev" in plan.notes[0] and "no transformer lever" in _left_out(plan)["quantize"]
    (step,) = validate_recipe(plan.recipe())  # a recipe the runner takes, for embed models
    assert step.params["to"] == "static" and plan.recipe()["task"] == "embed"
    # without a training budget: no fit, and the floor must allow what that kept (61%)
    assert "61%" in _left_out(_plan(task="embed", budget="none", hardware="cpu", speedup=30,
                                    max_quality_drop=0.05))["static tier"]
    cheap = _plan(task="embed", budget="none", hardware="cpu", speedup=30, max_quality_drop=0.4)
    assert cheap.levers() == ["distill"] and cheap.steps[0].params["fit_texts"] == 0


@pytest.mark.parametrize(("kw", "why"), [
    ({"task": "embed", "speedup": 30, "max_quality_drop": 0.03},
     "below the floor of 97%: relax --max-quality-drop to 0.045"),
    ({"task": "embed", "speedup": 5, "max_quality_drop": 0.05}, "within what quantization"),
    ({"task": "classify", "speedup": 50, "max_quality_drop": 0.5}, "sentence-embedding model only"),
    ({"task": "embed", "speedup": 30, "max_quality_drop": 0.05, "has_calibration_data": False},
     "from in-domain text (--train), and there is none"),
])
def test_the_static_tier_is_left_out_with_the_reason(kw, why):
    plan = _plan(budget="some", teacher=True, hardware="cpu", **kw)
    assert "static tier" in _left_out(plan) and why in _left_out(plan)["static tier"]
    assert all(s.params.get("to") != "static" for s in plan.steps) and plan.steps
    # no speed goal: not mentioned
    assert "static tier" not in _left_out(_plan(task="embed", budget="some", hardware="cpu"))
