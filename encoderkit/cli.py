"""The `encoderkit` command: one subcommand per stage, each a thin shell over ``run(cfg)``.

Flags are generated from the stage's config dataclass (see :mod:`encoderkit.config`), so
``--help`` shows every field's documentation, and ``--config FILE`` (YAML/TOML) takes the same
keys. Flags given on the command line win over the file. Errors meant for the user
(:class:`EncoderkitError`) print one clear message and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import typing
from dataclasses import MISSING, fields
from typing import Any

from encoderkit.config import StageConfig, coerce, load_mapping
from encoderkit.errors import EncoderkitError

# command words -> "module:ConfigClass:run_function". Add one line per stage.
STAGES: dict[tuple[str, ...], str] = {
    ("tokenizer", "train"): "encoderkit.tokenizer:TokenizerConfig:run",
    ("data", "prepare"): "encoderkit.data.prepare:PrepareConfig:run",
    ("data", "inspect"): "encoderkit.data.prepare:InspectConfig:inspect",
    ("pretrain",): "encoderkit.train.pretrain:PretrainConfig:run",
    ("quantize",): "encoderkit.compress.quantize:QuantizeConfig:run",
    ("prune",): "encoderkit.compress.prune:PruneConfig:run",
    ("finetune",): "encoderkit.train.finetune:FinetuneConfig:run",
}


def _load(spec: str) -> tuple[type[StageConfig], Any]:
    mod, cls, fn = spec.split(":")
    m = importlib.import_module(mod)
    return getattr(m, cls), getattr(m, fn)


def _doc(obj: Any) -> str:
    return (obj.__doc__ or "").strip()


def add_config_flags(parser: argparse.ArgumentParser, cfg_cls: type[StageConfig]) -> None:
    """One flag per dataclass field; defaults are None so that only flags given override a file."""
    hints = typing.get_type_hints(cfg_cls)
    main = parser.add_argument_group("settings")
    speed = parser.add_argument_group("speed settings (never change results beyond float tolerance)")
    for f in fields(cfg_cls):
        hint = hints[f.name]
        meta = f.metadata
        default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING else None)  # type: ignore[misc]
        help_text = meta.get("help", "")
        if meta.get("required"):
            help_text += " (required)"
        elif default not in (None, "", []):
            help_text += f" (default: {default})"
        group = speed if meta.get("speed") else main
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        base = _base_type(hint)
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if typing.get_origin(base) is list:
            kwargs["nargs"] = "+"
            kwargs["metavar"] = f.name.upper()
        elif meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        else:
            kwargs["metavar"] = f.name.upper()
        group.add_argument(flag, **kwargs)


def _base_type(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner[0]
    return hint


def config_from_args(cfg_cls: type[StageConfig], ns: argparse.Namespace) -> StageConfig:
    data: dict[str, Any] = load_mapping(ns.config) if getattr(ns, "config", None) else {}
    hints = typing.get_type_hints(cfg_cls)
    for f in fields(cfg_cls):
        value = getattr(ns, f.name, None)
        if value is not None:
            data[f.name] = coerce(value, hints[f.name], "--" + f.name.replace("_", "-"))
    return cfg_cls.from_dict(data, source=ns.config or "command line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="encoderkit",
        description="Pretrain, fine-tune, compress and deploy encoder language models on your own hardware.",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=None, help="global seed for Python, NumPy and torch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, spec in STAGES.items():
        mod, cls_name, fn_name = spec.split(":")
        try:
            cfg_cls, fn = _load(spec)
        except ImportError as e:  # a stage whose optional dependency is missing still lists the rest
            print(f"warning: stage {' '.join(words)} unavailable: {e}", file=sys.stderr)
            continue
        if len(words) == 1:
            p = sub.add_parser(words[0], help=_doc(fn).split("\n")[0], description=_doc(fn),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        else:
            if words[0] not in groups:
                gp = sub.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            p = groups[words[0]].add_parser(words[1], help=_doc(fn).split("\n")[0], description=_doc(fn),
                                            formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", default=None, metavar="FILE",
                       help="YAML or TOML file whose keys mirror these flags; flags given here win")
        add_config_flags(p, cfg_cls)
        p.set_defaults(_stage=spec)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "_stage", None):
        parser.print_help()
        return 0 if ns.command is None else 2
    try:
        if ns.threads:
            import torch

            torch.set_num_threads(ns.threads)
        if ns.seed is not None:
            from encoderkit.seeding import seed_everything

            seed_everything(ns.seed)
        cfg_cls, fn = _load(ns._stage)
        cfg = config_from_args(cfg_cls, ns)
        result = fn(cfg)
    except EncoderkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing half-written was left under the output name", file=sys.stderr)
        return 130
    if result is not None:
        summary = result.summary() if hasattr(result, "summary") else result
        if isinstance(summary, str):
            print(summary)
        else:
            print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
