"""The one reader of a model folder: :class:`ModelFolder` reads ``config.json``, ``encoderkit.json``
and the sentence-transformers files once, checks the folder is complete, and loads the model.

    folder = ModelFolder.open("runs/sst2")          # config, weights readable, tokenizer files present
    folder.task, folder.labels, folder.pooling       # "classify", ["neg", "pos"], "first"
    model = folder.load()                            # eval-mode torch model (quantized/pruned folders rebuilt)
    tokenizer = folder.tokenizer()

Facts, each with one rule:

- ``task``: ``encoderkit.json``'s ``task``; else a sentence-transformers folder (``modules.json``)
  is ``embed``; else ``config.architectures``: ``*ForSequenceClassification`` is ``rerank`` with one
  label (``len(id2label)``) and ``classify`` with more, ``*ForTokenClassification`` ``ner``,
  ``*ForQuestionAnswering`` ``qa``, ``*ForMaskedLM`` ``mlm``, a bare encoder (``BertModel``) ``embed``.
- ``pooling``, one vocabulary everywhere: ``"first"`` (the first token, [CLS]) or ``"mean"`` (of the
  real tokens). The task's head in :data:`encoderkit.models.heads.HEADS` says which record is read, and
  :func:`encoderkit.models.pooling.recorded_pooling` reads it: a ``classifier`` head (classify, rerank,
  multilabel) ``config.json``'s ``classifier_pooling``; a ``sentence`` head (embed) the card, else
  ``1_Pooling/config.json``; a static embedding the mean. None for the other tasks.
- ``max_length``: the card's, else the sentence-transformers ``max_seq_length``, else the
  tokenizer's ``model_max_length``, each capped at the usable ``positions``
  (``max_position_embeddings``, less RoBERTa's padding offset).
- which backends exist: torch weights (``model.safetensors`` (never a pickled ``pytorch_model.bin``), or the
  quantized ``model.quantized.safetensors``, or the sparse-packed ``model.sparse.safetensors`` of a magnitude or
  2:4 pruned folder, :mod:`encoderkit.models.sparse`), ``model.onnx``, ``model.int8.onnx``; or, for a static
  embedding folder (``config.json``'s ``model_type: model2vec``, :mod:`encoderkit.models.static`), its
  token table (``static_weights``): an ``embed`` model with no transformer, mean-pooled, whole texts read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open

from encoderkit.errors import EncoderkitError
from encoderkit.models.card import CARD
from encoderkit.models.heads import HEADS
from encoderkit.models.names import resolve_model
from encoderkit.models.pooling import SENTENCE, apply_pooling, recorded_pooling
from encoderkit.models.pooling import STATIC as STATIC_POOLING
from encoderkit.models.rebuild import HEADS_KEY, QUANT_FILE, QUANT_KEY, rebuild_model
from encoderkit.models.sparse import SPARSE_FILE, SPARSE_KEY
from encoderkit.models.static import WEIGHTS_FILE as STATIC_WEIGHTS
from encoderkit.models.static import is_static_config
from encoderkit.models.tokenizer import TOKENIZER_FILES, load_tokenizer
from encoderkit.progress import note

ONNX_FP32 = "model.onnx"
ONNX_INT8 = "model.int8.onnx"
# never pytorch_model.bin: a pickle, which runs code as it loads
TORCH_WEIGHTS = ("model.safetensors", QUANT_FILE, SPARSE_FILE)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; an error naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise EncoderkitError(f"{path} cannot be read ({e.strerror or e}); fix its permissions, or copy the model "
                              "folder again") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EncoderkitError(f"{path} could not be read as JSON ({e}); fix or re-create the model folder") from e
    if not isinstance(data, dict):
        raise EncoderkitError(f"{path} must hold a JSON object; fix or re-create the model folder")
    return data


def check_safetensors(path: Path) -> None:
    """Refuse a damaged ``.safetensors`` file (truncated, bad header) with a message naming it."""
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except PermissionError as e:  # a file we may not read is not a damaged one
        raise EncoderkitError(f"{path} cannot be read: permission denied; fix its permissions (e.g. chmod u+r) or run "
                              "as a user who may read it") from e
    except Exception as e:  # SafetensorError, OSError: the file cannot be read as written
        raise EncoderkitError(f"{path} is damaged or truncated ({e}); copy it again or re-create the folder "
                              "with the stage that wrote it") from e


def num_labels_of(config: dict[str, Any]) -> int:
    """Labels of a classification head: ``len(id2label)`` (what ``save_pretrained`` writes), else ``num_labels``."""
    return len(config.get("id2label") or {}) or int(config.get("num_labels", 0) or 0)


def task_from_config(config: dict[str, Any]) -> str | None:
    """The task a plain HF ``config.json`` implies by its architectures (see the module doc), or None."""
    for arch in config.get("architectures") or []:
        if arch.endswith("ForSequenceClassification"):
            return "rerank" if num_labels_of(config) == 1 else "classify"
        if arch.endswith("ForTokenClassification"):
            return "ner"
        if arch.endswith("ForQuestionAnswering"):
            return "qa"
        if arch.endswith(("ForMaskedLM", "ForPreTraining")):
            return "mlm"
        if arch.endswith("Model"):
            return "embed"
    return None


def usable_positions(config: dict[str, Any]) -> int | None:
    """Sub-tokens the model takes at once: ``max_position_embeddings`` less RoBERTa's pad id + 1."""
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


