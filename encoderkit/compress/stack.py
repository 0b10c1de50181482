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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.compress.measure import latency_meta, make_measure
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
    model: str = arg(help="Fine-tuned model folder to compress (classify, ner, qa, rerank or embed: the task and the data "
                          "columns are read from its encoderkit.json).", required=True)
    dev: str = arg(help="Dev data on which the task's own metric is re-measured after every step, in the task's format "
                        "(what `encoderkit evaluate --data` takes): classify a labelled .tsv/.csv/.jsonl (accuracy); "
                        "ner a CoNLL file (entity F1); qa a SQuAD file (F1; see --qa-split); rerank a BEIR source "
                        "with --miner (nDCG@10 reranking the miner's top --candidates) or a JSONL of queries with "
                        "candidates {query, positive, negatives} (MRR@10); embed a BEIR source (nDCG@10, recall@100).",
                     required=True)
    out: str = arg(help="Output folder: one model folder per step plus report.md/json/png.", required=True)
    train: str | None = arg(None, help="Labelled task training file for distillation, recovery training and calibration.")
    calib: str | None = arg(None, help="Unlabelled in-domain texts for calibration and vocabulary (default: --train).")
    # -- measurement (encoderkit.compress.measure) --
    seq_len: int = arg(0, help="Longest timed example in sub-tokens (0: the model's max length). Latency is timed on real "
                               "dev examples in the unit the task is served in: classify/ner/qa one request (a typical "
                               "dev example) and 32 requests; rerank one query's top 100 candidates; embed one query "
                               "and a batch of 32 documents.")
    runtime: str = arg("deploy", choices=("deploy", "torch"), help="Runtime for latency and quality: 'deploy' (ONNX Runtime, "
                       "the deploy Predictor's engine: a folder's INT8 graph, else an FP32 export; torch for folders it "
                       "cannot load) or 'torch' (folders with an INT8 graph still run it). Quality is `encoderkit "
                       "evaluate`'s figure run by that engine.")
    dev_limit: int = arg(0, help="Measure quality on a seeded subset of N dev examples (rerank/embed: N judged queries, "
                                 "the whole corpus searched) (0: all).")
    repeats: int = arg(5, speed=True, help="Timed repetitions per latency figure (the median is reported).")
    miner: str = arg("", help="rerank on a BEIR --dev: the first stage, a bi-encoder folder (or 'minilm') whose top "
                              "--candidates per query the reranker reorders (required there).")
    candidates: int = arg(100, help="rerank on a BEIR --dev: documents per query from the --miner.")
    qa_split: str = arg("all", choices=("all", "train", "heldout"), help="qa: which articles of the SQuAD --dev file "
                        "quality is measured on: 'heldout' (the last 20%%, what finetune evaluates on when --train and "
                        "--dev are one file), 'train' (the first 80%%) or 'all'.")
    max_quality_drop: float = arg(0.03, help="The allowed relative drop of the dev metric, drawn as the floor on "
                                  "report.png (0.03: at least 97%% of the starting model's quality).")
    batch_size: int = arg(32, speed=True, help="Inference batch size of the quality measurement.")
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
    defaults to :func:`encoderkit.compress.measure.make_measure` (the task's own metric on ``cfg.dev``)."""
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
        note(f"step {step.index} ({step.lever}): {row.get('metric', 'quality')} {row.get('quality')} params {row.get('params')} "
             f"bytes {row.get('bytes')} {row.get('latency_ms')} ms per {row.get('latency_unit')}")
        cur, cur_final = dst, final / step.name
    return rows


def run(cfg: CompressConfig, measure: Any = None) -> CompressResult:
    """Run a compression recipe step by step; re-measure quality, size and speed after each step."""
    import torch

    from encoderkit.hardware import describe
    from encoderkit.io import output_dir, relocate_paths
    from encoderkit.report import write_report

    steps = load_recipe(cfg.recipe)
    check(Path(cfg.model).is_dir(), f"--model {cfg.model} is not a folder")
    out = Path(cfg.out)
    measure = measure or make_measure(cfg)  # reads the task and checks the dev data before anything runs
    with output_dir(out, cfg.overwrite) as tmp:
        rows = run_steps(steps, cfg, tmp, out.resolve(), measure)
        meta = {"title": f"Compression report: {Path(cfg.recipe).name} on {Path(cfg.model).name}",
                "model": str(Path(cfg.model).resolve()), "recipe": str(cfg.recipe), "dev": str(cfg.dev),
                **latency_meta(rows), "threads": torch.get_num_threads(),
                "runtime": cfg.runtime, "max_quality_drop": cfg.max_quality_drop, "hardware": describe(),
                "steps_config": [s.params | {"lever": s.lever} for s in steps]}
        write_report(tmp, rows, meta)
        relocate_paths(tmp, tmp, out)  # the levers' report.json files name the step folders they wrote in tmp
    return CompressResult(out, rows)
