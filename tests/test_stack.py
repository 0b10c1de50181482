"""Recipe runner: validation errors name step and field; a two-lever stack writes per-step folders
and a report whose numbers are measured on each step's own model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.compress.measure import StepMeasurer
from encoderkit.compress.stack import CompressConfig, validate_recipe
from encoderkit.compress.stack import run as compress
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS, tiny_bert_config


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("clf")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(3)
    cfg = tiny_bert_config(len(tok), num_hidden_layers=2, num_labels=2, id2label={0: "neg", 1: "pos"},
                           label2id={"neg": 0, "pos": 1})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():  # a head whose decisions depend on the input, so that pruning changes some
        model.classifier.weight.mul_(50.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dev_tsv(tmp_path_factory, classifier_dir) -> Path:
    """48 sentences labelled with the starting model's own predictions (its accuracy is 1.0)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    g = torch.Generator().manual_seed(1)
    texts = [" ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,), generator=g)) for _ in range(48)]
    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = BertForSequenceClassification.from_pretrained(classifier_dir).eval()
    with torch.no_grad():
        pred = model(**tok(texts, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    p = tmp_path_factory.mktemp("dev") / "dev.tsv"
    p.write_text("sentence\tlabel\n" + "".join(f"{t} \t{model.config.id2label[y]}\n" for t, y in zip(texts, pred)))
    return p


@pytest.mark.parametrize(
    "steps, pattern",
    [
        ([{"lever": "quantize", "method": "dynamic"}, {"lever": "shrink"}],
         r"step 2 \(lever 'shrink'\): unknown lever"),
        ([{"lever": "prune", "method": "heads", "amuont": 0.3}], r"step 1 \(lever 'prune'\): unknown field 'amuont'"),
        ([{"lever": "prune", "method": "heads"}, {"lever": "quantize", "method": "int3"}],
         r"step 2 \(lever 'quantize'\).*method"),
        ([{"lever": "prune", "method": "heads", "amount": 1.5}], r"step 1 \(lever 'prune'\).*amount"),
        ([{"lever": "distill", "model": "x"}], r"step 1 \(lever 'distill'\): field 'model' is set by the runner"),
        ([{"lever": "prune", "method": "structured"}], r"step 1 \(lever 'prune'\).*'heads' and/or 'ffn'"),
        ([{"method": "dynamic"}], r"step 1 must be a mapping with a 'lever' key"),
        ([], r"non-empty list"),
    ],
)
def test_recipe_errors_name_the_step_and_the_field(steps, pattern):
    with pytest.raises(EncoderkitError, match=pattern):
        validate_recipe({"steps": steps}, source="r.yaml")


def test_shorthands_expand_to_lever_calls():
    steps = validate_recipe({"steps": [
        {"lever": "prune", "method": "structured", "heads": 0.25, "ffn": 0.5, "recover_steps": 10},
        {"lever": "quantize", "method": "dynamic-int8"},
    ]})
    assert steps[0].calls == [{"method": "heads", "amount": 0.25},
                              {"method": "ffn", "amount": 0.5, "recovery_steps": 10}]
    assert steps[1].calls == [{"method": "dynamic", "format": "onnx"}]
    # one quantization step per recipe: gptq is checked in a recipe of its own
    assert validate_recipe({"steps": [{"lever": "gptq", "bits": 4}]})[0].calls == [{"method": "gptq", "bits": 4}]


def test_bad_recipe_writes_nothing(classifier_dir, dev_tsv, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n  - {lever: quantize, method: dynamic}\n  - {lever: prune, heds: 0.3}\n")
    out = tmp_path / "out"
    with pytest.raises(EncoderkitError, match=r"step 2 \(lever 'prune'\): unknown field 'heds'"):
        compress(CompressConfig(recipe=str(recipe), model=str(classifier_dir), dev=str(dev_tsv), out=str(out)))
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def _accuracy(model, tok, tsv: Path) -> float:
    rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
    enc = tok([r[0] for r in rows], padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        pred = model(**enc).logits.argmax(-1)
    gold = torch.tensor([model.config.label2id[r[1].strip()] for r in rows])
    return (pred == gold).double().mean().item()


def test_two_lever_stack_remeasures_every_step(classifier_dir, dev_tsv, tmp_path):
    from transformers import AutoTokenizer

    from encoderkit.compress.packing import load_model
    from encoderkit.models.card import lineage

    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n"
                      "  - {lever: prune, method: ffn, amount: 0.5, importance: magnitude}\n"
                      "  - {lever: quantize, method: rtn, bits: 4, group_size: 16}\n")
    out = tmp_path / "out"
    res = compress(CompressConfig(recipe=str(recipe), model=str(classifier_dir), dev=str(dev_tsv), out=str(out),
                                  runtime="torch", seq_len=64, repeats=2))
    names = sorted(p.name for p in out.iterdir())
    # progress.json: what --resume continues
    assert names == ["01-prune", "02-quantize", "progress.json", "report.json", "report.md", "report.png"]
    rows = json.loads((out / "report.json").read_text())["steps"]
    assert [r["lever"] for r in rows] == ["start", "prune", "quantize"]
    # sizes shrink step by step and are the bytes of each step's own weights
    assert rows[1]["params"] < rows[0]["params"]
    assert rows[2]["bytes"] < rows[1]["bytes"] < rows[0]["bytes"]
    assert rows[2]["bytes"] == (out / "02-quantize" / "model.quantized.safetensors").stat().st_size
    # quality of step 2 is what step 2's model scores on the dev set (not start + deltas)
    tok = AutoTokenizer.from_pretrained(out / "02-quantize")
    for i, folder in ((1, out / "01-prune"), (2, out / "02-quantize")):
        assert rows[i]["quality"] == pytest.approx(_accuracy(load_model(folder), tok, dev_tsv), abs=1e-9)
    for r in rows:
        # latency of one request (a typical dev example, at most --seq-len sub-tokens) and of 32 requests
        assert r["latency_b1_ms"] > 0 and r["latency_b32_ms"] > 0 and 0 < r["seq_len"] <= 64 and r["dev_examples"] == 48
        assert r["latency_unit"] == "request" and r["metric"] == "accuracy" and r["task"] == "classify"
    # lineage: step 2 -> step 1 -> the starting model, the parents recorded relative to each folder (portable)
    chain = lineage(out / "02-quantize")
    assert [c["folder"] for c in chain[:2]] == [str(out / "02-quantize"), str(out / "01-prune")]
    assert chain[0]["parent"] == "../01-prune" and not Path(chain[1]["parent"]).is_absolute()
    assert (out / "01-prune" / chain[1]["parent"]).resolve() == classifier_dir.resolve()
    assert chain[0]["recipe_step"] == 2 and chain[0]["metrics"]["recipe_measurement"]["quality"] == rows[2]["quality"]
    assert "| 2 | quantize |" in (out / "report.md").read_text()
    assert res.rows[2]["quality"] == rows[2]["quality"]


def test_measurer_uses_the_deploy_runtime_for_plain_folders(classifier_dir, dev_tsv):
    row = StepMeasurer(str(dev_tsv), seq_len=32, repeats=2)(classifier_dir)
    assert row["runtime"] == "deploy onnx-fp32"
    assert row["bytes"] == (classifier_dir / "model.safetensors").stat().st_size
    from transformers import AutoTokenizer

    from encoderkit.compress.packing import load_model

    torch_acc = _accuracy(load_model(classifier_dir), AutoTokenizer.from_pretrained(classifier_dir), dev_tsv)
    assert row["quality"] == pytest.approx(torch_acc, abs=1 / 48 + 1e-9)  # ONNX fp32 agrees with torch


def test_shipped_recipes_are_valid():
    from encoderkit.compress.stack import load_recipe

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert recipes
    for r in recipes:
        assert load_recipe(r), r


def test_int8_onnx_step_is_measured_in_the_deploy_runtime(classifier_dir, dev_tsv, tmp_path):
    """The PTQ recipe: the step folder holds only the INT8 ONNX graph; its row is measured by the
    deploy runtime on that graph, and its bytes are that graph's bytes."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu-ptq.yaml"
    out = tmp_path / "out"
    res = compress(CompressConfig(recipe=str(recipe), model=str(classifier_dir), dev=str(dev_tsv), out=str(out),
                                  seq_len=32, repeats=2))
    start, step = res.rows
    assert start["runtime"] == "deploy onnx-fp32" and step["runtime"] == "deploy onnx-int8"
    onnx_bytes = sum(p.stat().st_size for p in (out / "01-quantize").glob("model.int8.onnx*"))
    assert step["bytes"] == onnx_bytes  # (on a model this tiny the embeddings dominate, so INT8 saves little)
    assert step["params"] == start["params"]  # one count for the torch folder and its INT8 graph
    assert step["quality"] >= 0.9  # INT8 keeps the tiny model's own decisions on most of the dev set
