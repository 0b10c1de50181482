"""``--backend auto`` and INT8 for classify/ner/qa/rerank: export --dev records the INT8 graph's agreement with
FP32 in the card, in each task's own terms (its task object), and auto runs INT8 only where the CPU has VNNI/AMX
int8 and that agreement is at least 99.5%, saying why in every case."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from encoderkit import hardware
from encoderkit.hardware import Hardware
from encoderkit.inference.agreement import AgreementRunner
from encoderkit.inference.export import ExportConfig
from encoderkit.inference.export import run as export
from encoderkit.inference.policy import resolve
from encoderkit.inference.predictor import Predictor
from encoderkit.models.card import inherited_card, read_card
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import get_task
from tests.conftest import WORDS
from tests.deploy_models import make_task_model
from tests.test_hardware import AVX2_ONLY, BF16_AMX, VNNI_NO_BF16

UNMEASURED = "FP32: no INT8 agreement measured (export --quantize int8-dynamic --dev FILE)"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("int8_auto")


def sentences(n: int, seed: int, length: int = 6) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[int(j)] for j in rng.integers(0, len(WORDS), length)) for _ in range(n)]


def dev_file(task: str, folder: Path) -> tuple[Path, int]:
    """A small dev file of ``task`` in its own format, and its row count (rerank: queries)."""
    texts = sentences(40, seed=7)
    if task == "classify":
        p = folder / "dev.tsv"
        p.write_text("sentence\tlabel\n"
                     + "".join(f"{t}\t{['negative', 'positive'][i % 2]}\n" for i, t in enumerate(texts)))
        return p, len(texts)
    if task == "ner":
        p = folder / "dev.conll"
        p.write_text("".join("".join(f"{w} {'B-PER' if w == 'he' else 'O'}\n" for w in t.split()) + "\n"
                             for t in texts))
        return p, len(texts)
    if task == "qa":
        qas = [{"id": str(i), "question": f"what {t.split()[0]} ?", "answers": [{"text": t.split()[2], "answer_start":
                len(" ".join(t.split()[:2])) + 1}]} for i, t in enumerate(texts)]
        data = {"data": [{"title": "t", "paragraphs": [{"context": t, "qas": [q]}]} for t, q in zip(texts, qas)]}
        p = folder / "dev.json"
        p.write_text(json.dumps(data))
        return p, len(texts)
    p = folder / "dev.jsonl"
    p.write_text("".join(json.dumps({"query": t, "positive": texts[i - 1],
                                     "negatives": [texts[i - 2], texts[i - 3]]}) + "\n"
                         for i, t in enumerate(texts[:20])))
    return p, 20


@pytest.fixture(scope="module")
def exported(root, tiny_tokenizer_dir) -> dict[str, tuple[Path, dict, Path, int]]:
    """Per task, its tiny model exported with FP32 + INT8 graphs and --dev: the folder, the agreement record the
    export returned, the dev file and its rows."""
    out = {}
    for task in ("classify", "ner", "qa", "rerank"):
        src = make_task_model(root, tiny_tokenizer_dir, task, seed=1)
        dev, rows = dev_file(task, root)
        dst = root / f"{task}_onnx"
        res = export(ExportConfig(model=str(src), out=str(dst), quantize="int8-dynamic", dev=str(dev)))
        out[task] = (dst, res.int8_agreement, dev, rows)
    return out


@pytest.mark.parametrize("task, measure", [("classify", "label"), ("ner", "token label"), ("qa", "answer span"),
                                           ("rerank", "top-1")])
def test_export_dev_records_the_agreement_in_the_card(exported, task, measure):
    folder, record, dev, rows = exported[task]
    card = read_card(folder)["int8_agreement"]
    assert card == {**record, "file": card["file"]}  # the file recorded relative to the folder (portable)
    assert card["rows"] == rows and card["measure"] == measure and card["threshold"] == 0.995
    assert (Path(folder) / card["file"]).resolve() == Path(dev).resolve() and 0.0 <= card["value"] <= 1.0
    assert card["units"] == (rows * 6 if task == "ner" else rows)  # ner: one unit per word (six a sentence)


@pytest.mark.parametrize("task", ["classify", "qa", "rerank"])
def test_the_agreement_is_what_the_two_graphs_answer(exported, task):
    """The card's figure is the share of dev rows that the Predictor answers the same on both graphs (the tiny
    random models give 100% on classify, less on qa and rerank, whose spans and top passages are near ties)."""
    folder, record, dev, _ = exported[task]
    fp32, int8 = (Predictor.load(folder, backend=b) for b in ("onnx-fp32", "onnx-int8"))
    if task == "classify":
        texts = [line.split("\t")[0] for line in dev.read_text().splitlines()[1:]]
        same = [a["label"] == b["label"] for a, b in zip(fp32.classify(texts), int8.classify(texts), strict=True)]
    elif task == "qa":
        items = [(q["question"], p["context"]) for a in json.loads(dev.read_text())["data"] for p in a["paragraphs"]
                 for q in p["qas"]]
        answers = [p.answer([q for q, _ in items], [c for _, c in items]) for p in (fp32, int8)]
        same = [(a["start"], a["end"]) == (b["start"], b["end"]) for a, b in zip(*answers, strict=True)]
    else:
        rows = [json.loads(line) for line in dev.read_text().splitlines()]
        same = [fp32.rerank(r["query"], [r["positive"], *r["negatives"]])[0]["index"]
                == int8.rerank(r["query"], [r["positive"], *r["negatives"]])[0]["index"] for r in rows]
    assert record["value"] == pytest.approx(float(np.mean(same)), abs=1e-6)


def test_without_dev_rows_the_card_says_none_was_measured(root, tiny_tokenizer_dir):
    src = make_task_model(root, tiny_tokenizer_dir, "classify", seed=1)
    export(ExportConfig(model=str(src), out=str(root / "no_dev"), quantize="int8-dynamic"))
    card = read_card(root / "no_dev")["int8_agreement"]
    assert card["value"] is None and "--dev" in card["why"]
    export(ExportConfig(model=str(src), out=str(root / "no_int8")))
    assert read_card(root / "no_int8")["int8_agreement"]["value"] is None
    assert "int8_agreement" not in inherited_card(root / "no_dev")  # a derived folder's graph is another one


def test_dev_without_int8_graph_is_refused():
    from encoderkit.errors import EncoderkitError

    with pytest.raises(EncoderkitError, match="--quantize int8-dynamic"):
        ExportConfig(model="m", out="o", dev="dev.tsv")


# -- auto: the rule and its reason --------------------------------------------------------------------------

def with_agreement(exported, root, name: str, record: dict | None) -> Path:
    """A copy of the classify export whose card records ``record`` (None: no record at all)."""
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(exported["classify"][0], folder)
    card = read_card(folder)
    card.pop("int8_agreement")
    if record is not None:
        card["int8_agreement"] = record
    (folder / "encoderkit.json").write_text(json.dumps(card))
    return folder


@pytest.mark.parametrize("cpu, value, backend, reason", [
    (VNNI_NO_BF16, 0.999, "onnx-int8", ("INT8: INT8 agrees on 99.9% of 872 dev rows >= 99.5%, and the CPU has "
                                        "AVX512-VNNI (run one text at a time: its activation scales come from the "
                                        "text alone, whatever its batch)")),
    (VNNI_NO_BF16, 0.987, "onnx-fp32", "FP32: INT8 agrees on 98.7% of 872 dev rows < 99.5%"),
    (VNNI_NO_BF16, 0.99499, "onnx-fp32", "FP32: INT8 agrees on 99.499% of 872 dev rows < 99.5%"),
    (AVX2_ONLY, 0.999, "onnx-fp32", "FP32: this CPU has no VNNI/AMX int8"),
    (VNNI_NO_BF16, None, "onnx-fp32", UNMEASURED),
])
def test_auto_follows_the_cpu_and_the_cards_agreement(exported, root, monkeypatch, cpu, value, backend, reason):
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(cpu, threads=2))
    record = {"value": value, "rows": 872, "units": 872, "measure": "label", "file": "dev.tsv", "threshold": 0.995}
    folder = with_agreement(exported, root, f"auto_{backend}_{value}", record if value is not None else
                            {"value": None, "why": "no dev rows given (export --dev FILE)"})
    p = Predictor.load(folder)
    assert (p.backend, p.backend_reason) == (backend, reason)
    assert resolve(folder).reason == reason


def test_auto_without_any_record_or_own_int8_graph_runs_fp32(exported, root, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    assert resolve(with_agreement(exported, root, "no_record", None)).reason == UNMEASURED
    plain = make_task_model(root, tiny_tokenizer_dir, "classify", seed=1)  # weights, no graph of its own
    assert resolve(plain).backend == "onnx-fp32"
    # embed keeps its own rule, whatever the card: on AVX2, OpenVINO's graph (never a per-batch-scaled engine)
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(AVX2_ONLY, threads=2))
    embed = resolve(make_task_model(root, tiny_tokenizer_dir, "embed"))
    assert embed.backend == "openvino"
    assert embed.reason.startswith("OpenVINO's fp32 graph: faithful and batch-independent")


@pytest.mark.parametrize("cpu, ready, backend, why", [
    (VNNI_NO_BF16, True, "openvino-int8", ("INT8: the embed task's rule, on OpenVINO's static INT8 (activation scales "
     "fixed by calibration: batch-independent)")),
    (VNNI_NO_BF16, False, "onnx-int8", "INT8: the embed task's rule, on ONNX Runtime (run one text at a time"),
    (BF16_AMX, True, "openvino", "OpenVINO's bf16 graph: faithful and batch-independent"),  # AMX: never dynamic INT8
    (AVX2_ONLY, True, "openvino", "OpenVINO's fp32 graph: faithful and batch-independent"),
])
def test_embed_auto_runs_openvino_int8_on_the_cpu_class_it_was_measured_faster_on(root, tiny_tokenizer_dir, monkeypatch,
                                                                                   cpu, ready, backend, why):
    from encoderkit.inference import engines

    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(cpu, threads=2))
    monkeypatch.setattr(engines, "openvino_ready", lambda: ready)
    choice = resolve(make_task_model(root, tiny_tokenizer_dir, "embed"))
    assert choice.backend == backend and choice.reason.startswith(why)


def test_embed_auto_keeps_a_folders_own_int8_graph(exported, root, tiny_tokenizer_dir, monkeypatch):
    from encoderkit.inference import engines
    from encoderkit.inference.export import export_onnx

    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    monkeypatch.setattr(engines, "openvino_ready", lambda: True)
    folder = root / "embed_with_own_int8"  # a copy: make_task_model shares one folder per task
    shutil.copytree(make_task_model(root, tiny_tokenizer_dir, "embed"), folder, dirs_exist_ok=True)
    export_onnx(folder, folder, int8=True)  # the user's own INT8 graph beside the weights
    assert resolve(folder).backend == "onnx-int8"


def test_embed_auto_on_openvino_int8_computes_what_fp32_computes(root, tiny_tokenizer_dir, monkeypatch):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    folder = make_task_model(root, tiny_tokenizer_dir, "embed")
    auto, fp32 = Predictor.load(folder), Predictor.load(folder, backend="onnx-fp32")
    assert auto.backend == "openvino-int8" and "OpenVINO's static INT8" in auto.backend_reason
    texts = ["the cat sat on the mat", "a dog ran", "the bird sang in the tree all day long"]
    a, b = auto.embed(texts), fp32.embed(texts)
    assert a.shape == b.shape and float(np.min(np.sum(a * b, axis=1))) > 0.95


# -- each task's measure, through its task object -------------------------------------------------------------

class FakeGraph:
    """An engine whose outputs follow the input tokens: ``fn(input_ids (B, T), token_type_ids) -> outputs``."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        ids = inputs["input_ids"]
        return [np.asarray(o, dtype=np.float32) for o in self.fn(ids, inputs.get("token_type_ids", np.zeros_like(ids)))]


