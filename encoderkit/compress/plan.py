"""`encoderkit plan`: choose a compression recipe from the situation, with a reason for every choice.

A short list of rules for encoders: post-training levers only without a training budget; distillation first with a
teacher; structured pruning for CPU latency, 2:4 sparsity on a sparse GPU; one quantization step at most; the static
tier for an embedding model's speed goal beyond the transformer levers. Latency is planned in the unit the task is
served in (:func:`served_unit`), for the hardware ``--hardware`` names or :mod:`encoderkit.hardware` finds.
``--run`` runs the plan and backs off (:func:`backoff_variants`) until the quality floor holds.

Absolute constraints (:class:`Limits`): ``--max-ms`` (per served unit at ``--seq-len`` on this machine), ``--max-mb``
(the weight file the runtime loads), ``--min-quality`` (a fraction of the starting model's dev metric); ``--labels``
and ``--train-minutes`` say what training is possible. The seeds' rules: no training budget on a CPU gives
post-training quantization only; INT4 is QAT with a training budget and labels, else GPTQ; 2:4 sparsity only on a GPU
with sparse tensor cores (compute capability >= 8.0). ``--run`` re-measures after every lever, backs off until every
constraint holds, or names the constraint that cannot hold and the closest folder it found.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from encoderkit.compress.measure import StepMeasurer
from encoderkit.compress.report import write_report
from encoderkit.compress.stack import QUANT_LEVERS, CompressConfig, run_steps, validate_recipe
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import PLANNER_HARDWARE, Hardware, describe, detect, planner_hardware
from encoderkit.io import output_dir, portable, write_json_atomic, write_text_atomic
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.protocol import Task

# The static tier (`distill --to static`, recipes/static-tier.yaml): a table of token vectors, no transformer. Its
# speed and the share of the teacher's quality it keeps (with and without the fit) are measured in
# docs/compress-embed.md and docs/search.md (bench/static_tier.py); quantization, distillation and pruning give far
# less speed, so a goal of STATIC_SPEEDUP x or more is out of their reach.
STATIC_SPEEDUP = 20.0
STATIC_SHARE = {"some": 0.96, "none": 0.61}  # of the teacher's quality, by training budget (with / without the fit)


def task_object(task: str | None) -> Task | None:
    """The task object planned for; None when the task is unknown."""
    return get_task(task) if task in TASKS else None


def served_unit(task: str | None) -> tuple[int, str]:
    """(batch, what one timed call is): the unit ``task`` is served in, which latency is planned for (the task
    object's ``planned_unit``: the sizes the compression measurer times), else one request."""
    spec = task_object(task)
    return spec.planned_unit if spec is not None else (1, "one request")


@dataclass
class PlanConfig(StageConfig):
    """The situation the recipe is planned for, and optionally a model to run it on."""

    task: str = arg("auto", choices=("auto", *TASKS), help="The model's task, which sets the latency unit (rerank: "
                    "one query's top 100 candidates; embed: a batch of documents and one query; others: one "
                    "request). auto: the --model folder's task, else unknown (one request).")
    budget: str = arg("none", choices=("none", "some"), help="Training budget for compression: 'none' (post-training "
                      "levers only) or 'some' (distillation, pruning with recovery, QAT).")
    teacher: bool = arg(False, help="A fine-tuned teacher model is available (the model to compress can be its own "
                        "teacher).")
    hardware: str = arg("auto", choices=("auto", *PLANNER_HARDWARE), help="Where the model will run: auto (this "
                        "machine, as `encoderkit doctor` finds it), plain CPU, CPU with VNNI/AMX int8 dot products, or "
                        "a GPU with 2:4 sparse tensor cores.")
    goal: str = arg("latency", choices=("latency", "memory"), help="What to minimise: latency (time per request) or "
                    "memory (bytes on disk and in RAM).")
    max_quality_drop: float = arg(0.03, help="Largest allowed relative drop of the dev metric (0.03 = keep at least "
                                  "97% of the starting quality).")
    speedup: float = arg(0.0, help="The speed-up over the starting model the latency goal needs (texts/s), e.g. 20; 0: "
                         f"as much as the levers give. An embed model asked for {STATIC_SPEEDUP:g}x or more, with a "
                         "--max-quality-drop a static model's measured quality allows, is planned as the static tier "
                         "(recipes/static-tier.yaml).")
    has_calibration_data: bool = arg(True, help="Unlabelled in-domain text is available for calibration (GPTQ, static "
                                     "INT8, vocabulary pruning).")
    write: str | None = arg(None, help="Write the planned recipe to this YAML file.")
    run: bool = arg(False, help="Execute the plan on --model with --dev and back off until the quality floor holds.")
    model: str | None = arg(None, help="Model folder to compress (with --run).")
    dev: str | None = arg(None, help="Dev set file to measure quality on (with --run).")
    train: str | None = arg(None, help="Task training data for distillation and pruning recovery (with --run; "
                            "defaults to the model's training data if its card names it).")
    out: str | None = arg(None, help="Output folder of the run (with --run).")
    miner: str = arg("", help="With --run, as `compress --miner`: a rerank model on a BEIR --dev is measured over this "
                     "bi-encoder's top --candidates.")
    candidates: int = arg(100, help="With --run, as `compress --candidates`.")
    dev_limit: int = arg(0, help="With --run, as `compress --dev-limit`: measure on a seeded subset of N dev examples "
                         "(0: all).")
    qa_split: str = arg("all", choices=("all", "train", "heldout"), help="With --run, as `compress --qa-split`.")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")
    max_backoff: int = arg(6, help="How many less aggressive variants --run tries before giving up.")
    max_ms: float = arg(0.0, help="At most this many milliseconds per request (the task's served unit) at --seq-len "
                        "on this machine, as the compression measurer times it (0: no limit); with --run, checked "
                        "on every step.")
    max_mb: float = arg(0.0, help="At most this many MB (1e6 bytes) of weights the runtime loads (0: no limit). "
                        "Without --max-ms it plans for memory (--goal memory); --max-ms plans for latency.")
    min_quality: float = arg(0.0, help="Keep at least this fraction of the starting model's dev metric, e.g. 0.97 "
                             "(0: 1 - --max-quality-drop).")
    labels: str = arg("yes", choices=("yes", "no"), help="Whether --train has labels: QAT (the INT4 rule) needs them; "
                      "without, INT4 is GPTQ.")
    train_minutes: float = arg(0.0, help="Minutes of training allowed; > 0 is a training budget (as --budget some), "
                               "0: --budget decides.")
    seq_len: int = arg(0, help="With --run: the longest timed example in sub-tokens, the length --max-ms is for (0: "
                       "the model's max length).")

    def validate(self) -> None:
        check(0.0 <= self.max_quality_drop < 1.0, f"max_quality_drop must be in [0, 1), got {self.max_quality_drop}")
        check(self.max_ms >= 0 and self.max_mb >= 0, "--max-ms and --max-mb must be >= 0 (0: no limit)")
        check(0.0 <= self.min_quality <= 1.0, f"--min-quality is a fraction in [0, 1], got {self.min_quality}")
        check(self.train_minutes >= 0, f"--train-minutes must be >= 0, got {self.train_minutes}")
        check(self.speedup >= 0, f"--speedup must be >= 0 (0: no speed goal), got {self.speedup}")
        if self.run:
            for name in ("model", "dev", "out"):
                check(bool(getattr(self, name)), f"plan --run needs --{name}")


@dataclass
class PlannedStep:
    lever: str
    params: dict[str, Any]
    reason: str

    def as_recipe_step(self) -> dict[str, Any]:
        return {"lever": self.lever, **self.params}


@dataclass
class Plan:
    steps: list[PlannedStep]
    left_out: list[tuple[str, str]] = field(default_factory=list)
    hardware: str = "cpu"
    hardware_why: str = ""
    task: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def latency_unit(self) -> tuple[int, str]:
        """(batch, what it is) of the latency the plan is for: the task's served unit, else one request."""
        return served_unit(self.task)

    def quantization(self) -> PlannedStep | None:
        """The plan's one quantization step (a plan never quantizes twice), if any."""
        return next((s for s in self.steps if s.lever in QUANT_LEVERS), None)

    def recipe(self) -> dict[str, Any]:
        """The recipe mapping; it names the task when the plan knows it (the runner then checks the model's)."""
        return {**({"task": self.task} if self.task else {}), "steps": [s.as_recipe_step() for s in self.steps]}

    def levers(self) -> list[str]:
        return [s.lever for s in self.steps]

    def describe(self) -> str:
        q = self.quantization()
        quant = f"{q.lever}({', '.join(f'{k}={v}' for k, v in q.params.items())})" if q else "none"
        batch, unit = self.latency_unit
        lines = [f"Hardware: {self.hardware} ({self.hardware_why})",
                 f"Task: {self.task or 'unknown'}; latency planned per {unit} (batch {batch})",
                 f"Quantization lever on {self.hardware}: {quant}", "Planned recipe (in order):"]
        for i, s in enumerate(self.steps, 1):
            params = ", ".join(f"{k}={v}" for k, v in s.params.items())
            lines.append(f"  {i}. {s.lever}({params})\n     why: {s.reason}")
        if self.left_out:
            lines.append("Left out:")
            lines += [f"  - {lever}: {why}" for lever, why in self.left_out]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def resolve_hardware(cfg: PlanConfig, hw: Hardware | None = None) -> tuple[str, str]:
    """The planner's hardware kind and why: as given, or for ``auto`` from ``hw`` (default: this machine)."""
    if cfg.hardware != "auto":
        return cfg.hardware, "given by --hardware"
    choice = planner_hardware(hw or detect())
    return choice.value, f"auto: {choice.why}"


def resolve_task(cfg: PlanConfig) -> str | None:
    """The task planned for: ``--task``, else the ``--model`` folder's task, else None (unknown)."""
    if cfg.task in TASKS:  # given (else "auto")
        return cfg.task
    if cfg.model:
        task = ModelFolder.open(cfg.model, weights=False, tokenizer=False).task
        return task if task in TASKS else None
    return None


def make_plan(asked: PlanConfig, hw: Hardware | None = None) -> Plan:
    """The ordered recipe for ``asked``'s situation; pure (reads no files) except that
    ``--hardware auto`` looks at ``hw`` (default: this machine, :func:`encoderkit.hardware.detect`),
    and ``--task auto`` reads the ``--model`` folder's task."""
    # --train-minutes is a budget; --max-ms is a latency goal, --max-mb alone a memory goal
    goal = "latency" if asked.max_ms else "memory" if asked.max_mb else asked.goal
    cfg = dataclasses.replace(asked, budget="some" if asked.train_minutes > 0 else asked.budget, goal=goal)
    kind, kind_why = resolve_hardware(cfg, hw)
    task = resolve_task(cfg)
    spec = task_object(task)
    batch, unit = served_unit(task)
    ranks_lists = spec is not None and spec.ranks_lists  # a reranker: served per query's candidate list
    per_query = ranks_lists and cfg.goal == "latency"
    trains = cfg.budget == "some"
    steps: list[PlannedStep] = []
    out: list[tuple[str, str]] = []
    tight = cfg.max_quality_drop < 0.01
    static = static_tier(cfg, spec)
    if isinstance(static, PlannedStep):
        return Plan(steps=[static], left_out=[(lever, ("the static tier replaces the transformer, so no transformer "
                                                      "lever applies"))
                                              for lever in ("prune", "vocab", "quantize", "qat")],
                    hardware=kind, hardware_why=kind_why, task=task, notes=[
                        ("the static tier's quality is measured, not assumed: `plan --run` (or compress) re-measures "
                         "it on --dev and says when it is below the floor; then `encoderkit plan` without --speedup "
                         "gives the transformer levers, or serve it as the first stage of the tiered index "
                         "(`encoderkit index --first-stage-model`), where the full encoder rescores its candidates")])
    if static:
        out.append(("static tier", static))

    # 1. distillation: fewer layers is the biggest win on every hardware, if we may train. A reranker on a CPU
    # keeps its depth instead: half the heads and 3/4 of the FFN neurons go, and the unpruned model teaches the
    # pruned one back, which keeps more of the teacher than half the layers do (docs/compress.md).
    width = ranks_lists and kind != "gpu-sparse" and per_query and trains and cfg.teacher and not tight
    if width:
        steps.append(PlannedStep("prune", {"method": "structured", "heads": 0.5, "ffn": 0.75, "seq_len": 256},
                                 f"a reranker on a CPU, per {unit}: keeping all layers and removing half the "
                                 "attention heads and 3/4 of the FFN neurons (by Taylor importance) is faster in "
                                 "FP32 (docs/results/compress-rerank-log.md); a cut this deep ranks below the first "
                                 "stage until the next step teaches it back"))
        steps.append(PlannedStep("distill", {"teacher": "start", "epochs": 5, "lr": spec.distill_lr, "candidates": 8,
                                             "pseudo_queries": 1000, "fresh_pseudo_queries": True, "seq_len": 256},
                                 "the unpruned model (the recipe's start) teaches the pruned one on its scores over "
                                 "each query's mined candidates (KL over the list), 1,000 new corpus titles each "
                                 "epoch as label-free queries: the width-pruned student keeps more of the teacher "
                                 "than one with half the layers (SciFact: docs/compress.md, Rerank)"))
    elif trains and cfg.teacher:
        rerank = ranks_lists
        steps.append(PlannedStep("distill", {"layers": "every-other", "epochs": 3, **(
                                     {"lr": spec.distill_lr, "pseudo_queries": 1000, "fresh_pseudo_queries": True}
                                     if rerank else {})},
                                 "a teacher and a training budget: a student with every other layer, initialised "
                                 "from the teacher's layers and trained on its soft targets, halves depth-bound "
                                 "latency and size for a small quality cost" + (
                                     f"; per {unit} the cross-encoder's time is depth x {batch} full sequences, so "
                                     "half the layers is about half the time per query" if per_query else "") + (
                                     "; a cut cross-encoder ranks no better than chance until trained back, so at "
                                     "3e-4, not a classifier's 1e-4, and on more lists than the training queries "
                                     "give (a BEIR --train: 1,000 new corpus titles each epoch as label-free "
                                     "queries)" if rerank else "")))
    elif not trains:
        out.append(("distill", "no training budget: distillation needs training"))
    else:
        out.append(("distill", "no teacher: distillation needs a fine-tuned teacher's soft targets"))

    # 2. pruning: pattern chosen by what the hardware can exploit.
    if kind == "gpu-sparse":
        if trains:
            steps.append(PlannedStep("prune", {"method": "2:4", "recovery_steps": 500},
                                     "the GPU has 2:4 sparse tensor cores: half the weights in every group of four are "
                                     "zeroed in the pattern they skip, and short recovery training restores quality" + (
                                         f"; per {unit} the matrix multiplies are large enough ({batch} x sequence "
                                         "rows) for the sparse kernels to pay off, which single requests are not"
                                         if per_query else "")))
        else:
            out.append(("prune 2:4", "2:4 sparsity costs quality that needs recovery training; no budget"))
        out.append(("prune structured",
                    "on a 2:4 sparse GPU, 2:4 sparsity gives the speed-up without removing whole heads"))
    else:
        out.append(("prune 2:4", "no sparse hardware: 2:4 sparsity saves no time on a CPU"))
        if width:
            out.append(("prune recovery",
                        "the pruned reranker is taught back by the distill step, not by recovery steps"))
        elif cfg.goal == "latency" and trains:
            ffn = 0.3 if tight else 0.4
            params: dict[str, Any] = {"method": "structured", "ffn": ffn, "recovery_steps": 500}
            reason = ("CPU latency: removing whole FFN neurons makes the FFN matrices (2/3 of a layer's weights) "
                      "smaller, which dense CPU kernels turn into time; recovery training restores quality")
            if tight:
                out.append(("prune heads", ("a quality floor under 1 point: only FFN neurons are removed, the larger "
                                           "and more forgiving part of each layer")))
            else:
                params["heads"] = 0.25
                reason += ("; a quarter of the attention heads go too (smaller Q/K/V/output matrices and less "
                           "attention work; the folder still exports to ONNX for the INT8 step)")
            steps.append(PlannedStep("prune", params, reason))
        elif cfg.goal == "latency":
            out.append(("prune structured",
                        "no training budget: structured pruning without recovery training loses too much quality"))
        else:
            out.append(("prune structured",
                        "memory goal: vocabulary pruning and low-bit weights save more bytes per quality point"))
    out.append(("prune unstructured",
                "unstructured sparsity saves storage only when stored sparse, and no CPU time with dense kernels"))

    # 3. memory: the embeddings are the largest single matrix of a small encoder.
    if cfg.goal == "memory":
        if cfg.has_calibration_data:
            steps.append(PlannedStep("vocab", {},
                                     "memory goal: keep only the tokens that in-domain text uses; the embedding matrix "
                                     "is a large share of a small encoder's bytes"))
            if trains and cfg.labels == "yes":  # the seeds' INT4 rule
                steps.append(PlannedStep("qat", {"bits": 4, "group_size": 128, "qat_steps": 300},
                                         "memory goal, a training budget and labels: INT4 by quantization-aware "
                                         "fine-tuning (the seeds' rule: QAT when there is a budget and labels), which "
                                         "learns weights that survive 4-bit rounding, then stores int4 in groups"))
                out.append(("gptq", "a training budget and labels: INT4 is QAT (GPTQ is for no budget or no labels)"))
            else:
                why = "no training budget" if not trains else "no labels (--labels no)"
                steps.append(PlannedStep("gptq", {"bits": 4, "group_size": 128, "embeddings": "int8"},
                                         f"memory goal with calibration data and {why}: INT4 by GPTQ (the seeds' "
                                         "rule), 4-bit linear weights (error-compensated rounding) and 8-bit "
                                         "embeddings cut bytes several-fold with little quality loss "
                                         "(docs/results/compress-from-code.md)"))
        else:
            out.append(("vocab", "no in-domain text to learn which tokens are used"))
            out.append(("gptq", "no calibration data: GPTQ needs activations from in-domain text"))
            steps.append(PlannedStep("quantize", {"method": "rtn", "bits": 8, "embeddings": "int8"},
                                     "memory goal without calibration data: round-to-nearest 8-bit weights and "
                                     "embeddings need no data and store 4x fewer bytes"))
    else:
        out.append(("vocab",
                    "latency goal: a smaller vocabulary saves bytes but no time (an embedding lookup is cheap)"))
        out.append(("gptq", "latency goal: 4-bit weight-only GPTQ saves bytes but CPU kernels dequantise, so no time"))

    # 4. one quantization step at most: a quantized model is never quantized again.
    memory_quant = next((s for s in steps if s.lever in QUANT_LEVERS), None)
    if cfg.goal == "latency" or kind == "gpu-sparse":
        if memory_quant is not None:
            what = "GPTQ" if memory_quant.lever == "gptq" else "round-to-nearest"
            out.append(("quantize dynamic-int8", (
                f"the {memory_quant.lever} step already quantizes the linear layers ({what} "
                f"{memory_quant.params.get('bits')}-bit) and a quantized model is never quantized again: "
                f"{memory_quant.lever} (bytes) and dynamic INT8 (speed) are alternatives, and the memory goal takes "
                f"{memory_quant.lever}")))
        elif trains and tight:
            steps.append(PlannedStep("qat", {"qat_steps": 300},
                                     "a very tight quality floor and a budget: quantization-aware fine-tuning ends in "
                                     "real INT8 weights itself, recovering the fraction of a point that post-training "
                                     "INT8 loses; it takes the place of dynamic INT8 (never both)"))
            out.append(("quantize dynamic-int8",
                        "QAT already quantizes to INT8; a quantized model is never quantized again"))
        else:
            why = ("dynamic INT8 (ONNX Runtime, per-channel weights) of the linear layers needs no data and no "
                   "training; its matrix multiplies run on the CPU's VNNI/AMX int8 dot-product instructions"
                   if kind == "cpu-vnni" else
                   "dynamic INT8 (ONNX Runtime, per-channel weights) of the linear layers needs no data and no "
                   "training, and gives the largest CPU speed-up per quality point; without VNNI the gain is smaller")
            if kind == "gpu-sparse":
                why = ("dynamic INT8 of the (2:4-pruned) linear layers: ONNX Runtime per-channel int8 weights, "
                       "the pruned zeros stay zero; 4x fewer weight bytes and the CPU serving path. It quantizes "
                       "once, after pruning (pruning is not quantization)")
            steps.append(PlannedStep("quantize", {"method": "dynamic-int8", "per_channel": True}, why))
    if not any(s.lever == "qat" for s in steps):
        if memory_quant is not None and trains and tight:
            out.append(("qat",
                        f"the {memory_quant.lever} step already quantizes; QAT would quantize a quantized model"))
        elif trains:
            out.append(("qat", ("PTQ INT8 usually stays within the floor for encoders; QAT only if the measured drop "
                                "is too large")))
        else:
            out.append(("qat", "no training budget: QAT needs training"))
    notes = []
    if any(s.params.get("method") == "2:4" for s in steps):
        here = (hw or detect()).sparse_gpu
        if here is None:
            notes.append("this machine has no CUDA GPU with 2:4 sparse tensor cores: here 2:4 sparsity buys no time "
                         "(dense kernels); the speed-up needs the planned GPU, and the compression report says so")
    return Plan(steps=steps, left_out=out, hardware=kind, hardware_why=kind_why, task=task, notes=notes)


def static_tier(cfg: PlanConfig, spec: Task | None) -> PlannedStep | str:
    """The static tier's distill step when ``cfg`` asks for it (an embedding model, a speed goal of
    :data:`STATIC_SPEEDUP` x or more, a quality floor that its measured share allows, corpus text to learn from), else
    why it is left out ("" when no speed goal was set)."""
    if not cfg.speedup:
        return ""
    if spec is None or spec.distill_kind != "embedding":
        return ("a static model replaces a sentence-embedding model only (embed); this task's model needs its "
                "transformer")
    if cfg.goal != "latency" or cfg.speedup < STATIC_SPEEDUP:
        return (f"the speed goal ({cfg.speedup:g}x) is within what quantization, distillation and pruning give; the "
                f"static tier is for goals of {STATIC_SPEEDUP:g}x and more (far faster, at a larger quality cost: "
                "docs/compress-embed.md)")
    share = STATIC_SHARE[cfg.budget]
    if 1.0 - cfg.max_quality_drop > share:
        how = ("with the fit on corpus pieces" if cfg.budget == "some" else
               "without training (--budget none: no fit; with the fit, a few minutes of training, "
               f"{STATIC_SHARE['some']:.0%}: docs/compress-embed.md)")
        return (f"the speed goal ({cfg.speedup:g}x) needs the static tier, but a static model kept {share:.0%} of "
                f"MiniLM's nDCG@10 on SciFact {how}, below the floor of {1.0 - cfg.max_quality_drop:.0%}: relax "
                f"--max-quality-drop to {1.0 - share + 0.005:.3f}, or serve it as the first stage of the tiered index "
                "(index --first-stage-model), where the full encoder rescores its candidates")
    if not cfg.has_calibration_data:
        return "the static tier takes its vocabulary and fit from in-domain text (--train), and there is none"
    fit = cfg.budget == "some"
    return PlannedStep("distill", {"to": "static", "fit_texts": 20000 if fit else 0, "weighting": "sif"},
                       f"an embedding model with a speed goal of {cfg.speedup:g}x, beyond what quantization, "
                       "distillation and pruning give: a static model (one vector per token of the corpus, a text the "
                       "mean of its tokens' vectors, no transformer) encodes far faster (docs/compress-embed.md); on "
                       "SciFact it kept "
                       f"{share:.0%} of MiniLM's nDCG@10 " + ("with the fit on 20,000 corpus pieces (a few minutes)"
                                                             if fit else "without training (no fit: --budget none)")
                       + f", within the floor of {1.0 - cfg.max_quality_drop:.0%}; re-measured on --dev by the recipe")


# -- backoff ------------------------------------------------------------------------------------

def backoff_variants(recipe: dict[str, Any], max_variants: int = 6) -> Iterator[tuple[str, dict[str, Any]]]:
    """Ever less aggressive versions of ``recipe``, each with what changed.

    Order: (1) halve the structured pruning fractions (twice); (2) keep the embeddings (and, for
    static INT8, the most sensitive layers) in full precision; (3) 8-bit instead of 4-bit GPTQ;
    (4) drop steps, the riskiest lever first (pruning, vocabulary, GPTQ, INT8, distillation).
    Each variant carries all earlier changes.
    """
    cur = copy.deepcopy(recipe)
    n = 0

    def emit(what: str) -> Iterator[tuple[str, dict[str, Any]]]:
        nonlocal n
        n += 1
        yield what, copy.deepcopy(cur)

    for _ in range(2):
        changed = False
        for s in cur["steps"]:
            if s["lever"] == "prune" and s.get("method") == "structured":
                for k in ("heads", "ffn"):
                    if s.get(k):
                        s[k] = round(s[k] / 2, 3)
                        changed = True
        if changed and n < max_variants:
            yield from emit("halved the structured pruning fractions")
    changed = False
    for s in cur["steps"]:
        if s["lever"] in ("quantize", "gptq") and s.get("embeddings", "fp32") != "fp32":
            s["embeddings"] = "fp32"
            changed = True
        if s["lever"] == "quantize" and s.get("method") == "static":
            s["fallback_layers"] = s.get("fallback_layers", 0) + 2
            changed = True
    if changed and n < max_variants:
        yield from emit("kept the embeddings (and the most sensitive layers) in full precision")
    changed = False
    for s in cur["steps"]:
        if s["lever"] in ("gptq", "qat") and s.get("bits", 8) < 8:
            s["bits"] = 8
            changed = True
    if changed and n < max_variants:
        yield from emit("8-bit instead of 4-bit GPTQ/QAT")
    for lever in ("prune", "vocab", "gptq", "qat", "quantize", "distill"):
        while n < max_variants and any(s["lever"] == lever for s in cur["steps"]):
            idx = max(i for i, s in enumerate(cur["steps"]) if s["lever"] == lever)
            del cur["steps"][idx]
            if not cur["steps"]:
                return
            yield from emit(f"dropped the {lever} step")


@dataclass
class Limits:
    """The constraints a delivered folder must meet: dev ``floor`` (absolute quality), and where > 0 ``max_mb`` of
    weights the runtime loads (the row's ``bytes``) and ``max_ms`` per served unit (the row's ``latency_ms``)."""

    floor: float
    max_mb: float = 0.0
    max_ms: float = 0.0

    def misses(self, row: dict[str, Any]) -> list[str]:
        """The constraints ``row`` breaks, each with its figure (empty: every one holds)."""
        out = []
        q = row.get("quality")
        if q is None or q < self.floor:
            out.append(f"--min-quality: quality {q if q is None else round(q, 4)} < floor {self.floor:.4f}")
        if self.max_mb and (row.get("bytes") is None or row["bytes"] / 1e6 > self.max_mb):
            out.append(f"--max-mb: {_mb(row.get('bytes'))} MB > {self.max_mb:g} MB")
        if self.max_ms and (row.get("latency_ms") is None or row["latency_ms"] > self.max_ms):
            out.append(f"--max-ms: {row.get('latency_ms')} ms per {row.get('latency_unit', 'request')} > "
                       f"{self.max_ms:g} ms")
        return out

    def excess(self, row: dict[str, Any]) -> float:
        """How far ``row`` is from meeting every constraint (relative excesses summed; 0 when it meets them)."""
        q = row.get("quality") or 0.0
        out = max(0.0, self.floor - q) / max(self.floor, 1e-9)
        if self.max_mb:
            out += max(0.0, (row.get("bytes") or float("inf")) / 1e6 / self.max_mb - 1.0)
        if self.max_ms:
            out += max(0.0, (row.get("latency_ms") or float("inf")) / self.max_ms - 1.0)
        return out


def _mb(n: Any) -> str:
    return "?" if n is None else f"{n / 1e6:.3f}"


@dataclass
class BackoffResult:
    ok: bool
    recipe: dict[str, Any]
    quality: float | None
    floor: float
    tried: list[dict[str, Any]]
    row: dict[str, Any] | None = None  # the delivered step's measurement (its ``folder``), or the closest one
    missed: list[str] = field(default_factory=list)  # the constraints the closest folder breaks (when not ok)

    def summary(self) -> str:
        lines = [f"{'ok' if t['ok'] else 'not met'}: quality {t['quality']:.4f} ({t['what']})" for t in self.tried]
        if self.ok:
            verdict = f"the recipe holds the floor {self.floor:.4f}"
            if self.row and self.row.get("folder"):
                verdict += (f"; delivered: {self.row['folder']} in --out ({_mb(self.row.get('bytes'))} MB, "
                            f"{self.row.get('latency_ms')} ms per {self.row.get('latency_unit', 'request')})")
        elif self.missed:
            verdict = (f"no plan tried meets every constraint: {'; '.join(self.missed)}; the closest was "
                       f"{(self.row or {}).get('folder', '?')} in --out")
        else:
            verdict = f"no variant tried holds the floor {self.floor:.4f}; compress less or relax max_quality_drop"
        return "\n".join(lines + [verdict])


def search_recipe(recipe: dict[str, Any], evaluate: Callable[[dict[str, Any], str], Any], floor: float,
                  max_backoff: int = 6, limits: Limits | None = None) -> BackoffResult:
    """Try ``recipe`` and then its back-off variants until the final step meets every constraint (``limits``, by
    default the quality ``floor`` alone).

    ``evaluate`` runs a whole recipe and returns the final model's dev quality, or the measured rows of its steps
    (it is a fake in tests, the stack runner for real). When no variant's final step meets every constraint, an
    earlier step of a tried variant that does (the later levers dropped) is delivered; else the result names what
    the closest step missed.
    """
    limits = limits or Limits(floor)
    tried: list[dict[str, Any]] = []
    measured: list[tuple[dict[str, Any], dict[str, Any], int]] = []  # (row, recipe, steps kept)
    candidates = [("as planned", recipe), *backoff_variants(recipe, max_backoff)]
    for i, (what, r) in enumerate(candidates):
        got = evaluate(r, f"try{i}")
        rows = got[1:] if isinstance(got, list) else [{"quality": float(got)}]
        final = rows[-1]
        ok = not limits.misses(final)
        tried.append({"what": what, "quality": final.get("quality"), "ok": ok,
                      "levers": [s["lever"] for s in r["steps"]],
                      **{k: final[k] for k in ("bytes", "latency_ms", "folder") if k in final}})
        measured += [(row, r, k + 1) for k, row in enumerate(rows) if isinstance(got, list)]
        if ok:
            return BackoffResult(True, r, final.get("quality"), limits.floor, tried, final)
    meeting = [(row, r, k) for row, r, k in measured if not limits.misses(row)]
    if meeting:  # the later levers of a tried variant dropped: the most compressed step that meets every constraint
        row, r, k = min(meeting, key=lambda m: (m[0].get("bytes") or 0, m[0].get("latency_ms") or 0))
        kept = {**r, "steps": r["steps"][:k]}
        tried.append({"what": f"dropped the levers after step {k} of a tried plan", "quality": row.get("quality"),
                      "ok": True, "levers": [s["lever"] for s in kept["steps"]], "folder": row.get("folder")})
        return BackoffResult(True, kept, row.get("quality"), limits.floor, tried, row)
    closest = min((row for row, _, _ in measured), key=limits.excess, default=None)
    missed = limits.misses(closest) if closest is not None else []
    return BackoffResult(False, recipe, None, limits.floor, tried, closest, missed)


def plan_limits(cfg: PlanConfig, start_quality: float) -> Limits:
    """The absolute constraints of ``cfg`` against the starting model's dev quality."""
    share = cfg.min_quality or (1.0 - cfg.max_quality_drop)
    return Limits(start_quality * share, cfg.max_mb, cfg.max_ms)


def run_recipe_for_plan(recipe: dict[str, Any], plan_cfg: PlanConfig, measure: Any = None) -> BackoffResult:
    """`encoderkit plan --run`: run ``recipe`` on ``plan_cfg.model``, re-measuring after every lever, and back off
    until every constraint (:func:`plan_limits`) holds. Each try is a complete compress output (``tryN/`` with its
    steps and report); ``plan.json`` records the search and the delivered folder. When no try meets every absolute
    constraint (``--max-mb``, ``--max-ms``, ``--min-quality``), the folder is kept and the error names the constraints
    the closest step breaks."""
    out = Path(plan_cfg.out)
    measured = {"miner": plan_cfg.miner, "candidates": plan_cfg.candidates, "dev_limit": plan_cfg.dev_limit,
                "qa_split": plan_cfg.qa_split, "seq_len": plan_cfg.seq_len}
    measure = measure or StepMeasurer(plan_cfg.dev, model=plan_cfg.model, **measured)
    with output_dir(out, plan_cfg.overwrite) as tmp:
        start = measure(Path(plan_cfg.model))
        limits = plan_limits(plan_cfg, start["quality"])

        def evaluate(r: dict[str, Any], tag: str) -> list[dict[str, Any]]:
            work = tmp / tag
            work.mkdir()
            write_text_atomic(work / "recipe.yaml", yaml.safe_dump(r, sort_keys=False))
            steps = validate_recipe(r, source=f"{tag}/recipe.yaml")
            cfg = CompressConfig(recipe=str(work / "recipe.yaml"), model=plan_cfg.model, dev=plan_cfg.dev,
                                 out=str(out / tag), train=plan_cfg.train, **measured)
            rows = run_steps(steps, cfg, work, out.resolve() / tag,
                             lambda f: start if Path(f) == Path(plan_cfg.model) else measure(f), task=r.get("task"))
            write_report(work, rows, portable({"title": f"plan --run {tag}", "model": plan_cfg.model,
                                               "dev": plan_cfg.dev, "floor": round(limits.floor, 4),
                                               "hardware": describe()}, work))
            # plan.json names the step folders relative to the plan's --out (run_steps: relative to out/tag)
            return [{**row, "folder": os.path.normpath(os.path.join(tag, row["folder"]))} for row in rows]

        result = search_recipe(recipe, evaluate, limits.floor, plan_cfg.max_backoff, limits)
        write_json_atomic(tmp / "plan.json", {
            "start_quality": start["quality"], "start_bytes": start.get("bytes"), "floor": limits.floor,
            "max_mb": limits.max_mb or None, "max_ms": limits.max_ms or None, "ok": result.ok,
            "tried": result.tried, "recipe": result.recipe,
            "delivered" if result.ok else "closest": result.row, "missed": result.missed})
    if result.missed and (plan_cfg.max_mb or plan_cfg.max_ms or plan_cfg.min_quality):
        closest = out / result.row.get("folder", "")
        raise EncoderkitError(f"plan --run: no plan tried meets every constraint. Cannot hold: "
                              f"{'; '.join(result.missed)}. The closest plan found: {closest} "
                              f"(quality {result.row.get('quality')}, {_mb(result.row.get('bytes'))} MB, "
                              f"{result.row.get('latency_ms')} ms per {result.row.get('latency_unit', 'request')}); "
                              f"every try is in {out} (plan.json). Relax that constraint, or give a training budget "
                              "(--train-minutes) for levers that keep more quality")
    return result


@dataclass
class PlanResult:
    plan: Plan
    written: Path | None = None
    backoff: BackoffResult | None = None

    def summary(self) -> str:
        parts = [self.plan.describe()]
        if self.written:
            parts.append(f"recipe written to {self.written}")
        if self.backoff:
            parts.append(self.backoff.summary())
        return "\n".join(parts)


def run(cfg: PlanConfig) -> PlanResult:
    """Plan a compression recipe for a situation; print it with reasons, write it, or run it."""
    plan = make_plan(cfg)
    result = PlanResult(plan)
    if cfg.write:
        text = (f"# planned by `encoderkit plan` for {cfg.result_dict() | {'hardware': plan.hardware}}\n"
                f"# hardware: {plan.hardware_why}\n" + yaml.safe_dump(plan.recipe(), sort_keys=False))
        write_text_atomic(Path(cfg.write), text)
        result.written = Path(cfg.write)
    if cfg.run:
        if not plan.steps:
            raise EncoderkitError("the plan has no steps to run; change the situation (budget, goal, hardware)")
        result.backoff = run_recipe_for_plan(plan.recipe(), cfg)
    return result
