"""No stage changes its config after parsing: configs are read-only, the package's source has no
write to a ``cfg`` (checked on its syntax tree), a finetune + evaluate run leaves its configs as
given, and task code gets one frozen options object per task instead of the stage config."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import random
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "encoderkit"
MUTATING_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault",
                    "add", "discard", "popitem"}


def config_writes(tree: ast.AST, path: str) -> list[str]:
    """Writes to a stage config named ``cfg``: ``cfg.x = ...`` (also ``+=`` and annotated), ``del cfg.x``,
    ``setattr(cfg, ...)`` / ``object.__setattr__(cfg, ...)``, ``cfg.x.append(...)`` and the like on a field,
    and re-binding a function's ``cfg`` parameter (``cfg = dataclasses.replace(cfg, ...)`` hides that the
    settings in use are not the ones given)."""
    out = []

    def is_cfg(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "cfg"

    def field_of_cfg(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and is_cfg(node.value)

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            for sub in ast.walk(t):
                if field_of_cfg(sub) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    out.append(f"{path}:{node.lineno}: writes cfg.{sub.attr}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "setattr" and node.args and is_cfg(node.args[0]):
                out.append(f"{path}:{node.lineno}: setattr(cfg, ...)")
            if isinstance(f, ast.Attribute) and f.attr == "__setattr__" and node.args and is_cfg(node.args[0]):
                out.append(f"{path}:{node.lineno}: __setattr__(cfg, ...)")
            if isinstance(f, ast.Attribute) and f.attr in MUTATING_METHODS and field_of_cfg(f.value):
                out.append(f"{path}:{node.lineno}: cfg.{f.value.attr}.{f.attr}(...) changes a config field in place")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            if "cfg" in params:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Name) and sub.id == "cfg" and isinstance(sub.ctx, ast.Store):
                        out.append(f"{path}:{sub.lineno}: re-binds the parameter cfg in {node.name}()")
    return out


def test_the_package_never_writes_to_a_config():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += config_writes(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "derive the value (a local, the task's options) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "def f(cfg):\n    cfg.lr = 1\n",
    "def f(cfg):\n    cfg.steps += 1\n",
    "def f(cfg):\n    setattr(cfg, 'lr', 1)\n",
    "def f(cfg):\n    object.__setattr__(cfg, 'lr', 1)\n",
    "def f(cfg):\n    cfg.freeze.append('x')\n",
    "def f(cfg):\n    cfg = dataclasses.replace(cfg, lr=1)\n",
    "def f(cfg):\n    del cfg.lr\n",
])
def test_the_source_check_catches_each_kind_of_write(source):
    assert config_writes(ast.parse(source), "x.py")


def test_the_source_check_allows_reading_and_deriving():
    ok = ("def f(cfg):\n    lr = cfg.lr * 2\n    other = dataclasses.replace(cfg, lr=lr)\n    model.config.x = 1\n"
          "    opts = pick(Options, cfg, max_length=cfg.max_length or 128)\n")
    assert config_writes(ast.parse(ok), "x.py") == []


def test_a_parsed_config_is_read_only(tmp_path):
    from encoderkit.train.finetune import FinetuneConfig

    cfg = FinetuneConfig(train="t.tsv", out=str(tmp_path / "out"))
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only once parsed"):
        cfg.max_length = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.lr
    other = dataclasses.replace(cfg, max_length=64)  # a new config is the way to change one
    assert (other.max_length, cfg.max_length) == (64, 0)


def _tsv(path: Path, n: int) -> Path:
    rng = random.Random(0)
    lines = (["sentence\tlabel"]
             + [f"{'good fun' if (y := rng.randint(0, 1)) else 'dull bad'} movie {i}\t{y}" for i in range(n)])
    path.write_text("\n".join(lines) + "\n")
    return path


def test_finetune_and_evaluate_leave_their_configs_as_given(tmp_path, tiny_bert_dir):
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    data = _tsv(tmp_path / "d.tsv", 24)
    cfg = FinetuneConfig(model=str(tiny_bert_dir), train=str(data), dev=str(data), out=str(tmp_path / "m"),
                         max_steps=2, batch_size=8, matryoshka_dims=[8], freeze=[])
    given = json.dumps(cfg.to_dict(), sort_keys=True)
    finetune(cfg)
    assert json.dumps(cfg.to_dict(), sort_keys=True) == given  # nothing written back, lists included
    card = json.loads((tmp_path / "m" / "encoderkit.json").read_text())
    assert card["max_length"] == 128  # the task's default, derived for the run...
    assert card["config"]["max_length"] == 128  # ...and recorded as run, while the config keeps the 0 it was given
    assert cfg.max_length == 0

    ecfg = EvaluateConfig(model=str(tmp_path / "m"), data=str(data), max_length=32)
    given = json.dumps(ecfg.to_dict(), sort_keys=True)
    assert "accuracy" in evaluate(ecfg).metrics
    assert json.dumps(ecfg.to_dict(), sort_keys=True) == given and ecfg.task == ""


@pytest.mark.parametrize("task", ["classify", "ner", "qa", "rerank", "embed"])
def test_each_task_gets_its_own_frozen_options(task, tmp_path, tiny_bert_dir):
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks import get_task
    from encoderkit.tasks.options import TaskDataOptions
    from encoderkit.train.finetune import FinetuneConfig

    task_object = get_task(task)
    assert task_object.name == task and importlib.import_module(f"encoderkit.tasks.{task}").TASK is task_object
    options_cls = task_object.options
    assert options_cls.__module__ == f"encoderkit.tasks.{task}.options"
    assert dataclasses.fields(options_cls) and options_cls.__dataclass_params__.frozen
    # only task settings: every option is a task flag or a stage flag of that task, none of the run's own
    flags = {f.name for f in dataclasses.fields(FinetuneConfig)}
    names = {f.name for f in dataclasses.fields(options_cls)} - {"max_question_length"}
    assert names <= flags
    assert not names & {"train", "dev", "out", "model", "lr", "seed", "batch_size", "task"}
    assert {f.name for f in dataclasses.fields(TaskDataOptions)} - {"task", "seed"} <= flags

    cfg = FinetuneConfig(model=str(tiny_bert_dir), train="t", out=str(tmp_path / "o"), task=task)
    options = options_cls.for_training(cfg, ModelFolder.open(tiny_bert_dir))
    assert options.max_length > 0  # the task default, settled against the model
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_length = 1
    assert cfg.max_length == 0