def runners(root: Path, tokenizer_dir: Path, task: str, ref, other) -> tuple[AgreementRunner, AgreementRunner]:
    info = ModelFolder.open(make_task_model(root, tokenizer_dir, task, seed=1))
    tok = info.tokenizer()
    return AgreementRunner(info, tok, FakeGraph(ref), 4), AgreementRunner(info, tok, FakeGraph(other), 4)


def token_id(tokenizer_dir: Path, word: str) -> int:
    vocab = (tokenizer_dir / "vocab.txt").read_text().split("\n")
    return vocab.index(word)


def test_classify_measure_is_the_predicted_label(root, tiny_tokenizer_dir):
    bad = token_id(tiny_tokenizer_dir, "bad")

    def ref(ids, _):
        return [np.tile([0.0, 1.0], (len(ids), 1))]

    def other(ids, _):  # a text with "bad" in it flips to the other label
        return [np.where((ids == bad).any(1, keepdims=True), [1.0, 0.0], [0.0, 1.0])]

    texts = sentences(10, seed=3)
    texts = [t + " bad" if i in (1, 4, 8) else t.replace("bad", "good") for i, t in enumerate(texts)]
    a = get_task("classify").agreement(*runners(root, tiny_tokenizer_dir, "classify", ref, other),
                                       [{"text": t} for t in texts])
    assert (a.value, a.rows, a.units, a.measure) == (0.7, 10, 10, "label")


