"""One measurement for compression: every task's measurer gives the figure `encoderkit evaluate` gives
on the same folder (exactly in torch fp32, within tolerance in ONNX Runtime), the compression
report's quality column is that figure, one parameter count holds for a torch folder and its ONNX
export, and dev data that lacks what the task needs is refused before anything runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from deploy_models import export_task_model, make_task_model, tiny_root
from test_finetune import _beir, _conll, _jsonl, _pairs, _squad, _tsv, one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.cli import main
from encoderkit.compress.measure import StepMeasurer, folder_parameters, onnx_parameters
from encoderkit.evaluate.run import EvaluateConfig
from encoderkit.evaluate.run import run as evaluate

CPU_PTQ = Path(__file__).resolve().parents[1] / "recipes" / "cpu-ptq.yaml"


def _qa(path: Path, n: int) -> Path:
    """A small SQuAD file, the same for every call with the same ``n``."""
    return _squad(path, n, random.Random(0),
                  ["the", "movie", "was", "good", "bad", "story", "time", "man", "film", "fun"], 2)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tiny_root(tmp_path_factory)


@pytest.fixture(scope="module")
def dev_data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dev")
    tsv = _tsv(d / "dev.tsv", 40, 1)
    # the tiny classifier's labels are negative/positive
    tsv.write_text(tsv.read_text().replace("\tneg", "\tnegative").replace("\tpos", "\tpositive"))
    return {"classify": tsv, "ner": _conll(d / "dev.conll", 24, random.Random(1), "B"), "qa": _qa(d / "dev.json", 16),
            "rerank": _jsonl(d / "dev.jsonl", _pairs(16, 1)), "embed": _beir(d)}


def _ner_dev(path: Path) -> Path:
    """The tiny NER model's labels are PER and LOC: the generated LANG entities become LOC."""
    path.write_text(path.read_text().replace("-LANG", "-LOC"))
    return path


def _figure(folder: Path, data: Path, task: str, **kw) -> tuple[float, str]:
    metrics = evaluate(EvaluateConfig(model=str(folder), data=str(data), **kw)).metrics
    key = {"classify": "accuracy", "ner": "f1", "qa": "f1", "rerank": "mrr@10", "embed": "ndcg@10"}[task]
    return metrics[key], key


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_bert_dir) -> dict[str, tuple[Path, Path]]:
    """NER and QA folders fine-tuned for a few steps (non-trivial F1, windows with the card's strides),
    each with its dev file."""
    d = tmp_path_factory.mktemp("trained")
    ner_train, ner_dev = (_conll(d / "train.conll", 120, random.Random(0), "B"),
                          _conll(d / "dev.conll", 30, random.Random(1), "B"))
    qa_train, qa_dev = _qa(d / "train.json", 160), _qa(d / "dev.json", 24)
    common = ["--model", str(tiny_bert_dir), "--batch-size", "16", "--lr", "3e-3", "--seed", "0"]
    assert main(["finetune", *common, "--task", "ner", "--train", str(ner_train), "--out", str(d / "ner"),
                 "--max-steps", "30", "--max-length", "16", "--stride", "4"]) == 0
    assert main(["finetune", *common, "--task", "qa", "--train", str(qa_train), "--out", str(d / "qa"),
                 "--max-steps", "40", "--max-length", "24", "--doc-stride", "8"]) == 0
    return {"ner": (d / "ner", ner_dev), "qa": (d / "qa", qa_dev)}


@pytest.mark.slow  # fine-tunes two tiny models
@pytest.mark.parametrize("task", ["ner", "qa"])
def test_trained_ner_and_qa_measurers_agree_with_evaluate(task, trained):
    folder, dev = trained[task]
    figure, _ = _figure(folder, dev, task)
    assert figure > 0.1  # a trained head: the comparison is not between two zeros
    row = StepMeasurer(str(dev), runtime="torch", repeats=1, model=folder)(folder)
    assert row["quality"] == figure
    assert StepMeasurer(str(dev), repeats=1, model=folder)(folder)["quality"] == pytest.approx(figure, abs=0.05)


@pytest.mark.parametrize("task", ["classify", "ner", "qa", "rerank", "embed"])
def test_each_task_measurer_agrees_with_evaluate(task, root, tiny_tokenizer_dir, dev_data):
    folder = make_task_model(root, tiny_tokenizer_dir, task)
    dev = _ner_dev(dev_data[task]) if task == "ner" else dev_data[task]
    figure, metric = _figure(folder, dev, task)
    row = StepMeasurer(str(dev), runtime="torch", repeats=1, model=folder)(folder)
    assert row["task"] == task and row["metric"] == metric and row["runtime"] == "torch fp32"
    assert row["quality"] == figure  # exactly: evaluate's own path, the same torch model
    assert row["latency_ms"] > 0 and row["params"] == folder_parameters(folder)
    # the same folder in ONNX Runtime (its FP32 export, as deployed): the same figure within tolerance
    onnx_row = StepMeasurer(str(dev), runtime="deploy", repeats=1, model=folder)(folder)
    assert onnx_row["runtime"] == "deploy onnx-fp32"
    assert onnx_row["quality"] == pytest.approx(figure, abs=0.05)
    assert onnx_row["params"] == row["params"]


