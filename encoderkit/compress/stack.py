"""`encoderkit compress --recipe FILE`: run compression levers in order, re-measuring after each.

A recipe is YAML (or TOML/JSON) with a list of steps, each a lever and its settings::

    steps:
      - {lever: distill, layers: every-other, epochs: 3}
      - {lever: prune, method: structured, heads: 0.3, ffn: 0.4, recover_steps: 500}
      - {lever: quantize, method: dynamic-int8}

Levers and their settings are the lever configs' own fields (``encoderkit prune --help`` ...):
``distill`` (:class:`~encoderkit.compress.distill.DistillConfig`, mode task, the previous step's
model as teacher), ``prune`` / ``vocab`` (:class:`~encoderkit.compress.prune.PruneConfig`),
``quantize`` / ``gptq`` / ``qat`` (:class:`~encoderkit.compress.quantize.QuantizeConfig`).
Shorthands: ``prune method: structured`` with ``heads``/``ffn`` fractions runs the heads and
FFN pruning one after the other (recovery after the last); ``recover_steps`` is
``recovery_steps``; ``quantize method: dynamic-int8`` is dynamic INT8 through ONNX Runtime.
Model, output and data paths are filled in by the runner (``--train`` feeds distillation,
recovery and calibration unless a step names its own file).

The whole recipe is validated before anything runs: an unknown lever or field, or a bad value,
is an error naming the step (number and lever) and the field, and so is a second quantizing step
(``quantize``, ``gptq``, ``qat``: each refuses an already quantized model). Everything is written into one
output folder (``NN-lever/`` per step, ``report.md``, ``report.json``, ``report.png``) that
appears only when the whole recipe finished.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.config import StageConfig, arg, check, load_mapping
from encoderkit.errors import EncoderkitError

# lever name -> (module, config class, function, fixed settings)
LEVERS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "distill": ("encoderkit.compress.distill", "DistillConfig", "run", {"mode": "task"}),
    "prune": ("encoderkit.compress.prune", "PruneConfig", "prune", {}),
    "vocab": ("encoderkit.compress.prune", "PruneConfig", "prune", {"method": "vocab"}),
    "quantize": ("encoderkit.compress.quantize", "QuantizeConfig", "quantize", {}),
    "gptq": ("encoderkit.compress.quantize", "QuantizeConfig", "quantize", {"method": "gptq"}),
    "qat": ("encoderkit.compress.quantize", "QuantizeConfig", "quantize", {"method": "qat"}),
}
# levers that quantize the model; a quantized model is never quantized again (the lever refuses it)
QUANT_LEVERS = ("quantize", "gptq", "qat")
RUNNER_FIELDS = ("model", "out", "teacher", "overwrite")  # set by the runner, never by a recipe
ALIASES = {"recover_steps": "recovery_steps"}
# field of each lever's config that takes the runner's --train / --calib file, when the step sets none
TRAIN_FIELDS = {"DistillConfig": ("train",), "PruneConfig": ("recovery_data",), "QuantizeConfig": ("train_data",)}
CALIB_FIELDS = {"PruneConfig": ("calib_data",), "QuantizeConfig": ("calib_data",)}


@dataclass
class RecipeStep:
    """One validated step: ``calls`` are the settings of the lever calls it makes (two for
    structured pruning), without the paths that the runner fills in."""

    index: int
    lever: str
    params: dict[str, Any]
    calls: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return f"{self.index:02d}-{self.lever}"


def _lever_config_class(lever: str) -> type[StageConfig]:
    mod, cls, _, _ = LEVERS[lever]
    return getattr(importlib.import_module(mod), cls)


def _expand(lever: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn a step's recipe settings into the settings of its lever calls (shorthands resolved)."""
    p = {ALIASES.get(k, k): v for k, v in params.items()}
    p = {**LEVERS[lever][3], **p}
    if lever == "quantize" and p.get("method") == "dynamic-int8":
        p["method"] = "dynamic"
        p.setdefault("backend", "onnx")
    if lever == "prune" and p.get("method") == "structured":
        heads, ffn = p.pop("heads", 0.0), p.pop("ffn", 0.0)
        rest = {k: v for k, v in p.items() if k != "method"}
        recovery = {k: rest.pop(k) for k in ("recovery_steps", "recovery_data") if k in rest}
        calls = [{**rest, "method": m, "amount": a} for m, a in (("heads", heads), ("ffn", ffn)) if a]
        if not calls:
            raise EncoderkitError("prune method 'structured' needs 'heads' and/or 'ffn' fractions above 0")
        calls[-1].update(recovery)
        return calls
    return [p]


