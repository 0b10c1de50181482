"""The one reader of a model folder: its facts (one rule each) and the completeness checks that every
stage gets from it, through the real CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder, task_from_config
from encoderkit.models.pooling import pooling_name

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink(missing_ok=True)
    return dst


def _tsv(path):
    path.write_text("sentence\tlabel\n" + "".join(f"the movie was {w}\t{lab}\n" for w, lab in
                                                  [("great", "positive"), ("dull", "negative")] * 4))
    return path


def test_task_rule_is_one_rule_for_evaluate_and_deploy():
    seq = {"architectures": ["BertForSequenceClassification"]}
    assert task_from_config({**seq, "id2label": {"0": "LABEL_0"}}) == "rerank"
    assert task_from_config({**seq, "id2label": {"0": "a", "1": "b"}}) == "classify"
    assert task_from_config({**seq, "num_labels": 1}) == "rerank"
    assert task_from_config({"architectures": ["BertForTokenClassification"]}) == "ner"
    assert task_from_config({"architectures": ["BertForMaskedLM"]}) == "mlm"
    assert task_from_config({"architectures": ["BertModel"]}) == "embed"
    import encoderkit.evaluate.run as evaluate_run

    assert not hasattr(evaluate_run, "infer_task")  # evaluate asks ModelFolder, as deploy does


def test_pooling_has_one_vocabulary():
    assert pooling_name("cls", "x") == "first" and pooling_name("first", "x") == "first"
    assert pooling_name("mean", "x") == "mean"
    with pytest.raises(EncoderkitError, match="'max'"):
        pooling_name("max", "card")


def test_facts_of_task_folders(tmp_path_factory, tiny_tokenizer_dir, tmp_path):
    root = tiny_root(tmp_path_factory)
    clf = ModelFolder.open(make_task_model(root, tiny_tokenizer_dir, "classify"))
    assert (clf.task, clf.labels, clf.pooling, clf.num_labels) == ("classify", ["negative", "positive"], "first", 2)
    assert clf.max_length == clf.positions == 128 and "torch" in clf.backends and clf.onnx(False) is None
    old = _copy(make_task_model(root, tiny_tokenizer_dir, "embed"), tmp_path / "old")
    card = json.loads((old / "encoderkit.json").read_text())
    (old / "encoderkit.json").write_text(json.dumps({**card, "pooling": "cls"}))  # an old card's word for it
    assert ModelFolder.open(old).pooling == "first"
    rerank = ModelFolder.open(make_task_model(root, tiny_tokenizer_dir, "rerank"))
    assert rerank.task == "rerank" and rerank.num_labels == 1


def _retask(src, dst, task):
    folder = _copy(src, dst)
    card = json.loads((folder / "encoderkit.json").read_text())
    (folder / "encoderkit.json").write_text(json.dumps({**card, "task": task}))
    return folder


def test_a_head_registered_in_one_line_is_opened_checked_and_loaded(tmp_path_factory, tiny_tokenizer_dir, tmp_path,
                                                                     monkeypatch):
    """The folder reader takes a task's head from the registry: its Auto class, the architecture suffix
    require_task checks and the pooling it records; a name the registry lacks is refused."""
    from encoderkit.models.heads import HEADS, Head

    root = tiny_root(tmp_path_factory)
    regression = _retask(make_task_model(root, tiny_tokenizer_dir, "classify"), tmp_path / "reg", "regression")
    with pytest.raises(EncoderkitError, match="task 'regression' is not one of mlm, classify"):
        ModelFolder.open(regression)
    monkeypatch.setitem(HEADS, "regression", Head("AutoModelForSequenceClassification", "ForSequenceClassification",
                                                  "classifier"))
    opened = ModelFolder.open(regression)
    assert (opened.task, opened.pooling, opened.require_task("regression")) == ("regression", "first", "regression")
    assert type(opened.load(task="regression")).__name__ == "BertForSequenceClassification"
    wrong = ModelFolder.open(_retask(make_task_model(root, tiny_tokenizer_dir, "ner"), tmp_path / "wrong",
                                     "regression"))
    with pytest.raises(EncoderkitError, match=r"a 'regression' model needs a \*ForSequenceClassification head"):
        wrong.require_task("regression")


def test_an_mlm_card_on_a_pretraining_head_passes_the_head_check(tmp_path):
    """BertForPreTraining holds an MLM head (task_from_config reads it as mlm), so its card's task stands."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForPreTraining"]}))
    (tmp_path / "encoderkit.json").write_text(json.dumps({"task": "mlm"}))
    assert ModelFolder.open(tmp_path, weights=False, tokenizer=False).require_task("mlm") == "mlm"


