"""Every compression lever in one shape: model folder + its config + the data it declares -> folder + report.

A :class:`Lever` turns a recipe step's settings into calls (:meth:`Lever.calls`), names the data they need
(:meth:`Lever.needs`), builds each call's config and runs it. The recipe runner (:mod:`encoderkit.compress.stack`)
and the CLI stages (:func:`run_distill`, :func:`run_prune`, :func:`run_quantize`) call the same objects, so a
lever works, or refuses naming the task, the same way in both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from encoderkit.compress import distill as distill_mod
from encoderkit.compress import prune as prune_mod
from encoderkit.compress import quantize as quantize_mod
from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.measure import LeverReport
from encoderkit.compress.prune import PruneConfig
from encoderkit.compress.quantize import QuantizeConfig
from encoderkit.compress.task_data import LeverData
from encoderkit.config import StageConfig, check
from encoderkit.errors import EncoderkitError
from encoderkit.models.heads import PRETRAINED
from encoderkit.tasks import TASKS

WEIGHT_TASKS = (*TASKS, PRETRAINED)  # pruning and quantization also take a pretrained MLM model
ALIASES = {"recover_steps": "recovery_steps"}


class Lever(Protocol):
    """What every lever offers the recipe runner and its CLI stage."""

    name: str
    config_class: type[StageConfig]
    tasks: tuple[str, ...]
    runner_fields: tuple[str, ...]  # config fields the runner fills (model and output folders); never in a recipe

    def calls(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """A recipe step's settings -> the settings of each lever call (shorthands resolved)."""

    def recipe_keys(self) -> set[str]:
        """The keys a recipe step may give."""

    def needs(self, settings: dict[str, Any]) -> tuple[str, ...]:
        """The data fields (:data:`encoderkit.compress.task_data.FIELDS`) a call needs from the runner."""

    def config(self, settings: dict[str, Any], model: Path, out: Path, data: LeverData) -> StageConfig:
        """The call's config with the model, the output folder and the declared data filled in."""

    def run(self, model: Path, config: Any, data: LeverData, out: Path) -> LeverReport:
        """Compress ``model`` into the new folder ``out``."""


@dataclass(frozen=True)
class _Base:
    name: str
    fixed: dict[str, Any] = field(default_factory=dict)
    tasks: tuple[str, ...] = TASKS

    def recipe_keys(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self.config_class)} - set(self.runner_fields) | set(ALIASES)

    def calls(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**self.fixed, **{ALIASES.get(k, k): v for k, v in params.items()}}]


@dataclass(frozen=True)
class DistillLever(_Base):
    """Task distillation. The recipe key ``teacher`` says who teaches: ``previous`` (default), the previous step's
    model, into a student cut from it; ``start``, the recipe's starting model, into the previous step's model as it
    is (e.g. a structured-pruned one)."""

    config_class: type[StageConfig] = DistillConfig
    runner_fields: tuple[str, ...] = ("teacher", "out", "overwrite")
    teachers: tuple[str, ...] = ("previous", "start")

    def recipe_keys(self) -> set[str]:
        return super().recipe_keys() | {"teacher"}

    def needs(self, settings: dict[str, Any]) -> tuple[str, ...]:
        if settings.get("mode", "task") == "agnostic":  # prepared MLM blocks ('data'), no task data
            return ()
        return () if settings.get("train") else ("train",)

    def config(self, settings: dict[str, Any], model: Path, out: Path, data: LeverData) -> StageConfig:
        settings = dict(settings)
        who = settings.pop("teacher", "previous")
        check(who in self.teachers, f"distill 'teacher' is 'previous' (the previous step's model) or 'start' (the "
                                    f"recipe's starting model, teaching the previous step's model), got {who!r}")
        teacher = str(model)
        if who == "start":
            check(not ({"layers", "hidden_size", "student"} & set(settings)),
                  "distill with teacher 'start' trains the previous step's model as it is; 'layers', 'hidden_size' and "
                  "'student' choose a new student: drop them, or use teacher 'previous'")
            teacher, settings["student"] = str(data.folder or "<the starting model>"), str(model)
        train = settings.get("train") or data.source("train")
        # compress --miner, unless the step names its own
        if data.uses_miner and not settings.get("miner") and data.source("miner"):
            settings = {**settings, "miner": data.source("miner")}
        return DistillConfig.from_dict({**settings, "teacher": teacher, "out": str(out), "train": train})

    def run(self, model: Path, config: Any, data: LeverData, out: Path) -> LeverReport:
        res = distill_mod.run(dataclasses.replace(config, out=str(out)))
        return LeverReport("distill", config.mode, str(model), str(out), details=res.summary())


