"""`encoderkit compress --recipe FILE`: run compression levers in order, re-measuring after each.

A recipe (YAML, TOML or JSON) lists steps, each a lever of :mod:`encoderkit.compress.levers` and its settings, e.g.
``{lever: prune, method: structured, heads: 0.3, ffn: 0.4}``; it is validated whole before anything runs. The output
folder appears only when the recipe finished; until then the work lies in ``.<out>.partial``, so ``--resume`` reruns
none of the finished steps (after an edit of the recipe, only the steps from the first edited one).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from encoderkit.compress.levers import LEVERS, QUANT_LEVERS, check_task
from encoderkit.compress.measure import latency_meta, make_measure, step_int8_agreement
from encoderkit.compress.report import markdown_table, write_report
from encoderkit.compress.task_data import LeverData
from encoderkit.config import StageConfig, arg, check, check_spellings, load_mapping
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import describe
from encoderkit.inference.agreement import verdict
from encoderkit.io import (
    partial_dir,
    portable,
    portable_path,
    read_json,
    read_text_file,
    relocate_paths,
    resumable_dir,
    resumed_folder,
    write_json_atomic,
)
from encoderkit.models.card import card_facts, read_card, write_card
from encoderkit.progress import note, progress
from encoderkit.tasks import TASKS

__all__ = ["QUANT_LEVERS", "CompressConfig", "RecipeStep", "load_recipe", "run", "run_steps", "validate_recipe"]
RECIPE_KEYS = {"steps", "name", "description", "task"}
# what the validation builds each lever call's config with, in place of the runner's folders and data
_PLACEHOLDER_DATA = LeverData("<task>", {"train": "<--train>", "calib": "<--calib>"})


@dataclass
class RecipeStep:
    """One validated step: ``calls`` are the settings of the lever calls it makes (two for
    structured pruning), without the paths and data that the runner fills in."""

    index: int
    lever: str
    params: dict[str, Any]
    calls: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return f"{self.index:02d}-{self.lever}"

    def needs(self) -> list[tuple[str, int]]:
        """(data field, call number) of every field the step's calls declare."""
        lever = LEVERS[self.lever]
        return [(f, j) for j, c in enumerate(self.calls) for f in lever.needs(c)]


def recipe_task(data: Any) -> str | None:
    """The ``task`` a recipe mapping names, if any."""
    return str(data["task"]) if isinstance(data, dict) and data.get("task") else None


def validate_recipe(data: Any, source: str = "recipe") -> list[RecipeStep]:
    """Check every step of a recipe mapping (or list of steps) before anything runs."""
    steps = data.get("steps") if isinstance(data, dict) else data
    if isinstance(data, dict):
        extra = sorted(set(data) - RECIPE_KEYS)
        check(not extra, f"{source}: unknown top-level key(s) {extra}; a recipe holds 'steps' (and optional 'task', "
                         "'name', 'description')")
        task = recipe_task(data)
        check(task is None or task in TASKS, f"{source}: task {task!r} is not one of {', '.join(TASKS)}")
    check(isinstance(steps, list) and len(steps) > 0, f"{source}: expected a non-empty list under 'steps'")
    out: list[RecipeStep] = []
    for i, raw in enumerate(steps, 1):
        if not isinstance(raw, dict) or "lever" not in raw:
            raise EncoderkitError(f"{source}: step {i} must be a mapping with a 'lever' key, got {raw!r}")
        name = str(raw["lever"])
        where = f"{source}: step {i} (lever '{name}')"
        if name not in LEVERS:
            raise EncoderkitError(f"{where}: unknown lever; known levers: {', '.join(LEVERS)}")
        lever = LEVERS[name]
        params = {k: v for k, v in raw.items() if k != "lever"}
        check_spellings(params, where)
        known = lever.recipe_keys()
        for key in params:
            field_name = key.replace("-", "_")
            if field_name not in known and (field_name in lever.runner_fields
                                            or field_name in ("model", "out", "teacher")):
                raise EncoderkitError(f"{where}: field '{key}' is set by the runner (the previous step's model and the "
                                      "step folder); remove it")
            if field_name not in known:
                raise EncoderkitError(f"{where}: unknown field '{key}'; known fields: {', '.join(sorted(known))}")
        params = {k.replace("-", "_"): v for k, v in params.items()}
        try:
            calls = lever.calls(params)
            for c in calls:
                lever.config(c, Path("<previous step>"), Path("<step folder>"), _PLACEHOLDER_DATA)
                lever.needs(c)
        except EncoderkitError as e:
            msg = str(e)
            raise EncoderkitError(msg if msg.startswith(where) else f"{where}: {msg}") from e
        earlier = next((o for o in out if o.lever in QUANT_LEVERS), None) if name in QUANT_LEVERS else None
        if earlier is not None:
            raise EncoderkitError(f"{where}: step {earlier.index} ({earlier.lever}) already quantizes the model and a "
                                  "quantized model is never quantized again; keep one quantization step (they are "
                                  "alternatives: gptq/rtn for bytes, dynamic-int8/static for CPU speed, qat for "
                                  "quality)")
        out.append(RecipeStep(i, name, params, calls))
    return out


