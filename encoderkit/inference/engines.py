"""Engines, and how one is opened for a model folder.

An engine runs a model on padded token arrays: ``run(inputs: dict[str, int64 (B, T)]) -> list[float32 array]``, in
the order of ``task.outputs``. :func:`open_engine` opens the one an :class:`~encoderkit.inference.policy.EngineChoice`
names; which one a run gets is decided by :func:`encoderkit.inference.policy.resolve` alone. ``Engine``,
``ModuleEngine`` and ``run_rows`` live in :mod:`encoderkit.tasks.inference` (the tasks layer may not import this
package) and are re-exported here.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import itertools
import json
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit import hardware
from encoderkit.data.builtin_corpus import stdlib_docstrings
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import Hardware
from encoderkit.inference.export import (
    GRAPH_RECIPE,
    INT8_REFUSED,
    export_onnx,
    ort_session,
    per_batch_scales,
    run_alone,
)
from encoderkit.io import cache_dir, output_dir, write_json_atomic
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.static import read_static_table
from encoderkit.progress import note
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.inference import Engine, ModuleEngine, run_rows

__all__ = ["BACKENDS", "CALIBRATION_TEXTS", "DEFAULT_CALIBRATION", "STATIC", "TORCH_INT8", "Engine",
           "ModuleEngine", "OnnxEngine", "OpenVinoEngine", "StaticEngine", "cached_export", "cached_openvino_int8",
           "default_calibration", "int8_by_default", "open_engine", "openvino_int8_measured", "openvino_ready",
           "run_rows", "torch_engine", "vocabulary_batches"]

# what a caller may name explicitly
BACKENDS = ("torch-fp32", "torch-bf16", "onnx-fp32", "onnx-int8", "openvino", "openvino-int8")
TORCH_INT8 = "torch int8-dynamic"  # the ``evaluate`` rule's name for torch's dynamic INT8 model
STATIC = "static"  # a static embedding folder's one backend


def int8_by_default(task: str) -> bool:
    """Whether ``auto`` runs ``task`` on INT8 (the task object says; :func:`encoderkit.inference.policy.serve_rule`
    states the rule)."""
    return bool(get_task(task).int8_by_default)


def openvino_int8_measured(hw: Hardware) -> bool:
    """Whether ``hw`` is the CPU class where OpenVINO's static INT8 was measured ahead of ONNX Runtime's dynamic INT8
    for embeddings (AVX-512 VNNI without AMX; docs/deploy.md). Elsewhere it was not measured, so ``auto`` keeps
    ONNX Runtime."""
    return "avx512_vnni" in hw.isa and not hw.amx


def openvino_installed() -> bool:
    """Whether OpenVINO is installed (``--backend openvino``), without importing it."""
    return importlib.util.find_spec("openvino") is not None


def openvino_ready() -> bool:
    """Whether OpenVINO and NNCF are installed (``pip install "encoderkit[openvino]"``), without importing them."""
    return all(importlib.util.find_spec(m) is not None for m in ("openvino", "nncf"))


def open_engine(folder: ModelFolder, choice: Any, *, task: str | None = None, threads: int | None = None,
                spin: bool = True, calibration: list[dict[str, np.ndarray]] | None = None) -> Engine | None:
    """The engine ``choice`` (an :class:`~encoderkit.inference.policy.EngineChoice`) names for ``folder``; None for
    a choice without a backend (the torch model as the task's evaluation loads it). ``task``: the head torch loads
    (default: the folder's); ``threads``/``spin``: ONNX Runtime's intra-op threads and whether idle ones spin;
    ``calibration``: token batches ``openvino-int8`` quantises with (default: :func:`default_calibration`)."""
    backend = choice.backend
    if backend is None:
        return None
    if backend == STATIC:
        return StaticEngine.open(folder)
    if backend.startswith("onnx"):
        folder.require_task(*TASKS)  # a graph runs the task it was exported for
        graph = cached_export(folder, backend == "onnx-int8")
        engine = OnnxEngine(graph, folder.task, threads, spin)
        return checked_engine(folder, backend, engine, graph) if backend == "onnx-int8" else engine
    if backend == "openvino":
        folder.require_task(*TASKS)
        graph = cached_export(folder, False, plain=True)
        engine = OpenVinoEngine(graph, folder.task, threads)
        return engine if engine.precision == "f32" else checked_engine(folder, f"openvino {engine.precision}",
                                                                       engine, graph)
    if backend == "openvino-int8":
        folder.require_task(*TASKS)
        graph, record = openvino_int8_check(folder, calibration)
        if not record["ok"]:
            raise EncoderkitError(f"{folder.path}: OpenVINO's static INT8 graph of this folder bends its outputs "
                                  f"({describe_fidelity(record)}), so it is refused; use --backend openvino (its "
                                  "bf16/fp32 graph, faithful) or another calibration")
        return OpenVinoEngine(graph, folder.task, threads)
    task = task or folder.task
    if backend == TORCH_INT8:
        module = get_task(task).graph_module(folder.load(task=task, int8_runtime=True))
        return ModuleEngine(module, get_task(task).outputs)
    engine = torch_engine(folder, bf16=backend == "torch-bf16")
    return checked_engine(folder, backend, engine, folder.torch_weights) if backend == "torch-bf16" else engine


def torch_engine(folder: ModelFolder, bf16: bool) -> ModuleEngine:
    """The eager transformers model as an engine: int64 arrays (B, T) in, the task's float32 outputs out."""
    model = folder.load(task=folder.task, dtype=torch.bfloat16 if bf16 else None, attn="sdpa", frozen=True)
    return ModuleEngine(get_task(folder.task).graph_module(model), list(get_task(folder.task).outputs))


class StaticEngine:
    """A static embedding folder as an engine that pools (``pools``): a text's vector is the mean of its tokens'
    rows of the table over the real tokens less [CLS]/[SEP] (``skip_ids``), sentence-transformers' ``EmbeddingBag``
    mean of the text tokenised without special tokens; ``[(B, D) float32]``, un-normalised. :meth:`pool_texts` is
    the Embedder's fast path: whole texts through the Rust tokenizer, then one segment mean."""

    pools = True
    TEXTS_PER_BLOCK = 512  # texts gathered at once: (their tokens, D) float32 in memory

    def __init__(self, table: np.ndarray, skip_ids: list[int], tokenizer: object | None = None) -> None:
        self.table = table  # (V, D) float32
        self.counted = np.ones(len(table), dtype=np.float32)
        self.counted[[i for i in skip_ids if 0 <= i < len(table)]] = 0.0
        self.backend = None
        if tokenizer is not None:  # a copy: the transformers tokenizer sets truncation and padding on its own
            self.backend = copy.deepcopy(tokenizer.backend_tokenizer)
            self.backend.no_truncation()
            self.backend.no_padding()

    @classmethod
    def open(cls, folder: ModelFolder) -> StaticEngine:
        tokenizer = folder.tokenizer()
        return cls(read_static_table(folder.path), list(tokenizer("")["input_ids"]), tokenizer)

    def pool_texts(self, texts: list[str]) -> np.ndarray:
        """(N, D) float32: the mean of each whole text's token rows (zeros for a text without tokens)."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        table = torch.from_numpy(self.table)
        out = []
        for start in range(0, len(texts), self.TEXTS_PER_BLOCK):
            enc = encode(texts[start : start + self.TEXTS_PER_BLOCK], add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
            flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in enc), dtype=np.int64,
                               count=int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            # a gather and a segment mean in one kernel (numpy's gather + reduceat is much slower)
            bag = torch.nn.functional.embedding_bag(torch.from_numpy(flat), table, torch.from_numpy(offsets),
                                                    mode="mean")
            out.append(bag.numpy())
        return np.concatenate(out) if out else np.zeros((0, self.table.shape[1]), dtype=np.float32)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        ids = inputs["input_ids"]  # (B, T)
        keep = inputs["attention_mask"].astype(np.float32) * self.counted[ids]  # (B, T)
        summed = np.einsum("bt,btd->bd", keep, self.table[ids])  # (B, D)
        return [summed / np.maximum(keep.sum(1, keepdims=True), 1.0)]


ONNX_INT8_PER_ROW = True  # OnnxEngine runs a graph with per-call activation scales one text at a time


class OnnxEngine:
    """onnxruntime session on one ``.onnx`` file. A graph that quantises activations per call (``quantize_dynamic``'s
    INT8: :func:`~encoderkit.inference.export.per_batch_scales`) runs one text at a time, unpadded (``per_row``), so
    that a text's scales, and its output, come from itself alone, whatever it is batched with."""

    def __init__(self, path: Path, task: str, threads: int | None, spin: bool = True) -> None:
        self.path, self.threads, self.spin = path, threads, spin
        self.session = ort_session(path, threads, spin)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.outputs = list(get_task(task).outputs)
        self.per_row = ONNX_INT8_PER_ROW and per_batch_scales(path)
        self.per_token = get_task(task).per_token
        missing = set(self.outputs) - {o.name for o in self.session.get_outputs()}
        if missing or not {"input_ids", "attention_mask"} <= set(self.input_names):
            raise EncoderkitError(f"{path}: graph inputs/outputs do not match a {task} model (missing "
                                  f"{sorted(missing) or 'input_ids/attention_mask'}); re-run encoderkit export")

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        feed = {k: v for k, v in inputs.items() if k in self.input_names}
        if "token_type_ids" in self.input_names and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(inputs["input_ids"])
        if self.per_row:
            return run_alone(partial(self.session.run, self.outputs), feed, self.per_token)
        return self.session.run(self.outputs, feed)

    def lane(self, threads: int) -> OnnxEngine:
        """Another session on the same graph with ``threads`` intra-op threads of its own, for a model call that runs
        beside this engine's (serve's long rows beside short batches, :mod:`encoderkit.deploy.batching`)."""
        other = copy.copy(self)
        other.threads, other.session = threads, ort_session(self.path, threads, self.spin)
        return other


def cached_export(folder: ModelFolder, int8: bool, plain: bool = False) -> Path:
    """The wanted ONNX file of ``folder``: its own, else one in a cache folder exported once from it. ``plain``:
    an FP32 graph of standard ONNX operators only (not fused into ONNX Runtime's contrib ops: what OpenVINO reads),
    exported from the folder's weights; a folder without weights gives its own FP32 graph."""
    own = folder.onnx(int8)
    if own and not (plain and folder.torch_weights):
        return own

    st = (folder.path / "config.json").stat()
    weights = [folder.torch_weights] if folder.torch_weights else []
    stamp = (f"{folder.path.resolve()}|{st.st_mtime_ns}|{[(p.stat().st_size, p.stat().st_mtime_ns) for p in weights]}"
             f"|{GRAPH_RECIPE}")  # a graph exported the older way is not reused
    out = cache_dir("onnx") / (hashlib.sha256(stamp.encode()).hexdigest()[:16] + ("-plain" if plain else ""))
    cached = out / ("model.int8.onnx" if int8 else "model.onnx")
    if not cached.is_file() and not (out / INT8_REFUSED).is_file():
        with output_dir(out, overwrite=True) as tmp:  # both graphs at once: INT8 is quantised from the FP32 trace
            copy_side_files(folder.path, tmp, weights=True)
            export_onnx(folder, tmp, optimize=not plain, int8=not plain, int8_strict=False)
    if not cached.is_file() and (out / INT8_REFUSED).is_file():  # the FP32 graph stays usable
        raise EncoderkitError(f"{(out / INT8_REFUSED).read_text(encoding='utf-8').strip()}: --backend onnx-int8 is "
                              "refused for this folder; use --backend onnx-fp32 (or auto)")
    return cached


CALIBRATION_TEXTS = 128  # texts (of a corpus) whose activation ranges openvino-int8 quantises with


def vocabulary_batches(folder: ModelFolder, rows: int = CALIBRATION_TEXTS,
                       seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Data-free calibration batches: [CLS] + tokens drawn uniformly from the vocabulary's non-special ids +
    [SEP], 8 rows a batch at seeded lengths, log-uniform from 8 to the model's maximum."""
    tok = folder.tokenizer()
    rng = np.random.default_rng(seed)
    special = set(tok.all_special_ids)
    ids = np.array([i for i in range(len(tok)) if i not in special], dtype=np.int64)
    cls = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    sep = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    top = max(16, min(folder.max_length, 512))
    batches = []
    for _ in range(max(1, rows // 8)):
        length = min(top, max(8, round(float(np.exp(rng.uniform(np.log(8), np.log(top)))))))  # short texts and long
        x = rng.choice(ids, size=(8, length))
        if cls is not None:
            x[:, 0] = cls
        if sep is not None:
            x[:, -1] = sep
        batches.append({"input_ids": x, "attention_mask": np.ones_like(x), "token_type_ids": np.zeros_like(x)})
    return batches


DEFAULT_CALIBRATION = ("half vocabulary draws, half builtin:stdlib docstrings (seed 0), and short spans of those "
                       "docstrings")  # part of the cache key: a change to default_calibration must change this text
SHORT_SPANS = 64  # short texts (1-5 words) cut from the calibration texts and added to them: a graph calibrated on
# long texts alone bends the shortest ones (a two-word sentence, a query)


def short_spans(texts: Sequence[str], rows: int = SHORT_SPANS, seed: int = 2) -> list[str]:
    """``rows`` seeded runs of 1 to 5 consecutive words of ``texts`` (none if they hold no words)."""
    words = " ".join(texts).split()
    if not words:
        return []
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(words), size=rows)
    return [" ".join(words[int(i):int(i) + int(rng.integers(1, 6))]) for i in starts]


def calibration_batches(folder: ModelFolder, texts: Sequence[str], limit: int | None = None
                        ) -> list[dict[str, np.ndarray]]:
    """Token batches (8 rows each) that ``openvino-int8`` calibrates on from ``texts``: the texts, cut at ``limit``
    tokens (default: the folder's, at most 512), then :func:`short_spans` of them."""
    tok = folder.tokenizer()
    limit = limit or min(folder.max_length, 512)
    texts = [*texts, *short_spans(texts)]
    return [dict(tok(texts[i:i + 8], truncation=True, max_length=limit, padding=True, return_tensors="np"))
            for i in range(0, len(texts), 8)]


def default_calibration(folder: ModelFolder, rows: int = CALIBRATION_TEXTS,
                        seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Calibration when the caller has no texts of its own (``--backend auto``, a Predictor without ``calibration``):
    half :func:`vocabulary_batches` (every script the vocabulary has), half seeded docstrings of ``builtin:stdlib``
    (real prose at real lengths; the vocabulary alone where the interpreter ships no sources), with short spans of
    those docstrings (:func:`calibration_batches`)."""
    try:
        docs = [doc for _, _, doc in stdlib_docstrings()]
    except OSError:
        docs = []
    texts = [docs[i] for i in _calibration_docs(len(docs), rows, seed)]
    real = calibration_batches(folder, texts) if texts else []
    return vocabulary_batches(folder, rows - len(texts), seed) + real


def _calibration_docs(docs: int, rows: int = CALIBRATION_TEXTS, seed: int = 0) -> list[int]:
    """Which of ``docs`` docstrings :func:`default_calibration` takes (seeded)."""
    if not docs:
        return []
    return sorted(int(i) for i in np.random.default_rng(seed).choice(docs, size=min(docs, rows // 2), replace=False))


INT8_FIDELITY = (0.99, 0.95)  # the least mean and least minimum cosine an INT8 graph keeps to its FP32 graph
CHECK_TEXTS = ("24 builtin:stdlib docstrings outside the default calibration, their first lines, 16 spans of 1-5 "
               "of their words, and 16 vocabulary draws (seed 1)")
# CHECK_TEXTS: what the fidelity check runs on; part of its record: a change re-checks
FIDELITY_FILE = "fidelity.json"  # the check's record, beside the graph it checked


def check_batches(folder: ModelFolder, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """The texts an INT8 graph is checked on (:data:`CHECK_TEXTS`), none of them the default calibration's: whole
    docstrings (long prose), their first lines and spans of a few of their words (short texts, where a graph
    calibrated on long ones bends most) and draws from the vocabulary (every script it holds)."""
    try:
        docs = [doc for _, _, doc in stdlib_docstrings()]
    except OSError:
        docs = []
    taken = set(_calibration_docs(len(docs)))
    rest = [d for i, d in enumerate(docs) if i not in taken and d.strip()]
    rng = np.random.default_rng(seed)
    picked = [rest[i] for i in sorted(rng.choice(len(rest), size=min(len(rest), 24), replace=False))] if rest else []
    texts = picked + [d.strip().splitlines()[0] for d in picked] + short_spans(picked, 16, seed + 2)
    tok = folder.tokenizer()
    limit = min(folder.max_length, 512)
    real = [dict(tok(texts[i:i + 8], truncation=True, max_length=limit, padding=True, return_tensors="np"))
            for i in range(0, len(texts), 8)]
    return vocabulary_batches(folder, 16, seed) + real


def fidelity(folder: ModelFolder, engine: Engine, reference: Engine,
             batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """The cosine of ``engine``'s outputs to ``reference``'s (an INT8 graph's to its FP32 graph's) per text of
    ``batches``: the text's vector as the folder pools a per-token output (``first``: its first token; ``mean``: the
    mean of its real tokens), else its outputs over its real tokens, all outputs joined. ``ok`` when the mean and the
    minimum reach :data:`INT8_FIDELITY`."""
    per_token = get_task(folder.task).per_token
    cosines: list[float] = []
    for b in batches:
        mask = b["attention_mask"].astype(np.float64)

        def vectors(outs: list[np.ndarray], mask: np.ndarray = mask) -> np.ndarray:
            parts = []
            for o in outs:
                o = np.asarray(o, dtype=np.float64)
                if per_token:
                    o = o.reshape(*o.shape[:2], -1) * mask[:, :, None]
                    if folder.pooling == "first":
                        o = o[:, 0]
                    elif folder.pooling == "mean":
                        o = o.sum(1) / np.maximum(mask.sum(1, keepdims=True), 1.0)
                parts.append(o.reshape(len(o), -1))
            return np.concatenate(parts, 1)

        x, y = vectors(engine.run(b)), vectors(reference.run(b))
        norms = np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-12)
        cosines += ((x * y).sum(1) / norms).tolist()
    mean, low = float(np.mean(cosines)), float(np.min(cosines))
    return {"mean": round(mean, 4), "min": round(low, 4), "texts": len(cosines), "on": CHECK_TEXTS,
            "least": list(INT8_FIDELITY), "ok": mean >= INT8_FIDELITY[0] and low >= INT8_FIDELITY[1]}


def describe_fidelity(record: dict[str, Any]) -> str:
    """``cosine to FP32 0.9968 mean / 0.9612 min on 64 check texts`` (and the bounds a refused graph misses)."""
    text = f"cosine to FP32 {record['mean']:.4f} mean / {record['min']:.4f} min on {record['texts']} check texts"
    return text if record["ok"] else f"{text}, below the {INT8_FIDELITY[0]} mean / {INT8_FIDELITY[1]} min kept"


def openvino_int8_check(folder: ModelFolder, calibration: list[dict[str, np.ndarray]] | None = None
                        ) -> tuple[Path, dict[str, Any]]:
    """``folder``'s OpenVINO static INT8 graph (:func:`cached_openvino_int8`) and its fidelity check
    (:func:`fidelity` against ONNX Runtime on the plain FP32 graph, on :func:`check_batches`), made once with the
    graph and kept beside it (:data:`FIDELITY_FILE`)."""
    graph = cached_openvino_int8(folder, calibration)
    kept = graph.parent / FIDELITY_FILE
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(kept.read_text(encoding="utf-8"))
        if isinstance(record, dict) and record.get("on") == CHECK_TEXTS and record.get("least") == list(INT8_FIDELITY):
            return graph, record
    plain = cached_export(folder, False, plain=True)
    record = fidelity(folder, OpenVinoEngine(graph, folder.task, None), OnnxEngine(plain, folder.task, None),
                      check_batches(folder))
    note(f"openvino-int8: {folder.path.name}'s graph checked: {describe_fidelity(record)}")
    with contextlib.suppress(OSError):  # not kept: checked again next time
        write_json_atomic(kept, record)
    return graph, record


CHECKED_TASKS = ("embed",)  # tasks whose outputs are vectors a lower precision may bend: checked by cosine (other
# tasks' INT8 is judged by agreement on the folder's dev rows: encoderkit.inference.agreement)


def checked_engine(folder: ModelFolder, backend: str, engine: Engine, made_from: Path | None) -> Engine:
    """``engine`` (``backend``: a lower-precision run of ``folder``: ONNX Runtime's INT8, OpenVINO at bf16, torch
    bf16) once its :func:`fidelity` to the FP32 graph holds on :func:`check_batches`, else refused with the figures.
    Checked once per graph or weights file (``made_from``) and kept in a cache folder; tasks outside
    :data:`CHECKED_TASKS` pass unchecked."""
    if folder.task not in CHECKED_TASKS or made_from is None or not made_from.is_file():
        return engine
    if not folder.torch_weights and not folder.onnx(False):  # an INT8 graph alone: no FP32 run to check it against
        return engine  # (its export measured it against its parent: the compress report)
    st = made_from.stat()
    stamp = f"{made_from.resolve()}|{st.st_size}|{st.st_mtime_ns}|{backend}|{CHECK_TEXTS}|{INT8_FIDELITY}"
    kept = cache_dir("fidelity") / (hashlib.sha256(stamp.encode()).hexdigest()[:16] + ".json")
    record = None
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(kept.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or "ok" not in record:
        reference = OnnxEngine(cached_export(folder, False, plain=True), folder.task, None)
        record = fidelity(folder, engine, reference, check_batches(folder))
        note(f"{backend}: {folder.path.name}'s outputs checked: {describe_fidelity(record)}")
        with contextlib.suppress(OSError):  # not kept: checked again next time
            write_json_atomic(kept, record)
    if not record["ok"]:
        raise EncoderkitError(f"{folder.path}: --backend {backend.split()[0]} bends this folder's vectors "
                              f"({describe_fidelity(record)}), so it is refused; use --backend onnx-fp32 or "
                              "openvino-int8 (calibrated, checked the same way)")
    return engine


def cached_openvino_int8(folder: ModelFolder, calibration: list[dict[str, np.ndarray]] | None = None) -> Path:
    """``folder``'s plain graph quantised to static INT8 by NNCF (the transformer preset: activations per tensor,
    weights per channel, softmax and norms left in the CPU plugin's own precision), activation ranges measured on
    ``calibration`` (token batches; default :func:`default_calibration`). Made once per folder and calibration
    and kept in a cache folder (``model.xml`` + ``model.bin``)."""
    try:
        import nncf
        import openvino as ov
    except ImportError as e:
        raise EncoderkitError(f"--backend openvino-int8 needs OpenVINO and NNCF ({e}); install them with: "
                              'pip install "encoderkit[openvino]"') from e
    plain = cached_export(folder, False, plain=True)
    digest = hashlib.sha256(str(plain.resolve()).encode() + str(plain.stat().st_mtime_ns).encode())
    for b in calibration or []:
        for k in sorted(b):
            digest.update(k.encode() + np.ascontiguousarray(b[k], dtype=np.int64).tobytes())
    if not calibration:  # named, not hashed: the default's texts are made only when the graph is
        digest.update(DEFAULT_CALIBRATION.encode())
    out = cache_dir("openvino") / digest.hexdigest()[:16]
    if (out / "model.xml").is_file() and (out / "model.bin").is_file():
        return out / "model.xml"
    batches = calibration if calibration else default_calibration(folder)
    note(f"openvino-int8: quantising {folder.path.name} on {sum(len(b['input_ids']) for b in batches)} calibration "
         f"texts (once; kept in {out})")
    model = ov.Core().read_model(str(plain))
    names = {i.get_any_name() for i in model.inputs}
    data = nncf.Dataset([{k: v.astype(np.int64) for k, v in b.items() if k in names} for b in batches])
    nncf.set_log_level(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars: stdout stays the command's own output
        quantized = nncf.quantize(model, data, model_type=nncf.ModelType.TRANSFORMER,
                                  preset=nncf.QuantizationPreset.MIXED, subset_size=len(batches))
    with output_dir(out, overwrite=True) as tmp:
        ov.save_model(quantized, str(tmp / "model.xml"))
    return out / "model.xml"


# OpenVINO's CPU plugin prepares kernels once per input shape: lengths padded to a multiple of 8 give a 256-token
# model 32 shapes a batch size instead of 256 (the cost of new shapes: docs/results/deploy-log.md)
OPENVINO_LENGTH_STEP = 8


class OpenVinoEngine:
    """OpenVINO's CPU runtime on a plain FP32 graph (``--backend openvino``) or on its static INT8 quantisation
    (``--backend openvino-int8``). What is not quantised runs at the CPU plugin's own precision (``precision``: bf16
    with AMX or AVX512-BF16, else fp32). One batch (:meth:`run`, serving) runs on every thread; many
    (:meth:`run_many`, a corpus) run on ``streams`` at once, handed ``in_flight`` batches at a time so that the
    streams do not drain between windows."""

    def __init__(self, path: Path, task: str, threads: int | None) -> None:
        try:
            import openvino as ov
        except ImportError as e:
            raise EncoderkitError(f"--backend openvino needs OpenVINO ({e}); install it with: "
                                  'pip install "encoderkit[openvino]"') from e
        self.ov, self.path, self.threads = ov, path, threads
        self.core = ov.Core()
        self.model = self._compile({"PERFORMANCE_HINT": "LATENCY"})
        hint = self.core.get_property("CPU", "INFERENCE_PRECISION_HINT")
        self.precision = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)  # "bf16" or "f32"
        self.input_names = {i.get_any_name() for i in self.model.inputs}
        self.outputs, self.per_token = list(get_task(task).outputs), get_task(task).per_token
        self.request = self.model.create_infer_request()
        self.lock = threading.Lock()
        self.streams = 2 if (threads or hardware.usable_threads()) >= 2 else 1
        self.in_flight = 8 * self.streams if self.streams > 1 else 1  # batches handed together: fewer drains
        self.length_step = OPENVINO_LENGTH_STEP  # run_rows groups rows by their lengths rounded up as this pads them
        self.queue = None  # the throughput-mode model's request queue, made on the first run_many

    def _compile(self, config: dict) -> object:
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = int(self.threads)
        try:
            return self.core.compile_model(str(self.path), "CPU", config)
        except RuntimeError as e:
            raise EncoderkitError(f"OpenVINO cannot run {self.path} ({str(e).strip().splitlines()[0][:200]}); it reads "
                                  "standard ONNX operators and some of ONNX Runtime's fused ones, not its quantised "
                                  "ones: give it the model folder with its weights (a plain graph is exported from "
                                  "them), or use --backend onnx-fp32") from e

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's inputs, their token axis padded (mask 0) up to a multiple of :data:`OPENVINO_LENGTH_STEP`."""
        feed = {k: v for k, v in inputs.items() if k in self.input_names}
        if "token_type_ids" in self.input_names and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(inputs["input_ids"])
        length = inputs["input_ids"].shape[1]
        pad = -length % self.length_step
        return {k: np.pad(v, ((0, 0), (0, pad))) if pad and v.ndim == 2 and v.shape[1] == length else v
                for k, v in feed.items()}

    def _outputs(self, get: Callable[[str], np.ndarray], inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs copied out (the request reuses its tensors), a per-token output cut back to the real length."""
        length = inputs["input_ids"].shape[1]
        return [np.array(get(name)[:, :length] if self.per_token else get(name), dtype=np.float32)
                for name in self.outputs]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self.lock:  # the request's output tensors are reused by its next call: copied out under the lock
            result = self.request.infer(self._feed(inputs))
            return self._outputs(lambda name: result[self.model.output(name)], inputs)

    def lane(self, threads: int) -> OpenVinoEngine:
        """Another compiled model on the same graph with ``threads`` threads of its own, not pinned to cores, and its
        own infer request: a model call that runs beside this engine's (serve's long rows beside short batches,
        :mod:`encoderkit.deploy.batching`) takes whichever core is free rather than one the other's threads hold."""
        other = copy.copy(self)
        other.threads, other.streams, other.in_flight, other.queue = threads, 1, 1, None
        other.model = other._compile({"PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False})
        other.request, other.lock = other.model.create_infer_request(), threading.Lock()
        return other

    def run_many(self, batches: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        """Each batch's outputs, in order, ``streams`` batches running at once."""
        with self.lock:
            if self.queue is None:
                self.fast = self._compile({"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": self.streams})
                self.queue = self.ov.AsyncInferQueue(self.fast, self.streams)
            results: list[list[np.ndarray]] = [[] for _ in batches]

            def done(request: object, i: int) -> None:
                results[i] = self._outputs(lambda name: request.get_tensor(self.fast.output(name)).data, batches[i])

            self.queue.set_callback(done)
            for i, b in enumerate(batches):
                self.queue.start_async(self._feed(b), i)
            self.queue.wait_all()
            return results