@pytest.fixture(scope="module")
def broken(tmp_path_factory, tiny_tokenizer_dir):
    """A classify folder without tokenizer files, and one whose model.safetensors is cut in half."""
    root = tiny_root(tmp_path_factory)
    base = tmp_path_factory.mktemp("broken")
    src = make_task_model(root, tiny_tokenizer_dir, "classify")
    no_tok = _copy(src, base / "no_tok", TOKENIZER_FILES)
    cut = _copy(src, base / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    texts = base / "in.txt"
    texts.write_text("the movie was great\n")
    return {"no_tok": no_tok, "cut": cut, "texts": texts, "tsv": _tsv(base / "dev.tsv"), "base": base}


def test_a_folder_without_tokenizer_is_refused_by_predict_serve_and_export(broken, capsys, monkeypatch):
    import uvicorn

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(a))
    folder, base = str(broken["no_tok"]), broken["base"]
    runs = {
        "predict": ["predict", "--model", folder, "--input", str(broken["texts"]), "--output", str(base / "p.jsonl"),
                    "--backend", "torch-fp32"],
        "serve": ["serve", "--model", folder],
        "export": ["export", "--model", folder, "--out", str(base / "onnx")],
    }
    for stage, argv in runs.items():
        assert main(argv) == 2, stage
        err = capsys.readouterr().err
        assert "holds no tokenizer files" in err and folder in err and "Traceback" not in err, (stage, err)
    assert not started  # serve refused while loading, before uvicorn started
    assert not (base / "p.jsonl").exists() and not (base / "onnx").exists()


def test_a_truncated_safetensors_file_is_named_by_every_stage(broken, capsys):
    cut, base = broken["cut"], broken["base"]
    weights = str(cut / "model.safetensors")
    runs = {
        "finetune": ["finetune", "--model", str(cut), "--task", "classify", "--train", str(broken["tsv"]),
                     "--out", str(base / "ft"), "--max-steps", "1"],
        "evaluate": ["evaluate", "--model", str(cut), "--data", str(broken["tsv"])],
        "predict":
            ["predict", "--model", str(cut), "--input", str(broken["texts"]), "--output", str(base / "p2.jsonl")],
        "export": ["export", "--model", str(cut), "--out", str(base / "onnx2")],
    }
    for stage, argv in runs.items():
        assert main(argv) == 2, stage
        err = capsys.readouterr().err
        assert f"{weights} is damaged or truncated" in err and "Traceback" not in err, (stage, err)


def test_evaluate_leaves_its_parsed_config_as_given(tmp_path_factory, tiny_tokenizer_dir, tmp_path):
    import dataclasses

    from encoderkit.evaluate.run import EvaluateConfig, run

    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    cfg = EvaluateConfig(model=str(folder), data=str(_tsv(tmp_path / "dev.tsv")), batch_size=4)
    before = dataclasses.asdict(cfg)
    assert run(cfg).task == "classify"
    assert dataclasses.asdict(cfg) == before  # task, batch_size, multi_label: read, never written back


def test_loading_a_folder_prints_one_line_and_no_tensor_parallel_warning(tmp_path_factory, tiny_tokenizer_dir):
    """transformers 5 warns that no layer "was sharded" when its loader's log level is raised; the load
    report is replaced by one line of what is new, and that warning must not leak to a newcomer's log.
    In a fresh process: transformers binds its log handler to the stderr of the moment it is configured."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    code = ("from transformers import AutoModel; from encoderkit.models.folder import ModelFolder; "
            f"ModelFolder.open({str(folder)!r}).load(AutoModel)")  # the classifier's head is left out: one line says so
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    assert "weights of the checkpoint not used" in err
    assert "sharded" not in err and "LOAD REPORT" not in err