def read_recipe(path: str | Path) -> Any:
    """The mapping of a recipe file (YAML, TOML or JSON)."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        text = read_text_file(p, "recipe file")
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise EncoderkitError(f"recipe file {p} is not valid YAML: {e}") from e
    return load_mapping(p)


def load_recipe(path: str | Path) -> list[RecipeStep]:
    """Read and validate a recipe file."""
    return validate_recipe(read_recipe(path), source=str(path))


@dataclass
class CompressConfig(StageConfig):
    """Settings of `encoderkit compress`."""

    recipe: str = arg(help="Recipe file (YAML/TOML/JSON) with the levers to run in order.", required=True)
    model: str = arg(help="Fine-tuned model folder to compress (classify, ner, qa, rerank or embed: the task and the "
                          "data columns are read from its encoderkit.json).", required=True)
    dev: str = arg(help="Dev data on which the task's own metric is re-measured after every step, in the task's format "
                        "(what `encoderkit evaluate --data` takes): classify a labelled .tsv/.csv/.jsonl (accuracy); "
                        "ner a CoNLL file (entity F1); qa a SQuAD file (F1; see --qa-split); rerank a BEIR source "
                        "with --miner (nDCG@10 reranking the miner's top --candidates) or a JSONL of queries with "
                        "candidates {query, positive, negatives} (MRR@10); embed a BEIR source (nDCG@10, recall@100).",
                     required=True)
    out: str = arg(help="Output folder: one model folder per step plus report.md/json/png.", required=True)
    train: str | None = arg(None, help="The task's training data (read by the task's reader, with the columns of the "
                                       "model's card) for distillation, recovery training and calibration.")
    calib: str | None = arg(None, help="In-domain inputs for calibration and vocabulary, the task's data or a .txt of "
                                       "texts (default: --train).")
    # -- measurement (encoderkit.compress.measure) --
    seq_len: int = arg(0, help="Longest timed example in sub-tokens (0: the model's max length). Latency is timed on "
                               "real dev examples in the unit the task is served in: classify/ner/qa one request (a "
                               "typical dev example) and 32 requests; rerank one query's top 100 candidates; embed one "
                               "query and a batch of 32 documents.")
    runtime: str = arg("deploy", choices=("deploy", "torch"), help="Runtime for latency and quality: 'deploy' (ONNX "
                       "Runtime, the deploy Predictor's engine: a folder's INT8 graph, else an FP32 export; torch for "
                       "folders it cannot load) or 'torch' (folders with an INT8 graph still run it). Quality is "
                       "`encoderkit evaluate`'s figure run by that engine.")
    dev_limit: int = arg(0, help="Measure quality on a seeded subset of N dev examples (rerank/embed: N judged "
                                 "queries, the whole corpus searched) (0: all).")
    repeats: int = arg(5, speed=True, help="Timed repetitions per latency figure (the median is reported).")
    miner: str = arg("", help="rerank on a BEIR --dev: the first stage, a bi-encoder folder (or 'minilm') whose top "
                              "--candidates per query the reranker reorders (required there). On a BEIR --train it is "
                              "also the first stage of rerank distillation (unless the step names its own 'miner') and "
                              "of recovery training, which then reads each query's top 16 documents, not only the "
                              "judged ones.")
    candidates: int = arg(100, help="rerank on a BEIR --dev: documents per query from the --miner.")
    qa_split: str = arg("all", choices=("all", "train", "heldout"), help="qa: which articles of the SQuAD --dev file "
                        "quality is measured on: 'heldout' (the last 20%%, what finetune evaluates on when --train and "
                        "--dev are one file), 'train' (the first 80%%) or 'all'.")
    max_quality_drop: float = arg(0.03, help="The allowed relative drop of the dev metric, drawn as the floor on "
                                  "report.png (0.03: at least 97%% of the starting model's quality).")
    batch_size: int = arg(32, speed=True, help="Inference batch size of the quality measurement.")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")
    resume: bool = arg(False, speed=True, help="Continue an interrupted recipe (its work is kept in .<out>.partial "
                       "beside --out) or a finished one (--out): the steps it finished and measured are not run "
                       "again, a distill step continues from its latest checkpoint; a recipe edited from step k on "
                       "keeps steps 1 to k-1 and runs the rest; other measurement settings (--dev, --dev-limit, "
                       "--candidates, --qa-split, --seq-len, --runtime) measure every kept step again without running "
                       "it. The other settings must be the same.")
    save_every: int = arg(100, speed=True, help="Checkpoint a distill step every N training steps, so --resume loses "
                          "at most N (0: only at the end).")


# settings that change how a step is measured, not what it builds: --resume with other values re-measures
MEASURE_SETTINGS = ("dev", "dev_limit", "candidates", "qa_split", "seq_len", "runtime", "max_quality_drop")
PROGRESS_FILE = "progress.json"  # in the partial folder: the rows measured so far and what made them


@dataclass
class CompressResult:
    out: Path
    rows: list[dict[str, Any]]

    def summary(self) -> str:
        return f"{markdown_table(self.rows)}\n\nreport: {self.out / 'report.md'}"


def check_steps(steps: list[RecipeStep], data: LeverData, source: str, task: str | None = None) -> None:
    """Before anything runs: the model is of the recipe's ``task``, every lever handles the model's
    task, and every step has the data its calls declare (errors name the task, the field and the step)."""
    if task is not None and task != data.task:
        raise EncoderkitError(f"{source}: the recipe is for {task} models but the model {data.folder} is a {data.task} "
                              f"model; use a {task} model or a recipe for {data.task}")
    for step in steps:
        where = f"{source}: step {step.index} (lever '{step.lever}')"
        check_task(LEVERS[step.lever], data.task, where)
        data.require(tuple(dict.fromkeys(f for f, _ in step.needs())), where)


def lever_notes(details: dict[str, Any]) -> str:
    """What a lever's report says about speed or bytes that the numbers alone do not (e.g. that 2:4
    sparsity buys no time without a sparse GPU)."""
    return "; ".join(str(details[k]) for k in ("speedup", "bytes_note") if details.get(k))


def run_steps(steps: list[RecipeStep], cfg: CompressConfig, work: Path, final: Path,
              measure: Any = None, task: str | None = None, done: list[dict[str, Any]] | None = None,
              on_row: Any = None) -> list[dict[str, Any]]:
    """Run ``steps`` from ``cfg.model`` into ``work/NN-lever`` folders, measuring each; returns the report rows (row
    0: the starting model; each row's ``folder`` relative to ``final``, where ``work`` will be renamed to); ``done``
    are a resumed run's rows, not run again; ``on_row(rows)`` is called after every measurement."""
    data = LeverData.for_model(cfg.model, train=cfg.train, calib=cfg.calib, miner=cfg.miner)
    check_steps(steps, data, str(cfg.recipe), task)
    measure = measure or make_measure(cfg)
    on_row = on_row or (lambda rows: None)
    rows = list(done or [])
    if not rows:
        start = portable_path(cfg.model, final)  # rows name folders relative to final
        rows.append({"step": 0, "lever": "start", "folder": start, **measure(Path(cfg.model))})
        on_row(rows)
    cur = Path(cfg.model)
    if len(rows) > 1:
        last = steps[len(rows) - 2]
        cur = work / last.name
        note(f"resuming after step {last.index} ({last.lever}): {len(rows) - 1} of {len(steps)} steps were finished")
    for step in progress(steps[len(rows) - 1:], desc="recipe", unit="step"):
        dst = work / step.name
        where = f"{cfg.recipe}: step {step.index} (lever '{step.lever}')"
        lever = LEVERS[step.lever]
        notes = []
        _clear_unfinished(work, step)
        calls = step.calls
        if dst.is_dir():  # levers write their folder atomically: an earlier attempt finished it, then stopped
            note(f"step {step.index} ({step.lever}) finished before the interruption; measuring it")
            calls, notes = [], [lever_notes(_saved_details(dst))]
        for j, call in enumerate(calls):
            src = cur if j == 0 else work / f".{step.name}-part{j - 1}"
            target = dst if j == len(step.calls) - 1 else work / f".{step.name}-part{j}"
            if step.lever == "distill":  # hours on a CPU: checkpointed, and continued by --resume
                call = {**call, "save_every": cfg.save_every, "resume": cfg.resume}
            try:
                config = lever.config(call, src, target, data)
            except EncoderkitError as e:
                raise EncoderkitError(f"{where}: {e}") from e
            report = lever.run(src, config, data, target)
            notes.append(lever_notes(report.details))
        for j in range(len(step.calls) - 1):
            shutil.rmtree(work / f".{step.name}-part{j}", ignore_errors=True)
        card = read_card(dst)
        extra = card_facts(card)  # this step's own facts (its distillation's steps and layers...)
        if "int8_agreement" not in extra and (agreement := step_int8_agreement(cur, dst, cfg)):  # an INT8 graph's
            extra["int8_agreement"] = agreement  # agreement with FP32 on the dev rows, which --backend auto reads
            note(f"step {step.index} ({step.lever}): {verdict(agreement)[1]}")
        row = {"step": step.index, "lever": step.lever, "folder": step.name, **measure(dst)}  # relative to final
        if any(notes):
            row["note"] = "; ".join(n for n in notes if n)
        # the parent as seen from dst (``../01-prune``, or the start model beside ``final``): what it is from final
        write_card(dst, card.get("stage", step.lever), cur, card.get("config", step.params),
                   {**card.get("metrics", {}),
                    "recipe_measurement": {k: v for k, v in row.items() if k not in ("step", "folder")}},
                   **{**extra, "recipe_step": step.index, "recipe_params": step.params})
        rows.append(row)
        on_row(rows)
        note(f"step {step.index} ({step.lever}): {row.get('metric', 'quality')} {row.get('quality')} "
             f"params {row.get('params')} bytes {row.get('bytes')} {row.get('latency_ms')} ms per "
             f"{row.get('latency_unit')}")
        cur = dst
    return rows


def run(cfg: CompressConfig, measure: Any = None) -> CompressResult:
    """Run a compression recipe step by step; re-measure quality, size and speed after each step."""
    recipe = read_recipe(cfg.recipe)
    steps = validate_recipe(recipe, source=str(cfg.recipe))
    check(Path(cfg.model).is_dir(), f"--model {cfg.model} is not a folder")
    out = Path(cfg.out)
    measure = measure or make_measure(cfg)  # reads the task and checks the dev data before anything runs
    identity = run_identity(cfg, steps)
    done, same = [], 0
    if cfg.resume:  # checked before anything moves: a refused resume leaves a finished --out where it is
        earlier = resumed_folder(out) or partial_dir(out)
        if earlier == out and not (out / PROGRESS_FILE).is_file():
            raise EncoderkitError(f"cannot resume {out}: it has no {PROGRESS_FILE} (not a recipe's output, or one "
                                  "written before finished runs kept it); pass --overwrite instead of --resume to run "
                                  "it again")
        done, same = resumed_rows(earlier / PROGRESS_FILE, identity)
    with resumable_dir(out, cfg.overwrite, cfg.resume, retry="rerun the same command with --resume") as tmp:
        if cfg.resume:
            _clear_steps_after(tmp, same)
        rows = run_steps(steps, cfg, tmp, out.resolve(), measure, task=recipe_task(recipe), done=done,
                         on_row=lambda rows: write_json_atomic(tmp / PROGRESS_FILE,
                                                               {"identity": identity, "rows": rows}))
        meta = {"title": f"Compression report: {Path(cfg.recipe).name} on {Path(cfg.model).name}",
                "model": portable_path(cfg.model, out), "recipe": portable(str(cfg.recipe), out),
                "dev": portable(str(cfg.dev), out),
                **latency_meta(rows), "threads": torch.get_num_threads(),
                "runtime": cfg.runtime, "max_quality_drop": cfg.max_quality_drop, "hardware": describe(),
                "steps_config": [s.params | {"lever": s.lever} for s in steps]}
        write_report(tmp, rows, meta)
        relocate_paths(tmp, tmp, out)  # the levers' report.json files name the step folders they wrote in tmp
    return CompressResult(out, rows)


def run_identity(cfg: CompressConfig, steps: list[RecipeStep]) -> dict[str, Any]:
    """What a resumed recipe must share with the run it continues: its steps and the settings that change
    results (not where the recipe file or the output lie)."""
    settings = {k: v for k, v in cfg.result_dict().items() if k not in ("recipe", "out", "overwrite")}
    settings = portable(settings, cfg.out)  # absolute paths as seen from --out: a moved run resumes
    return json.loads(json.dumps({"steps": [{"lever": s.lever, **s.params} for s in steps], "settings": settings}))


def resumed_rows(path: Path, identity: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The rows an earlier run measured (``[]`` when it measured none) that this run keeps, and how many
    leading steps it shares with this recipe, after checking that it ran with the same settings. A
    recipe edited from step k on keeps the rows of the steps before k."""
    if not path.is_file():
        note(f"--resume: {path.parent} holds no finished step, so the recipe starts from the beginning")
        return [], 0
    saved = read_json(path, f"{path} is missing", "rerun without --resume to start again")
    was, now = saved.get("identity", {}), identity
    differ = [k for k in sorted(set(was.get("settings", {})) | set(now["settings"]))
              if was.get("settings", {}).get(k) != now["settings"].get(k)]
    built = [k for k in differ if k not in MEASURE_SETTINGS]
    if built:
        raise EncoderkitError(f"cannot resume from {path.parent}: it was run with other settings ({', '.join(built)}); "
                              "rerun with those, or without --resume to start again")
    old, new = was.get("steps", []), now["steps"]
    same = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    if old != new:
        note(f"--resume: the recipe differs from step {same + 1} on; steps 1-{same} are kept, the rest run again"
             if same else "--resume: the recipe differs from its first step on; only the start's measurement is kept")
    if differ:  # the same models, measured another way: every kept step is measured again, none is run again
        note(f"--resume: measured with other settings ({', '.join(differ)}): the start and the kept steps are measured "
             "again, no step is run again")
        return [], same
    return saved["rows"][: same + 1], same


def _clear_steps_after(work: Path, same: int) -> None:
    """Remove what steps after the first ``same`` left in ``work`` (folders, parts, checkpoints): an
    edited recipe runs them again."""
    for entry in work.iterdir():
        index = re.match(r"\.?(\d+)-", entry.name)
        if index and int(index.group(1)) > same:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _clear_unfinished(work: Path, step: RecipeStep) -> None:
    """Remove what an interrupted attempt at ``step`` left half-made (the parts of a structured pruning, a
    lever's temporary folder), keeping a finished step folder and a distillation's checkpoints."""
    for path in [*work.glob(f".{step.name}-part*"), *work.glob(f".{step.name}.tmp-*")]:
        if path.is_dir():
            shutil.rmtree(path)


def _saved_details(folder: Path) -> dict[str, Any]:
    """The details a lever wrote in its folder's report.json (none for a distillation)."""
    path = folder / "report.json"
    return json.loads(path.read_text()).get("details", {}) if path.is_file() else {}