def validate_recipe(data: Any, source: str = "recipe") -> list[RecipeStep]:
    """Check every step of a recipe mapping (or list of steps) before anything runs."""
    steps = data.get("steps") if isinstance(data, dict) else data
    if isinstance(data, dict):
        extra = sorted(set(data) - {"steps", "name", "description"})
        check(not extra, f"{source}: unknown top-level key(s) {extra}; a recipe holds 'steps' (and optional 'name', 'description')")
    check(isinstance(steps, list) and len(steps) > 0, f"{source}: expected a non-empty list under 'steps'")
    out: list[RecipeStep] = []
    for i, raw in enumerate(steps, 1):
        if not isinstance(raw, dict) or "lever" not in raw:
            raise EncoderkitError(f"{source}: step {i} must be a mapping with a 'lever' key, got {raw!r}")
        lever = str(raw["lever"])
        where = f"{source}: step {i} (lever '{lever}')"
        if lever not in LEVERS:
            raise EncoderkitError(f"{where}: unknown lever; known levers: {', '.join(LEVERS)}")
        params = {k: v for k, v in raw.items() if k != "lever"}
        cls = _lever_config_class(lever)
        known = {f.name for f in dataclasses.fields(cls)} | set(ALIASES)
        if lever == "prune":
            known |= {"heads", "ffn"}
        for key in params:
            name = key.replace("-", "_")
            if name in RUNNER_FIELDS:
                raise EncoderkitError(f"{where}: field '{key}' is set by the runner (the previous step's model and the step folder); remove it")
            if name not in known:
                raise EncoderkitError(f"{where}: unknown field '{key}'; known fields: {', '.join(sorted(known - set(RUNNER_FIELDS)))}")
        params = {k.replace("-", "_"): v for k, v in params.items()}
        try:
            calls = _expand(lever, params)
            placeholders = {"teacher": "<previous step>", "out": "<step folder>", "train": "<--train>"} if lever == "distill" else {}
            for c in calls:
                cls.from_dict({**placeholders, **c}, source=where)
        except EncoderkitError as e:
            msg = str(e)
            raise EncoderkitError(msg if msg.startswith(where) else f"{where}: {msg}") from e
        earlier = next((o for o in out if o.lever in QUANT_LEVERS), None) if lever in QUANT_LEVERS else None
        if earlier is not None:
            raise EncoderkitError(f"{where}: step {earlier.index} ({earlier.lever}) already quantizes the model and a "
                                  "quantized model is never quantized again; keep one quantization step (they are "
                                  "alternatives: gptq/rtn for bytes, dynamic-int8/static for CPU speed, qat for quality)")
        out.append(RecipeStep(i, lever, params, calls))
    return out


