"""``encoderkit export``: a task model folder -> the same folder plus ``model.onnx`` (and ``model.int8.onnx``).

The graph is traced with the TorchScript exporter (``dynamo=False``: the dynamo exporter needs
onnxscript) with dynamic batch and sequence axes. ``--optimize`` runs onnxruntime's BERT fusions
(attention, GELU, skip-layer-norm); ``--quantize int8-dynamic`` adds an INT8 copy with per-channel
weight scales and dynamic activation scales (per-tensor scales lose too much on MiniLM).
Parity against eager PyTorch is measured on sample inputs and the export fails beyond tolerance.

Graph inputs: ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer makes
them), int64 (B, T). Outputs: ``last_hidden_state`` (B, T, H) for ``embed``; ``logits`` (B, C) for
``classify``/``rerank``; ``logits`` (B, T, C) for ``ner``; ``start_logits``, ``end_logits`` (B, T)
for ``qa``.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.agreement import (
    CARD_KEY,
    INT8_MIN_AGREEMENT,
    agreement_rows,
    int8_agreement,
    not_measured,
    verdict,
)
from encoderkit.io import check_output_dir, output_dir
from encoderkit.models.anatomy import config_heads_hidden
from encoderkit.models.card import inherited_card, write_card
from encoderkit.models.folder import ONNX_FP32, ONNX_INT8, ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.tasks import TASKS, get_task

OUTPUT_NAMES = {t: list(get_task(t).outputs) for t in TASKS}  # task -> its graph's output names (``task.outputs``)
SAMPLE_TEXTS = [
    "the movie was great fun",
    "a dull , boring story that never ends and never gets to the point at all",
    "Angela Merkel visited Paris on Tuesday.",
]


@dataclass
class ExportConfig(StageConfig):
    """Settings of ``encoderkit export``."""

    model: str = arg(help="Task model folder (classify, rerank, ner, qa or embed).", required=True)
    out: str = arg(help="New folder: the model's files plus model.onnx (and model.int8.onnx).", required=True)
    format: str = arg("onnx", help="Export format.", choices=("onnx",))
    optimize: bool = arg(False, help="Fuse BERT attention/GELU/layer-norm with onnxruntime's transformer optimizer.")
    quantize: str = arg("none", help="Also write model.int8.onnx (dynamic INT8, per-channel weights).",
                        choices=("none", "int8-dynamic"))
    opset: int = arg(17, help="ONNX opset version.")
    tolerance: float = arg(1e-3, help="Largest allowed |ONNX fp32 - PyTorch| on the sample inputs.")
    int8_min_cosine: float = arg(0.95, help="Smallest allowed mean cosine between INT8 and PyTorch outputs "
                                            "(embed/ner/qa; classify/rerank: probabilities within 0.1).")
    dev: str = arg("", help="The task's dev data (what `encoderkit evaluate --data` takes; rerank: JSONL {query, "
                            "positive, negatives}, or a BEIR source with --miner): the INT8 graph's agreement with "
                            "FP32 on its rows, in the task's terms (classify: the label; multilabel: the label set; "
                            "ner: each word's tag; qa: the answer span; rerank: each query's top-1 passage), is "
                            "recorded in the card, where --backend auto reads it: INT8 from "
                            f"{100 * INT8_MIN_AGREEMENT:.1f}%% on a CPU with VNNI/AMX int8, else FP32.")
    dev_limit: int = arg(0, help="Measure agreement on the first N dev rows (rerank: queries) (0: all).")
    miner: str = arg("", help="rerank with a BEIR --dev: the bi-encoder folder (or 'minilm') whose top 100 documents "
                              "per query the reranker orders.")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")

    def validate(self) -> None:
        check(11 <= self.opset <= 21, f"--opset {self.opset} is not supported; use 14-20 (17 is the default)")
        check(self.tolerance > 0, "--tolerance must be positive")
        check(not self.dev or self.quantize != "none", f"--dev {self.dev} measures the INT8 graph's agreement with "
              "FP32; add --quantize int8-dynamic (or drop --dev)")
        check(self.dev_limit >= 0, f"--dev-limit must be >= 0, got {self.dev_limit}")


@dataclass
class ExportResult:
    out: Path
    task: str
    files: list[str]
    parity: dict[str, Any] = field(default_factory=dict)
    int8_agreement: dict[str, Any] | None = None  # the card's record (None: the task is not measured so)

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "task": self.task, "files": self.files, "parity": self.parity,
                **({"int8_agreement": self.int8_agreement} if self.int8_agreement else {})}


def _sample_inputs(tokenizer, info: ModelFolder) -> dict[str, np.ndarray]:
    """Three examples of different lengths, padded (B=3, T); (text, text) pairs for a task whose requests are pairs."""
    if get_task(info.task).pair_inputs:
        enc = tokenizer(["who visited paris ?", "what was fun", "why"], SAMPLE_TEXTS, padding=True,
                        truncation=True, max_length=min(64, info.max_length), return_tensors="np")
    else:
        enc = tokenizer(SAMPLE_TEXTS, padding=True, truncation=True, max_length=min(64, info.max_length),
                        return_tensors="np")
    return {k: v.astype(np.int64) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


class _GraphModule:
    """Builds the torch.nn.Module that takes positional int64 tensors and returns the task's tensors."""

    @staticmethod
    def wrap(model, task: str, input_names: list[str]):
        outputs = get_task(task).outputs

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, *tensors):
                out = self.model(**dict(zip(input_names, tensors, strict=True)))
                return tuple(out[name] for name in outputs)

        return Wrapped().eval()