@dataclass(frozen=True)
class _WeightLever(_Base):
    """A lever that rewrites a model's weights (prune, quantize): any task's folder or an MLM model."""

    runner_fields: tuple[str, ...] = ("model", "out", "overwrite")
    tasks: tuple[str, ...] = WEIGHT_TASKS

    def config(self, settings: dict[str, Any], model: Path, out: Path, data: LeverData) -> StageConfig:
        # the runner measures every step itself; the lever's own before/after timing would double the time
        return self.config_class.from_dict({"measure": False, **settings, "model": str(model), "out": str(out)})


@dataclass(frozen=True)
class PruneLever(_WeightLever):
    """Unstructured, 2:4, heads, FFN neurons or vocabulary (method ``vocab``). The recipe shorthand
    ``method: structured`` with ``heads`` / ``ffn`` fractions is two calls (recovery after the last)."""

    config_class: type[StageConfig] = PruneConfig

    def recipe_keys(self) -> set[str]:
        return super().recipe_keys() | ({"heads", "ffn"} if "method" not in self.fixed else set())

    def calls(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        (p,) = super().calls(params)
        if p.get("method") != "structured":
            return [p]
        heads, ffn = p.pop("heads", 0.0), p.pop("ffn", 0.0)
        rest = {k: v for k, v in p.items() if k != "method"}
        recovery = {k: rest.pop(k) for k in ("recovery_steps", "recovery_data") if k in rest}
        calls = [{**rest, "method": m, "amount": a} for m, a in (("heads", heads), ("ffn", ffn)) if a]
        if not calls:
            raise EncoderkitError("prune method 'structured' needs 'heads' and/or 'ffn' fractions above 0")
        calls[-1].update(recovery)
        return calls

    def needs(self, settings: dict[str, Any]) -> tuple[str, ...]:
        return prune_mod.data_needs(PruneConfig.from_dict(settings))

    def run(self, model: Path, config: Any, data: LeverData, out: Path) -> LeverReport:
        return prune_mod.prune(model, config, out, data=data)


@dataclass(frozen=True)
class QuantizeLever(_WeightLever):
    """Dynamic / static INT8 (ONNX Runtime or torch), QAT, GPTQ and RTN. The recipe shorthand
    ``method: dynamic-int8`` is dynamic INT8 through ONNX Runtime (per task, the task's ONNX outputs)."""

    config_class: type[StageConfig] = QuantizeConfig

    def calls(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        (p,) = super().calls(params)
        if p.get("method") == "dynamic-int8":
            p["method"] = "dynamic"
            p.setdefault("format", "onnx")
        return [p]

    def needs(self, settings: dict[str, Any]) -> tuple[str, ...]:
        return quantize_mod.data_needs(QuantizeConfig.from_dict(settings))

    def run(self, model: Path, config: Any, data: LeverData, out: Path) -> LeverReport:
        return quantize_mod.quantize(model, config, out, data=data)


LEVERS: dict[str, Lever] = {
    "distill": DistillLever("distill", {"mode": "task"}),
    "prune": PruneLever("prune"),
    "vocab": PruneLever("vocab", {"method": "vocab"}),
    "quantize": QuantizeLever("quantize"),
    "gptq": QuantizeLever("gptq", {"method": "gptq"}),
    "qat": QuantizeLever("qat", {"method": "qat"}),
}
# levers that quantize the model; a quantized model is never quantized again (the lever refuses it)
QUANT_LEVERS = tuple(name for name, lever in LEVERS.items() if lever.config_class is QuantizeConfig)


def check_task(lever: Lever, task: str | None, where: str) -> None:
    """Refuse, naming the task and the lever, a model whose task the lever does not handle."""
    check(task in lever.tasks, f"{where}: lever '{lever.name}' compresses {', '.join(lever.tasks)} models; "
                               f"this model's task is {task!r}")


# -- the CLI stages: the same lever objects on one model -------------------------------------------------

def _stage(name: str, cfg: Any, model: str, out: str) -> Any:
    check(bool(model) and bool(out), f"{name}: --model and --out are required")
    data = LeverData.for_model(model)
    check_task(LEVERS[name], data.task, name)
    return LEVERS[name].run(Path(model), cfg, data, Path(out))


def run_prune(cfg: PruneConfig) -> LeverReport:
    """Prune a model folder of any task (unstructured, 2:4, attention heads, FFN neurons or vocabulary)."""
    return _stage("prune", cfg, cfg.model, cfg.out)


def run_quantize(cfg: QuantizeConfig) -> LeverReport:
    """Quantize a model folder of any task (PTQ dynamic/static INT8, QAT, GPTQ or RTN at 8/4 bits)."""
    return _stage("quantize", cfg, cfg.model, cfg.out)


def run_distill(cfg: DistillConfig) -> Any:
    """Distil a teacher into a smaller student (task-specific for every task, or task-agnostic, DistilBERT-style)."""
    if cfg.mode == "agnostic" or cfg.to:  # an MLM teacher on prepared blocks, or a static model: not a lever
        return distill_mod.run(cfg)
    return _stage("distill", cfg, cfg.teacher, cfg.out)