def load_recipe(path: str | Path) -> list[RecipeStep]:
    """Read and validate a recipe file."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        import yaml

        if not p.is_file():
            raise EncoderkitError(f"recipe file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise EncoderkitError(f"recipe file {p} is not valid YAML: {e}") from e
    else:
        data = load_mapping(p)
    return validate_recipe(data, source=str(p))


@dataclass
class CompressConfig(StageConfig):
    """Settings of `encoderkit compress`."""

    recipe: str = arg(help="Recipe file (YAML/TOML/JSON) with the levers to run in order.", required=True)
    model: str = arg(help="Fine-tuned model folder to compress (a classify model).", required=True)
    dev: str = arg(help="Labelled dev file (.tsv with 'label', or .jsonl) on which quality is re-measured after every step.", required=True)
    out: str = arg(help="Output folder: one model folder per step plus report.md/json/png.", required=True)
    train: str | None = arg(None, help="Labelled task training file for distillation, recovery training and calibration.")
    calib: str | None = arg(None, help="Unlabelled in-domain texts for calibration and vocabulary (default: --train).")
    seq_len: int = arg(128, help="Sequence length of the latency measurement (every row of the batch this long).")
    runtime: str = arg("deploy", choices=("deploy", "torch"), help="Runtime for latency and quality: 'deploy' (the ONNX Runtime Predictor; torch for folders it cannot load) or 'torch'.")
    dev_limit: int = arg(0, help="Measure quality on only the first N dev examples (0: all).")
    repeats: int = arg(5, speed=True, help="Timed repetitions per latency figure (the median is reported).")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")


@dataclass
class CompressResult:
    out: Path
    rows: list[dict[str, Any]]

    def summary(self) -> str:
        from encoderkit.report import markdown_table

        return f"{markdown_table(self.rows)}\n\nreport: {self.out / 'report.md'}"


def with_data(lever: str, call: dict[str, Any], train: str | None, calib: str | None, where: str) -> dict[str, Any]:
    """Fill the data files a lever call needs and the recipe left out with the runner's files."""
    call = dict(call)
    calib = calib or train
    if lever == "distill" and not call.get("train"):
        check(bool(train), f"{where}: distillation needs task texts; pass --train (or set 'train' in the step)")
        call["train"] = train
    if LEVERS[lever][1] == "PruneConfig":
        if call.get("recovery_steps", 0) > 0 and not call.get("recovery_data"):
            check(bool(train), f"{where}: recovery_steps > 0 needs labelled data; pass --train")
            call["recovery_data"] = train
        if calib and not call.get("calib_data"):
            call["calib_data"] = calib
        if call.get("method") == "vocab" and not call.get("vocab_data"):
            check(bool(calib), f"{where}: vocabulary pruning needs in-domain texts; pass --train or --calib")
            call["vocab_data"] = [calib]
    if LEVERS[lever][1] == "QuantizeConfig":
        if calib and not call.get("calib_data"):
            call["calib_data"] = calib
        if call.get("method") == "qat" and not call.get("train_data"):
            check(bool(train), f"{where}: QAT needs labelled data; pass --train")
            call["train_data"] = train
    return call


def run_lever(lever: str, call: dict[str, Any], model_dir: Path, out_dir: Path, where: str) -> None:
    """Run one lever call (validated settings ``call``) from ``model_dir`` into the new folder ``out_dir``."""
    mod, _, fn_name, _ = LEVERS[lever]
    fn = getattr(importlib.import_module(mod), fn_name)
    cls = _lever_config_class(lever)
    if lever == "distill":
        fn(cls.from_dict({**call, "teacher": str(model_dir), "out": str(out_dir)}, source=where))
    else:
        # the runner measures every step itself; the lever's own before/after timing would double the time
        quiet = {"measure": False} if "measure" in {f.name for f in dataclasses.fields(cls)} else {}
        cfg = cls.from_dict({**quiet, **call, "model": str(model_dir), "out": str(out_dir)}, source=where)
        fn(model_dir, cfg, out_dir)