def torch_outputs(model, task: str, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The task's output arrays from eager PyTorch for numpy ``inputs``."""
    with torch.inference_mode():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return [out[name].float().numpy() for name in get_task(task).outputs]


def _run_graph(session, outputs: list[str], inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``session.run`` fed only the inputs its graph kept: the exporter drops one the model never reads
    (``token_type_ids`` of a DeBERTa-v3, whose ``type_vocab_size`` is 0)."""
    names = {i.name for i in session.get_inputs()}
    return session.run(outputs, {k: v for k, v in inputs.items() if k in names})


class GraphEngine:
    """One ``.onnx`` file as an engine: the task's outputs, ``token_type_ids`` zero where rows have none; a graph
    that quantises activations per call (:func:`per_batch_scales`) runs one row at a time (:func:`run_alone`)."""

    def __init__(self, path: Path, task: str, threads: int | None = None) -> None:
        self.session, self.outputs = ort_session(path, threads), list(get_task(task).outputs)
        self.type_ids = any(i.name == "token_type_ids" for i in self.session.get_inputs())
        self.per_row, self.per_token = per_batch_scales(path), get_task(task).per_token

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.type_ids and "token_type_ids" not in inputs:
            inputs = inputs | {"token_type_ids": np.zeros_like(inputs["input_ids"])}
        if self.per_row:
            return run_alone(partial(_run_graph, self.session, self.outputs), inputs, self.per_token)
        return _run_graph(self.session, self.outputs, inputs)


DYNAMIC_QUANT_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})


@lru_cache(maxsize=64)
def _dynamic_ops(path: str, mtime_ns: int) -> bool:
    import onnx

    model = onnx.load(path, load_external_data=False)
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return any(n.op_type in DYNAMIC_QUANT_OPS for n in nodes)


def per_batch_scales(path: Path) -> bool:
    """Whether the ONNX graph at ``path`` quantises activations with scales computed at run time over the whole
    call (``quantize_dynamic``'s ``DynamicQuantizeLinear``): run on a padded batch, a text's output would depend on
    the texts beside it and on the padding, so the engines run such a graph one text at a time (:func:`run_alone`)."""
    return _dynamic_ops(str(Path(path).resolve()), Path(path).stat().st_mtime_ns)


def run_alone(run: Callable[[dict[str, np.ndarray]], list[np.ndarray]], inputs: dict[str, np.ndarray],
              per_token: bool) -> list[np.ndarray]:
    """``run`` on each row of the right-padded batch ``inputs`` alone, its padding cut off, the outputs put back
    together as the batch's: ``(B, ...)``, or ``(B, T, ...)`` zero past each row's length with ``per_token``. A
    graph with per-call activation scales then gives each text the output it has alone, whatever its batch."""
    mask = inputs["attention_mask"]
    width = mask.shape[1]
    lengths = np.where(mask.any(1), width - np.argmax(mask[:, ::-1] > 0, axis=1), 1)  # through the last real token
    rows = [run({k: v[i:i + 1, :n] if v.ndim == 2 and v.shape[1] == width else v[i:i + 1] for k, v in inputs.items()})
            for i, n in enumerate(lengths)]
    if not per_token:
        return [np.concatenate([r[j] for r in rows]) for j in range(len(rows[0]))]
    out = []
    for j in range(len(rows[0])):
        full = np.zeros((len(rows), width, *rows[0][j].shape[2:]), dtype=rows[0][j].dtype)
        for i, r in enumerate(rows):
            full[i, : r[j].shape[1]] = r[j][0]
        out.append(full)
    return out


def ort_session(path: Path, threads: int | None = None, spin: bool = True):
    """An onnxruntime CPU session for ``path``; a corrupt file raises EncoderkitError."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if not spin:  # idle worker threads sleep instead of spinning: better when the CPU is shared (a server)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/InvalidProtobuf types
        raise EncoderkitError(
            f"{path} is not a valid ONNX model ({type(e).__name__}: {str(e)[:200]}); re-create it with "
            f"encoderkit export --model <task model folder> --out <folder>"
        ) from e


def _max_abs(a: list[np.ndarray], b: list[np.ndarray], mask: np.ndarray) -> float:
    """Largest |a-b| over real (non-padding) positions."""
    diffs = []
    for x, y in zip(a, b, strict=True):
        d = np.abs(x - y)
        if d.ndim >= 2 and d.shape[1] == mask.shape[1]:
            d = d * mask.reshape(mask.shape + (1,) * (d.ndim - 2))
        diffs.append(float(d.max()))
    return max(diffs)


def _mean_cosine(a: list[np.ndarray], b: list[np.ndarray], mask: np.ndarray) -> float:
    """Mean over examples of the cosine between the two outputs, padding positions zeroed."""

    def flat(ts: list[np.ndarray]) -> np.ndarray:
        rows = []
        for t in ts:
            if t.ndim >= 2 and t.shape[1] == mask.shape[1]:
                t = t * mask.reshape(mask.shape + (1,) * (t.ndim - 2))
            rows.append(t.reshape(len(t), -1))
        return np.concatenate(rows, axis=1)

    x, y = flat(a), flat(b)
    cos = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-12)
    return float(cos.mean())


def _probs(logits: np.ndarray, multi_label: bool = False) -> np.ndarray:
    """Softmax over labels (B, C), or the sigmoid of each logit for a one-logit head (B, 1) or a
    ``multi_label`` head (a sigmoid per label)."""
    if multi_label or logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _optimize(src: Path, dst: Path, config: dict[str, Any]) -> bool:
    """onnxruntime BERT fusions from ``src`` into ``dst``; False (``src`` copied) when they do not apply."""
    from onnxruntime.transformers import optimizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # under the family's own config keys: with 0 the optimizer guesses from the graph, and fails on DistilBERT's
            heads, hidden = config_heads_hidden(config)
            opt = optimizer.optimize_model(str(src), model_type="bert", num_heads=heads, hidden_size=hidden)
        opt.save_model_to_file(str(dst))
        return True
    except Exception as e:  # noqa: BLE001 -- the optimizer is best effort: keep the plain graph
        warnings.warn(f"onnxruntime optimizer failed ({e}); keeping the unfused graph", stacklevel=2)
        shutil.copyfile(src, dst)
        return False


# how export makes its graphs; raised when that changes (3: INT8 quantises the fused graph's MatMul and Attention;
# 4: the optimizer is told the heads and width under the family's config keys, so DistilBERT's attention fuses too)
GRAPH_RECIPE = 4


def _quantize(raw: Path, fused: Path | None, dst: Path, config: dict[str, Any], optimize: bool, tmp: Path) -> str:
    """Dynamic INT8 (per-channel int8 weights) of the exported graph into ``dst``; which route it took.

    ``fused-then-quantized`` (when ``fused``, the optimizer's FP32 graph, is given): its fused ``Attention``
    becomes ``QAttention`` (the Q, K, V projections in int8, in one kernel) and its other MatMuls dynamic INT8,
    the faster route at the same cosine to FP32 (docs/results/deploy-log.md). ``quantized-then-fused`` otherwise
    (and when the fused graph does not quantise): the plain graph quantised, then GELU and layer norm fused."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    q = tmp / "int8.onnx"
    if fused is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # the fused ops (a contrib domain) leave shape inference without types: their outputs are float
                # MatMul and Attention only: the embedding lookup stays float (as on the other route), so the
                # graph's weights are the torch model's (compress.measure.onnx_parameters)
                quantize_dynamic(str(fused), str(q), per_channel=True, weight_type=QuantType.QInt8,
                                 op_types_to_quantize=["MatMul", "Attention"],
                                 extra_options={"DefaultTensorType": TensorProto.FLOAT})
            shutil.copyfile(q, dst)
            return "fused-then-quantized"
        except Exception as e:  # noqa: BLE001 -- a fused op the quantiser does not know: take the other route
            warnings.warn(f"quantising the fused graph failed ({str(e)[:120]}); quantising the plain graph",
                          stacklevel=2)
    quantize_dynamic(str(raw), str(q), per_channel=True, weight_type=QuantType.QInt8)
    if optimize:  # fusing after quantising keeps the QDQ-free MatMulInteger path and still fuses GELU/LN
        _optimize(q, dst, config)
    else:
        shutil.copyfile(q, dst)
    return "quantized-then-fused" if optimize else "quantized"


def export_onnx(model_dir: str | Path | ModelFolder, out: Path, *, optimize: bool = False, int8: bool = False,
                opset: int = 17, tolerance: float = 1e-3, int8_min_cosine: float = 0.95,
                int8_strict: bool = True) -> dict[str, Any]:
    """Write ``out/model.onnx`` (and ``out/model.int8.onnx``) for the task model in ``model_dir``.

    Returns the parity figures: ``fp32_max_abs_diff`` (and ``int8_max_abs_diff``, ``int8_mean_cosine``).
    Raises EncoderkitError when the FP32 graph differs from eager PyTorch beyond ``tolerance``.
    """
    info = model_dir if isinstance(model_dir, ModelFolder) else ModelFolder.open(model_dir, tokenizer=False)
    model_dir = info.path
    info.require_task(*TASKS)
    task = get_task(info.task)
    tokenizer = info.tokenizer()
    inputs = _sample_inputs(tokenizer, info)
    input_names = list(inputs)
    # The reference comes from a model that was never traced: tracing leaves transformers' modules in a
    # state where later eager calls can differ.
    reference = torch_outputs(task.graph_module(info.load(task=info.task, attn="eager", frozen=True)), info.task,
                              inputs)
    model = task.graph_module(info.load(task=info.task, attn="eager", frozen=True))
    outputs = list(task.outputs)
    axes = {name: {0: "batch", 1: "sequence"} for name in input_names}
    axes.update({name: ({0: "batch", 1: "sequence"} if task.per_token else {0: "batch"}) for name in outputs})
    config = info.config
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_GraphModule.wrap(model, info.task, input_names),
                              tuple(torch.from_numpy(inputs[k]) for k in input_names), str(raw),
                              input_names=input_names, output_names=outputs, dynamic_axes=axes,
                              opset_version=opset, dynamo=False, do_constant_folding=True)
        if optimize:
            report["optimized"] = _optimize(raw, out / ONNX_FP32, config)
        else:
            shutil.copyfile(raw, out / ONNX_FP32)
        fp32 = _run_graph(ort_session(out / ONNX_FP32), outputs, inputs)
        report["fp32_max_abs_diff"] = _max_abs(fp32, reference, inputs["attention_mask"])
        if not report["fp32_max_abs_diff"] <= tolerance:
            raise EncoderkitError(
                f"ONNX export of {model_dir} differs from PyTorch by {report['fp32_max_abs_diff']:.3g} "
                f"(> --tolerance {tolerance}); try without --optimize or another --opset"
            )
        if int8:
            report["int8_graph"] = _quantize(raw, out / ONNX_FP32 if report.get("optimized") else None,
                                             out / ONNX_INT8, config, optimize, Path(tmp))
            got = _run_graph(ort_session(out / ONNX_INT8), outputs, inputs)
            report["int8_max_abs_diff"] = _max_abs(got, reference, inputs["attention_mask"])
            if task.few_logits:  # few logits per example: compare probabilities instead
                # a sigmoid per label (as encoderkit.compress.students.is_multi_label, a layer above): each label's
                # probability
                multi = config.get("problem_type") == "multi_label_classification"
                report["int8_max_prob_diff"] = float(np.abs(_probs(got[0], multi) - _probs(reference[0], multi)).max())
                if report["int8_max_prob_diff"] > 0.1:
                    return _int8_refused(report, out, int8_strict,
                                         f"INT8 export of {model_dir}: probabilities differ from PyTorch by up to "
                                         f"{report['int8_max_prob_diff']:.3f} (> 0.1); keep the FP32 graph "
                                         "(--quantize none)")
                return report
            report["int8_mean_cosine"] = _mean_cosine(got, reference, inputs["attention_mask"])
            if not report["int8_mean_cosine"] >= int8_min_cosine:
                return _int8_refused(report, out, int8_strict,
                                     f"INT8 export of {model_dir}: mean cosine to PyTorch outputs "
                                     f"{report['int8_mean_cosine']:.4f} < --int8-min-cosine {int8_min_cosine}; "
                                     "keep the FP32 graph (--quantize none)")
    return report


INT8_REFUSED = "int8_refused.txt"  # beside an FP32 graph whose INT8 graph failed its parity check: why


def _int8_refused(report: dict[str, Any], out: Path, strict: bool, why: str) -> dict[str, Any]:
    """An INT8 graph beyond its parity bound: an error (``strict``: ``export --quantize int8-dynamic``), else the
    INT8 file removed and the reason kept beside the FP32 graph (:data:`INT8_REFUSED`), which stays usable."""
    if strict:
        raise EncoderkitError(why)
    (out / ONNX_INT8).unlink(missing_ok=True)
    (out / INT8_REFUSED).write_text(why + "\n", encoding="utf-8")
    report["int8_refused"] = why
    return report


def run(cfg: ExportConfig) -> ExportResult:
    """Export a task model to ONNX (optionally fused and INT8), checked against PyTorch.

    Example: encoderkit export --model runs/sst2 --out runs/sst2-onnx --optimize --quantize int8-dynamic
    """
    src = Path(cfg.model)
    info = ModelFolder.open(src, tokenizer=False)
    info.require_task(*TASKS)
    info.require_tokenizer()
    measured = get_task(info.task).agreement_measure is not None
    if cfg.dev and not measured:
        raise EncoderkitError(f"--dev {cfg.dev}: a {info.task} model's INT8 graph is not measured on dev rows "
                              f"(--backend auto runs {info.task} by the task's rule); drop --dev")
    check_output_dir(cfg.out, cfg.overwrite)  # before any work, as the dev rows below
    rows = agreement_rows(info, cfg.dev, limit=cfg.dev_limit, miner=cfg.miner) if cfg.dev and measured else None
    with output_dir(cfg.out, cfg.overwrite) as tmp:
        copy_side_files(src, tmp, weights=True)
        parity = export_onnx(info, tmp, optimize=cfg.optimize, int8=cfg.quantize == "int8-dynamic", opset=cfg.opset,
                             tolerance=cfg.tolerance, int8_min_cosine=cfg.int8_min_cosine)
        print(f"parity on {len(SAMPLE_TEXTS)} sample inputs: "
              + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in parity.items()))
        parent_card = inherited_card(info.card)
        parent_card.update(task=info.task, labels=info.labels, pooling=info.pooling, normalize=info.normalize,
                           max_length=info.max_length)
        onnx_files = {"fp32": ONNX_FP32, **({"int8": ONNX_INT8} if cfg.quantize != "none" else {})}
        agreement = _agreement(cfg, info, tmp, rows) if measured else None
        write_card(tmp, "export", src, cfg.result_dict(), metrics=parity, onnx=onnx_files, **parent_card,
                   **({CARD_KEY: agreement} if agreement else {}))
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    return ExportResult(Path(cfg.out), info.task, files, parity, agreement)


def _agreement(cfg: ExportConfig, info: ModelFolder, out: Path, rows: Any = None) -> dict[str, Any]:
    """The card's ``int8_agreement`` of the graphs just written to ``out`` (:mod:`encoderkit.inference.agreement`) on
    the dev ``rows`` read before the export."""
    if cfg.quantize == "none":
        return not_measured("no INT8 graph (export --quantize int8-dynamic --dev FILE)")
    if not cfg.dev:
        record = not_measured("no dev rows given (export --dev FILE)")
    else:
        fp32, int8 = (GraphEngine(out / name, info.task) for name in (ONNX_FP32, ONNX_INT8))
        record = int8_agreement(info, fp32, int8, cfg.dev, limit=cfg.dev_limit, miner=cfg.miner, records=rows)
    ok, why = verdict(record)
    print(f"{why}: --backend auto runs this folder on {'INT8' if ok else 'FP32'} on a CPU with VNNI/AMX int8"
          + (f" ({record['measure']} agreement, {record['units']} compared)" if ok is not None else ""))
    return record
