"""Quantization lever: model folder + :class:`QuantizeConfig` -> new model folder + report.

``dynamic`` INT8 (torch int8 safetensors, or an ORT ``model.int8.onnx``), ``static`` INT8 (ORT QDQ with calibrated
activations), ``qat`` (straight-through fake quantization, then real INT8, or weight-only int4 with ``bits=4``),
``gptq`` (:mod:`encoderkit.compress.gptq`) and ``rtn`` (round-to-nearest, GPTQ's baseline). Every method refuses a
model that is already quantized; the torch methods find the encoder's blocks through the family's anatomy
(:mod:`encoderkit.models.anatomy`).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.compress.gptq import gptq_encoder, quantizable_linears
from encoderkit.compress.measure import LeverReport, QualityFn, finish_lever, measure_folder, text_batches
from encoderkit.compress.onnx_embeddings import BLOCK_SIZES, int4_word_embeddings
from encoderkit.compress.packing import (
    QTensor,
    QuantSpec,
    is_quantized,
    load_model,
    rtn_quantize,
    save_quantized,
    scale_zero,
)
from encoderkit.compress.recovery import recover
from encoderkit.compress.task_data import LeverData
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.export import export_onnx, ort_session
from encoderkit.io import output_dir
from encoderkit.models.anatomy import anatomy_of
from encoderkit.models.folder import ONNX_FP32, ONNX_INT8, ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.pooling import task_pooling
from encoderkit.progress import progress

METHODS = ("dynamic", "static", "qat", "gptq", "rtn")
# a Hessian per Linear (up to 1536 x 1536) needs tens of thousands of tokens (docs/compress.md: GPTQ calibration)
CALIB_DEFAULT = {"gptq": 4096}


@dataclass
class QuantizeConfig(StageConfig):
    """Settings of the quantization lever (CLI: ``encoderkit quantize``; recipe step ``lever: quantize``)."""

    model: str = arg("", help="Model folder to quantize (given by the recipe runner inside a recipe)")
    out: str = arg("", help="Output folder for the quantized model (given by the recipe runner inside a recipe)")
    method: str = arg("dynamic", help="dynamic | static | qat | gptq | rtn", choices=METHODS)
    format: str = arg("torch", help="dynamic: 'torch' (int8 safetensors) or 'onnx' (ORT int8 model.int8.onnx); static "
                      "always uses onnx", choices=("torch", "onnx"))
    bits: int = arg(8, help="Weight bits: 8 or 4 (4 for gptq, rtn and qat: weight-only int4 in groups of "
                    "--group-size)")
    group_size: int = arg(128, help="Input columns sharing one scale (gptq/rtn); -1 = one scale per output row")
    symmetric: bool = arg(True, help="Symmetric quantization (no zero point); False stores uint zero points (gptq/rtn)")
    act_order: bool = arg(True, help="gptq: quantize columns in order of decreasing Hessian diagonal")
    damp: float = arg(0.01, help="gptq: dampening added to the Hessian diagonal, as a fraction of its mean")
    block_size: int = arg(128, help="gptq: columns per lazy batch update")
    per_channel: bool = arg(True, help="dynamic/static/qat: one weight scale per output channel (else per tensor)")
    embeddings: str = arg("fp32", help="torch/gptq/rtn: also store word/position embeddings and the pooler in "
                                       "int8/int4 (rows quantized, RTN, int4 in groups of --group-size). onnx: 'int4' "
                                       "stores the word embeddings as packed uint4 blocks of --group-size columns (ORT "
                                       "GatherBlockQuantized); ORT dynamic INT8 already stores them in uint8",
                          choices=("fp32", "int8", "int4"))
    calib_data: str = arg("", help="Calibration inputs: the task's data file, read by the task's reader (or a .txt of "
                          "texts): static/gptq")
    calib_samples: int = arg(0, help="Number of calibration texts (0: the method's default: gptq 4096, a Hessian per "
                                     "Linear needs many tokens and short texts give few; static/qat 128)")
    calib_seq_len: int = arg(0, help="Max tokens per calibration / QAT text (0: the model's max length, the length it "
                             "serves at)")
    calib_method: str = arg("minmax", help="static: activation range calibration",
                            choices=("minmax", "entropy", "percentile"))
    fallback_layers: int = arg(0, help="static, and dynamic with --format onnx: keep this many most sensitive MatMuls "
                               "in fp32 (each quantized alone, measured by the output error on calibration inputs)")
    train_data: str = arg("", help="qat: the task's training data for the quantization-aware fine-tuning (read by the "
                          "task's reader)")
    qat_steps: int = arg(200, help="qat: optimisation steps")
    lr: float = arg(2e-5, help="qat: learning rate")
    kd_alpha: float = arg(0.5, help="qat: loss = alpha * KD from the fp32 model's outputs + (1 - alpha) * label loss "
                                    "(classify data with labels; 1: match the fp32 model only)")
    batch_size: int = arg(16, help="qat: training batch size; static/gptq: calibration batch size")
    overwrite: bool = arg(False, help="Replace an existing output folder")
    seed: int = arg(0, help="Seed for calibration sampling and QAT")
    measure: bool = arg(True, help="Measure latency (batch 1 and 32, seq 128) before and after", speed=True)

    def validate(self) -> None:
        check(self.bits in (4, 8), f"bits must be 8 or 4, got {self.bits}")
        check(self.bits == 8 or self.method in ("gptq", "rtn", "qat"),
              f"bits={self.bits} is only supported by method gptq, rtn or qat; {self.method} is INT8 only")
        check(self.group_size == -1 or self.group_size >= 8, f"group_size must be -1 or >= 8, got {self.group_size}")
        check(0 <= self.damp < 1, f"damp must be in [0, 1), got {self.damp}")
        check(self.calib_samples >= 0 and (self.calib_seq_len == 0 or self.calib_seq_len >= 8),
              "calib_samples must be >= 0 and calib_seq_len 0 (the model's max length) or >= 8")
        check(self.fallback_layers >= 0, "fallback_layers must be >= 0")
        check(0 <= self.kd_alpha <= 1, f"kd_alpha must be in [0, 1], got {self.kd_alpha}")
        onnx = self.method == "static" or self.method == "dynamic" and self.format == "onnx"
        check(self.fallback_layers == 0 or onnx, "fallback_layers needs ONNX: method static, or dynamic with "
              "--format onnx (the torch format has no per-layer fallback)")
        check(not onnx or self.embeddings != "int4" or self.group_size in BLOCK_SIZES,
              f"embeddings=int4 on ONNX needs --group-size in {BLOCK_SIZES} (columns per block), got {self.group_size}")


def data_needs(cfg: QuantizeConfig) -> tuple[str, ...]:
    """The lever data fields (:mod:`encoderkit.compress.task_data`) ``cfg`` needs and does not name itself."""
    if cfg.method == "qat":
        return () if cfg.train_data else ("train",)
    return ("calib",) if needs_calibration(cfg) and not cfg.calib_data else ()


def needs_calibration(cfg: QuantizeConfig) -> bool:
    """Whether ``cfg`` cannot run without calibration inputs: GPTQ's Hessians, static ranges, or the
    per-MatMul sensitivity that ``fallback_layers`` ranks (ONNX only, checked by the config)."""
    return cfg.method in ("gptq", "static") or cfg.fallback_layers > 0


def quantize(model_dir: str | Path, config: QuantizeConfig, out_dir: str | Path, calib: list[Any] | None = None,
             quality_fn: QualityFn | None = None, data: LeverData | None = None) -> LeverReport:
    """Quantize the model in ``model_dir`` as ``config`` says into ``out_dir``; ``calib`` overrides the calibration
    inputs, ``data`` gives the declared data fields (default: ``config``'s own files)."""

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_quantized(model_dir):
        raise EncoderkitError(f"{model_dir} is already quantized; quantize its unquantized parent "
                              "(see 'parent' in its encoderkit.json) instead of stacking quantizers")
    data = (data or LeverData.for_model(model_dir)).with_sources(train=config.train_data, calib=config.calib_data)
    folder = ModelFolder.open(model_dir)
    cfg = config if config.calib_seq_len else dataclasses.replace(config, calib_seq_len=folder.max_length)  # as served
    # the INT8 graph's output error
    onnx_check = cfg.method == "dynamic" and cfg.format == "onnx" and data.source("calib")
    if calib is None and (needs_calibration(cfg) or onnx_check):
        calib = calibration_texts(cfg, None, data, model_dir)
    before = measure_folder(model_dir, latency=cfg.measure, quality_fn=quality_fn)
    tokenizer = folder.tokenizer()
    model = folder.load()
    details: dict[str, Any] = {}
    onnx = cfg.method == "dynamic" and cfg.format == "onnx" or cfg.method == "static"
    if not onnx:  # torch methods walk the family's blocks: a family without an anatomy is refused by name, first
        anatomy_of(model, f"quantize --method {cfg.method} --format torch")
    with output_dir(out_dir, cfg.overwrite) as tmp:
        if onnx:
            details = _quantize_onnx(model, tokenizer, cfg, model_dir, tmp, calib)
        else:
            if cfg.method in ("gptq", "rtn", "dynamic"):
                qtensors, details = _weight_only(model, tokenizer, cfg, calib)
            else:
                qtensors, details = _qat(model, model_dir, tokenizer, cfg, data, task_pooling(folder, "embed"))
            qtensors.update(_embedding_codes(model, cfg))
            runtime = "torch-int8" if cfg.method == "dynamic" or cfg.method == "qat" and cfg.bits == 8 \
                else "dequantized-fp32"
            info = {"method": cfg.method, "bits": cfg.bits, "group_size": cfg.group_size, "runtime": runtime}
            save_quantized(model, model_dir, tmp, qtensors, info)
        report = finish_lever(tmp, "quantize", cfg.method, model_dir, out_dir, cfg.result_dict(), before, details,
                              latency=cfg.measure, quality_fn=quality_fn)
    return report


def calibration_texts(cfg: QuantizeConfig, calib: list[Any] | None, data: LeverData | None = None,
                      model_dir: Path | None = None) -> list[Any]:
    """``calib`` if given, else the first ``cfg.calib_samples`` inputs of ``data``'s calibration source
    (read as the model's task's data)."""
    n = cfg.calib_samples or CALIB_DEFAULT.get(cfg.method, 128)
    if calib is not None:
        texts = list(calib)[:n]
    elif data is not None and data.source("calib"):
        texts = data.inputs("calib", model_dir, limit=n).texts
    else:
        task = f" of the {data.task} model" if data is not None else ""
        raise EncoderkitError(f"quantize method={cfg.method} needs calibration inputs{task}: pass --calib-data FILE "
                              "(the task's training data, or a .txt of in-domain texts)")
    check(len(texts) > 0, "calibration set is empty")
    return texts


def _encoder_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [pair for layer in quantizable_linears(model) for pair in layer]


@torch.no_grad()
def _weight_only(model: torch.nn.Module, tokenizer: Any, cfg: QuantizeConfig,
                 calib: list[Any] | None) -> tuple[dict[str, QTensor], dict[str, Any]]:
    """GPTQ / RTN / dynamic-INT8 codes of the encoder's Linear weights (model updated in place)."""
    if cfg.method == "dynamic":
        spec = QuantSpec(8, -1 if cfg.per_channel else 0, True)
    else:
        spec = QuantSpec(cfg.bits, cfg.group_size, cfg.symmetric)
    if cfg.method == "gptq":
        texts = calibration_texts(cfg, calib)
        batches = list(text_batches(tokenizer, texts, cfg.calib_seq_len, cfg.batch_size))
        qtensors = gptq_encoder(model, batches, spec, act_order=cfg.act_order, damp=cfg.damp, block_size=cfg.block_size)
        return qtensors, {"calib_texts": len(texts), "layers": len(qtensors)}
    if spec.group_size == 0:  # per-tensor: one scale for the whole matrix
        qtensors = {}
        for name, lin in _encoder_linears(model):
            flat = rtn_quantize(lin.weight.reshape(1, -1), QuantSpec(8, -1, True))
            qtensors[f"{name}.weight"] = QTensor(flat.q.reshape(lin.weight.shape),
                                                 flat.scale.expand(lin.weight.shape[0], 1).clone(),
                                                 None, None, QuantSpec(8, -1, True))
            lin.weight.copy_(qtensors[f"{name}.weight"].dequantize())
        return qtensors, {"layers": len(qtensors), "per_channel": False}
    qtensors = {}
    for name, lin in _encoder_linears(model):
        qt = rtn_quantize(lin.weight, spec)
        lin.weight.copy_(qt.dequantize())
        qtensors[f"{name}.weight"] = qt
    return qtensors, {"layers": len(qtensors)}


class FakeQuantLinear(torch.nn.Module):
    """A Linear that trains through INT8 rounding (straight-through estimator): weights with the scales
    :func:`rtn_quantize` will store, activations per tensor over ``ACT_LEVELS`` steps as ``torch.ao``'s x86 dynamic
    kernels quantize them (``reduce_range=True``: 0..127). With ``low_bit`` (an int4 :class:`QuantSpec`) it trains
    through the weight-only int4 codes that :func:`rtn_quantize` will store, in groups, and leaves the activations
    in float (the int4 runtime dequantizes the weights)."""

    ACT_LEVELS = 127

    def __init__(self, linear: torch.nn.Linear, per_channel: bool = True, activations: bool = True,
                 low_bit: QuantSpec | None = None) -> None:
        super().__init__()
        self.linear, self.per_channel, self.activations, self.low_bit = linear, per_channel, activations, low_bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        if self.low_bit is not None:
            w_q = w + (rtn_quantize(w.detach(), self.low_bit).dequantize().to(w.dtype) - w).detach()
            return torch.nn.functional.linear(x, w_q, self.linear.bias)
        rows = w if self.per_channel else w.reshape(1, -1)
        scale, _ = scale_zero(rows.detach(), QuantSpec(8, -1, True))
        scale = scale[:, None] if self.per_channel else scale
        w_q = w + (torch.clamp(torch.round(w / scale), -127, 127) * scale - w).detach()
        if self.activations:
            lo = torch.clamp(x.detach().min(), max=0.0)
            hi = torch.clamp(x.detach().max(), min=0.0)
            s = torch.clamp((hi - lo) / self.ACT_LEVELS, min=1e-8)
            z = torch.round(-lo / s)
            x = x + ((torch.clamp(torch.round(x / s) + z, 0, self.ACT_LEVELS) - z) * s - x).detach()
        return torch.nn.functional.linear(x, w_q, self.linear.bias)


def _swap_linears(model: torch.nn.Module, wrap: bool, per_channel: bool = True,
                  low_bit: QuantSpec | None = None) -> None:
    """Wrap the Linear layers of the encoder's blocks in :class:`FakeQuantLinear` (``wrap``) or unwrap them."""
    inside = {id(m) for block in anatomy_of(model).blocks(model) for m in block.modules()} if wrap else set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if wrap and isinstance(child, torch.nn.Linear) and id(child) in inside:
                setattr(parent, name, FakeQuantLinear(child, per_channel, low_bit=low_bit))
            elif not wrap and isinstance(child, FakeQuantLinear):
                setattr(parent, name, child.linear)


def _qat(model: torch.nn.Module, model_dir: Path, tokenizer: Any, cfg: QuantizeConfig,
         data: LeverData, pooling: str) -> tuple[dict[str, QTensor], dict[str, Any]]:
    """Quantization-aware fine-tuning (KD from the fp32 model + label loss), then real codes: INT8 (per channel, as
    the dynamic INT8 runtime runs them) or, with ``bits=4``, weight-only int4 in groups of ``group_size``."""
    if not data.source("train"):
        raise EncoderkitError(f"quantize method=qat needs --train-data FILE (the {data.task} model's training data)")
    inputs = data.inputs("train", model_dir)
    teacher = load_model(model_dir)
    low_bit = QuantSpec(4, cfg.group_size, cfg.symmetric) if cfg.bits == 4 else None
    _swap_linears(model, wrap=True, per_channel=cfg.per_channel, low_bit=low_bit)
    try:
        log = recover(model, teacher, tokenizer, inputs, cfg, {}, cfg.qat_steps, [], pooling)
    finally:
        _swap_linears(model, wrap=False)
    final = QuantizeConfig(method="rtn", bits=4, group_size=cfg.group_size, symmetric=cfg.symmetric, measure=False) \
        if low_bit is not None else QuantizeConfig(method="dynamic", per_channel=cfg.per_channel, measure=False)
    qtensors, details = _weight_only(model, tokenizer, final, None)
    return qtensors, {**details, "qat": log}


@torch.no_grad()
def _embedding_codes(model: torch.nn.Module, cfg: QuantizeConfig) -> dict[str, QTensor]:
    """Row-wise codes of the word and position embeddings (and the pooler's dense weight, a plain
    (H, H) matrix outside the encoder) when ``cfg.embeddings`` asks for them."""
    if cfg.embeddings == "fp32":
        return {}
    names = {m: n for n, m in model.named_modules()}
    bits = 8 if cfg.embeddings == "int8" else 4
    gs = cfg.group_size if bits == 4 and cfg.group_size > 0 else -1
    base = getattr(model, "base_model", model)
    targets = [model.get_input_embeddings(), getattr(getattr(base, "embeddings", None), "position_embeddings", None)]
    pooler = getattr(base, "pooler", None)
    targets.append(getattr(pooler, "dense", None))
    out = {}
    for mod in targets:
        if mod is None or mod.weight.shape[1] % max(gs, 1):
            continue
        qt = rtn_quantize(mod.weight, QuantSpec(bits, gs, True))
        mod.weight.copy_(qt.dequantize())
        out[names[mod] + ".weight"] = qt
    return out


# -- ONNX Runtime: dynamic and static INT8 -----------------------------------------------------
class _CalibReader:
    """ORT ``CalibrationDataReader`` over tokenised batches (int64 numpy feeds)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def rewind(self) -> None:
        self.i = 0


def _feeds(tokenizer: Any, texts: list[Any], input_names: list[str], seq_len: int,
           batch_size: int) -> list[dict[str, np.ndarray]]:
    """Calibration feeds padded to ``seq_len``: ORT's histogram calibrators need equal shapes."""
    out = []
    for i in range(0, len(texts), batch_size):
        chunk = list(texts[i:i + batch_size])
        if isinstance(chunk[0], (tuple, list)):
            a, b = zip(*chunk)
            batch = tokenizer(list(a), list(b), truncation=True, max_length=seq_len, padding="max_length",
                              return_tensors="pt")
        else:
            batch = tokenizer(chunk, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
        out.append({n: batch[n].numpy().astype(np.int64) if n in batch else np.zeros_like(batch["input_ids"].numpy())
                    for n in input_names})
    return out


def _output_error(ref_path: Path, q_path: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    """Relative error ``||y_q - y|| / ||y||`` of the first graph output over ``feeds``."""
    ref, q = ort_session(ref_path), ort_session(q_path)
    num = den = 0.0
    for f in feeds:
        a = ref.run(None, f)[0].astype(np.float64)
        b = q.run(None, f)[0].astype(np.float64)
        num += float(((a - b) ** 2).sum())
        den += float((a ** 2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def _weight_matmuls(path: Path) -> list[str]:
    """Names of the MatMul nodes whose second input is a weight (initializer)."""
    import onnx

    g = onnx.load(str(path)).graph
    inits = {t.name for t in g.initializer}
    return [n.name for n in g.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits]


def _quantize_onnx(model: torch.nn.Module, tokenizer: Any, cfg: QuantizeConfig, model_dir: Path, out: Path,
                   calib: list[Any] | None) -> dict[str, Any]:
    """Export ``model_dir`` to ONNX and write ``out/model.int8.onnx`` with ORT ``quantize_dynamic`` or QDQ
    ``quantize_static``; with ``fallback_layers=N`` the N weight MatMuls whose quantization alone hurts the output
    most on the calibration inputs stay in fp32."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    details: dict[str, Any] = {"runtime": "onnxruntime"}
    with tempfile.TemporaryDirectory(prefix="encoderkit-onnx-") as work:
        work = Path(work)
        details["export"] = export_onnx(model_dir, work)
        fp32 = src = work / ONNX_FP32
        if cfg.embeddings == "int4":
            src = work / "model.emb4.onnx"
            details.update(int4_word_embeddings(fp32, src, cfg.group_size))
        names = [i.name for i in ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).get_inputs()]
        texts = calibration_texts(cfg, calib) if (needs_calibration(cfg) or calib or cfg.calib_data) else []
        feeds = _feeds(tokenizer, texts, names, cfg.calib_seq_len, cfg.batch_size) if texts else []
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[cfg.calib_method]

        def int8(dst: Path, nodes_to_quantize: list[str] | None = None, exclude: list[str] | None = None,
                 use: list[dict[str, np.ndarray]] | None = None) -> None:
            if cfg.method == "dynamic":  # Gather (the word embeddings) too, unless int4 already packed them
                quantize_dynamic(str(src), str(dst), per_channel=cfg.per_channel, weight_type=QuantType.QInt8,
                                 nodes_to_quantize=nodes_to_quantize, nodes_to_exclude=exclude or [])
                return
            quantize_static(str(src), str(dst), _CalibReader(use or feeds), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=["MatMul", "Gemm"], per_channel=cfg.per_channel,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_quantize=nodes_to_quantize, nodes_to_exclude=exclude or [],
                            calibrate_method=method)

        excluded: list[str] = []
        if cfg.fallback_layers > 0:
            probe = feeds[: max(1, 16 // cfg.batch_size)]
            sensitivity = {}
            for node in progress(_weight_matmuls(src), desc="layer sensitivity"):
                int8(work / "one.onnx", nodes_to_quantize=[node], use=probe)
                sensitivity[node] = _output_error(src, work / "one.onnx", probe)  # against the graph before INT8 (with
                # int4 embeddings already in it), so that each node's own error is what ranks it
            excluded = sorted(sensitivity, key=sensitivity.get, reverse=True)[: cfg.fallback_layers]
            details["sensitivity_top"] = {n: round(sensitivity[n], 5) for n in excluded}
        int8(out / ONNX_INT8, exclude=excluded)
        if excluded or cfg.method == "static":
            details["fp32_nodes"] = excluded
        if cfg.method == "static":
            details["calib_method"] = cfg.calib_method
        if feeds:
            details["output_rel_error"] = round(_output_error(fp32, out / ONNX_INT8, feeds), 5)
    copy_side_files(model_dir, out)
    (out / "config.json").write_text((model_dir / "config.json").read_text(encoding="utf-8"), encoding="utf-8")
    return details


def run(cfg: QuantizeConfig) -> LeverReport:
    """Quantize a model folder (PTQ dynamic/static INT8, QAT, GPTQ or RTN at 8/4 bits)."""
    check(bool(cfg.model) and bool(cfg.out), "quantize: --model and --out are required")
    return quantize(cfg.model, cfg, cfg.out)