def test_latency_is_in_the_unit_the_task_is_served_in(root, tiny_tokenizer_dir, dev_data):
    units = {}
    for task in ("classify", "rerank", "embed"):
        folder = make_task_model(root, tiny_tokenizer_dir, task)
        row = StepMeasurer(str(dev_data[task]), runtime="torch", repeats=1, model=folder)(folder)
        units[task] = (row["latency_unit"], row.get("batch_unit"))
    assert units == {"classify": ("request", "32 requests"), "rerank": ("query (top 100)", None),
                     "embed": ("query", "32 documents")}


def test_rerank_on_a_beir_source_reranks_the_miners_candidates(root, tiny_tokenizer_dir, dev_data):
    folder = make_task_model(root, tiny_tokenizer_dir, "rerank")
    miner = make_task_model(root, tiny_tokenizer_dir, "embed")
    figure = evaluate(EvaluateConfig(model=str(folder), data=str(dev_data["embed"]),
                                     miner=str(miner))).metrics["ndcg@10"]
    row = StepMeasurer(str(dev_data["embed"]), runtime="torch", repeats=1, model=folder, miner=str(miner))(folder)
    assert row["metric"] == "ndcg@10" and row["quality"] == figure
    assert "first_stage_ndcg@10" in row["metrics"]


@pytest.mark.parametrize("task", ["classify", "ner", "qa", "embed"])
def test_one_parameter_count_for_a_torch_folder_and_its_onnx_export(task, root, tiny_tokenizer_dir):
    """Plain, fused (classify/qa are exported with --optimize) and INT8 graphs count what torch counts
    (embed: the bare encoder's pooler, which no embedding uses and the export drops, is left out)."""
    src = make_task_model(root, tiny_tokenizer_dir, task)
    onnx = export_task_model(root, tiny_tokenizer_dir, task)
    n = folder_parameters(src)
    assert n == onnx_parameters(onnx / "model.onnx") == onnx_parameters(onnx / "model.int8.onnx")
    only_graph = root / f"{task}_graph_only"
    if not only_graph.is_dir():
        only_graph.mkdir()
        for p in onnx.iterdir():
            if p.is_file() and p.suffix != ".safetensors":
                (only_graph / p.name).write_bytes(p.read_bytes())
    assert folder_parameters(only_graph) == n