@dataclass(frozen=True)
class ModelFolder:
    """What a model folder is, read once; see the module docstring."""

    path: Path
    config: dict[str, Any]
    card: dict[str, Any]
    task: str | None
    labels: list[str]
    num_labels: int
    pooling: str | None
    normalize: bool
    max_length: int
    positions: int | None
    quantization: dict[str, Any] | None
    kept_heads: list[list[int]] | None
    sentence_transformers: bool
    torch_weights: Path | None
    onnx_fp32: Path | None
    onnx_int8: Path | None
    tokenizer_files: tuple[str, ...]
    static_weights: Path | None = None
    sparse: dict[str, Any] | None = None  # config.json's encoderkit_sparse: the weights are packed (models/sparse.py)

    @classmethod
    def open(cls, path: str | Path, *, weights: bool = True, tokenizer: bool = True) -> ModelFolder:
        """Read ``path``. Always checks ``config.json`` (and ``encoderkit.json`` when present) and that
        every ``.safetensors`` file present is intact; ``weights`` also requires torch or ONNX weights,
        ``tokenizer`` the tokenizer files."""
        path = resolve_model(path)  # 'minilm' means the same here as in every stage
        if not path.is_dir():
            raise EncoderkitError(f"model folder {path} does not exist; pass a folder made by encoderkit or an HF "
                                  "model folder (config.json, model.safetensors, tokenizer files)")
        if not (path / "config.json").is_file():
            raise EncoderkitError(f"{path} has no config.json; it is not a model folder in Hugging Face layout")
        config = read_json_object(path / "config.json")
        card = read_json_object(path / CARD) if (path / CARD).is_file() else {}
        is_st = (path / "modules.json").is_file()
        task = card.get("task") or ("embed" if is_st else task_from_config(config))
        if task is not None and task not in HEADS:
            raise EncoderkitError(f"{path}/{CARD}: task {task!r} is not one of {', '.join(HEADS)}")
        head_pooling = HEADS[task].pooling if task else None

        id2label = config.get("id2label") or {}
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label))]
        if card.get("labels"):
            labels = [str(x) for x in card["labels"]]
        positions = usable_positions(config)
        max_length = positions or 512
        tok_cfg = path / "tokenizer_config.json"
        if tok_cfg.is_file():
            tml = read_json_object(tok_cfg).get("model_max_length")
            if isinstance(tml, (int, float)) and 0 < tml < 1e6:
                max_length = min(max_length, int(tml))

        normalize = True
        if is_st:
            sbert = path / "sentence_bert_config.json"
            if sbert.is_file():
                msl = read_json_object(sbert).get("max_seq_length")
                if isinstance(msl, int) and msl > 0:
                    max_length = min(max_length, msl)
            modules = json.loads((path / "modules.json").read_text(encoding="utf-8"))
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        if "normalize" in card:
            normalize = bool(card["normalize"])
        if card.get("max_length"):
            max_length = min(positions or int(card["max_length"]), int(card["max_length"]))

        static = is_static_config(config)
        head_pooling = STATIC_POOLING if static else head_pooling
        st_pooling = path / "1_Pooling" / "config.json"
        pooling = recorded_pooling(head_pooling, path, config, card, read_json_object(st_pooling)
                                   if head_pooling == SENTENCE and st_pooling.is_file() else None)
        if static:  # token vectors, no transformer: mean of whole texts (model2vec's config says whether normalised)
            max_length = int(config.get("seq_length") or 1_000_000)
            if not is_st:
                normalize = bool(config.get("normalize", True))
        existing = [] if static else [path / name for name in TORCH_WEIGHTS if (path / name).is_file()]
        for p in sorted(path.glob("*.safetensors")):
            check_safetensors(p)
        quant, sparse = config.get(QUANT_KEY), config.get(SPARSE_KEY)
        weights_file = QUANT_FILE if quant is not None else SPARSE_FILE if sparse is not None else "model.safetensors"
        folder = cls(
            path=path, config=config, card=card, task=task, labels=labels,
            num_labels=num_labels_of(config) or len(labels),
            pooling=pooling, normalize=normalize, max_length=max_length, positions=positions,
            quantization=quant, kept_heads=config.get(HEADS_KEY), sentence_transformers=is_st,
            torch_weights=next((p for p in existing if p.name == weights_file), None), sparse=sparse,
            onnx_fp32=path / ONNX_FP32 if (path / ONNX_FP32).is_file() else None,
            onnx_int8=path / ONNX_INT8 if (path / ONNX_INT8).is_file() else None,
            tokenizer_files=tuple(n for n in TOKENIZER_FILES if (path / n).is_file()),
            static_weights=path / STATIC_WEIGHTS if static and (path / STATIC_WEIGHTS).is_file() else None,
        )
        if static and weights and folder.static_weights is None:
            raise EncoderkitError(f"{path} is a static embedding folder without its {STATIC_WEIGHTS}; "
                                  "copy it again or re-create it with encoderkit distill --to static")
        pickled = [n for n in PICKLED_WEIGHTS if (path / n).is_file()]
        if weights and not static and folder.torch_weights is None and pickled:
            raise EncoderkitError(f"{path} holds its weights only as {pickled[0]}, a pickle, which can run any code "
                                  "when it is loaded; encoderkit never unpickles. Convert it to model.safetensors "
                                  "where you trust the file (transformers: from_pretrained(...).save_pretrained(..., "
                                  "safe_serialization=True)) and pass that folder")
        if (weights and not static and folder.torch_weights is None and folder.onnx_fp32 is None
                and folder.onnx_int8 is None):
            want = weights_file
            raise EncoderkitError(f"{path} holds no weights ({want} is missing, and there is no model.onnx); "
                                  "the folder is incomplete: copy the weights or re-run the stage that wrote it")
        if tokenizer:
            folder.require_tokenizer()
        return folder

    # -- what the folder holds ----------------------------------------------------------------
    @property
    def backends(self) -> dict[str, Path]:
        """Backend -> file: ``torch`` (safetensors/bin, or quantized), ``onnx-fp32``, ``onnx-int8``."""
        found = {"torch": self.torch_weights, "onnx-fp32": self.onnx_fp32, "onnx-int8": self.onnx_int8,
                 "static": self.static_weights}
        return {k: v for k, v in found.items() if v is not None}

    def onnx(self, int8: bool) -> Path | None:
        """The exported ONNX graph (INT8 or FP32), or None."""
        return self.onnx_int8 if int8 else self.onnx_fp32

    def require_tokenizer(self) -> None:
        """Refuse a folder without tokenizer files (nothing may invent a tokenizer for it)."""
        if not self.tokenizer_files:
            raise EncoderkitError(
                f"{self.path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer the "
                "model was trained with into it (e.g. from its parent folder) or pass --tokenizer FOLDER where offered")

    def tokenizer(self, override: str | Path | None = None) -> Any:
        """The folder's fast tokenizer, or the one in ``override``."""
        if override:
            return load_tokenizer(override)
        self.require_tokenizer()
        if self.static_weights is None:
            return load_tokenizer(self.path)
        # transformers reads config.json beside the tokenizer and warns that model2vec is no model type it knows
        log = logging.getLogger("transformers.configuration_utils")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return load_tokenizer(self.path)
        finally:
            log.setLevel(level)

    def require_task(self, *tasks: str) -> str:
        """The folder's task when it is one of ``tasks`` and its weights hold that task's head."""
        if self.task not in tasks:
            what = f"a {self.task!r} model" if self.task else "a model whose task cannot be told"
            raise EncoderkitError(f"{self.path} is {what}; this needs one of {', '.join(tasks)} "
                                  "(fine-tune it first: encoderkit finetune, or set 'task' in encoderkit.json)")
        archs = self.config.get("architectures") or []
        suffix = HEADS[self.task].suffix
        # the head is there when an architecture ends with the task's suffix, or when the architectures
        # imply the task by the rules of task_from_config (BertForPreTraining holds an MLM head)
        if (suffix and archs and not any(a.endswith(suffix) for a in archs)
                and task_from_config(self.config) != self.task):
            raise EncoderkitError(
                f"{self.path}: encoderkit.json says task {self.task!r} but config.json architectures are {archs}; "
                f"a {self.task!r} model needs a *{suffix} head. Fix the 'task' field or use the right folder")
        return self.task

    def model_class(self, task: str | None = None) -> Any:
        """The transformers class for ``task`` (an Auto class), else the one ``config.architectures`` names."""
        if task:
            return getattr(transformers, HEADS[task].auto_class)
        for arch in self.config.get("architectures") or []:
            found = getattr(transformers, arch, None)
            if found is not None:
                return found
        return transformers.AutoModel

    # -- loading --------------------------------------------------------------------------------
    def load(self, model_cls: Any = None, *, task: str | None = None, int8_runtime: bool = False,
             attn: str | None = None, dtype: torch.dtype | None = None, frozen: bool = False,
             **overrides: Any) -> torch.nn.Module:
        """The eval-mode torch model: plain, quantized (dequantized to fp32), sparse-packed (unpacked exactly) or
        head-pruned, with a recorded classifier pooling applied.

        ``model_cls`` (or ``task``'s Auto class) defaults to ``config.architectures``. ``overrides``
        go to ``from_pretrained`` (a new head: ``num_labels=...``); the weights that the checkpoint
        lacks are named in one line instead of transformers' load report. ``int8_runtime`` swaps the
        Linear layers for dynamically quantized INT8 ones; ``attn`` picks the attention kernel
        (``"eager"`` traces cleanly for ONNX); ``frozen`` turns gradients off."""
        if self.static_weights is not None:
            raise EncoderkitError(f"{self.path} is a static embedding model (a table of token vectors, no "
                                  "transformer): it embeds through predict, index, search and serve, but cannot be "
                                  "loaded as a torch model, so it cannot be fine-tuned, compressed, distilled from or "
                                  "exported")
        if self.torch_weights is None:
            raise EncoderkitError(f"{self.path} has no torch weights (model.safetensors); only its ONNX graph can run")
        cls = model_cls or self.model_class(task)
        plain = self.quantization is None and self.kept_heads is None and self.sparse is None
        if overrides and not plain:
            raise EncoderkitError(f"{self.path} is quantized, head-pruned or sparse-packed; it cannot take a new head")

        def build(kwargs: dict[str, Any]) -> torch.nn.Module:
            if plain:
                return _from_pretrained(cls, self.path, {**kwargs, **overrides})
            return rebuild_model(self.path, cls, self.torch_weights, self.quantization, self.kept_heads, kwargs)

        try:
            try:
                model = build({} if attn is None else {"attn_implementation": attn})
            except ValueError as e:  # a family without that attention kernel (DeBERTa-v2 has no sdpa): its eager one
                if attn in (None, "eager") or "attention implementation" not in str(e):
                    raise
                model = build({"attn_implementation": "eager"})
        except (OSError, ValueError) as e:
            raise EncoderkitError(f"{self.path}: could not load the model as {cls.__name__} ({e})") from e
        except RuntimeError as e:  # an edited config.json: a size there (vocab_size...) is not the weights'
            if not any(w in str(e) for w in ("size mismatch", "mismatched_sizes", "shape")):
                raise
            first = " ".join(str(e).split())[:300]
            raise EncoderkitError(f"{self.path}: config.json does not match the weights in "
                                  f"{self.torch_weights.name} ({first}); a size in config.json (vocab_size, "
                                  "hidden_size, ...) was changed: restore the config.json the folder was written "
                                  "with") from e
        apply_pooling(model)
        model.eval()
        if int8_runtime:  # per-channel weights, as stored (the default qconfig would re-quantize them per tensor)
            qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8)
        if dtype is not None:
            model = model.to(dtype)
        if frozen:
            for p in model.parameters():
                p.requires_grad_(False)
        return model


