"""The one home of compression measurement: parameters, bytes on disk, latency, quality.

Size is the bytes of the folder's files (a sparse weight in a dense file is not smaller); parameters follow one
rule for a torch folder and its ONNX graph; latency is :func:`median_ms`, the one timing loop; quality is the task's
own metric as ``encoderkit evaluate`` computes it, run by the measured folder's engine. :func:`measure_folder` is
what one lever reports, :class:`StepMeasurer` what the recipe runner and the planner report per step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.config import check
from encoderkit.errors import EncoderkitError
from encoderkit.evaluate.run import EvaluateConfig, compressed_engine, folder_metrics
from encoderkit.inference.agreement import int8_agreement, not_measured
from encoderkit.inference.engines import cached_export, open_engine
from encoderkit.inference.export import GraphEngine
from encoderkit.inference.policy import resolve
from encoderkit.io import portable, write_json_atomic
from encoderkit.models.card import inherited_card, write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.heads import HEADS
from encoderkit.models.sparse import sparse_stats
from encoderkit.models.static import static_parameters
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.inference import ModuleEngine, run_rows
from encoderkit.tasks.protocol import Task

QualityFn = Callable[[Path], dict[str, float]]

# files that belong to a model folder but are not the model (left out of "bytes on disk")
_NOT_MODEL = {"encoderkit.json", "report.json", "README.md"}


@dataclass
class LeverReport:
    """Result of one lever: the folders, the measurements before and after, and method details."""

    lever: str
    method: str
    model_in: str
    model_out: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        # a corpus folder's links left out are said at the top, as every stage that reads a corpus folder says them
        links = {"skipped_links": self.details["skipped_links"]} if "skipped_links" in self.details else {}
        return {"lever": self.lever, "method": self.method, "model_in": self.model_in,
                "model_out": self.model_out, "before": self.before, "after": self.after,
                "details": self.details, **links}


def finish_lever(tmp: Path, lever: str, method: str, model_dir: Path, out_dir: Path, config: dict[str, Any],
                 before: dict[str, Any], details: dict[str, Any], *, latency: bool,
                 quality_fn: QualityFn | None) -> LeverReport:
    """Measure the lever's new folder ``tmp`` (to be renamed to ``out_dir``), write its card (the
    parent's task facts carried over) and ``report.json``, and return the report."""
    after = measure_folder(tmp, latency=latency, quality_fn=quality_fn)
    report = LeverReport(lever, method, str(model_dir), str(out_dir), before, after, details)
    write_card(tmp, lever, model_dir, config, after, **inherited_card(model_dir))
    write_json_atomic(tmp / "report.json", portable(report.summary(), tmp))  # paths relative to the folder
    return report


def bytes_on_disk(folder: str | Path, only_weights: bool = False) -> int:
    """Sum of the sizes of the files in ``folder`` (recursively), cards and reports left out.

    ``only_weights`` counts only ``*.safetensors`` / ``*.onnx`` / ``*.bin`` / ``*.data`` files.
    """
    total = 0
    for p in Path(folder).rglob("*"):
        if not p.is_file() or p.name in _NOT_MODEL or p.name.startswith("."):
            continue
        if only_weights and p.suffix not in (".safetensors", ".onnx", ".bin", ".data"):
            continue
        total += p.stat().st_size
    return total


def count_parameters(model: torch.nn.Module, nonzero: bool = False) -> int:
    """Number of parameters (tied weights once); ``nonzero`` counts only the entries that are not 0."""
    seen: set[int] = set()
    n = 0
    for p in list(model.parameters()) + [b for b in model.buffers() if getattr(b, "_encoderkit_weight", False)]:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += int(torch.count_nonzero(p)) if nonzero else p.numel()
    return n


def median_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time (ms) of ``repeats`` calls of ``fn`` after one warm-up call: the one timing loop
    of the package (bench/ scripts keep their own)."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1000, 2)


# ONNX element types that hold weights (float, or the int8/uint8/int4 codes of quantized weights)
_WEIGHT_TYPES = (1, 2, 3, 10, 11, 16, 21, 22)  # FLOAT UINT8 INT8 FLOAT16 DOUBLE BFLOAT16 UINT4 INT4