def run_steps(steps: list[RecipeStep], cfg: CompressConfig, work: Path, final: Path,
              measure: Any = None) -> list[dict[str, Any]]:
    """Run ``steps`` from ``cfg.model`` into ``work/NN-lever`` folders, measuring each; returns the
    report rows (row 0 is the starting model). ``final`` is where ``work`` will be renamed to,
    so that lineage in the step cards points at the final folders. ``measure(folder) -> row``
    defaults to a :class:`StepMeasurer` on ``cfg.dev``."""
    from encoderkit.io import inherited_card, read_card, write_card
    from encoderkit.progress import note, progress

    measure = measure or make_measure(cfg)
    rows = [{"step": 0, "lever": "start", "folder": str(Path(cfg.model).resolve()), **measure(Path(cfg.model))}]
    cur, cur_final = Path(cfg.model), Path(cfg.model).resolve()
    for step in progress(steps, desc="recipe", unit="step"):
        dst = work / step.name
        where = f"{cfg.recipe}: step {step.index} (lever '{step.lever}')"
        for j, call in enumerate(step.calls):
            call = with_data(step.lever, call, cfg.train, cfg.calib, where)
            target = dst if j == len(step.calls) - 1 else work / f".{step.name}-part{j}"
            run_lever(step.lever, call, cur if j == 0 else work / f".{step.name}-part{j - 1}", target, where)
        for j in range(len(step.calls) - 1):
            shutil.rmtree(work / f".{step.name}-part{j}", ignore_errors=True)
        card = read_card(dst)
        extra = inherited_card(card)
        row = {"step": step.index, "lever": step.lever, "folder": str(final / step.name), **measure(dst)}
        write_card(dst, card.get("stage", step.lever), cur_final, card.get("config", step.params),
                   {**card.get("metrics", {}), "recipe_measurement": {k: v for k, v in row.items() if k not in ("step", "folder")}},
                   **{**extra, "recipe_step": step.index, "recipe_params": step.params})
        rows.append(row)
        note(f"step {step.index} ({step.lever}): quality {row.get('quality')} params {row.get('params')} "
                   f"bytes {row.get('bytes')} b1 {row.get('latency_b1_ms')} ms b32 {row.get('latency_b32_ms')} ms")
        cur, cur_final = dst, final / step.name
    return rows