@pytest.mark.parametrize("task", ["classify", "ner"])
def test_report_quality_column_is_the_evaluate_figure(task, root, tiny_tokenizer_dir, dev_data, tmp_path):
    """Through `encoderkit compress`: the starting row (torch fp32) is evaluate's figure exactly, and the
    INT8 step's row is within tolerance of it (measured in ONNX Runtime on the INT8 graph)."""
    folder = make_task_model(root, tiny_tokenizer_dir, task)
    dev = _ner_dev(dev_data[task]) if task == "ner" else dev_data[task]
    figure, _ = _figure(folder, dev, task)
    out = tmp_path / "out"
    assert main(["compress", "--recipe", str(CPU_PTQ), "--model", str(folder), "--dev", str(dev), "--out", str(out),
                 "--runtime", "torch", "--repeats", "1", "--max-quality-drop", "0.05"]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = report["steps"]
    assert report["meta"]["max_quality_drop"] == 0.05  # the floor drawn on report.png
    assert rows[0]["quality"] == figure
    assert rows[1]["runtime"] == "deploy onnx-int8" and rows[1]["quality"] == pytest.approx(figure, abs=0.1)
    assert rows[1]["params"] == rows[0]["params"]
    # the INT8 step's folder holds only its graph: `encoderkit evaluate` runs that graph, the measurer's figure
    assert _figure(out / rows[1]["folder"], dev, task)[0] == rows[1]["quality"]
    md = (out / "report.md").read_text()
    assert f"| 0 | start | {figure:.4f} |" in md and "ms/request" in md


def _compress_error(capsys, folder: Path, dev: Path | str, tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "out"
    assert main(["compress", "--recipe", str(CPU_PTQ), "--model", str(folder), "--dev", str(dev), "--out", str(out),
                 *extra]) == 2
    assert not out.exists()
    return capsys.readouterr().err


def test_dev_data_without_the_field_the_task_needs_is_refused_naming_task_field_and_step(
        root, tiny_tokenizer_dir, tmp_path, capsys):
    folder = make_task_model(root, tiny_tokenizer_dir, "classify")
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tgold\nthe movie was fun\tpositive\n")
    err = _compress_error(capsys, folder, dev, tmp_path)
    assert "classify dev data" in err and "'label'" in err and "before step 1" in err


def test_rerank_dev_without_a_first_stage_or_candidates_is_refused(root, tiny_tokenizer_dir, dev_data, tmp_path,
                                                                   capsys):
    folder = make_task_model(root, tiny_tokenizer_dir, "rerank")
    err = _compress_error(capsys, folder, dev_data["embed"], tmp_path)
    assert "rerank dev data" in err and "'miner'" in err and "--miner" in err
    no_candidates = _jsonl(tmp_path / "q.jsonl",
                           [{"query": r["query"], "positive": r["positive"]} for r in _pairs(4, 0)])
    err = _compress_error(capsys, folder, no_candidates, tmp_path)
    assert "rerank dev data" in err and "'negatives'" in err


def test_embed_dev_must_be_a_corpus(root, tiny_tokenizer_dir, dev_data, tmp_path, capsys):
    folder = make_task_model(root, tiny_tokenizer_dir, "embed")
    err = _compress_error(capsys, folder, dev_data["classify"], tmp_path)
    assert "embed dev data" in err and "BEIR source" in err


def test_measurer_reads_the_columns_the_card_recorded(tmp_path, tiny_bert_dir):
    """A classifier fine-tuned on other column names is measured on them without flags."""
    src = _tsv(tmp_path / "plain.tsv", 48, 0).read_text().splitlines()
    rows = ["review\tstars\ttext"] + [f"{line}\tdecoy words here" for line in src[1:]]
    (tmp_path / "train.tsv").write_text("\n".join(rows[:33]) + "\n")
    (tmp_path / "dev.tsv").write_text("\n".join([rows[0], *rows[33:]]) + "\n")
    out = tmp_path / "clf"
    assert main(["finetune", "--model", str(tiny_bert_dir), "--task", "classify", "--train",
                 str(tmp_path / "train.tsv"),
                 "--text-column", "review", "--label-column", "stars", "--out", str(out), "--max-steps", "2",
                 "--batch-size", "16"]) == 0
    card = json.loads((out / "encoderkit.json").read_text())
    assert card["text_column"] == "review" and card["label_column"] == "stars"
    figure = evaluate(EvaluateConfig(model=str(out), data=str(tmp_path / "dev.tsv"), label_column="stars")).metrics
    row = StepMeasurer(str(tmp_path / "dev.tsv"), runtime="torch", repeats=1, model=out)(out)
    assert row["quality"] == figure["accuracy"] and row["dev_examples"] == 16


def test_a_step_of_another_task_is_refused(root, tiny_tokenizer_dir, dev_data):
    from encoderkit.errors import EncoderkitError

    measure = StepMeasurer(str(dev_data["classify"]), runtime="torch", repeats=1,
                           model=make_task_model(root, tiny_tokenizer_dir, "classify"))
    with pytest.raises(EncoderkitError, match=r"is a 'ner' model but the starting model is a 'classify' model"):
        measure(make_task_model(root, tiny_tokenizer_dir, "ner"))


def test_a_torch_int8_folder_is_evaluated_as_the_measurer_runs_it(root, tiny_tokenizer_dir, dev_data, tmp_path, capsys):
    """`quantize --format torch` stores INT8 weights that are served through torch's dynamic INT8: evaluate
    runs that model (not the weights dequantized to FP32), so its figure is the measurer's."""
    from encoderkit.compress.quantize import QuantizeConfig, quantize
    from encoderkit.evaluate.run import compressed_engine
    from encoderkit.models.folder import ModelFolder

    folder = make_task_model(root, tiny_tokenizer_dir, "classify")
    q = tmp_path / "q"
    quantize(folder, QuantizeConfig(method="dynamic", format="torch", measure=False), q)
    engine, runtime = compressed_engine(ModelFolder.open(q), "classify")
    assert runtime == "torch int8-dynamic" and engine is not None
    assert any(type(m).__module__ == "torch.ao.nn.quantized.dynamic.modules.linear" for m in engine.module.modules())
    capsys.readouterr()
    figure, _ = _figure(q, dev_data["classify"], "classify")
    assert "torch int8-dynamic" in capsys.readouterr().err
    row = StepMeasurer(str(dev_data["classify"]), runtime="torch", repeats=1, model=folder)(q)
    assert row["runtime"] == "torch int8-dynamic" and row["quality"] == figure
    assert compressed_engine(ModelFolder.open(folder), "classify") == (None, "torch fp32")
