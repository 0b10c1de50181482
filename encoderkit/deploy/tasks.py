"""What a model folder does: its task, labels, pooling and maximum length, read without loading weights.

The task comes from ``encoderkit.json`` (``task``) when present; otherwise a sentence-transformers
folder (``modules.json``) is ``embed`` and a plain HF folder is judged by ``config.architectures``
(``*ForSequenceClassification`` -> ``classify``, or ``rerank`` with one label;
``*ForTokenClassification`` -> ``ner``; ``*ForQuestionAnswering`` -> ``qa``; ``*ForMaskedLM`` ->
``mlm``; a bare encoder such as ``BertModel`` -> ``embed`` with mean pooling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_card

SERVABLE = ("classify", "ner", "qa", "rerank", "embed")
ONNX_FP32 = "model.onnx"
ONNX_INT8 = "model.int8.onnx"


@dataclass
class TaskInfo:
    """The serving facts of one model folder."""

    task: str
    labels: list[str] = field(default_factory=list)  # index -> label name (classify, ner)
    pooling: str = "mean"  # embed: "mean" or "cls"
    normalize: bool = True  # embed: L2-normalise by default (sentence-transformers Normalize module)
    max_length: int = 512  # tokens, special tokens included
    num_labels: int = 0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EncoderkitError(f"{path} could not be read as JSON ({e}); fix or re-create the model folder") from e
    if not isinstance(data, dict):
        raise EncoderkitError(f"{path} must hold a JSON object")
    return data


def _task_from_architectures(config: dict[str, Any], folder: Path) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch.endswith("ForSequenceClassification"):
            return "rerank" if int(config.get("num_labels", len(config.get("id2label") or {}) or 2)) == 1 else "classify"
        if arch.endswith("ForTokenClassification"):
            return "ner"
        if arch.endswith("ForQuestionAnswering"):
            return "qa"
        if arch.endswith(("ForMaskedLM", "ForPreTraining")):
            return "mlm"
        if arch.endswith("Model"):
            return "embed"
    raise EncoderkitError(
        f"{folder}: cannot tell the task (no encoderkit.json 'task', no modules.json, "
        f"config.architectures={archs!r}); add encoderkit.json with a 'task' field"
    )


def detect_task(folder: str | Path) -> TaskInfo:
    """Read ``folder``'s task, labels, pooling and length limit (no weights are loaded)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EncoderkitError(f"model folder {folder} does not exist; pass a folder made by encoderkit or an HF model folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise EncoderkitError(f"{folder} has no config.json; it is not an HF model folder")
    config = _read_json(cfg_path)
    card = read_card(folder)
    is_st = (folder / "modules.json").is_file()
    task = card.get("task") or ("embed" if is_st else _task_from_architectures(config, folder))
    if task not in SERVABLE + ("mlm",):
        raise EncoderkitError(f"{folder}/encoderkit.json: task {task!r} is not one of {', '.join(SERVABLE)}")

    id2label = config.get("id2label") or {}
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label))]
    if card.get("labels"):
        labels = [str(x) for x in card["labels"]]
    info = TaskInfo(task=task, labels=labels, num_labels=int(config.get("num_labels", len(labels) or 0)))

    max_pos = int(config.get("max_position_embeddings", 512))
    max_length = max_pos
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        tml = _read_json(tok_cfg).get("model_max_length")
        if isinstance(tml, (int, float)) and 0 < tml < 1e6:
            max_length = min(max_length, int(tml))
    if is_st:
        sbert = folder / "sentence_bert_config.json"
        if sbert.is_file():
            msl = _read_json(sbert).get("max_seq_length")
            if isinstance(msl, int) and msl > 0:
                max_length = min(max_length, msl)
        pool_cfg = folder / "1_Pooling" / "config.json"
        if pool_cfg.is_file():
            pc = _read_json(pool_cfg)
            if pc.get("pooling_mode_cls_token"):
                info.pooling = "cls"
            elif pc.get("pooling_mode_mean_tokens", True):
                info.pooling = "mean"
            else:
                raise EncoderkitError(f"{pool_cfg}: only mean and cls pooling are supported")
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
        info.normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    if card.get("pooling"):
        info.pooling = str(card["pooling"])
    if "normalize" in card:
        info.normalize = bool(card["normalize"])
    if card.get("max_length"):
        max_length = min(max_pos, int(card["max_length"]))
    info.max_length = max_length
    if info.task == "embed" and info.pooling not in ("mean", "cls"):  # task heads pool inside the model
        raise EncoderkitError(f"{folder}: pooling {info.pooling!r} is not supported; use 'mean' or 'cls'")
    return info


def onnx_file(folder: str | Path, int8: bool) -> Path | None:
    """The exported ONNX graph in ``folder`` (INT8 or FP32), or None when the folder has none."""
    p = Path(folder) / (ONNX_INT8 if int8 else ONNX_FP32)
    return p if p.is_file() else None


def auto_class(task: str):
    """The ``transformers`` Auto class that holds ``task``'s weights (see docs/CONTRACTS.md)."""
    import transformers

    return {
        "classify": transformers.AutoModelForSequenceClassification,
        "rerank": transformers.AutoModelForSequenceClassification,
        "ner": transformers.AutoModelForTokenClassification,
        "qa": transformers.AutoModelForQuestionAnswering,
        "embed": transformers.AutoModel,
        "mlm": transformers.AutoModelForMaskedLM,
    }[task]


def check_servable(folder: str | Path, info: TaskInfo) -> None:
    """Refuse a folder whose task cannot be served or whose weights do not hold that task's head."""
    folder = Path(folder)
    if info.task not in SERVABLE:
        raise EncoderkitError(
            f"{folder} is a {info.task!r} model; export, predict and serve take one of {', '.join(SERVABLE)} "
            f"(fine-tune it first: encoderkit finetune)"
        )
    archs = _read_json(folder / "config.json").get("architectures") or []
    if info.task == "embed" or not archs:
        return
    expected = {"classify": "ForSequenceClassification", "rerank": "ForSequenceClassification",
                "ner": "ForTokenClassification", "qa": "ForQuestionAnswering"}[info.task]
    if not any(a.endswith(expected) for a in archs):
        raise EncoderkitError(
            f"{folder}: encoderkit.json says task {info.task!r} but config.json architectures are {archs}; "
            f"a {info.task!r} model needs a *{expected} head. Fix the 'task' field or use the right folder"
        )


def load_torch_model(folder: str | Path, info: TaskInfo, dtype=None, attn: str = "eager"):
    """The eval-mode ``transformers`` model for ``info.task``; ``attn="eager"`` traces cleanly for ONNX export.

    Loaded through :func:`encoderkit.models.rebuild.load_model`, which also rebuilds quantized and
    head-pruned folders (written by the compression levers; weights dequantized to fp32) and applies
    a recorded classifier pooling.
    """
    from encoderkit.models.rebuild import load_model

    try:
        model = load_model(folder, auto_class(info.task), attn_implementation=attn)
    except (OSError, ValueError) as e:
        raise EncoderkitError(f"{folder}: could not load the {info.task} model ({e})") from e
    if dtype is not None:
        model = model.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model
