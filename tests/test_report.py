"""Report: ratios against the starting model, the markdown table, a valid PNG."""

from __future__ import annotations

import json

import pytest

from encoderkit.compress.report import (
    floor_share,
    label_groups,
    markdown_table,
    plot_tradeoffs,
    quality_limits,
    with_ratios,
    write_report,
)

ROWS = [
    {"step": 0, "lever": "start", "quality": 0.90, "metric": "accuracy", "params": 22_000_000, "bytes": 88_000_000,
     "latency_b1_ms": 10.0, "latency_b32_ms": 320.0, "throughput_b32": 100.0},
    {"step": 1, "lever": "distill", "quality": 0.88, "metric": "accuracy", "params": 11_000_000, "bytes": 44_000_000,
     "latency_b1_ms": 5.0, "latency_b32_ms": 160.0, "throughput_b32": 200.0, "note": "3 layers"},
    {"step": 2, "lever": "quantize", "quality": 0.873, "metric": "accuracy", "params": 11_000_000, "bytes": 8_800_000,
     "latency_b1_ms": 2.5, "latency_b32_ms": 80.0, "throughput_b32": 400.0},
]


def test_ratios_are_against_the_first_row():
    r = with_ratios(ROWS)
    assert r[0]["quality_kept"] == pytest.approx(1.0) and r[0]["bytes_saved"] == pytest.approx(0.0)
    assert r[2]["quality_kept"] == pytest.approx(0.873 / 0.90)
    assert r[2]["bytes_saved"] == pytest.approx(0.9)
    assert r[2]["speedup_b32"] == pytest.approx(4.0) and r[1]["speedup_b1"] == pytest.approx(2.0)
    assert with_ratios([{"step": 0, "lever": "start", "quality": None}])[0]["quality_kept"] is None


def test_markdown_table_has_one_row_per_step():
    table = markdown_table(ROWS).splitlines()
    assert len(table) == 2 + len(ROWS)
    assert "| 2 | quantize | 0.8730 | 97.0% |" in table[-1]
    assert "90.0%" in table[-1] and "4.00x" in table[-1]


def test_a_rerank_report_shows_the_order_fused_with_the_first_stage_and_others_do_not():
    rerank = [{**r, "metric": "ndcg@10", "metrics": {"ndcg@10": r["quality"], "fused_ndcg@10": f}}
              for r, f in zip(ROWS, (0.73, 0.729, 0.7212))]
    head, _, *body = markdown_table(rerank).splitlines()
    assert "| kept | fused with the first stage | params |" in head
    assert "| 2 | quantize | 0.8730 | 97.0% | 0.7212 |" in body[-1]
    assert "fused" not in markdown_table(ROWS)  # classify rows: no first stage, no column


def test_write_report_writes_md_json_and_a_valid_png(tmp_path):
    import matplotlib.image as mpimg

    paths = write_report(tmp_path, ROWS, {"title": "t", "seq_len": 128, "threads": 2})
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(paths["png"])
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 200
    assert img[..., :3].std() > 0.01  # something was drawn
    data = json.loads(paths["json"].read_text())
    assert [s["step"] for s in data["steps"]] == [0, 1, 2] and data["meta"]["seq_len"] == 128
    md = paths["md"].read_text()
    assert "seq_len: 128" in md and "step 1 (distill): 3 layers" in md and "report.png" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md", "report.png"]


def test_plot_axis_spans_the_floor_and_100_percent_so_small_changes_look_small(tmp_path):
    rows = [dict(ROWS[0], quality=0.9500), dict(ROWS[1], quality=0.9520)]  # +0.2 points
    lo, hi = quality_limits([1.0, 0.9520 / 0.9500], 0.97)
    assert lo < 0.97 and hi > 0.9520 / 0.9500
    assert (0.9520 - 0.9500) / 0.9500 / (hi - lo) < 0.15  # the change is a small part of the height
    fig = plot_tradeoffs(rows, tmp_path / "p.png", floor=0.97)
    for ax in fig.axes:
        y0, y1 = ax.get_ylim()
        assert y0 < 97.0 and y1 > 100.2 and (y0, y1) == pytest.approx((100 * lo, 100 * hi))
        floors = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [97.0, 97.0]]
        assert len(floors) == 1 and "floor 97.0%" in floors[0].get_label()
        points = next(ln for ln in ax.get_lines() if ln.get_marker() == "o")
        assert list(points.get_ydata()) == pytest.approx([100.0, 100 * 0.9520 / 0.9500])
    assert "% of the starting model" in fig.axes[0].get_ylabel()


def test_steps_on_the_same_spot_share_one_label_instead_of_printing_over_each_other(tmp_path):
    """The seeds' reranker run: vocabulary trimming kept nDCG@10 and took 5% off the time, so its
    point sat on the distillation's and the two names were printed over each other."""
    rows = [dict(ROWS[0], quality=0.7011, latency_ms=4900.5, bytes=90.87e6),
            dict(ROWS[1], quality=0.5661, latency_ms=2657.7, bytes=69.57e6),
            dict(ROWS[2], step=2, lever="vocab", quality=0.5661, latency_ms=2540.4, bytes=45.38e6)]
    fig = plot_tradeoffs(rows, tmp_path / "p.png", floor=0.97)
    by_bytes, by_time = ([t.get_text() for t in ax.texts] for ax in fig.axes)
    assert by_bytes == ["0:start", "1:distill", "2:vocab"]  # 24 MB apart: three labels
    assert by_time == ["0:start", "1:distill, 2:vocab"]
    assert label_groups([1.0, 1.0], [50.0, 99.0], ["a", "b"], (0.0, 100.0)) == [(1.0, 50.0, "a"), (1.0, 99.0, "b")]


def test_a_low_point_or_floor_widens_the_axis_and_the_floor_comes_from_the_meta():
    lo, hi = quality_limits([1.0, 0.80], 0.97)
    assert lo < 0.80 and hi > 1.0
    assert floor_share(ROWS, {"floor": 0.873}) == pytest.approx(0.97)  # plan --run: absolute floor
    assert floor_share(ROWS, {"max_quality_drop": 0.01}) == pytest.approx(0.99)
    assert floor_share(ROWS, {}) == pytest.approx(0.97)


def test_a_slow_unit_shows_its_rate_not_zero():
    """A reranker serves ~0.2 queries (of 100 pairs) per second: the table shows 0.204, not 0."""
    rows = [{"step": 0, "lever": "start", "quality": 0.70, "latency_unit": "query (top 100)", "latency_ms": 4900.0,
             "throughput": 0.2041},
            {"step": 1, "lever": "quantize", "quality": 0.69, "latency_unit": "query (top 100)", "latency_ms": 1850.0,
             "throughput": 0.5405}]
    last = markdown_table(rows).splitlines()[-1]
    assert "| 0.54 | 2.65x |" in last and "| 0.204 |" in markdown_table(rows).splitlines()[-2]