def onnx_parameters(path: str | Path) -> int:
    """Weights of an ONNX graph, counted as :func:`count_parameters` counts its torch model: the elements of every
    use of a weight tensor by a node (not scales, zero points, int64 shapes or scalars). Counting uses, not stored
    tensors, gives the torch number for fused, INT8 and deduplicated graphs alike."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    tensors = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    tensors[node.output[0]] = a.t

    def is_weight(name: str) -> bool:
        t = tensors.get(name)
        return (t is not None and t.data_type in _WEIGHT_TYPES and len(t.dims) >= 1
                and not name.endswith(("_scale", "_zero_point", "scale", "zero_point")))

    def uses(nodes: Any) -> int:
        n = 0
        for node in nodes:
            n += sum(int(np.prod(tensors[i].dims)) for i in node.input if is_weight(i))
            n += sum(uses(a.g.node) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
        return n

    return uses(graph.node)


def folder_parameters(folder: str | Path | ModelFolder, model: torch.nn.Module | None = None) -> int:
    """Parameters of a model folder, one rule for both representations: its torch model
    (:func:`count_parameters`; ``model`` when already loaded; an embed model's unused pooler left out) or,
    for a folder that holds only an ONNX graph, :func:`onnx_parameters` of it (INT8 before FP32) -- the
    same number for a model and its export."""
    mf = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder, tokenizer=False)
    if mf.static_weights is not None:  # a static embedding model: its token table and weights
        return static_parameters(mf.path)
    if model is None and mf.torch_weights is not None:
        model = mf.load()
    if model is not None:
        # an embedding pools the token states; a bare encoder's pooler (dense + tanh) never runs, and its
        # ONNX export (outputs: last_hidden_state) has none
        head = HEADS.get(mf.task or "")
        pooler = getattr(model, "pooler", None) if head is not None and head.auto_class == "AutoModel" else None
        return count_parameters(model) - (count_parameters(pooler) if isinstance(pooler, torch.nn.Module) else 0)
    graph = mf.onnx_int8 or mf.onnx_fp32
    if graph is None:
        raise EncoderkitError(f"{mf.path} holds no weights to count (no model.safetensors, no model.onnx)")
    return onnx_parameters(graph)


def text_batches(tokenizer: Any, texts: Sequence[str | tuple[str, str]], seq_len: int,
                 batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Tokenised batches of ``texts`` (single sentences or pairs), each tensor ``(B, <=seq_len)``."""
    for i in range(0, len(texts), batch_size):
        chunk = list(texts[i:i + batch_size])
        if chunk and isinstance(chunk[0], (tuple, list)):
            a, b = zip(*chunk)
            enc = tokenizer(list(a), list(b), truncation=True, max_length=seq_len, padding=True, return_tensors="pt")
        else:
            enc = tokenizer(chunk, truncation=True, max_length=seq_len, padding=True, return_tensors="pt")
        yield dict(enc)


@torch.no_grad()
def torch_latency(model: torch.nn.Module, batch_size: int, seq_len: int, repeats: int = 5,
                  vocab_size: int | None = None) -> dict[str, float]:
    """Median wall time (ms) of ``model(input_ids (B, T))`` on CPU with the current thread count."""
    vocab_size = vocab_size or int(getattr(model.config, "vocab_size", 1000))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones_like(ids)
    model.eval()
    ms = median_ms(lambda: model(input_ids=ids, attention_mask=mask), repeats)
    return {"ms": ms, "items_per_s": round(batch_size / (ms / 1000), 1)}


_MEASURED: dict[tuple[Any, ...], dict[str, Any]] = {}


def measure_folder(folder: str | Path, *, latency: bool = True, seq_len: int = 128,
                   batch_sizes: tuple[int, ...] = (1, 32), quality_fn: QualityFn | None = None,
                   repeats: int = 5) -> dict[str, Any]:
    """Parameters, nonzero parameters, bytes on disk, torch CPU latency at ``batch_sizes`` and quality. Results
    are remembered per folder state within the process, so a lever's "before" reuses the previous one's "after"."""
    if not Path(folder).is_dir():
        raise EncoderkitError(f"model folder {folder} does not exist")
    files = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                         for p in Path(folder).iterdir() if p.is_file()))
    key = (str(Path(folder).resolve()), files, latency, seq_len, batch_sizes, quality_fn, repeats,
           torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = _measure(Path(folder), latency, seq_len, batch_sizes, quality_fn, repeats)
    return dict(_MEASURED[key])


def _measure(folder: Path, latency: bool, seq_len: int, batch_sizes: tuple[int, ...],
             quality_fn: QualityFn | None, repeats: int) -> dict[str, Any]:
    mf = ModelFolder.open(folder, tokenizer=False)
    folder = mf.path
    onnx_files = sorted(folder.glob("*.onnx"))
    out: dict[str, Any] = {"bytes": bytes_on_disk(folder), "weight_bytes": bytes_on_disk(folder, only_weights=True)}
    if onnx_files and not any(folder.glob("*.safetensors")):
        vocab = int(mf.config.get("vocab_size", 1000))
        return {**out, "params": folder_parameters(mf),
                **_measure_onnx(onnx_files[0], latency, seq_len, batch_sizes, repeats, vocab), **(
            {"quality": quality_fn(folder)} if quality_fn else {})}
    runtime = (mf.quantization or {}).get("runtime", "")
    model = mf.load()
    out["params"] = folder_parameters(mf, model)
    out["nonzero_params"] = count_parameters(model, nonzero=True)
    if latency:
        int8 = runtime == "torch-int8"
        if int8:
            model = mf.load(int8_runtime=True)
        out["latency"] = {"seq_len": seq_len, "threads": torch.get_num_threads(),
                          "runtime": "torch-cpu-dynamic-int8" if int8 else "torch-cpu-fp32"}
        for b in batch_sizes:
            out["latency"][f"batch{b}"] = torch_latency(model, b, seq_len, repeats=repeats)
    if quality_fn is not None:
        out["quality"] = quality_fn(folder)
    return out


def _measure_onnx(path: Path, latency: bool, seq_len: int, batch_sizes: tuple[int, ...], repeats: int,
                  vocab_size: int) -> dict[str, Any]:
    """ONNX Runtime CPU latency of an ONNX model file on random tokens."""
    import onnxruntime as ort

    out: dict[str, Any] = {}
    if not latency:
        return out
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out["latency"] = {"seq_len": seq_len, "threads": torch.get_num_threads(),
                      "runtime": f"onnxruntime-cpu ({path.name})"}
    rng = np.random.default_rng(0)
    for b in batch_sizes:
        feed = {n: (rng.integers(5, vocab_size, (b, seq_len)) if n == "input_ids" else
                    np.ones((b, seq_len)) if n == "attention_mask" else np.zeros((b, seq_len))).astype(np.int64)
                for n in names}
        ms = median_ms(lambda feed=feed: sess.run(None, feed), repeats)
        out["latency"][f"batch{b}"] = {"ms": ms, "items_per_s": round(b / (ms / 1000), 1)}
    return out


# -- the recipe runner's measurement: every task, its own metric, its own serving unit ------------------------

# per task (its object, :mod:`encoderkit.tasks.protocol`): the dev metric reported as ``quality``
# (``primary_metrics``: the first one the evaluation gives), what a latency figure is (``unit``), the dev
# examples timed (``latency_samples``) and their feature rows (``latency_rows``)
MAX_BATCH = 32  # rows per engine call, as the Predictor serves (Predictor.load's max_batch)
_COUNTS = ("examples", "sentences", "questions", "queries")


class StepMeasurer:
    """Measures a model folder of the starting model's task (``model``, else the first folder measured): dev
    quality (``encoderkit evaluate``'s metric with the starting card's columns), parameters, weight bytes and
    latency in the task's serving unit on real dev examples, tokenisation excluded.

    Each folder runs on its own engine, and each row names it: its INT8 graph, an ONNX-only folder's FP32 graph,
    with ``runtime="deploy"`` a plain folder's cached FP32 export, else torch.
    """

    def __init__(self, dev: str, seq_len: int = 0, runtime: str = "deploy", dev_limit: int = 0, repeats: int = 5, *,
                 model: str | Path | None = None, miner: str = "", candidates: int = 100, batch_size: int = 32,
                 qa_split: str = "all") -> None:
        self.dev, self.seq_len, self.runtime, self.repeats = str(dev), seq_len, runtime, repeats
        self.dev_limit, self.miner, self.candidates, self.batch_size = dev_limit, miner, candidates, batch_size
        self.qa_split = qa_split
        self.task: str | None = None
        self.eval_cfg: Any = None
        self.samples: dict[str, Any] = {}
        if model is not None:
            self.setup(ModelFolder.open(model, tokenizer=False))

    # -- the task and its dev data, read once from the starting model ---------------------------------
    def setup(self, start: ModelFolder) -> None:
        """Take the task and the data columns from the starting model's folder and check the dev data
        (errors name the task, the field and the step: the starting model is measured before step 1)."""

        task = start.task
        if task not in TASKS:
            raise EncoderkitError(f"{start.path} is {'a ' + repr(task) if task else 'a'} model whose task "
                                  f"compression cannot measure; the starting model must be one of {', '.join(TASKS)} "
                                  "(fine-tune it first)")
        where = f"compress: {task} dev data {self.dev} (read to measure the starting model, before step 1)"
        cols = get_task(task).eval_columns(start.path)
        self.eval_cfg = EvaluateConfig(model=str(start.path), data=self.dev, task=task, max_examples=self.dev_limit,
                                       miner=self.miner, candidates=self.candidates, batch_size=self.batch_size,
                                       qa_split=self.qa_split, **cols)
        self.task = task
        try:
            self.samples = self._samples(start)
        except EncoderkitError as e:
            raise EncoderkitError(f"{where}: {e}") from e

    def _samples(self, start: ModelFolder) -> dict[str, Any]:
        """The dev examples timed for latency (one typical example: the median by characters; a batch:
        a seeded sample), read with the task's own reader -- which also checks the fields the task needs."""
        return self.spec.latency_samples(self.dev, self.eval_cfg, start, np.random.default_rng(0), miner=self.miner,
                                         candidates=self.candidates)

    @property
    def spec(self) -> Task:
        """The task object of the starting model's task."""
        return get_task(self.task)

    # -- one folder ----------------------------------------------------------------------------------
    def __call__(self, folder: Path) -> dict[str, Any]:
        folder = Path(folder)
        opened = ModelFolder.open(folder)  # with its tokenizer: quality and latency both tokenize
        if self.task is None:
            self.setup(opened)
        if opened.task is not None and opened.task != self.task:  # two folders' tasks, not a task's name
            raise EncoderkitError(f"{folder} is a {opened.task!r} model but the starting model is a {self.task!r} "
                                  "model; every step of a recipe keeps the task")
        try:
            return self._measure(opened)
        except EncoderkitError as e:
            raise EncoderkitError(f"{folder}: measuring {self.task} quality on {self.dev}: {e}") from e

    def _engine(self, mf: ModelFolder) -> tuple[Any, Any, str]:
        """(engine for quality: None = the folder's torch model as ``evaluate`` loads it; engine for
        latency; runtime name)."""
        threads = torch.get_num_threads()
        plain = mf.quantization is None and mf.kept_heads is None
        if mf.onnx_int8 is not None or (self.runtime == "deploy" and plain):
            choice = resolve(mf, "graph")
            engine = open_engine(mf, choice, threads=threads)
            return engine, engine, f"deploy {choice.backend}"
        engine, runtime = compressed_engine(mf, self.task, threads, MAX_BATCH)  # what `evaluate` runs on this folder
        if engine is None:
            return None, ModuleEngine(mf.load(task=self.task), self.spec.outputs), runtime
        return engine, engine, runtime

    def _measure(self, mf: ModelFolder) -> dict[str, Any]:
        quality_engine, engine, runtime = self._engine(mf)
        model = engine.module if hasattr(engine, "module") and not runtime.startswith("torch int8") else None
        row: dict[str, Any] = {"task": self.task, "params": folder_parameters(mf, model),
                               "folder_bytes": bytes_on_disk(mf.path), "bytes": weight_file_bytes(mf),
                               "runtime": runtime, "threads": torch.get_num_threads()}
        if mf.sparse is not None and mf.torch_weights is not None:  # pruned matrices stored packed
            packed = sparse_stats(mf.torch_weights)
            row.update(bytes_per_nonzero=packed["bytes_per_nonzero"], packed_bytes=packed["packed_bytes"],
                       packed_dense_bytes=packed["dense_bytes"], packed_nonzero=packed["nonzero"])
        cfg = dataclasses.replace(self.eval_cfg, model=str(mf.path))
        _, metrics = folder_metrics(mf, cfg, quality_engine)
        wanted = self.spec.primary_metrics
        primary = next((m for m in wanted if m in metrics), None)
        check(primary is not None, f"the {self.task} evaluation gave no {' or '.join(wanted)} ({sorted(metrics)})")
        row.update({"metric": primary, "quality": float(metrics[primary]),
                    "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        count = next((metrics[k] for k in _COUNTS if k in metrics), None)
        if count is not None:
            row["dev_examples"] = int(count)
        row.update(self._latency(mf, engine))
        return row

    def _latency(self, mf: ModelFolder, engine: Any) -> dict[str, Any]:
        """Latency of the task's serving unit and of its batch unit on this folder's tokenizer and engine."""
        tok = mf.tokenizer()
        max_length = min(self.seq_len, mf.max_length) if self.seq_len else mf.max_length
        pad = tok.pad_token_id or 0
        one, batch = self._rows(mf, tok, max_length)
        engine = self.spec.engine_for_latency(engine, mf)
        served = self.spec.unit
        unit, short, batch_unit, batch_short = served.desc, served.short, served.batch_desc, served.batch_short
        out: dict[str, Any] = {"latency_unit": short, "latency_unit_desc": unit,
                               "seq_len": max(len(r["input_ids"]) for r in one),
                               "latency_ms": median_ms(lambda: run_rows(engine, one, pad, MAX_BATCH), self.repeats)}
        if batch:
            ms = median_ms(lambda: run_rows(engine, batch, pad, MAX_BATCH), self.repeats)
            out.update({"batch_unit": batch_short, "batch_unit_desc": batch_unit, "batch_ms": ms,
                        "throughput": _sig(len(batch) / (ms / 1000))})
        else:
            out["throughput"] = _sig(1000 / out["latency_ms"])
        if short == "request":  # the batch-1 / batch-32 names the report and the quickstart read
            out.update({"latency_b1_ms": out["latency_ms"], "latency_b32_ms": out.get("batch_ms"),
                        "throughput_b32": out.get("throughput")})
        return out

    def _rows(self, mf: ModelFolder, tok: Any, max_length: int) -> tuple[list, list]:
        """Feature rows (the task's own featurisers, with the card's feature settings) of the timed unit and batch."""
        return self.spec.latency_rows(self.samples, tok, mf, self.eval_cfg, max_length)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a reranker serves under one query a second: one decimal would make ratios
    coarse)."""
    return float(f"{x:.4g}")


def weight_file_bytes(mf: ModelFolder) -> int:
    """Bytes of the weight file the runtime loads: the INT8 graph (and its external data), else the
    torch weights, else the FP32 graph."""
    if mf.static_weights is not None:  # a static embedding model's table
        return mf.static_weights.stat().st_size
    if mf.onnx_int8 is not None:
        return sum(p.stat().st_size for p in mf.path.glob(mf.onnx_int8.name + "*"))
    if mf.torch_weights is not None:
        return mf.torch_weights.stat().st_size
    return sum(p.stat().st_size for p in mf.path.glob(mf.onnx_fp32.name + "*")) if mf.onnx_fp32 else 0


def step_int8_agreement(src: Path, dst: Path, cfg: Any) -> dict[str, Any] | None:
    """The card's ``int8_agreement`` of the INT8 graph a recipe step wrote in ``dst`` against the FP32 graph of
    ``src``, on the recipe's dev data (``cfg``: a CompressConfig); None when ``dst`` has no INT8 graph or its task
    is not measured so."""
    made = ModelFolder.open(dst, tokenizer=False)
    if made.onnx_int8 is None or made.task not in TASKS or get_task(made.task).agreement_measure is None:
        return None
    parent = ModelFolder.open(src, tokenizer=False)
    if parent.onnx_fp32 is None and parent.torch_weights is None:
        return not_measured(f"{src} has no FP32 graph or weights to compare the INT8 graph with")
    fp32 = GraphEngine(cached_export(parent, int8=False), made.task)
    return int8_agreement(made, fp32, GraphEngine(made.onnx_int8, made.task), cfg.dev, limit=cfg.dev_limit,
                          miner=cfg.miner, candidates=cfg.candidates, qa_split=cfg.qa_split)


def make_measure(cfg: Any) -> StepMeasurer:
    """The recipe runner's measurer for a :class:`~encoderkit.compress.stack.CompressConfig`:
    ``measure(folder) -> row``; the task and the dev data are read and checked here, before any step runs."""
    return StepMeasurer(cfg.dev, seq_len=cfg.seq_len, runtime=cfg.runtime, dev_limit=cfg.dev_limit, repeats=cfg.repeats,
                        model=cfg.model, miner=cfg.miner, candidates=cfg.candidates, batch_size=cfg.batch_size,
                        qa_split=cfg.qa_split)


def latency_meta(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report says its latency columns are (the units of the rows' task)."""
    first = rows[0] if rows else {}
    out: dict[str, Any] = {"task": first.get("task"), "latency": first.get("latency_unit_desc"),
                           "longest timed example (sub-tokens)": first.get("seq_len")}
    if first.get("batch_unit_desc"):
        out["batch latency"] = first["batch_unit_desc"]
    return {k: v for k, v in out.items() if v is not None}