class StepMeasurer:
    """Measures one model folder: dev quality, parameters, weight bytes, latency at batch 1 and 32.

    ``runtime="deploy"`` uses the deploy Predictor (ONNX Runtime: the folder's own INT8 graph if
    it has one, else an FP32 export); folders it cannot load (packed low-bit weights, pruned
    heads) run in torch through :func:`encoderkit.compress.packing.load_model` (INT8 kernels for
    8-bit folders). Each row says which runtime measured it. Latency: median of ``repeats`` timed
    forward passes on (B, seq_len) inputs, tokenisation excluded, at ``torch.get_num_threads()``
    threads (ONNX Runtime gets the same count).
    """

    def __init__(self, dev: str, seq_len: int = 128, runtime: str = "deploy", dev_limit: int = 0, repeats: int = 5) -> None:
        from encoderkit.compress.measure import read_texts

        self.dev, self.seq_len, self.runtime, self.repeats = dev, seq_len, runtime, repeats
        self.texts = read_texts(dev, limit=dev_limit or None)

    def _gold(self, label2id: dict[str, int]) -> list[int]:
        from encoderkit.compress.distill import read_labels

        gold = read_labels(self.dev, label2id, len(self.texts))
        check(gold is not None, f"--dev {self.dev}: no 'label' column/key; the dev set must be labelled")
        return gold  # type: ignore[return-value]

    def __call__(self, folder: Path) -> dict[str, Any]:
        import numpy as np
        import torch

        from encoderkit.compress.measure import bytes_on_disk, count_parameters
        from encoderkit.models.folder import ModelFolder

        folder = Path(folder)
        opened = ModelFolder.open(folder, weights=False, tokenizer=False)
        config = opened.config
        label2id = {str(v): int(k) for k, v in (config.get("id2label") or {}).items()}
        gold = self._gold(label2id)
        quant, heads = opened.quantization, opened.kept_heads
        int8_onnx = opened.onnx(True)
        threads = torch.get_num_threads()
        has_torch_weights = any((folder / f).is_file() for f in ("model.safetensors", "model.quantized.safetensors"))
        model = opened.load() if has_torch_weights else None
        params = count_parameters(model) if model is not None else onnx_parameters(int8_onnx or folder / "model.onnx")
        row: dict[str, Any] = {"params": params, "folder_bytes": bytes_on_disk(folder),
                               "seq_len": self.seq_len, "threads": threads}
        if int8_onnx is not None:
            row["bytes"] = sum(p.stat().st_size for p in folder.glob(int8_onnx.name + "*"))
        else:
            weights = folder / ("model.quantized.safetensors" if quant else "model.safetensors")
            row["bytes"] = weights.stat().st_size
        use_deploy = int8_onnx is not None or (self.runtime == "deploy" and quant is None and heads is None)
        vocab = int(config.get("vocab_size", 1000))
        g = torch.Generator().manual_seed(0)
        if use_deploy:
            from encoderkit.deploy.runtime import Predictor

            del model
            backend = "onnx-int8" if int8_onnx is not None else "onnx-fp32"
            pred = Predictor.load(folder, backend=backend, threads=threads, max_batch=32, max_length=self.seq_len)
            labels = pred.info.labels
            out = pred.classify(self.texts)
            pred_ids = [labels.index(o["label"]) if o["label"] in labels else -1 for o in out]

            def forward(b: int) -> None:
                ids = torch.randint(5, vocab, (b, self.seq_len), generator=g).numpy()
                pred.engine.run({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})

            row["runtime"] = f"deploy {backend}"
        else:
            from transformers import AutoTokenizer

            int8 = bool(quant) and int(quant.get("bits", 8)) == 8
            model = opened.load(int8_runtime=int8) if int8 else model
            tok = AutoTokenizer.from_pretrained(str(folder))
            pred_ids = []
            with torch.inference_mode():
                for i in range(0, len(self.texts), 32):
                    chunk = self.texts[i:i + 32]
                    if isinstance(chunk[0], tuple):
                        a, b = zip(*chunk)
                        enc = tok(list(a), list(b), truncation=True, max_length=self.seq_len, padding=True, return_tensors="pt")
                    else:
                        enc = tok(list(chunk), truncation=True, max_length=self.seq_len, padding=True, return_tensors="pt")
                    pred_ids += model(**enc).logits.argmax(-1).tolist()

            def forward(b: int) -> None:
                ids = torch.randint(5, vocab, (b, self.seq_len), generator=g)
                with torch.inference_mode():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids))

            row["runtime"] = "torch int8-dynamic" if int8 else "torch fp32"
        row["metric"] = "accuracy"
        row["quality"] = float(np.mean(np.asarray(pred_ids) == np.asarray(gold)))
        row["dev_examples"] = len(gold)
        for b in (1, 32):
            forward(b)  # warm-up
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                forward(b)
                times.append(time.perf_counter() - t0)
            row[f"latency_b{b}_ms"] = round(1000 * sorted(times)[len(times) // 2], 2)
        row["throughput_b32"] = round(32 / (row["latency_b32_ms"] / 1000), 1)
        return row


def onnx_parameters(path: Path) -> int:
    """Number of weight entries in an ONNX graph (initializers, quantization scales and zero points left out)."""
    import numpy as np
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return int(sum(np.prod(t.dims) for t in graph.initializer
                   if not t.name.endswith(("_scale", "_zero_point", "scale", "zero_point"))))


def make_measure(cfg: CompressConfig) -> StepMeasurer:
    return StepMeasurer(cfg.dev, seq_len=cfg.seq_len, runtime=cfg.runtime, dev_limit=cfg.dev_limit, repeats=cfg.repeats)


def run(cfg: CompressConfig, measure: Any = None) -> CompressResult:
    """Run a compression recipe step by step; re-measure quality, size and speed after each step."""
    import torch

    from encoderkit.hardware import describe
    from encoderkit.io import output_dir, relocate_paths
    from encoderkit.report import write_report

    steps = load_recipe(cfg.recipe)
    check(Path(cfg.model).is_dir(), f"--model {cfg.model} is not a folder")
    check(Path(cfg.dev).is_file(), f"--dev {cfg.dev} does not exist")
    out = Path(cfg.out)
    with output_dir(out, cfg.overwrite) as tmp:
        rows = run_steps(steps, cfg, tmp, out.resolve(), measure)
        meta = {"title": f"Compression report: {Path(cfg.recipe).name} on {Path(cfg.model).name}",
                "model": str(Path(cfg.model).resolve()), "recipe": str(cfg.recipe), "dev": str(cfg.dev),
                "seq_len": cfg.seq_len, "batch_sizes": "1 and 32", "threads": torch.get_num_threads(),
                "runtime": cfg.runtime, "hardware": describe(),
                "steps_config": [s.params | {"lever": s.lever} for s in steps]}
        write_report(tmp, rows, meta)
        relocate_paths(tmp, tmp, out)  # the levers' report.json files name the step folders they wrote in tmp
    return CompressResult(out, rows)
