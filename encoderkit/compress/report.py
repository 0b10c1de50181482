"""Tables and plots for compression recipes: one row per step, each measured on that step's model.

A row is a plain dict (what ``report.json`` stores: ``step``, ``lever``, ``quality``, ``metric``, ``params``,
``bytes``, ``latency_ms`` per ``latency_unit``, ``batch_ms`` per ``batch_unit``, ``throughput``...; a sparse step's
``bytes_per_nonzero`` of its packed matrices), latency in the unit the task is served in. Ratios against the first
row (the starting model) are derived here, so the table and the plot always agree with the stored numbers.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from encoderkit.io import write_bytes_atomic, write_json_atomic, write_text_atomic


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``rows`` with ratios against row 0: ``quality_kept`` (fraction of the starting
    quality), ``bytes_saved`` (fraction of bytes removed) and ``speedup_b32`` (throughput ratio). Rows with only the
    older ``latency_b1_ms`` / ``latency_b32_ms`` / ``throughput_b32`` keys read as one request / 32 requests."""
    if not rows:
        return []
    base = rows[0]
    out = []
    for r in rows:
        r = dict(r)
        r["quality_kept"] = _ratio(r.get("quality"), base.get("quality"))
        kept_bytes = _ratio(r.get("bytes"), base.get("bytes"))
        r["bytes_saved"] = None if kept_bytes is None else 1.0 - kept_bytes
        r["speedup_b32"] = _ratio(r.get("throughput_b32"), base.get("throughput_b32"))
        r["speedup_b1"] = _ratio(base.get("latency_b1_ms"), r.get("latency_b1_ms"))
        for key, old in (("latency_ms", "latency_b1_ms"), ("batch_ms", "latency_b32_ms"),
                         ("throughput", "throughput_b32")):
            if r.get(key) is None and r.get(old) is not None:
                r[key] = r[old]
        # a reranker's order fused with its first stage's
        fused = (r.get("metrics") or {}).get(f"fused_{r.get('metric')}")
        if r.get("fused") is None and fused is not None:
            r["fused"] = fused
        out.append(r)
    for r in out:
        r["speedup"] = _ratio(out[0].get("latency_ms"), r.get("latency_ms"))
        r["speedup_throughput"] = _ratio(r.get("throughput"), out[0].get("throughput"))
    return out