def test_multilabel_measure_is_the_label_set(root, tiny_tokenizer_dir):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from encoderkit.models.card import write_card
    from tests.conftest import tiny_bert_config

    folder = root / "tiny_multilabel"
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    names = ["film", "love", "tech"]
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tok), num_labels=3, problem_type="multi_label_classification",
                                                   id2label=dict(enumerate(names)))).save_pretrained(folder)
    tok.save_pretrained(folder)
    write_card(folder, "finetune", None, {}, task="multilabel", labels=names, thresholds=dict.fromkeys(names, 0.5))
    bad = token_id(tiny_tokenizer_dir, "bad")

    def ref(ids, _):  # {film, love} for every text
        return [np.tile([5.0, 5.0, -5.0], (len(ids), 1))]

    def other(ids, _):  # a text with "bad" loses "love"; every text's labels come in another order of logits
        return [np.where((ids == bad).any(1, keepdims=True), [5.0, -5.0, -5.0], [6.0, 4.0, -5.0])]

    texts = [t.replace("bad", "good") for t in sentences(8, seed=6)]
    texts[0] += " bad"
    info = ModelFolder.open(folder)
    ref_runner, other_runner = (AgreementRunner(info, info.tokenizer(), FakeGraph(f), 4) for f in (ref, other))
    a = get_task("multilabel").agreement(ref_runner, other_runner, [{"text": t} for t in texts])
    assert (a.value, a.rows, a.units, a.measure) == (7 / 8, 8, 8, "label set")


