"""Every lever in one shape, for every task: prune (heads / FFN / unstructured / 2:4, with Taylor
scores and recovery), quantize (dynamic INT8 ONNX with the task's outputs, GPTQ) and distillation on
tiny NER, QA, rerank, embed (and classify) models; full recipes whose every step reloads and
predicts; task data read by the task readers with the card's columns; the bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.compress.levers import LEVERS
from encoderkit.compress.stack import CompressConfig
from encoderkit.compress.stack import run as compress
from encoderkit.compress.task_data import LeverData, read_task_inputs
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS

TASKS = ("classify", "ner", "qa", "rerank", "embed")


def sentence(g: np.random.Generator, lo: int = 3, hi: int = 9) -> str:
    return " ".join(WORDS[j] for j in g.integers(0, len(WORDS), g.integers(lo, hi)))


def write_task_data(root: Path, task: str) -> Path:
    """A small training file of ``task`` in its own format (read by the task's reader)."""
    g = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    if task == "classify":
        p = root / "train.tsv"
        p.write_text("sentence\tlabel\n"
                     + "".join(f"{sentence(g)}\t{['negative', 'positive'][i % 2]}\n" for i in range(48)))
    elif task == "ner":
        p = root / "train.conll"
        tags = ["O", "B-PER", "I-PER", "B-LOC", "O"]
        p.write_text("".join("".join(f"{w} {tags[j % 5]}\n" for j, w in enumerate(sentence(g).split())) + "\n"
                             for _ in range(48)))
    elif task == "qa":
        p = root / "squad.json"
        articles = []
        for a in range(5):
            paras = []
            for k in range(10):
                context = f"{sentence(g)} python {sentence(g)}"
                paras.append({"context": context, "qas": [{"id": f"{a}-{k}", "question": sentence(g, 2, 5),
                                                           "answers": [{"text": "python",
                                                                        "answer_start": context.index("python")}]}]})
            articles.append({"title": f"t{a}", "paragraphs": paras})
        p.write_text(json.dumps({"data": articles}))
    elif task == "rerank":
        p = root / "triples.jsonl"
        p.write_text("".join(json.dumps({"query": sentence(g, 2, 4), "positive": sentence(g),
                                         "negatives": [sentence(g) for _ in range(3)]}) + "\n" for _ in range(32)))
    else:
        p = root / "corpus.txt"
        p.write_text("".join(f"{sentence(g, 4, 12).capitalize()}. {sentence(g, 4, 12).capitalize()}.\n\n"
                             for _ in range(64)))
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    root = tiny_root(tmp_path_factory)
    return {t: make_task_model(root, tiny_tokenizer_dir, t) for t in TASKS}


@pytest.fixture(scope="module")
def train_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lever_data")
    return {t: write_task_data(root / t, t) for t in TASKS}


def predict(folder: Path, backend: str = "torch-fp32") -> np.ndarray:
    """The folder's task predictions through the deploy Predictor, as numbers (all finite)."""
    from encoderkit.inference.predictor import Predictor

    p = Predictor.load(folder, backend=backend, max_batch=8)
    texts = ["the movie was good", "she was in the city"]
    if p.task == "classify":
        out = np.asarray([o["score"] for o in p.classify(texts)])
    elif p.task == "ner":
        ents = p.extract(texts)
        assert len(ents) == 2
        out = np.zeros(1)
    elif p.task == "qa":
        out = np.asarray([a["score"] for a in p.answer(["who was good", "where"], texts)])
    elif p.task == "rerank":
        out = p.score_pairs(["good movie", "good movie"], texts)
    else:
        out = p.embed(texts)
        assert out.shape[0] == 2
    assert np.isfinite(out).all()
    return out


def run_lever(name: str, settings: dict, model: Path, out: Path, data: LeverData):
    lever = LEVERS[name]
    (call,) = lever.calls(settings)
    data.require(lever.needs(call), f"test {name}")
    return lever.run(model, lever.config(call, model, out, data), data, out)


# -- prune: every method on every task -------------------------------------------------------------

@pytest.mark.parametrize("task", ["ner", "qa", "rerank", "embed"])
@pytest.mark.parametrize("method", ["heads", "ffn", "magnitude", "2:4"])
def test_prune_every_method_on_every_task(task, method, models, train_files, tmp_path):
    """Heads with Taylor scores (the task's own label-free loss), FFN / unstructured / 2:4 with
    recovery on the task's data: the folder reloads, predicts, and the removed weights are gone."""
    from encoderkit.compress.prune import sparsity
    from encoderkit.models.folder import ModelFolder

    data = LeverData.for_model(models[task], train=str(train_files[task]))
    settings = {"method": method, "amount": 0.5, "batch_size": 8, "seq_len": 32, "calib_samples": 16}
    if method == "heads":
        settings["importance"] = "taylor"
    else:
        settings.update(importance="magnitude", recovery_steps=2)
    rep = run_lever("prune", settings, models[task], tmp_path / "p", data)
    folder = ModelFolder.open(tmp_path / "p")
    assert folder.task == task
    model = folder.load()
    if method == "heads":
        assert rep.details["heads_per_layer"] == [2, 2]
    elif method == "ffn":
        assert model.config.intermediate_size == 32
        assert rep.details["recovery"]["steps"] == 2
    else:
        assert abs(sparsity(model) - 0.5) < 0.02 and rep.details["recovery"]["steps"] == 2
    if method == "2:4":
        assert "none on CPU" in rep.details["speedup"]
    predict(tmp_path / "p")


# -- quantize: the task's ONNX outputs, GPTQ with the task's calibration data ---------------------------

@pytest.mark.parametrize("task", TASKS)
def test_dynamic_int8_onnx_has_the_tasks_outputs(task, models, train_files, tmp_path):
    import onnx

    from encoderkit.inference.export import OUTPUT_NAMES

    data = LeverData.for_model(models[task], train=str(train_files[task]))
    rep = run_lever("quantize", {"method": "dynamic-int8", "calib_samples": 16}, models[task], tmp_path / "q", data)
    graph = onnx.load(str(tmp_path / "q" / "model.int8.onnx"), load_external_data=False).graph
    assert [o.name for o in graph.output] == list(OUTPUT_NAMES[task])
    assert "output_rel_error" in rep.details  # the calibration inputs came from the task's data
    fp32, int8 = predict(models[task], "onnx-fp32"), predict(tmp_path / "q", "onnx-int8")
    assert fp32.shape == int8.shape


@pytest.mark.parametrize("task", ["ner", "qa", "rerank", "embed"])
def test_gptq_calibrates_on_the_tasks_data(task, models, train_files, tmp_path):
    data = LeverData.for_model(models[task], calib=str(train_files[task]))
    rep = run_lever("gptq", {"bits": 4, "group_size": 16, "calib_samples": 16, "batch_size": 8}, models[task],
                    tmp_path / "g", data)
    assert rep.details["calib_texts"] == 16 and rep.details["layers"] > 0
    predict(tmp_path / "g")


def test_qat_on_a_qa_model_matches_its_span_outputs(models, train_files, tmp_path):
    data = LeverData.for_model(models["qa"], train=str(train_files["qa"]))
    rep = run_lever("qat", {"qat_steps": 2, "batch_size": 8}, models["qa"], tmp_path / "qat", data)
    assert rep.details["qat"]["steps"] == 2 and rep.details["qat"]["kd_alpha"] == 1.0  # no labels in QA inputs
    predict(tmp_path / "qat")


# -- full recipes: distill -> prune -> quantize for every task ----------------------------------------

def reload_measure(folder: Path) -> dict:
    """A stand-in for the quality measurer: every step's folder must load in the deploy runtime and predict."""
    from encoderkit.compress.measure import bytes_on_disk
    from encoderkit.models.folder import ModelFolder

    int8 = ModelFolder.open(folder, tokenizer=False).onnx_int8 is not None
    predict(folder, "onnx-int8" if int8 else "torch-fp32")
    return {"quality": 1.0, "params": 1, "bytes": bytes_on_disk(folder), "latency_b1_ms": 1.0, "latency_b32_ms": 1.0}


@pytest.mark.parametrize("task", TASKS)
def test_full_recipe_distill_prune_int8_reloads_and_predicts(task, models, train_files, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"task: {task}\nsteps:\n"
                      "  - {lever: distill, layers: '0', max_steps: 4, batch_size: 8, seq_len: 32, candidates: 4, "
                      "bf16: false}\n"
                      "  - {lever: prune, method: structured, heads: 0.5, ffn: 0.5, importance: magnitude, "
                      "recover_steps: 2, "
                      "batch_size: 8, seq_len: 32}\n"
                      "  - {lever: quantize, method: dynamic-int8}\n")
    out = tmp_path / "out"
    res = compress(CompressConfig(recipe=str(recipe), model=str(models[task]), dev=str(train_files[task]), out=str(out),
                                  train=str(train_files[task])), measure=reload_measure)
    assert [r["lever"] for r in res.rows] == ["start", "distill", "prune", "quantize"]
    from encoderkit.models.folder import ModelFolder

    for name in ("01-distill", "02-prune", "03-quantize"):
        assert ModelFolder.open(out / name, tokenizer=False).task == task
    assert ModelFolder.open(out / "01-distill", tokenizer=False).config["num_hidden_layers"] == 1
    assert (out / "03-quantize" / "model.int8.onnx").is_file()
    predict(out / "03-quantize", "onnx-int8")


# -- task data through the task readers and the card's columns ---------------------------------------------

def test_classify_data_is_read_with_the_cards_columns(models, tmp_path):
    """A classifier fine-tuned on columns 'review' / 'stars': the levers read those (the old reader
    needed a column literally named 'label' and guessed the text)."""
    from encoderkit.compress.distill import task_batches
    from encoderkit.models.card import write_card
    from encoderkit.models.folder import ModelFolder

    src = models["classify"]
    folder = tmp_path / "clf"
    import shutil

    shutil.copytree(src, folder)
    write_card(folder, "finetune", None, {"text_column": "auto", "label_column": "stars", "text_pair_column": ""},
               task="classify", labels=["negative", "positive"], text_column="review")
    data = tmp_path / "train.csv"
    data.write_text("id,title,review,stars\n" + "".join(f"{i},t{i},the movie "
                                                        f"{WORDS[i]},{['negative', 'positive'][i % 2]}\n"
                                                       for i in range(16)))
    inputs = read_task_inputs(str(data), "classify", folder=folder, label2id={"negative": 0, "positive": 1})
    assert inputs.texts[3] == f"the movie {WORDS[3]}" and inputs.labels[:4] == [0, 1, 0, 1]
    mf = ModelFolder.open(folder)
    _, n, has_labels = task_batches(str(data), mf.tokenizer(), mf.load().config, 8, 32, 0, folder=folder)
    assert n == 16 and has_labels


# -- bad input --------------------------------------------------------------------------------------------

def test_recipe_for_another_task_is_refused(models, train_files, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: rerank\nsteps:\n  - {lever: quantize, method: dynamic-int8}\n")
    with pytest.raises(EncoderkitError, match=r"recipe is for rerank models but the model .* is a classify model"):
        compress(CompressConfig(recipe=str(recipe), model=str(models["classify"]), dev=str(train_files["classify"]),
                                out=str(tmp_path / "out")), measure=reload_measure)
    assert not (tmp_path / "out").exists()


def test_student_of_another_task_is_refused(models, train_files, tmp_path):
    """A one-label cross-encoder and a classifier share their head class; the task tells them apart."""
    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.levers import run_distill

    cfg = DistillConfig(teacher=str(models["classify"]), student=str(models["rerank"]), out=str(tmp_path / "s"),
                        train=str(train_files["classify"]), max_steps=1)
    with pytest.raises(EncoderkitError, match=r"student .* is a rerank model but the teacher .* a classify model"):
        run_distill(cfg)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("steps", "field"), [
    ("  - {lever: prune, method: ffn, amount: 0.5, recovery_steps: 2}\n", "train"),
    ("  - {lever: quantize, method: dynamic-int8}\n  - {lever: distill}\n", "train"),
    ("  - {lever: gptq, bits: 4}\n", "calib"),
])
def test_step_without_its_declared_data_names_task_field_and_step(steps, field, models, train_files, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n" + steps)
    n = steps.count("lever:")
    with pytest.raises(EncoderkitError, match=rf"step {n} \(lever '\w+'\): the rerank model's step needs '{field}'"):
        compress(CompressConfig(recipe=str(recipe), model=str(models["rerank"]), dev=str(train_files["rerank"]),
                                out=str(tmp_path / "out")), measure=reload_measure)
    assert not (tmp_path / "out").exists()


def test_cli_prune_stage_uses_the_task_reader(models, train_files, tmp_path):
    """`encoderkit prune` on a QA model with a SQuAD file as calibration data (the old reader took
    .txt/.tsv/.jsonl text only)."""
    from encoderkit.cli import main

    out = tmp_path / "p"
    rc = main(["prune", "--model", str(models["qa"]), "--out", str(out), "--method", "heads", "--amount", "0.5",
               "--importance", "taylor", "--calib-data", str(train_files["qa"]), "--calib-samples", "8",
               "--no-measure"])
    assert rc == 0
    assert json.loads((out / "report.json").read_text())["details"]["heads_per_layer"] == [2, 2]


def test_report_says_2_4_buys_no_time_without_a_sparse_gpu(models, train_files, tmp_path):
    from encoderkit.hardware import detect

    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: rerank\nsteps:\n  - {lever: prune, method: '2:4'}\n")
    out = tmp_path / "out"
    res = compress(CompressConfig(recipe=str(recipe), model=str(models["rerank"]), dev=str(train_files["rerank"]),
                                  out=str(out)), measure=reload_measure)
    report = (out / "report.md").read_text()
    assert "Notes:" in report and "step 1 (prune): none on CPU (dense kernels)" in report
    if detect().sparse_gpu is None:
        assert "this machine has no CUDA GPU with 2:4 sparse tensor cores" in res.rows[1]["note"]


def test_pair_columns_come_from_the_fine_tuning_config_in_the_lineage(models, tmp_path):
    """A pair classifier distilled once: the student's card names no columns, its parent's fine-tuning
    config does; without the parent the pair column is unknown and that is an error, not single texts."""
    import shutil

    from encoderkit.models.card import write_card

    parent, child = tmp_path / "parent", tmp_path / "child"
    for d in (parent, child):
        shutil.copytree(models["classify"], d)
    write_card(parent, "finetune", None,
               {"label_column": "gold", "text_pair_column": "hypothesis", "text_column": "premise"},
               task="classify", labels=["negative", "positive"], text_column="premise", text_pair=True)
    write_card(child, "distill", parent, {"layers": "every-other"}, task="classify", labels=["negative", "positive"],
               text_column="premise", text_pair=True)
    data = tmp_path / "dev.jsonl"
    data.write_text("".join(json.dumps({"premise": f"p{i}", "hypothesis": f"h{i}", "gold": "positive"}) + "\n"
                            for i in range(4)))
    data_lv = LeverData.for_model(child, train=str(data))
    inputs = data_lv.inputs("train", child)
    assert inputs.texts[1] == ("p1", "h1") and inputs.labels == [1, 1, 1, 1]
    shutil.rmtree(parent)
    with pytest.raises(EncoderkitError, match="classifies text pairs, but its lineage no longer names the pair column"):
        LeverData.for_model(child, train=str(data)).inputs("train", child)


def test_rerank_steps_on_a_beir_source_take_the_first_stage_from_compress_miner(models, tmp_path, monkeypatch):
    """With `compress --miner`, rerank distillation needs no miner of its own, and recovery training reads
    each judged query with the miner's top candidates (the pairs a reranker serves on), not only its
    judged positives."""
    from test_finetune import _beir

    from encoderkit.tasks.rerank.candidates import MINED_PAIRS

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    beir, ce, miner = f"{_beir(tmp_path)}#test", models["rerank"], str(models["embed"])
    judged = LeverData.for_model(ce, train=beir).inputs("train", ce).texts
    mined = LeverData.for_model(ce, train=beir, miner=miner).inputs("train", ce).texts
    from encoderkit.data.beir import load_retrieval

    n_queries = len(load_retrieval(beir).qrels)
    assert {q for q, _ in mined} == {q for q, _ in judged} and len(mined) == n_queries * MINED_PAIRS > len(judged)
    assert not set(mined) <= set(judged)  # the mined lists hold documents not judged relevant to their query
    # a calibration sample's first pairs span the queries
    assert {q for q, _ in mined[:n_queries]} == {q for q, _ in judged}

    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: rerank\nsteps:\n"
                      "  - {lever: distill, layers: '0', max_steps: 2, batch_size: 8, seq_len: 32, candidates: 4, "
                      "bf16: false}\n"
                      "  - {lever: prune, method: structured, ffn: 0.5, importance: magnitude, recover_steps: 2, "
                      "batch_size: 8, seq_len: 32}\n")
    out = tmp_path / "out"
    res = compress(CompressConfig(recipe=str(recipe), model=str(ce), dev=beir, out=str(out), train=beir, miner=miner),
                   measure=reload_measure)
    assert [r["lever"] for r in res.rows] == ["start", "distill", "prune"]
    card = json.loads((out / "01-distill" / "encoderkit.json").read_text())
    assert (out / "01-distill" / card["config"]["miner"]).resolve() == Path(miner).resolve()  # relative to the folder


def test_a_distill_step_with_the_starting_model_as_teacher_trains_the_pruned_model_as_it_is(
        models, train_files, tmp_path):
    """Prune the teacher's width, then let the unpruned teacher teach the pruned model: the student is the
    previous step's model (pruned shape kept), the teacher the recipe's start."""
    from encoderkit.models.folder import ModelFolder

    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: rerank\nsteps:\n"
                      "  - {lever: prune, method: ffn, amount: 0.5, importance: magnitude}\n"
                      "  - {lever: distill, teacher: start, max_steps: 2, batch_size: 8, seq_len: 32, candidates: 4, "
                      "bf16: false}\n")
    out = tmp_path / "out"
    compress(CompressConfig(recipe=str(recipe), model=str(models["rerank"]), dev=str(train_files["rerank"]),
                            out=str(out),
                            train=str(train_files["rerank"])), measure=reload_measure)
    card = json.loads((out / "02-distill" / "encoderkit.json").read_text())
    assert (out / "02-distill" / card["config"]["teacher"]).resolve() == models["rerank"].resolve()  # relative
    assert card["config"]["student"].endswith("01-prune")
    start, pruned, student = (ModelFolder.open(f, tokenizer=False).config
                              for f in (models["rerank"], out / "01-prune", out / "02-distill"))
    assert student["intermediate_size"] == pruned["intermediate_size"] == start["intermediate_size"] // 2
    assert student["num_hidden_layers"] == start["num_hidden_layers"]
    assert weights_differ(out / "01-prune", out / "02-distill")


def weights_differ(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return any(not np.allclose(wa[k].numpy(), wb[k].numpy()) for k in wa)


@pytest.mark.parametrize("extra, pattern", [("teacher: student", "'previous' .* or 'start'"),
                                            ("teacher: start, layers: '0'", "drop them, or use teacher 'previous'")])
def test_a_distill_steps_teacher_is_checked_before_anything_runs(extra, pattern, models, train_files, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: rerank\nsteps:\n  - {lever: prune, method: ffn, amount: 0.5, importance: magnitude}\n"
                      f"  - {{lever: distill, {extra}}}\n")
    with pytest.raises(EncoderkitError, match=rf"step 2 \(lever 'distill'\).*{pattern}"):
        compress(CompressConfig(recipe=str(recipe), model=str(models["rerank"]), dev=str(train_files["rerank"]),
                                out=str(tmp_path / "out"), train=str(train_files["rerank"])), measure=reload_measure)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