def _from_pretrained(cls: Any, path: Path, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``cls.from_pretrained`` with transformers' load report replaced by one line of what was new or unused."""
    # transformers 5 checks a tensor-parallel plan when its loader's log level is WARNING or above, and every
    # model without one (all of ours) then warns that none of its layers "were sharded": silenced with the report
    logs = [logging.getLogger(n) for n in ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")]
    old = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        model, info = cls.from_pretrained(path, output_loading_info=True, use_safetensors=True, **kwargs)
    finally:
        for log, level in zip(logs, old, strict=True):
            log.setLevel(level)
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("position_ids")]
    unused = list(info.get("unexpected_keys", []))
    parts = []
    if missing:
        new_head = all(k.startswith(("classifier", "score")) for k in missing)
        head = "new classification head" if new_head else "new weights"
        more = ", ..." if len(missing) > 4 else ""
        parts.append(f"{head}: {len(missing)} weights initialised ({', '.join(missing[:4])}{more})")
    if unused:
        parts.append(f"{len(unused)} weights of the checkpoint not used ({_unused_summary(unused)})")
    if parts:
        note(f"{path}: " + "; ".join(parts))
    return model


def _unused_summary(unused: list[str]) -> str:
    """Unused checkpoint weights in a few words: whole layers left out as a range ("layers 2-5"), then
    the first other names."""
    layers = sorted({int(m.group(1)) for k in unused if (m := _LAYER_KEY.search(k))})
    rest = [k for k in unused if not _LAYER_KEY.search(k)]
    said = []
    if layers:
        runs, start = [], layers[0]
        for a, b in zip(layers, [*layers[1:], None]):
            if b != a + 1:
                runs.append(f"{start}-{a}" if a > start else f"{a}")
                start = b
        said.append(f"layer{'s' if len(layers) > 1 else ''} {', '.join(runs)}")
    if rest:
        said.append(", ".join(rest[:2]) + (", ..." if len(rest) > 2 else ""))
    return "; ".join(said)


_LAYER_KEY = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def load_model(folder: str | Path, model_cls: Any = None, int8_runtime: bool = False,
               attn_implementation: str | None = None) -> torch.nn.Module:
    """:meth:`ModelFolder.load` for a folder path (the compression levers' shorthand)."""
    folder = ModelFolder.open(folder, tokenizer=False)
    return folder.load(model_cls, int8_runtime=int8_runtime, attn=attn_implementation)


def read_config(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict (an EncoderkitError naming it when missing or unreadable)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise EncoderkitError(f"{folder} is not a model folder: config.json is missing")
    return read_json_object(path)
