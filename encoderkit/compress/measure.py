"""What every compression lever reports: parameters, bytes on disk, latency, quality.

Measured honestly (see DESIGN.md): size is the sum of the bytes of the files in the model
folder (a sparse weight in a dense file is not smaller), latency is wall time of a forward pass
at a stated batch size, sequence length and thread count, and quality comes from a hook the
caller passes (``quality_fn(folder) -> dict``), e.g. the dev metrics of the task.

:class:`LeverReport` is the common result of ``quantize(...)`` and ``prune(...)``; the recipe
runner stacks them and prints ``before``/``after`` side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import ModelFolder

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
        return {"lever": self.lever, "method": self.method, "model_in": self.model_in,
                "model_out": self.model_out, "before": self.before, "after": self.after,
                "details": self.details}


def finish_lever(tmp: Path, lever: str, method: str, model_dir: Path, out_dir: Path, config: dict[str, Any],
                 before: dict[str, Any], details: dict[str, Any], *, latency: bool,
                 quality_fn: QualityFn | None) -> LeverReport:
    """Measure the lever's new folder ``tmp`` (to be renamed to ``out_dir``), write its card (the
    parent's task facts carried over) and ``report.json``, and return the report."""
    from encoderkit.io import inherited_card, write_card, write_json_atomic

    after = measure_folder(tmp, latency=latency, quality_fn=quality_fn)
    report = LeverReport(lever, method, str(model_dir), str(out_dir), before, after, details)
    write_card(tmp, lever, model_dir, config, after, **inherited_card(model_dir))
    write_json_atomic(tmp / "report.json", report.summary())
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


def read_texts(path: str | Path, limit: int | None = None) -> list[str | tuple[str, str]]:
    """Texts for calibration or vocabulary: a ``.txt`` (one per line) or a ``.tsv``/``.jsonl`` file.

    A TSV with a header takes ``sentence`` / ``text`` (or ``sentence1``+``sentence2`` as a pair),
    else its first column. A JSONL takes the ``text`` key (or ``text``+``text_pair``).
    """
    import csv

    from encoderkit.io import json_line

    p = Path(path)
    if not p.is_file():
        raise EncoderkitError(f"text file {p} does not exist; pass a .txt, .tsv or .jsonl file")
    out: list[str | tuple[str, str]] = []
    with p.open(encoding="utf-8") as f:
        if p.suffix == ".tsv":
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, [])
            cols = {c: i for i, c in enumerate(header)}
            if "sentence1" in cols and "sentence2" in cols:
                i1, i2 = cols["sentence1"], cols["sentence2"]
                pick = lambda r: (r[i1], r[i2])
            else:
                i = cols.get("sentence", cols.get("text", 0))
                pick = lambda r: r[i].strip()
            for n, row in enumerate(reader, start=2):
                if not row:
                    continue
                try:
                    out.append(pick(row))
                except IndexError as e:
                    raise EncoderkitError(f"{p}:{n}: too few tab-separated columns") from e
                if limit and len(out) >= limit:
                    break
        elif p.suffix == ".jsonl":
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                rec = json_line(line, f"{p}:{n}")
                if "text" not in rec:
                    raise EncoderkitError(f"{p}:{n}: expected a 'text' key")
                out.append((rec["text"], rec["text_pair"]) if "text_pair" in rec else rec["text"])
                if limit and len(out) >= limit:
                    break
        else:
            for line in f:
                if line.strip():
                    out.append(line.strip())
                if limit and len(out) >= limit:
                    break
    if not out:
        raise EncoderkitError(f"{p} holds no texts")
    return out


@torch.no_grad()
def torch_latency(model: torch.nn.Module, batch_size: int, seq_len: int, repeats: int = 5,
                  vocab_size: int | None = None) -> dict[str, float]:
    """Median wall time (ms) of ``model(input_ids (B, T))`` on CPU with the current thread count."""
    vocab_size = vocab_size or int(getattr(model.config, "vocab_size", 1000))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones_like(ids)
    model.eval()
    model(input_ids=ids, attention_mask=mask)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask)
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1000
    return {"ms": round(ms, 2), "items_per_s": round(batch_size / (ms / 1000), 1)}


_MEASURED: dict[tuple[Any, ...], dict[str, Any]] = {}


def measure_folder(folder: str | Path, *, latency: bool = True, seq_len: int = 128,
                   batch_sizes: tuple[int, ...] = (1, 32), quality_fn: QualityFn | None = None,
                   repeats: int = 5) -> dict[str, Any]:
    """Parameters, nonzero parameters, bytes on disk, latency at ``batch_sizes`` and quality.

    The model is loaded by :class:`encoderkit.models.folder.ModelFolder` (quantized and
    head-pruned folders included) and timed in PyTorch on CPU at ``torch.get_num_threads()``.
    Results are remembered per folder state (path, file sizes and times) within the process, so
    a lever's "before" reuses the previous lever's "after" in a stack.
    """
    if not Path(folder).is_dir():
        raise EncoderkitError(f"model folder {folder} does not exist")
    files = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()))
    key = (str(Path(folder).resolve()), files, latency, seq_len, batch_sizes, quality_fn, repeats, torch.get_num_threads())
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
        return {**out, **_measure_onnx(onnx_files[0], latency, seq_len, batch_sizes, repeats, vocab), **(
            {"quality": quality_fn(folder)} if quality_fn else {})}
    runtime = (mf.quantization or {}).get("runtime", "")
    model = mf.load()
    out["params"] = count_parameters(model)
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
    """Parameters (initializer elements) and ONNX Runtime CPU latency of an ONNX model file."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    m = onnx.load(str(path), load_external_data=False)
    out: dict[str, Any] = {"params": int(sum(np.prod(t.dims) for t in m.graph.initializer))}
    if not latency:
        return out
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out["latency"] = {"seq_len": seq_len, "threads": torch.get_num_threads(), "runtime": f"onnxruntime-cpu ({path.name})"}
    rng = np.random.default_rng(0)
    for b in batch_sizes:
        feed = {n: (rng.integers(5, vocab_size, (b, seq_len)) if n == "input_ids" else
                    np.ones((b, seq_len)) if n == "attention_mask" else np.zeros((b, seq_len))).astype(np.int64)
                for n in names}
        sess.run(None, feed)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1000
        out["latency"][f"batch{b}"] = {"ms": round(ms, 2), "items_per_s": round(b / (ms / 1000), 1)}
    return out
