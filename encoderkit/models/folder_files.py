"""What a derived model folder copies from its source (:func:`copy_side_files`: the tokenizer, the
sentence-transformers modules, ``README.md``...), and the fingerprint of what a folder computes with.

Never copied: the card and a lever's ``report.json`` (facts of the source), hidden entries (``.git``, run
checkpoints), and exported graphs and ``checkpoints/`` (made from weights the new folder does not hold).
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from encoderkit.errors import EncoderkitError
from encoderkit.models.card import CARD
from encoderkit.models.rebuild import QUANT_FILE
from encoderkit.models.sparse import SPARSE_FILE

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", QUANT_FILE, SPARSE_FILE, "config.json")
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
_NEVER_FILES = (CARD, "report.json")
_NEVER_SUFFIXES = (".onnx", ".data")
_NEVER_FOLDERS = ("onnx", "openvino", "checkpoints", "adapt")  # adapt/: the queries and negatives of an adapt run
_MODULE_FOLDER = re.compile(r"\d+_")  # a sentence-transformers module: 1_Pooling, 2_Normalize


def copy_side_files(src: str | Path, dst: str | Path, *, weights: bool = False,
                    sentence_transformers_only: bool = False) -> None:
    """Copy the files of model folder ``src`` that a folder made from it keeps into ``dst`` (see the module
    docstring), replacing files of the same name there.

    ``weights``: also the weights and ``config.json`` (an export: the new folder holds the same model).
    ``sentence_transformers_only``: only ``modules.json``, its configs and the module folders (a distilled
    embedding student: it saves its own tokenizer, and the teacher's README is not the student's).
    Files are copied, not linked (an in-place edit of either folder's file would change the other) and get
    the new folder's own permissions (umask), not the source's mode."""
    src, dst = Path(src), Path(dst)
    for p in sorted(src.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            if p.name in _NEVER_FOLDERS or sentence_transformers_only and not _MODULE_FOLDER.match(p.name):
                continue
        elif (p.name in _NEVER_FILES or p.suffix in _NEVER_SUFFIXES or not weights and p.name in WEIGHT_FILES
              or sentence_transformers_only and p.name not in SENTENCE_TRANSFORMERS_FILES):
            continue
        _copy(p, dst / p.name)


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            _copy(p, dst / p.name)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def model_fingerprint(folder: str | Path) -> str:
    """sha256 (first 16 hex) of a model folder's weights, tokenizer, config and pooling files: two folders
    with the same fingerprint compute the same outputs (an index's embedder, a cache's key)."""
    folder = Path(folder)
    h = hashlib.sha256()
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".onnx", ".bin") and p.is_file())
    names += [n for n in ("tokenizer.json", "vocab.txt", "config.json", "1_Pooling/config.json")
              if (folder / n).is_file()]
    if not names:
        raise EncoderkitError(f"{folder}: no model weights found to fingerprint")
    for n in names:
        h.update(n.encode())
        with open(folder / n, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
