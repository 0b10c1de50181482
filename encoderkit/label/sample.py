"""``encoderkit audit sample``: a stratified sample of labelled lines to check by hand.

Strata: label x confidence tercile x suspect flag (when ``audit suspect`` has run). Each stratum
gets its share of ``n`` in proportion to its size (largest remainders), drawn at random, so the
audited accuracy estimates the labeller's accuracy on the whole file. The sheet is then ordered
by suspicion (highest first; else lowest confidence first), so the likely mistakes come first.

A pairs file (``label --task embed``/``rerank``) is sampled the same way over one stratum per query position
within its passage (a passage's first query, second, ...), the sheet in file order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_output_file
from encoderkit.label.pairs import is_pairs_file, read_pairs, sheet_row
from encoderkit.label.records import read_labeled
from encoderkit.label.sheet import write_sheet


@dataclass
class SampleConfig(StageConfig):
    """Draw a stratified review sheet (CSV) with an empty gold column."""

    input: str = arg(help="labeled.jsonl (from `label`, or from `audit suspect` to stratify and order by suspicion), "
                          "or the pairs file of `label --task embed/rerank`.", required=True)
    n: int = arg(200, help="Lines to sample.")
    output: str = arg(help="Sheet to write (CSV).", required=True)
    overwrite: bool = arg(False, help="Replace an existing sheet (and lose its filled gold cells).")
    seed: int = arg(0, help="Seed of the draw.")

    def validate(self) -> None:
        check(self.n >= 1, "n must be at least 1")


@dataclass
class SampleResult:
    output: Path
    rows: int
    strata: int

    def summary(self) -> dict[str, Any]:
        return {"output": str(self.output), "rows": self.rows, "strata": self.strata}


def strata(recs: list[dict[str, Any]]) -> dict[tuple, list[int]]:
    """Labelled line indices grouped by (label, confidence tercile, suspect)."""
    idx = [i for i, r in enumerate(recs) if r.get("label") not in (None, "")]
    conf = [recs[i].get("confidence") for i in idx]
    known = np.asarray([c for c in conf if c is not None], dtype=float)
    cuts = np.quantile(known, [1 / 3, 2 / 3]) if len(known) else np.zeros(2)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, c in zip(idx, conf, strict=True):
        tercile = -1 if c is None else int(np.searchsorted(cuts, c, side="right"))
        groups[(str(recs[i]["label"]), tercile, bool(recs[i].get("suspect", False)))].append(i)
    return dict(sorted(groups.items()))


def allocate(sizes: list[int], n: int) -> list[int]:
    """Proportional allocation of ``n`` over strata of ``sizes`` by largest remainders (never above a size)."""
    total = sum(sizes)
    n = min(n, total)
    exact = [n * s / total for s in sizes]
    take = [int(e) for e in exact]
    for j in sorted(range(len(sizes)), key=lambda j: exact[j] - take[j], reverse=True)[:n - sum(take)]:
        take[j] += 1
    return take


def run(cfg: SampleConfig) -> SampleResult:
    """Write the sheet (see the module docstring)."""
    out = check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input])  # its gold cells may be filled in
    if is_pairs_file(cfg.input):
        return _sample_pairs(cfg, out)
    recs = read_labeled(cfg.input)
    groups = strata(recs)
    if not groups:
        raise EncoderkitError(f"{cfg.input}: no labelled line to sample")
    rng = np.random.default_rng(cfg.seed)
    chosen: list[int] = []
    for members, k in zip(groups.values(), allocate([len(m) for m in groups.values()], cfg.n), strict=True):
        chosen += [members[j] for j in rng.choice(len(members), size=k, replace=False)]

    def order(i: int) -> tuple:
        r = recs[i]
        if r.get("suspicion") is not None:
            return (-float(r["suspicion"]), i)
        return (float(r["confidence"]) if r.get("confidence") is not None else 1.0, i)

    rows = [{**recs[i], "row": i, "gold": ""} for i in sorted(chosen, key=order)]
    write_sheet(out, rows)
    return SampleResult(out, len(rows), len(groups))


def _sample_pairs(cfg: SampleConfig, out: Path) -> SampleResult:
    """A pairs file's sheet (see the module docstring): ``query``, its passage, ``label`` yes, ``gold`` empty."""
    recs = read_pairs(cfg.input)
    groups: dict[int, list[int]] = defaultdict(list)
    position = 0
    for i, r in enumerate(recs):  # position of the query within its passage's run of lines
        same = i and recs[i - 1].get("passage_id", recs[i - 1]["positive"]) == r.get("passage_id", r["positive"])
        position = position + 1 if same else 0
        groups[position].append(i)
    rng = np.random.default_rng(cfg.seed)
    chosen: list[int] = []
    members = [groups[k] for k in sorted(groups)]
    for m, k in zip(members, allocate([len(m) for m in members], cfg.n), strict=True):
        chosen += [m[j] for j in rng.choice(len(m), size=k, replace=False)]
    write_sheet(out, [sheet_row(i, recs[i]) for i in sorted(chosen)])
    return SampleResult(out, len(chosen), len(groups))
