"""The `encoderkit` command: one subcommand per stage, each a thin shell over ``run(cfg)``.

Flags are generated from the stage's config dataclass (see :mod:`encoderkit.config`), so
``--help`` shows every field's documentation, and ``--config FILE`` (YAML/TOML) takes the same
keys. Flags given on the command line win over the file. Errors meant for the user
(:class:`EncoderkitError`) print one clear message and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
import signal
import sys
import threading
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from encoderkit.config import StageConfig, check_spellings, coerce, load_mapping
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_writable, input_problem, refuse_input_as_output
from encoderkit.seeding import seed_everything

# command words -> ("module:ConfigClass:run_function", one-line summary). Add one entry per stage.
# Only the chosen stage's module is imported, so the CLI starts fast and one broken stage
# cannot take the others down.
STAGES: dict[tuple[str, ...], str | tuple[str, str]] = {
    ("quickstart",): ("encoderkit.quickstart:QuickstartConfig:run",
                      "the whole pipeline on the stdlib's docstrings (no downloads)"),
    ("doctor",): ("encoderkit.doctor:DoctorConfig:run",
                  "this machine's hardware, measured matmul peaks, and the backend each stage picks"),
    ("tokenizer", "train"): ("encoderkit.train.tokenizer:TokenizerConfig:run",
                             "train a WordPiece or byte-level BPE tokenizer"),
    ("data", "prepare"): ("encoderkit.data.prepare:PrepareConfig:run",
                          "tokenize a corpus into a packed, memory-mapped token store"),
    ("data", "inspect"): ("encoderkit.data.prepare:InspectConfig:inspect",
                          "counts and a decoded sample of a token store"),
    ("pretrain",): ("encoderkit.train.pretrain:PretrainConfig:run", "MLM pretraining, from scratch or continued"),
    ("quantize",): ("encoderkit.compress.levers:QuantizeConfig:run_quantize",
                    "INT8/INT4 quantization: PTQ dynamic/static, QAT, GPTQ, RTN"),
    ("prune",): ("encoderkit.compress.levers:PruneConfig:run_prune",
                 "unstructured, 2:4 or structured (heads/FFN) pruning"),
    ("distill",): ("encoderkit.compress.levers:DistillConfig:run_distill",
                   "distil a teacher into a smaller student (task or DistilBERT-style)"),
    ("compress",): ("encoderkit.compress.stack:CompressConfig:run",
                    "run a compression recipe, re-measuring quality/size/speed per step"),
    ("plan",): ("encoderkit.compress.plan:PlanConfig:run",
                "plan a compression recipe for a situation, with reasons; --run backs off"),
    ("finetune",): ("encoderkit.train.finetune:FinetuneConfig:run",
                    "train a task head: classify, ner, qa, rerank, embed"),
    ("evaluate",): ("encoderkit.evaluate.run:EvaluateConfig:run",
                    "task metrics of a model folder on labelled data (JSON)"),
    ("export",): ("encoderkit.inference.export:ExportConfig:run",
                  "export a task model to ONNX (fused, optional INT8), parity-checked"),
    ("predict",): ("encoderkit.inference.predictor:PredictConfig:run",
                   "run a task model over a .txt/.jsonl file into JSONL results"),
    ("serve",): ("encoderkit.deploy.serve:ServeConfig:run",
                 "HTTP service with micro-batching: classify/extract/answer/rerank/embed"),
    ("label",): ("encoderkit.label.run:LabelConfig:run",
                 "label texts with an OpenAI-compatible endpoint, an embedding model or an MLM"),
    ("audit", "suspect"): ("encoderkit.label.suspicion:SuspectConfig:run",
                           "score likely label errors (out-of-fold probabilities + cleanlab)"),
    ("audit", "sample"): ("encoderkit.label.sample:SampleConfig:run",
                          "a stratified review sheet (CSV) with an empty gold column"),
    ("audit", "review"): ("encoderkit.label.review:ReviewConfig:run",
                          "fill a sheet's gold column in the terminal (resumable)"),
    ("audit", "report"): ("encoderkit.label.report:ReportConfig:run",
                          "accuracy with Wilson intervals, confusion, cost per 1M requests"),
    ("decide",): ("encoderkit.label.decide:DecideConfig:run",
                  "an encoder or the LLM: break-even volume, cost and latency, a recommendation with reasons"),
    ("index",): ("encoderkit.retrieval.index:IndexConfig:run",
                 "build or update a local semantic-search index (binary/int8/float16)"),
    ("search",): ("encoderkit.retrieval.search:SearchConfig:run",
                  "tiered search: binary -> int8/float rescoring -> BM25 fusion -> rerank"),
    ("adapt",): ("encoderkit.adapt.run:AdaptConfig:run",
                 "adapt an embedding model to a corpus without labels: generated queries, mined negatives"),
}


def _load(spec: str) -> tuple[type[StageConfig], Any]:
    mod, cls, fn = spec.split(":")
    m = importlib.import_module(mod)
    return getattr(m, cls), getattr(m, fn)


def _doc(obj: Any) -> str:
    return (obj.__doc__ or "").strip()


def add_config_flags(parser: argparse.ArgumentParser, cfg_cls: type[StageConfig],
                     only: tuple[str, ...] | None = None) -> None:
    """One flag per dataclass field (``only``: those fields); defaults are None so that only flags given override a
    file."""
    hints = typing.get_type_hints(cfg_cls)
    main = parser.add_argument_group("settings")
    speed = parser.add_argument_group("speed settings (never change results beyond float tolerance)")
    for f in fields(cfg_cls):
        if only is not None and f.name not in only:
            continue
        hint = hints[f.name]
        meta = f.metadata
        factory = f.default_factory
        default = f.default if f.default is not MISSING else (factory() if factory is not MISSING else None)
        help_text = meta.get("help", "")
        if meta.get("required"):
            help_text += " (required)"
        elif default not in (None, "", []):
            help_text += f" (default: {default})"
        group = speed if meta.get("speed") else main
        flag = "--" + f.name.replace("_", "-")
        help_text = re.sub(r"(?<!%)%(?![%(])", "%%", help_text)  # argparse %-formats help: a bare % ("97%") is literal
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        base = _base_type(hint)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is list:
            kwargs["nargs"] = "+"
            kwargs["action"] = "extend"  # --model a --model b == --model a b
            kwargs["metavar"] = f.name.upper()
        elif meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
            if base in (int, float):  # argparse compares choices after type conversion
                kwargs["type"] = base
        else:
            kwargs["metavar"] = f.name.upper()
        group.add_argument(flag, **kwargs)


def _base_type(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner[0]
    return hint


def config_from_args(cfg_cls: type[StageConfig], ns: argparse.Namespace, seed: int | None = None) -> StageConfig:
    """The stage config from its flags over its ``--config`` file; a global ``seed`` fills the
    stage's own ``seed`` when neither gives one."""
    data: dict[str, Any] = load_mapping(ns.config) if getattr(ns, "config", None) else {}
    check_spellings(data, ns.config)
    data = {key.replace("-", "_"): value for key, value in data.items()}  # so that a flag given replaces its key
    hints = typing.get_type_hints(cfg_cls)
    for f in fields(cfg_cls):
        value = getattr(ns, f.name, None)
        if value is not None:
            data[f.name] = coerce(value, hints[f.name], "--" + f.name.replace("_", "-"))
    if seed is not None and "seed" in hints and "seed" not in data:
        data["seed"] = seed
    return cfg_cls.from_dict(data, source=ns.config or "command line")