def units(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """The latency unit and the batch unit of ``rows`` (one task per report)."""
    first = rows[0] if rows else {}
    return first.get("latency_unit", "request"), first.get("batch_unit", "32 requests")


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return None
    return float(a) / float(b)


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "mb":
        return f"{value / 1e6:.2f}"
    if kind == "m":
        return f"{value / 1e6:.2f}M"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "q":
        return f"{value:.4f}"
    if kind == "f2":
        return f"{value:.2f}"
    if kind == "int":  # a count per second: whole numbers, or 3 significant digits under 100 (a slow reranker)
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


COLUMNS: list[tuple[str, str, str]] = [
    ("step", "step", "str"),
    ("lever", "lever", "str"),
    ("quality", "quality", "q"),
    ("quality_kept", "kept", "pct"),
    ("fused", "fused with the first stage", "q"),
    ("params", "params", "m"),
    ("bytes", "MB on disk", "mb"),
    ("bytes_saved", "bytes saved", "pct"),
    ("bytes_per_nonzero", "bytes/non-zero weight (packed)", "f2"),
    ("latency_ms", "ms/{unit}", "ms"),
    ("speedup", "speed-up", "x"),
    ("batch_ms", "ms/{batch}", "ms"),
    ("throughput", "{items}/s", "int"),
    ("speedup_throughput", "throughput speed-up", "x"),
]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A GitHub markdown table of ``rows`` (ratios against row 0 added); latency headers name the
    task's units (a batch column only when the task has a batch unit)."""
    rows = with_ratios(rows)
    unit, batch = units(rows)
    items = batch.split(" ", 1)[-1] if batch else "queries"
    fused = any(r.get("fused") is not None for r in rows)  # a reranker's rows: the first stage's order fused in
    packed = any(r.get("bytes_per_nonzero") is not None for r in rows)  # a sparse step's packed matrices
    cols = [c for c in COLUMNS if (batch or c[0] != "batch_ms") and (fused or c[0] != "fused")
            and (packed or c[0] != "bytes_per_nonzero")]
    head = "| " + " | ".join(title.format(unit=unit, batch=batch, items=items) for _, title, _ in cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_fmt(r.get(key), kind) for key, _, kind in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


DEFAULT_FLOOR = 0.97  # share of the starting quality kept when no floor is given (the planner's default drop, 3%)


def floor_share(rows: list[dict[str, Any]], meta: dict[str, Any]) -> float:
    """The allowed quality floor as a share of the starting model's: ``meta['floor']`` (absolute,
    as ``plan --run`` records it), else ``1 - meta['max_quality_drop']``, else :data:`DEFAULT_FLOOR`."""
    base = rows[0].get("quality") if rows else None
    if isinstance(meta.get("floor"), (int, float)) and isinstance(base, (int, float)) and base:
        return float(meta["floor"]) / float(base)
    if isinstance(meta.get("max_quality_drop"), (int, float)):
        return 1.0 - float(meta["max_quality_drop"])
    return DEFAULT_FLOOR


def quality_limits(shares: list[float], floor: float) -> tuple[float, float]:
    """Y-axis limits (as shares) that hold every point, the floor and 100%, with a margin, so a
    0.2-point change looks like one and not like a cliff."""
    lo, hi = min([*shares, floor, 1.0]), max([*shares, floor, 1.0])
    pad = max(0.1 * (hi - lo), 0.005)
    return lo - pad, hi + pad


def label_groups(xs: list[float], ys: list[float], names: list[str], ylim: tuple[float, float],
                 near: float = 0.06) -> list[tuple[float, float, str]]:
    """One label per group of points closer than ``near`` of the panel's width and height, at the group's first
    point, its steps' names joined, so steps that change nothing share a label instead of printing over each
    other."""
    xspan = (max(xs) - min(xs) if xs else 0.0) or 1.0
    yspan = (ylim[1] - ylim[0]) or 1.0
    groups: list[list[int]] = []
    for i in range(len(xs)):
        for g in groups:
            j = g[0]
            if abs(xs[i] - xs[j]) < near * xspan and abs(ys[i] - ys[j]) < near * yspan:
                g.append(i)
                break
        else:
            groups.append([i])
    return [(xs[g[0]], ys[g[0]], ", ".join(names[i] for i in g)) for g in groups]


def plot_tradeoffs(rows: list[dict[str, Any]], path: Path, title: str = "", floor: float = DEFAULT_FLOOR) -> Any:
    """Write a PNG with two panels: quality kept (% of the starting model) vs MB on disk, and vs
    batch-32 latency per sequence; one labelled point per step, joined in recipe order. The y axis
    always spans the allowed floor (``floor``, a share of the starting quality, drawn as a line)
    and 100%. Returns the matplotlib ``Figure``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # the OO API: no pyplot global figure state

    fig = Figure(figsize=(10, 4), dpi=100)
    panels = [
        (fig.add_subplot(1, 2, 1), "bytes", 1e-6, "size on disk (MB)"),
        (fig.add_subplot(1, 2, 2), "latency_ms", None, f"latency (ms per {units(rows)[0]})"),
    ]
    metric = next((r.get("metric") for r in rows if r.get("metric")), "quality")
    kept_rows = with_ratios(rows)
    shares = [r["quality_kept"] for r in kept_rows if r.get("quality_kept") is not None]
    lo, hi = quality_limits(shares, floor)
    for ax, key, scale, label in panels:
        xs, ys, names = [], [], []
        for r in kept_rows:
            x, y = r.get(key), r.get("quality_kept")
            if x is None or y is None:
                continue
            xs.append(x * scale if scale else x)
            ys.append(100 * y)
            names.append(f"{r.get('step')}:{r.get('lever')}")
        ax.plot(xs, ys, "-o", color="tab:blue")
        for x, y, n in label_groups(xs, ys, names, (100 * lo, 100 * hi)):
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(100 * floor, color="tab:red", linestyle="--", linewidth=1, label=f"allowed floor {100 * floor:.1f}%")
        ax.axhline(100.0, color="gray", linewidth=0.8, alpha=0.6)
        ax.set_ylim(100 * lo, 100 * hi)
        ax.margins(x=0.1)  # room for the rightmost label
        ax.set_xlabel(label)
        ax.set_ylabel(f"dev {metric}, % of the starting model")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes_atomic(Path(path), buf.getvalue())
    return fig


def write_report(folder: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and ``report.png`` into ``folder``; ``meta`` (what the numbers depend
    on) is printed above the table, its floor drawn on the plot (:func:`floor_share`)."""
    folder = Path(folder)
    rows_r = with_ratios(rows)
    lines = [f"# {meta.get('title', 'Compression report')}", ""]
    for k, v in meta.items():
        if k != "title" and not isinstance(v, (list, dict)):
            lines.append(f"- {k}: {v}")
    lines += [
        "",
        ("Every row is re-measured on that step's own model: quality on the dev set (the task's own metric, "
         "as `encoderkit evaluate` computes it), parameters, bytes of the weight file the runtime loads, and "
         "wall-clock latency (median, tokenisation excluded) in the unit the task is served in."),
        "",
        markdown_table(rows),
        "",
    ]
    notes = [f"- step {r['step']} ({r['lever']}): {r['note']}" for r in rows if r.get("note")]
    if notes:
        lines += ["Notes:", *notes, ""]
    lines += ["![quality vs size and latency](report.png)", ""]
    paths = {"md": folder / "report.md", "json": folder / "report.json", "png": folder / "report.png"}
    write_text_atomic(paths["md"], "\n".join(lines))
    write_json_atomic(paths["json"], {"meta": meta, "steps": rows_r})
    plot_tradeoffs(rows, paths["png"], title=str(meta.get("title", "")), floor=floor_share(rows, meta))
    return paths