def test_ner_measure_is_each_words_tag(root, tiny_tokenizer_dir):
    movie = token_id(tiny_tokenizer_dir, "movie")

    def ref(ids, _):  # every token O
        out = np.zeros(ids.shape + (5,))
        out[..., 0] = 5.0
        return [out]

    def other(ids, _):  # "movie" tagged B-LOC
        out = ref(ids, _)[0]
        out[ids == movie] = [0.0, 0.0, 0.0, 5.0, 0.0]
        return [out]

    texts = [t.replace("movie", "film") for t in sentences(8, seed=4)]
    texts[2] += " movie"
    texts[5] = "movie " + texts[5] + " movie"
    words = sum(len(t.split()) for t in texts)
    a = get_task("ner").agreement(*runners(root, tiny_tokenizer_dir, "ner", ref, other), [{"text": t} for t in texts])
    assert (a.rows, a.units, a.measure) == (8, words, "token label")
    assert a.value == pytest.approx(1 - 3 / words)


def test_qa_measure_is_the_answer_span(root, tiny_tokenizer_dir):
    fun = token_id(tiny_tokenizer_dir, "fun")

    def peak(ids, where):  # start and end logits high at one position per row
        out = np.full(ids.shape, -10.0)
        out[np.arange(len(ids)), where] = 10.0
        return [out, out.copy()]

    def ref(ids, types):  # the first context token
        return peak(ids, (types == 1).argmax(1))

    def other(ids, types):  # the last "fun" of the context where there is one
        has = ((ids == fun) & (types == 1)).any(1)
        last = ids.shape[1] - 1 - np.argmax(((ids == fun) & (types == 1))[:, ::-1], axis=1)
        return peak(ids, np.where(has, last, (types == 1).argmax(1)))

    contexts = [t.replace("fun", "good") for t in sentences(10, seed=5)]
    contexts[0] += " fun"
    contexts[3] += " fun"
    records = [{"question": "what is it ?", "context": c} for c in contexts]
    a = get_task("qa").agreement(*runners(root, tiny_tokenizer_dir, "qa", ref, other), records)
    assert (a.value, a.rows, a.units, a.measure) == (0.8, 10, 10, "answer span")


def test_rerank_measure_is_each_querys_top_passage(root, tiny_tokenizer_dir):
    good, bad = token_id(tiny_tokenizer_dir, "good"), token_id(tiny_tokenizer_dir, "bad")

    def ref(ids, _):  # relevance: how often "good" occurs
        return [(ids == good).sum(1, keepdims=True).astype(float)]

    def other(ids, _):  # a query with "bad" in it turns the scores around
        score = (ids == good).sum(1, keepdims=True).astype(float)
        return [np.where((ids == bad).any(1, keepdims=True), -score, score)]

    queries = ["a movie", "the bad film", "a story", "bad code"]
    records = [{"query": q, "passages": ["the movie", "a good movie", "the film"]} for q in queries]
    a = get_task("rerank").agreement(*runners(root, tiny_tokenizer_dir, "rerank", ref, other), records)
    assert (a.value, a.rows, a.units, a.measure) == (0.5, 4, 4, "top-1")


# -- compress: a recipe's INT8 step records its agreement too --------------------------------------------------

def test_compress_records_the_int8_steps_agreement(exported, root, tiny_tokenizer_dir):
    from encoderkit.compress.stack import CompressConfig
    from encoderkit.compress.stack import run as compress

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu-ptq.yaml"
    src = make_task_model(root, tiny_tokenizer_dir, "classify", seed=1)
    out = root / "compressed"
    compress(CompressConfig(recipe=str(recipe), model=str(src), dev=str(root / "dev.tsv"), out=str(out), seq_len=32,
                            repeats=1))
    card = read_card(out / "01-quantize")["int8_agreement"]
    assert card["rows"] == 40 and card["measure"] == "label" and 0.0 <= card["value"] <= 1.0