def _spec(value: str | tuple[str, str]) -> tuple[str, str]:
    return (value, "") if isinstance(value, str) else value


def _find_stage(argv: list[str]) -> tuple[tuple[str, ...] | None, int]:
    """The stage named by the first words of ``argv`` (after global flags), and where they end."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("--threads", "--seed") else 1
    for n in (2, 1):
        words = tuple(argv[i:i + n])
        if len(words) == n and words in STAGES:
            return words, i + n
    return None, i


def _top_help() -> str:
    lines = ["usage: encoderkit [--threads N] [--seed N] COMMAND [SUBCOMMAND] [--help] [flags]", "",
             "Pretrain, fine-tune, compress and deploy encoder language models on your own hardware.", "",
             "commands:"]
    for words, value in STAGES.items():
        lines.append(f"  {' '.join(words):<20} {_spec(value)[1]}")
    lines += ["", "global flags:", "  --threads N          CPU threads for torch (default: torch's choice)",
              "  --seed N             global seed for Python, NumPy and torch, and the stage's --seed unless given", "",
              "`encoderkit COMMAND --help` explains every flag of a command."]
    return "\n".join(lines)


def _group_help(group: str) -> str:
    """The sub-commands of a command word such as ``tokenizer`` or ``data``."""
    lines = [f"usage: encoderkit {group} SUBCOMMAND [--help] [flags]", "", "subcommands:"]
    for words, value in STAGES.items():
        if len(words) > 1 and words[0] == group:
            lines.append(f"  {' '.join(words):<20} {_spec(value)[1]}")
    lines += ["", f"`encoderkit {group} SUBCOMMAND --help` explains every flag of a subcommand."]
    return "\n".join(lines)


def build_parser(words: tuple[str, ...], argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of one stage: its flags come from its config dataclass (imported only now). For ``--help`` with a
    setting that narrows the flags (``distill --to static --help``: the config's ``FLAG_VIEWS``), only the flags that
    apply are listed."""
    spec, summary = _spec(STAGES[words])
    cfg_cls, fn = _load(spec)
    description = _doc(fn) or summary
    only = _flag_view(cfg_cls, argv or [])
    if only is not None:
        setting, value, only = only
        description += (f"\n\nThe flags that apply with {setting} {value} (every flag: "
                        f"`encoderkit {' '.join(words)} --help`).")
    p = argparse.ArgumentParser(prog="encoderkit " + " ".join(words), description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or TOML file whose keys mirror these flags; flags given here win")
    add_config_flags(p, cfg_cls, only)
    return p


def _flag_view(cfg_cls: type[StageConfig], argv: list[str]) -> tuple[str, str, tuple[str, ...]] | None:
    """(flag, value, fields) when ``argv`` asks for help and names a value in ``cfg_cls.FLAG_VIEWS``, else None."""
    if not any(a in ("-h", "--help") for a in argv):
        return None
    for name, views in cfg_cls.FLAG_VIEWS.items():
        flag = "--" + name.replace("_", "-")
        given = [a.partition("=")[2] for a in argv if a.startswith(flag + "=")]
        given += [b for a, b in itertools.pairwise(argv) if a == flag]
        if given and given[-1] in views:  # the last one given wins, as argparse reads it
            return flag, given[-1], views[given[-1]]
    return None


def _named_paths(cfg: Any, output: str) -> list[str]:
    """The strings of ``cfg``'s fields other than ``output`` (and its sibling output fields): the paths a run may
    read; :func:`~encoderkit.io.refuse_input_as_output` looks only at those that exist."""
    out: list[str] = []
    for f in fields(cfg):
        if f.name in ("out", "output"):
            continue
        v = getattr(cfg, f.name)
        out += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    return out


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that output folders being written are cleaned up."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run one stage; SIGTERM (e.g. a scheduler's kill) unwinds like Ctrl-C, so nothing is left half-written."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words, end = _find_stage(argv)
    groups = {w[0] for w in STAGES if len(w) > 1}
    if words is None and end < len(argv) and argv[end] in groups:
        print(_group_help(argv[end]))
        if any(a in ("-h", "--help") for a in argv[end + 1:]):
            return 0
        print(f"\nerror: {argv[end]!r} needs a subcommand", file=sys.stderr)
        return 2
    if words is None:
        print(_top_help())
        unknown = [a for a in argv[end:] if not a.startswith("-")]
        if unknown:
            print(f"\nerror: unknown command {' '.join(unknown)!r}", file=sys.stderr)
            return 2
        return 0
    glob = argparse.ArgumentParser(add_help=False)
    glob.add_argument("--threads", type=int, default=None)
    glob.add_argument("--seed", type=int, default=None)
    g = glob.parse_args(argv[:end - len(words)])
    parser = build_parser(words, argv[end:])
    ns = parser.parse_args(argv[end:])
    try:
        if g.threads:
            import torch  # noqa: PLC0415 - light path: `encoderkit --help` must not import torch

            torch.set_num_threads(g.threads)
        if g.seed is not None:
            seed_everything(g.seed)
        cfg_cls, fn = _load(_spec(STAGES[words])[0])
        cfg = config_from_args(cfg_cls, ns, g.seed)
        if isinstance(getattr(cfg, "out", None), str) and cfg.out:
            check_writable(cfg.out)  # every stage: an unwritable --out is refused before the work, not after
        for name in ("out", "output"):  # every stage: an output is never one of the run's inputs (nor holds one)
            if isinstance(getattr(cfg, name, None), str) and getattr(cfg, name):
                inputs = [*_named_paths(cfg, name), ns.config]  # the --config file is read too
                refuse_input_as_output(getattr(cfg, name), inputs, "--" + name, name == "out")
        result = fn(cfg)
    except EncoderkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the run could not open that no stage's own check caught: said, not a traceback
        if e.filename is None:
            raise
        print(f"error: {e.filename}: {input_problem(e.filename, e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{'terminated' if isinstance(e, Terminated) else 'interrupted'}; nothing half-written was left "
              "under the output name", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    if result is not None:
        summary = result.summary() if hasattr(result, "summary") else result
        if isinstance(summary, str):
            print(summary)
        else:
            print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
