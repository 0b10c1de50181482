"""Packed sparse weights (encoderkit/models/sparse.py): 2:4 and unstructured pruning write fewer bytes, unpack
bit-identically, refuse damaged files, export to ONNX, and the compress report shows bytes per non-zero weight."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from encoderkit.compress.packing import load_model
from encoderkit.compress.prune import PruneConfig, magnitude_masks, prune, semi_structured_masks
from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder
from encoderkit.models.sparse import INDEX, SPARSE_FILE, SPARSE_KEY, VALUES, read_sparse, save_sparse
from tests.conftest import WORDS, tiny_bert_config

TEXTS = [" ".join(WORDS[(i * 5 + j * 7) % len(WORDS)] for j in range(5 + i % 7)) for i in range(16)]


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("sparse_parent")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(5)
    cfg = tiny_bert_config(len(tok), num_hidden_layers=2, num_labels=2, id2label={0: "neg", 1: "pos"},
                           label2id={"neg": 0, "pos": 1})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():  # decisions that depend on the input
        model.classifier.weight.mul_(50.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def two_four(parent, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("p24") / "p"
    prune(parent, PruneConfig(method="2:4", measure=False), out)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _expected(parent: Path, masks_of) -> dict[str, torch.Tensor]:
    """The parent's state with the lever's masks applied (plain zeros), what the folder must hold exactly."""
    model = load_model(parent)
    masks = masks_of(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, m in masks.items():
        state[f"{name}.weight"] = torch.where(m.bool(), state[f"{name}.weight"], 0.0)
    return state


def _packed_names(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[SPARSE_KEY])


def test_two_four_folder_is_packed_small_and_reloads_bit_identically(parent, two_four) -> None:
    assert not (two_four / "model.safetensors").exists() and (two_four / SPARSE_FILE).is_file()
    layout = _packed_names(two_four / SPARSE_FILE)
    assert len(layout) == 2 * 6 and {m["scheme"] for m in layout.values()} == {"2:4"}  # every block Linear
    # bytes on disk of the pruned blocks' weights (what the file holds for them) against their dense bytes
    with safe_open(str(two_four / SPARSE_FILE), "pt") as f:
        stored = sum(f.get_tensor(n + p).numel() * f.get_tensor(n + p).element_size() for n in layout
                     for p in (VALUES, INDEX))
    dense = sum(int(np.prod(m["shape"])) * 4 for m in layout.values())
    assert stored <= 0.6 * dense
    assert (two_four / SPARSE_FILE).stat().st_size < (parent / "model.safetensors").stat().st_size - 0.4 * dense
    # every tensor bit-identical to the masked parent, so the logits are the same
    expected = _expected(parent, semi_structured_masks)
    got = load_model(two_four).state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(_bits(got[k]), _bits(v)) if v.is_floating_point() else torch.equal(got[k], v), k
    report = json.loads((two_four / "report.json").read_text())["details"]
    assert report["packed"]["bytes_per_nonzero"] == pytest.approx(4.25)  # fp32 value + 2 bits
    assert report["packed"]["packed_bytes"] == stored


@pytest.mark.parametrize(("amount", "scheme"), [(0.6, "bitmask"), (0.97, "delta")])
def test_unstructured_folder_picks_the_smaller_index_and_reloads_exactly(parent, tmp_path, amount, scheme) -> None:
    out = tmp_path / "u"
    rep = prune(parent, PruneConfig(method="magnitude", amount=amount, scope="layer", measure=False), out)
    assert {m["scheme"] for m in _packed_names(out / SPARSE_FILE).values()} == {scheme}
    expected = _expected(parent, lambda m: magnitude_masks(m, amount, "layer"))
    got = load_model(out).state_dict()
    for k, v in expected.items():
        assert torch.equal(_bits(got[k]), _bits(v)) if v.is_floating_point() else torch.equal(got[k], v), k
    assert rep.details["packed"]["packed_bytes"] < (0.5 if amount < 0.9 else 0.1) * rep.details["packed"]["dense_bytes"]


def test_negative_zeros_and_low_sparsity_survive_the_packing(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g)
    w[w.abs() < 0.7] = 0.0
    w[0, :3] = torch.tensor([-0.0, 0.0, -0.0])  # a sign bit on a zero is kept
    dense = torch.randn(8, 16, generator=g)  # nothing to save: stays dense
    stats = save_sparse({"w": w, "d": dense, "b": torch.ones(3)}, ["w", "d"], tmp_path / SPARSE_FILE)
    assert stats["packed"] == 1
    back = read_sparse(tmp_path / SPARSE_FILE)
    assert torch.equal(_bits(back["w"]), _bits(w)) and torch.equal(back["d"], dense)


def test_the_folder_says_how_it_loads_and_plain_transformers_refuses_it(two_four) -> None:
    from transformers import AutoModelForSequenceClassification

    card = json.loads((two_four / "encoderkit.json").read_text())
    assert card["loads_with"].startswith("encoderkit only") and SPARSE_FILE in card["loads_with"]
    assert json.loads((two_four / "config.json").read_text())[SPARSE_KEY]["method"] == "2:4"
    with pytest.raises(OSError):  # no model.safetensors: refused, not loaded with zeros or random weights
        AutoModelForSequenceClassification.from_pretrained(two_four)


def test_export_to_onnx_works_from_a_packed_folder(two_four, tmp_path) -> None:
    from transformers import AutoTokenizer

    from encoderkit.inference.export import ExportConfig, ort_session
    from encoderkit.inference.export import run as export

    res = export(ExportConfig(model=str(two_four), out=str(tmp_path / "onnx")))
    tok = AutoTokenizer.from_pretrained(two_four)
    enc = tok(TEXTS, padding=True, return_tensors="np")
    sess = ort_session(res.out / "model.onnx")
    names = {i.name for i in sess.get_inputs()}
    onnx_logits = sess.run(None, {k: v.astype(np.int64) for k, v in enc.items() if k in names})[0]
    with torch.no_grad():
        torch_logits = load_model(two_four)(**tok(TEXTS, padding=True, return_tensors="pt")).logits.numpy()
    assert np.abs(onnx_logits - torch_logits).max() < 1e-4
    assert ModelFolder.open(res.out).sparse is not None  # the export copied the packed weights and their record


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_truncated_packed_file_is_refused(two_four, tmp_path) -> None:
    bad = _copy(two_four, tmp_path / "t")
    data = (bad / SPARSE_FILE).read_bytes()
    (bad / SPARSE_FILE).write_bytes(data[: len(data) - 1000])
    with pytest.raises(EncoderkitError, match=r"model\.sparse\.safetensors is damaged or truncated"):
        ModelFolder.open(bad).load()


def _rewrite(folder: Path, edit) -> None:
    path = folder / SPARSE_FILE
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    layout = json.loads(meta[SPARSE_KEY])
    edit(tensors, layout)
    save_file(tensors, str(path), metadata={**meta, SPARSE_KEY: json.dumps(layout)})


def _first(tensors) -> str:
    return min(k for k in tensors if k.endswith(VALUES))[: -len(VALUES)]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t, lay: t.update({_first(t) + VALUES: t[_first(t) + VALUES][:-2]}), r"values stored, the layout says"),
    (lambda t, lay: t.update({_first(t) + INDEX: t[_first(t) + INDEX][:-1]}), r"2:4 needs"),
    (lambda t, lay: lay[_first(t)].update(shape=[4, 4]), r"values stored, the layout says|2:4 needs"),
    (lambda t, lay: lay.pop(_first(t)), r"have no entry in the encoderkit_sparse layout"),
    (lambda t, lay: t.pop(_first(t) + INDEX), r"is missing"),
    (lambda t, lay: t[_first(t) + INDEX].fill_(0), r"not ascending"),
])
def test_damaged_packed_weights_are_refused_naming_the_matrix(two_four, tmp_path, edit, message) -> None:
    bad = _copy(two_four, tmp_path / "d")
    _rewrite(bad, edit)
    with pytest.raises(EncoderkitError, match=message) as e:
        ModelFolder.open(bad).load()
    assert "packed" in str(e.value) and "encoderkit prune" in str(e.value)


def test_compress_report_shows_bytes_per_nonzero_weight(parent, tmp_path) -> None:
    from encoderkit.compress.stack import CompressConfig
    from encoderkit.compress.stack import run as compress

    dev = tmp_path / "dev.tsv"
    model = load_model(parent)
    tok = ModelFolder.open(parent).tokenizer()
    with torch.no_grad():
        pred = model(**tok(TEXTS, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    dev.write_text("sentence\tlabel\n" + "".join(f"{t}\t{['neg', 'pos'][y]}\n" for t, y in zip(TEXTS, pred)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n  - {lever: prune, method: '2:4'}\n")
    out = tmp_path / "out"
    compress(CompressConfig(recipe=str(recipe), model=str(parent), dev=str(dev), out=str(out), seq_len=32,
                            repeats=1))  # the deploy runtime: an ONNX graph exported from the packed folder
    rows = json.loads((out / "report.json").read_text())["steps"]
    assert rows[0].get("bytes_per_nonzero") is None and rows[1]["bytes_per_nonzero"] == pytest.approx(4.25)
    assert rows[1]["bytes"] == (out / "01-prune" / SPARSE_FILE).stat().st_size < rows[0]["bytes"]
    table = (out / "report.md").read_text()
    assert "bytes/non-zero weight (packed)" in table and "| 4.25 |" in table
