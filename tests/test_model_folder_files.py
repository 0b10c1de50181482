"""What a folder made from a model folder copies from it (:func:`encoderkit.models.folder_files.copy_side_files`):
one rule for every stage, with the two real differences (an export keeps the weights; a distilled embedding
student takes only the sentence-transformers modules)."""

from __future__ import annotations

from pathlib import Path

from encoderkit.models.folder_files import copy_side_files

SOURCE = [
    "config.json", "model.safetensors", "model.quantized.safetensors", "tokenizer.json", "vocab.txt",
    "tokenizer_config.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "1_Pooling/config.json", "2_Normalize/.keep", "README.md", "encoderkit.json", "report.json", "model.onnx",
    "model.int8.onnx", "model.onnx.data", "onnx/model_O2.onnx", "openvino/model.xml", "checkpoints/step-1/x",
    ".git/HEAD", ".out.run/state",
]


def files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def copied(tmp_path: Path, **kw) -> set[str]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for name in SOURCE:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(name, encoding="utf-8")
    dst.mkdir()
    copy_side_files(src, dst, **kw)
    assert all((dst / n).read_text(encoding="utf-8") == n for n in files(dst))
    return files(dst)


SIDE = {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "modules.json", "sentence_bert_config.json",
        "config_sentence_transformers.json", "1_Pooling/config.json", "2_Normalize/.keep", "README.md"}


def test_a_lever_keeps_the_tokenizer_and_modules_but_not_weights_card_reports_or_graphs(tmp_path):
    assert copied(tmp_path) == SIDE


def test_an_export_also_keeps_the_weights_and_config(tmp_path):
    assert copied(tmp_path, weights=True) == SIDE | {"config.json", "model.safetensors", "model.quantized.safetensors"}


def test_an_embedding_student_takes_only_the_sentence_transformers_modules(tmp_path):
    assert copied(tmp_path, sentence_transformers_only=True) == {
        "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
        "2_Normalize/.keep"}
