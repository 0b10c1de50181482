"""The compatibility matrix, first part: every encoder family (tiny random configs built in-process,
tests/families.py) x every fine-tuning task, then ONNX export with its parity check, then predict on
the exported folder with ONNX Runtime against PyTorch.

A cell is one (family, task): the family's bare encoder fine-tuned 2 steps, then
(1) ``predict`` with PyTorch, checked against plain transformers (classify probabilities, embed mean
pooling) or against its input (entity and answer spans are the text they point at, a ranking is a
sorted permutation); (2) ``export`` (fp32, parity within 1e-3) and ``predict`` on the exported folder
with ``onnx-fp32`` and ``torch-fp32``, which must agree. Cells that fail today are marked xfail with
where and what they raise (PREDICT_XFAIL, EXPORT_XFAIL): such a cell must still raise that message,
and a fix shows up as a failure saying "DID NOT RAISE", which asks for the entry to be removed.

Compression levers (prune heads, prune FFN, dynamic INT8, task distillation) on each family's
fine-tuned classifier: a lever that works gives a smaller model (pruning, distillation: half the
layers) whose predictions are well formed (INT8: within 0.1 of fp32); a lever that refuses a family
must do so with an EncoderkitError naming the family, the stage and the model class (LEVER_REFUSED),
and leave no output (a family without an anatomy entry, refused through the CLI: tests/test_anatomy.py);
crashes are listed in LEVER_XFAIL with where they happen.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests import families
from tests.families import FAMILIES, TASKS, numbers, predict_records, strings

bpe_tokenizer_dir, family_dir, tuned = families.bpe_tokenizer_dir, families.family_dir, families.tuned  # the fixtures

# A known cell must still raise exactly that (else the test fails: fixed -> "DID NOT RAISE", remove it).
# (family, task) -> (where it fails today and why, a regex of the message raised). Empty: DeBERTa-v2 predicts
# (eager attention where a family has no sdpa kernel) and exports (the graph is fed only the inputs it kept).
PREDICT_XFAIL: dict[tuple[str, str], tuple[str, str]] = {}
EXPORT_XFAIL: dict[tuple[str, str], tuple[str, str]] = {}


def check_against_transformers(task: str, folder: Path, inputs: Path, records: list[dict]) -> None:
    """What predict returned, checked against plain transformers (classify, embed) or against its input
    (spans are the text they point at, a ranking is a sorted permutation)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if task in ("classify", "embed"):
        texts = inputs.read_text().splitlines()
        assert len(records) == len(texts)
        enc = tok(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
        with torch.no_grad():
            if task == "classify":
                model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
                probs = model(**enc).logits.softmax(-1).numpy()
                labels = [model.config.id2label[i] for i in range(probs.shape[1])]
                ours = np.array([[r["scores"][name] for name in labels] for r in records])
                np.testing.assert_allclose(ours, probs, atol=1e-4)
            else:
                hidden = AutoModel.from_pretrained(folder).eval()(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).float()
                mean = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
                np.testing.assert_allclose(np.array([r["embedding"] for r in records]), mean, atol=1e-4)
        return
    rows = [json.loads(line) for line in inputs.read_text().splitlines()] if inputs.suffix == ".jsonl" else \
        [{"text": t} for t in inputs.read_text().splitlines()]
    assert len(records) == len(rows)
    for row, rec in zip(rows, records):
        if task == "ner":
            assert all(row["text"][e["start"]:e["end"]] == e["entity"] for e in rec["entities"])
        elif task == "qa":
            assert row["context"][rec["start"]:rec["end"]] == rec["answer"] != ""
        else:
            ranking = rec["ranking"]
            assert sorted(r["index"] for r in ranking) == list(range(len(row["passages"])))
            assert [r["score"] for r in ranking] == sorted((r["score"] for r in ranking), reverse=True)


CELLS = [pytest.param(family, task, id=f"{family}-{task}") for family in FAMILIES for task in TASKS]


@contextlib.contextmanager
def known_failure(known: tuple[str, str] | None):
    """Run the body; for a known failing cell, require its exact message and report it as xfail."""
    if known is None:
        yield
        return
    where, pattern = known
    with pytest.raises(Exception) as info:  # any type: the message is checked below
        yield
    assert re.search(pattern, str(info.value)), str(info.value)
    pytest.xfail(where)


@pytest.mark.parametrize(("family", "task"), CELLS)
def test_family_finetunes_and_predicts(family, task, tuned, tmp_path) -> None:
    folder, inputs = tuned(family, task)
    with known_failure(PREDICT_XFAIL.get((family, task))):
        records = predict_records(folder, inputs, "torch-fp32", tmp_path / "out.jsonl")
    check_against_transformers(task, folder, inputs, records)


@pytest.mark.parametrize(("family", "task"), CELLS)
def test_family_exports_with_parity_and_onnx_predicts_like_torch(family, task, tuned, tmp_path) -> None:
    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export

    folder, inputs = tuned(family, task)
    with known_failure(EXPORT_XFAIL.get((family, task))):
        exported = export(ExportConfig(model=str(folder), out=str(tmp_path / "onnx")))
    assert "model.onnx" in exported.files and exported.parity["fp32_max_abs_diff"] <= 1e-3
    onnx = predict_records(tmp_path / "onnx", inputs, "onnx-fp32", tmp_path / "onnx.jsonl")
    torch_ = predict_records(tmp_path / "onnx", inputs, "torch-fp32", tmp_path / "torch.jsonl")
    assert len(onnx) == len(torch_) > 0
    for a, b in zip(onnx, torch_):
        np.testing.assert_allclose(numbers(a), numbers(b), atol=2e-3)
        if task != "rerank":  # a ranking may swap two near-equal scores
            assert strings(a) == strings(b)


# -- compression levers on each family's fine-tuned classifier --------------------------------------
LEVERS = ("prune-heads", "prune-ffn", "quantize-dynamic", "distill-task")
# (family, lever) -> the refusal (an EncoderkitError naming the family and the stage) it gives today, checked
# through the library. Empty: every family has an anatomy entry (encoderkit/models/anatomy.py), so every lever
# runs on it; a family without one is refused, through the CLI too, in tests/test_anatomy.py
LEVER_REFUSED: dict[tuple[str, str], str] = {}
# (family, lever) -> (where it breaks and why, a regex of the message): crashes, or a result that cannot be served
LEVER_XFAIL: dict[tuple[str, str], tuple[str, str]] = {}


def apply_lever(lever: str, folder: Path, train: Path, out: Path):
    if lever.startswith("prune"):
        from encoderkit.compress.prune import PruneConfig
        from encoderkit.compress.prune import run as prune

        return prune(PruneConfig(model=str(folder), out=str(out), method=lever.split("-")[1], amount=0.5,
                                 importance="magnitude", measure=False))
    if lever == "quantize-dynamic":
        from encoderkit.compress.quantize import QuantizeConfig
        from encoderkit.compress.quantize import run as quantize

        return quantize(QuantizeConfig(model=str(folder), out=str(out), method="dynamic", measure=False))
    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill

    return distill(DistillConfig(teacher=str(folder), out=str(out), mode="task", train=str(train), max_steps=2,
                                 batch_size=4, seq_len=16))


@pytest.mark.parametrize(("family", "lever"), [pytest.param(f, lv, id=f"{f}-{lv}") for f in FAMILIES for lv in LEVERS])
def test_family_compression_levers(family, lever, tuned, tmp_path) -> None:
    """Each lever on the family's classifier: the result is smaller where the lever removes weights,
    and predicts probabilities close to the original's (quantized) or at least well-formed ones."""
    from encoderkit.errors import EncoderkitError

    folder, inputs = tuned(family, "classify")
    refused = LEVER_REFUSED.get((family, lever))
    if refused:  # a clear refusal naming the model class, and no output left behind
        with pytest.raises(EncoderkitError, match=refused):
            apply_lever(lever, folder, folder.parent / "train.tsv", tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    with known_failure(LEVER_XFAIL.get((family, lever))):
        lever_and_checks(lever, folder, inputs, tmp_path)


def lever_and_checks(lever: str, folder: Path, inputs: Path, tmp_path: Path) -> None:
    apply_lever(lever, folder, folder.parent / "train.tsv", tmp_path / "out")
    before = predict_records(folder, inputs, "torch-fp32", tmp_path / "before.jsonl")
    after = predict_records(tmp_path / "out", inputs, "torch-fp32", tmp_path / "after.jsonl")
    assert [sorted(r["scores"]) for r in after] == [sorted(r["scores"]) for r in before]
    for r in after:
        assert abs(sum(r["scores"].values()) - 1) < 1e-4
    if lever == "quantize-dynamic":
        np.testing.assert_allclose(numbers(after[0]), numbers(before[0]), atol=0.1)
    if lever in ("prune-heads", "prune-ffn", "distill-task"):
        from transformers import AutoConfig

        def size(d: Path) -> int:
            from safetensors import safe_open

            with safe_open(d / "model.safetensors", framework="pt") as f:
                return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118

        assert size(tmp_path / "out") < size(folder), lever
        if lever == "distill-task":
            config = AutoConfig.from_pretrained(tmp_path / "out")
            assert config.num_hidden_layers == AutoConfig.from_pretrained(folder).num_hidden_layers // 2
