"""Engines, and the one rule that picks and opens one for a model folder.

An engine runs a model on padded token arrays: ``run(inputs: dict[str, int64 array (B, T)]) -> list[float32
array]``, the task's outputs in the order of ``task.outputs``. :class:`OnnxEngine` is ONNX Runtime on one
``.onnx`` file; :func:`torch_engine` is the eager transformers model (a
:class:`~encoderkit.tasks.inference.ModuleEngine`). The protocol, ``ModuleEngine`` and ``run_rows`` stay in
:mod:`encoderkit.tasks.inference` and are re-exported here: the tasks layer runs a training-time module with
them, and it may not import this package.

:func:`open_engine` is how every caller picks and opens an engine; :func:`pick_backend` is its rule, by policy:

* a backend name (``torch-fp32``, ``torch-bf16``, ``onnx-fp32``, ``onnx-int8``, ``openvino``, ``openvino-int8``):
  that one. ``openvino-int8`` is OpenVINO's static INT8 (NNCF post-training quantisation of the plain graph,
  activation ranges from calibration texts: :func:`cached_openvino_int8`);
* ``serve`` (the Predictor's ``backend="auto"``, :func:`serve_choice`, which also says why): INT8 for a task
  whose object says ``int8_by_default`` (embed: its own ``model.int8.onnx`` or an export of its weights on ONNX
  Runtime; plain weights on OpenVINO's static INT8 where the CPU is the class it was measured faster on); for
  classify, multilabel, ner, qa and rerank the folder's own INT8 graph where the CPU has VNNI/AMX int8 and the
  card records its agreement with FP32 on dev rows (``export --dev``) at 99.5% or more; ONNX FP32 otherwise;
  a folder holding only ``model.int8.onnx`` (no FP32 graph, no weights to export one from) runs on it;
* ``graph``: the folder's INT8 graph when it has one, else FP32 (its own, or exported once from its weights);
* ``evaluate`` (what ``evaluate`` and the compression measurer run on a compressed folder): the ``graph``
  rule when the folder has no torch weights; torch's dynamic INT8 model when its weights are 8-bit
  (``quantize --format torch``); else none: the folder's torch model as the task's evaluation loads it.

A static embedding folder (:mod:`encoderkit.models.static`) runs on :class:`StaticEngine` (``static``) under
every policy: a table lookup and a mean, in numpy; it has no graph and no transformer to run otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from encoderkit import hardware
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import Choice, Hardware
from encoderkit.inference.agreement import CARD_KEY, INT8_MIN_AGREEMENT, verdict
from encoderkit.inference.export import GRAPH_RECIPE, export_onnx, ort_session
from encoderkit.io import cache_dir, output_dir
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.progress import note
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.inference import Engine, ModuleEngine, run_rows

__all__ = ["AUTO_HELP", "BACKENDS", "CALIBRATION_TEXTS", "POLICIES", "STATIC", "TORCH_INT8", "Engine", "ModuleEngine",
           "OnnxEngine", "OpenVinoEngine", "StaticEngine", "cached_export", "cached_openvino_int8", "default_calibration",
           "int8_by_default", "open_engine", "openvino_int8_measured", "openvino_ready", "pick_backend", "run_rows",
           "serve_choice", "serve_rule", "torch_engine", "vocabulary_batches"]

AUTO_HELP = ("auto: what `encoderkit doctor` states for this CPU (embed: INT8, OpenVINO's static INT8 on an AVX-512 "
             "VNNI CPU without AMX; other tasks: INT8 where the card records >= 99.5%% agreement, else FP32); "
             "openvino-int8 calibrates on built-in texts (index: on its corpus).")  # --backend's help (argparse: %%)
BACKENDS = ("torch-fp32", "torch-bf16", "onnx-fp32", "onnx-int8", "openvino", "openvino-int8")  # what a caller may name explicitly
POLICIES = ("serve", "graph", "evaluate")  # what a caller may ask for instead (see the module docstring)
TORCH_INT8 = "torch int8-dynamic"  # the ``evaluate`` policy's name for torch's dynamic INT8 model
STATIC = "static"  # a static embedding folder's one backend


def int8_by_default(task: str) -> bool:
    """Whether the ``serve`` policy runs ``task`` on ONNX INT8 (the task object says; doctor states the rule)."""
    return bool(get_task(task).int8_by_default)


def serve_choice(folder: ModelFolder, hw: Hardware | None = None) -> Choice:
    """What ``--backend auto`` (the ``serve`` policy) runs ``folder`` on, on ``hw`` (default: this machine), and
    why (``Predictor.backend_reason``, serve's startup line): INT8 for a task whose object says
    ``int8_by_default`` (embed): OpenVINO's static INT8 (:func:`default_calibration`) for plain weights on a CPU
    where it was measured ahead (:func:`openvino_int8_measured`) and OpenVINO is installed, else ONNX INT8; for a
    task whose INT8 agreement is measured, the folder's own INT8 graph where the CPU has VNNI/AMX int8 and the card's ``int8_agreement`` (:mod:`encoderkit.inference.agreement`) is at least
    :data:`~encoderkit.inference.agreement.INT8_MIN_AGREEMENT`; else ONNX FP32. A folder holding only
    ``model.int8.onnx`` runs on it."""
    if folder.static_weights is not None:
        return Choice(STATIC, "a static embedding table: a lookup and a mean")
    task = get_task(folder.task)
    if task.int8_by_default:
        own = folder.torch_weights is not None and folder.onnx_int8 is None and folder.quantization is None
        if own and openvino_int8_measured(hw := hw or hardware.detect()):  # plain weights, no INT8 graph of its own
            if openvino_ready():
                return Choice("openvino-int8", f"INT8: the {task.name} task's rule, on OpenVINO's static INT8 (a CPU with "
                              "AVX-512 VNNI and no AMX, where it ran 1.4-1.5x ONNX Runtime's INT8 on passages)")
            return Choice("onnx-int8", f"INT8: the {task.name} task's rule, on ONNX Runtime; on this CPU (AVX-512 VNNI, no "
                          "AMX) OpenVINO's static INT8 ran 1.4-1.5x faster on passages: pip install \"encoderkit[openvino]\"")
        if folder.onnx_int8 or folder.torch_weights:
            return Choice("onnx-int8", f"INT8: the {task.name} task's rule (its INT8 graph was measured to keep quality)")
        return Choice("onnx-fp32", "FP32: the folder has neither an INT8 graph nor weights to quantise")
    if folder.onnx_int8 is not None and folder.onnx_fp32 is None and folder.torch_weights is None:
        return Choice("onnx-int8", "INT8: the folder holds only model.int8.onnx")
    if task.agreement_measure is None:
        return Choice("onnx-fp32", f"FP32: {task.name} runs INT8 only when asked (--backend onnx-int8)")
    hw = hw or hardware.detect()
    if not hw.vnni:
        return Choice("onnx-fp32", "FP32: this CPU has no VNNI/AMX int8")
    ok, why = verdict(folder.card.get(CARD_KEY) if folder.onnx_int8 is not None else None)
    if not ok:
        return Choice("onnx-fp32", f"FP32: {why}")
    return Choice("onnx-int8", f"INT8: {why}, and the CPU has {'/'.join(hw.vnni_names())}")


def openvino_int8_measured(hw: Hardware) -> bool:
    """Whether ``hw`` is the CPU class where OpenVINO's static INT8 was measured ahead of ONNX Runtime's dynamic INT8
    for embeddings (AVX-512 VNNI without AMX, an AMD EPYC, bench/embed_peers.py: 1.44-1.49x its passages/s and
    1.12-1.40x its sentences/s in three runs; as ``auto``, 1.52-1.65x the best peer's passages/s and 1.49-1.79x its
    sentences/s in four). Elsewhere it is not measured, so ``auto`` keeps ONNX Runtime: on an AMX Xeon OpenVINO's
    bf16 and ONNX Runtime's INT8 were measured, not its static INT8."""
    return "avx512_vnni" in hw.isa and not hw.amx


def openvino_ready() -> bool:
    """Whether OpenVINO and NNCF are installed (``pip install "encoderkit[openvino]"``), without importing them."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("openvino", "nncf"))


def pick_backend(folder: ModelFolder, policy: str, task: str | None = None) -> str | None:
    """The backend ``policy`` runs ``folder`` on (see the module docstring): a name in :data:`BACKENDS`,
    :data:`TORCH_INT8`, or None (``evaluate`` on a plain torch folder, or on 8-bit weights of a ``task``
    without a task object: the torch model as the evaluation loads it), or :data:`STATIC` for a static folder."""
    if folder.static_weights is not None:
        if policy in BACKENDS:
            raise EncoderkitError(f"{folder.path} is a static embedding model: it runs on its own table lookup, not "
                                  f"on {policy}; use --backend auto")
        return STATIC
    if policy in BACKENDS:
        return policy
    if policy == "serve":
        return serve_choice(folder).value
    if policy == "graph":
        return "onnx-int8" if folder.onnx_int8 is not None else "onnx-fp32"
    if policy == "evaluate":
        if folder.torch_weights is None and (folder.onnx_int8 is not None or folder.onnx_fp32 is not None):
            return pick_backend(folder, "graph")
        quant = folder.quantization
        eight_bit = quant is not None and int(quant.get("bits", 8)) == 8
        return TORCH_INT8 if eight_bit and (task or folder.task) in TASKS else None
    raise EncoderkitError(f"engine policy {policy!r} is not one of {', '.join(BACKENDS + POLICIES)}")


def open_engine(folder: ModelFolder, policy: str, *, task: str | None = None, threads: int | None = None,
                spin: bool = True, calibration: list[dict[str, np.ndarray]] | None = None) -> tuple[Engine | None, str | None]:
    """(engine, backend) for ``folder`` under ``policy`` (:func:`pick_backend`). ``task`` (default: the
    folder's) names the head torch loads; a graph runs the task it was exported for. ``threads``/``spin``:
    ONNX Runtime's intra-op threads, and whether its idle threads spin. ``calibration``: token batches whose
    activation ranges ``openvino-int8`` quantises with (default: :func:`default_calibration`). The
    engine is None when the backend is (``evaluate`` on a plain torch folder)."""
    backend = pick_backend(folder, policy, task)
    if backend is None:
        return None, None
    if backend == STATIC:
        return StaticEngine.open(folder), backend
    if backend.startswith("onnx"):
        folder.require_task(*TASKS)  # a graph runs the task it was exported for
        return OnnxEngine(cached_export(folder, backend == "onnx-int8"), folder.task, threads, spin), backend
    if backend == "openvino":
        folder.require_task(*TASKS)
        return OpenVinoEngine(cached_export(folder, False, plain=True), folder.task, threads), backend
    if backend == "openvino-int8":
        folder.require_task(*TASKS)
        return OpenVinoEngine(cached_openvino_int8(folder, calibration), folder.task, threads), backend
    task = task or folder.task
    if backend == TORCH_INT8:
        return ModuleEngine(get_task(task).graph_module(folder.load(task=task, int8_runtime=True)), get_task(task).outputs), backend
    return torch_engine(folder, bf16=backend == "torch-bf16"), backend


def torch_engine(folder: ModelFolder, bf16: bool) -> ModuleEngine:
    """The eager transformers model as an engine: int64 arrays (B, T) in, the task's float32 outputs out."""
    import torch

    model = folder.load(task=folder.task, dtype=torch.bfloat16 if bf16 else None, attn="sdpa", frozen=True)
    return ModuleEngine(get_task(folder.task).graph_module(model), list(get_task(folder.task).outputs))


class StaticEngine:
    """A static embedding folder as an engine that pools (``pools``): each text's vector is the mean of its
    tokens' rows of the weighted table, over the real tokens (``attention_mask``) less the ones the tokenizer adds
    around a text (``skip_ids``: [CLS]/[SEP]), so that it equals sentence-transformers' ``EmbeddingBag`` mean of
    the same text tokenised without special tokens. ``[(B, D) float32]`` comes back, un-normalised.

    :meth:`pool_texts` is the fast path the :class:`~encoderkit.tasks.embed.embedder.Embedder` takes: whole texts
    through the Rust tokenizer (no special tokens, no offsets, no padding) and a segment sum, what
    sentence-transformers computes; tokenising is then most of the time (SciFact's corpus: 1.1 s of 1.4 s)."""

    pools = True
    TEXTS_PER_BLOCK = 512  # texts gathered at once: (their tokens, D) float32 in memory

    def __init__(self, table: np.ndarray, skip_ids: list[int], tokenizer: object | None = None) -> None:
        self.table = table  # (V, D) float32
        self.counted = np.ones(len(table), dtype=np.float32)
        self.counted[[i for i in skip_ids if 0 <= i < len(table)]] = 0.0
        self.backend = None
        if tokenizer is not None:  # a copy: the transformers tokenizer sets truncation and padding on its own
            import copy

            self.backend = copy.deepcopy(tokenizer.backend_tokenizer)
            self.backend.no_truncation()
            self.backend.no_padding()

    @classmethod
    def open(cls, folder: ModelFolder) -> StaticEngine:
        from encoderkit.models.static import read_static_table

        tokenizer = folder.tokenizer()
        return cls(read_static_table(folder.path), list(tokenizer("")["input_ids"]), tokenizer)

    def pool_texts(self, texts: list[str]) -> np.ndarray:
        """(N, D) float32: the mean of each whole text's token rows (zeros for a text without tokens)."""
        import itertools

        import torch

        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        table = torch.from_numpy(self.table)
        out = []
        for start in range(0, len(texts), self.TEXTS_PER_BLOCK):
            enc = encode(texts[start : start + self.TEXTS_PER_BLOCK], add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
            flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in enc), dtype=np.int64, count=int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            # a gather and a segment mean in one kernel (numpy's gather + reduceat is 40x slower)
            bag = torch.nn.functional.embedding_bag(torch.from_numpy(flat), table, torch.from_numpy(offsets), mode="mean")
            out.append(bag.numpy())
        return np.concatenate(out) if out else np.zeros((0, self.table.shape[1]), dtype=np.float32)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        ids = inputs["input_ids"]  # (B, T)
        keep = inputs["attention_mask"].astype(np.float32) * self.counted[ids]  # (B, T)
        summed = np.einsum("bt,btd->bd", keep, self.table[ids])  # (B, D)
        return [summed / np.maximum(keep.sum(1, keepdims=True), 1.0)]


class OnnxEngine:
    """onnxruntime session on one ``.onnx`` file."""

    def __init__(self, path: Path, task: str, threads: int | None, spin: bool = True) -> None:
        self.session = ort_session(path, threads, spin)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.outputs = list(get_task(task).outputs)
        missing = set(self.outputs) - {o.name for o in self.session.get_outputs()}
        if missing or not {"input_ids", "attention_mask"} <= set(self.input_names):
            raise EncoderkitError(f"{path}: graph inputs/outputs do not match a {task} model "
                                  f"(missing {sorted(missing) or 'input_ids/attention_mask'}); re-run encoderkit export")

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        feed = {k: v for k, v in inputs.items() if k in self.input_names}
        if "token_type_ids" in self.input_names and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(inputs["input_ids"])
        return self.session.run(self.outputs, feed)


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
    if cached.is_file():
        return cached
    with output_dir(out, overwrite=True) as tmp:  # both graphs at once: the INT8 one is quantised from the FP32 trace
        copy_side_files(folder.path, tmp, weights=True)
        export_onnx(folder, tmp, optimize=not plain, int8=not plain)
    return cached


CALIBRATION_TEXTS = 128  # texts (of a corpus) whose activation ranges openvino-int8 quantises with


def vocabulary_batches(folder: ModelFolder, rows: int = CALIBRATION_TEXTS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Data-free calibration batches: [CLS] + tokens drawn uniformly from the vocabulary's non-special ids +
    [SEP], 8 rows a batch at seeded lengths, log-uniform from 8 to the model's maximum. On all-MiniLM-L6-v2 and SciFact
    passages they gave a cosine of 0.9943 (min 0.9619) to fp32 and the same nDCG@10, against 0.9973 (min
    0.9915) with 128 passages of the corpus itself."""
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


DEFAULT_CALIBRATION = "half vocabulary draws, half builtin:stdlib docstrings (seed 0)"  # part of the cache key: a
# change to default_calibration must change this text


def default_calibration(folder: ModelFolder, rows: int = CALIBRATION_TEXTS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Calibration when the caller has no texts of its own (``--backend auto``, a Predictor without ``calibration``):
    half :func:`vocabulary_batches` (every script the vocabulary has), half seeded docstrings of ``builtin:stdlib``
    (real prose, in the lengths real texts have; the vocabulary alone where the interpreter ships no sources).
    On all-MiniLM-L6-v2 against ONNX Runtime fp32, cosine mean / min: SST-2 dev 0.9968 / 0.932 (``cool ?``),
    400 SciFact passages 0.9967 / 0.9919, its queries 0.9974 / 0.9930; the vocabulary alone gave 0.9909 / 0.795
    on SST-2 (the same two words), 0.9942 / 0.9853 on the passages (AMD EPYC, AVX-512 VNNI)."""
    from encoderkit.data.builtin_corpus import stdlib_docstrings

    try:
        docs = [doc for _, _, doc in stdlib_docstrings()]
    except OSError:
        docs = []
    rng = np.random.default_rng(seed)
    texts = [docs[i] for i in sorted(rng.choice(len(docs), size=min(len(docs), rows // 2), replace=False))] if docs else []
    tok = folder.tokenizer()
    limit = min(folder.max_length, 512)
    real = [dict(tok(texts[i:i + 8], truncation=True, max_length=limit, padding=True, return_tensors="np"))
            for i in range(0, len(texts), 8)]
    return vocabulary_batches(folder, rows - len(texts), seed) + real


def cached_openvino_int8(folder: ModelFolder, calibration: list[dict[str, np.ndarray]] | None = None) -> Path:
    """``folder``'s plain graph quantised to static INT8 by NNCF (the transformer preset: activations per tensor,
    weights per channel, softmax and norms left in the CPU plugin's own precision), activation ranges measured on
    ``calibration`` (token batches; default :func:`default_calibration`). Made once per folder and calibration
    and kept in a cache folder (``model.xml`` + ``model.bin``); about 10-20 s for MiniLM on 2 cores."""
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


OPENVINO_LENGTH_STEP = 8  # OpenVINO's CPU plugin prepares kernels once per input shape: lengths padded to a multiple
# of 8 give a 256-token model 32 shapes a batch size instead of 256 (SST-2 sentences met for the first time: 575/s with
# every length its own shape, against 797-841/s once each shape had been seen)


class OpenVinoEngine:
    """OpenVINO's CPU runtime on a plain FP32 graph (``--backend openvino``), or on its static INT8 quantisation
    (``--backend openvino-int8``, :func:`cached_openvino_int8`). It runs what is not quantised at the CPU plugin's
    own inference precision: bf16 on a CPU with AMX or AVX512-BF16, fp32 elsewhere (``precision``). One batch at a time
    (:meth:`run`, serving) runs on every thread; many (:meth:`run_many`, a corpus) run ``streams`` at once, the
    threads shared among them (OpenVINO's throughput mode: on 2 threads, 2 streams of one thread gave 1.25x the
    passages/s and 1.35x the sentences/s of one stream of two). Measured on an AMX Xeon at 2 threads against ONNX
    Runtime INT8 on all-MiniLM-L6-v2 (bench/embed_peers.py): 2x the passages/s at a cosine of 1.0000 to fp32; the
    static INT8 graph on an AVX-512 VNNI/BF16 EPYC without AMX: 1.4-1.55x ONNX Runtime INT8 on passages. ``run_many``
    takes ``in_flight`` batches (8 per stream) before it waits: 4 drained the streams at every window (78 vs 87
    passages/s, 550-770 vs 800 sentences/s)."""

    def __init__(self, path: Path, task: str, threads: int | None) -> None:
        import threading

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
        self.in_flight = 8 * self.streams if self.streams > 1 else 1  # batches handed together: fewer drains of the streams
        self.length_step = OPENVINO_LENGTH_STEP  # run_rows groups rows by their lengths rounded up as this engine pads them
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
        return [np.array(get(name)[:, :length] if self.per_token else get(name), dtype=np.float32) for name in self.outputs]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self.lock:  # the request's output tensors are reused by its next call: copied out under the lock
            result = self.request.infer(self._feed(inputs))
            return self._outputs(lambda name: result[self.model.output(name)], inputs)

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


def serve_rule(hw: Hardware, tasks: tuple[str, ...] = TASKS) -> str:
    """What the ``serve`` policy (:func:`serve_choice`) runs each task on, on ``hw``: what doctor states."""
    int8 = [t for t in tasks if int8_by_default(t)]
    measured = [t for t in tasks if t not in int8 and get_task(t).agreement_measure]
    fp32 = [t for t in tasks if t not in int8 and t not in measured]
    rule = [f"ONNX INT8 for {', '.join(int8)}"] if int8 else []
    if int8 and openvino_int8_measured(hw):  # the class of CPU where OpenVINO's static INT8 measured faster
        rule = [f"OpenVINO static INT8 for {', '.join(int8)} (ONNX INT8 for a folder with its own INT8 graph)"
                if openvino_ready() else f"ONNX INT8 for {', '.join(int8)} (OpenVINO's static INT8 is faster on "
                'this CPU: pip install "encoderkit[openvino]")']
    if measured and hw.vnni:
        rule.append(f"for {', '.join(measured)} ONNX INT8 where the folder's card records INT8 agreement >= "
                    f"{100 * INT8_MIN_AGREEMENT:.1f}% with FP32 on its dev rows (export --quantize int8-dynamic "
                    "--dev FILE), else ONNX FP32")
    elif measured:
        rule.append(f"ONNX FP32 for {', '.join(measured)} (this CPU has no VNNI/AMX int8)")
    if fp32:
        rule.append(f"ONNX FP32 for {', '.join(fp32)}")
    return "; ".join(rule)
