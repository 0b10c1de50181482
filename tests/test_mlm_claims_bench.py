"""bench/mlm_claims.py: the verdict rule, and its smallest setting end to end (the RESULT line's keys)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "mlm_claims.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("mlm_claims", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_a_claim_holds_only_beyond_the_seeds_spread() -> None:
    verdict = load_bench().verdict
    assert verdict([0.80, 0.82], [0.70, 0.71], 1)["verdict"] == "held"
    inside = verdict([0.72, 0.74], [0.70, 0.73], 1)  # diff 0.015 inside the larger spread 0.03
    assert inside["verdict"] == "not shown at this budget"
    assert (inside["diff"], inside["spread"]) == (0.015, 0.03)
    assert verdict([0.60, 0.61], [0.70, 0.71], 1)["verdict"] == "reversed"
    # "contributes little": held while the arm gains no more than the spread, not held beyond it
    assert verdict([0.71, 0.72], [0.70, 0.72], 0)["verdict"].startswith("held")
    assert verdict([0.80, 0.81], [0.70, 0.71], 0)["verdict"].startswith("not held")
    assert verdict([0.80], [0.70], 1)["verdict"] == "one seed: no spread"


@pytest.mark.slow
def test_smallest_setting_prints_every_arm_and_domain(shared_data, tiny_bert_dir, tmp_path, monkeypatch,
                                                      capsys) -> None:
    if not (shared_data / "scifact" / "scifact_hf_export.zip").is_file():
        pytest.skip("no SciFact export in the shared data")
    bench = load_bench()
    work = tmp_path / "work"
    # a head-less tiny BertModel stands in for MiniLM: continued pretraining adds a fresh head tied to its embeddings
    monkeypatch.setattr(sys, "argv", ["mlm_claims.py", "--smoke", "--seeds", "2", "--arms", "base,wwm,nsp,static",
                                      "--cont-model", str(tiny_bert_dir), "--work", str(work)])
    bench.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    fields = dict(re.findall(r'(\S+?)[=:](\S+)', last.split(" hardware=")[0]))
    for key in ("bench", "steps", "seeds", "sst", "cont_steps", "claims", "held", "base", "wwm", "nsp", "static",
                "scifact_shipped", "scifact_continued", "sst2_shipped", "sst2_continued", "wall_s"):
        assert key in fields, (key, last)
    assert 'hardware="CPU ' in last
    assert fields["seeds"] == "2" and fields["claims"] == "8"  # 3 claims x 2 metrics, 2 domains
    report = json.loads((work / "mlm_claims.json").read_text())
    assert {v["verdict"] for v in report["verdicts"]} <= {
        "held", "reversed", "not shown at this budget", "held (no gain beyond the spread)",
        "not held (a gain beyond the spread)"}
    assert len(report["arm_rows"]) == 8 and len(report["domain_rows"]) == 8
    assert all(0.0 <= r["mlm_acc"] <= 1.0 and 0.0 <= r["sst2_acc"] <= 1.0 for r in report["arm_rows"])
    from encoderkit.models.load import load_encoder

    continued = load_encoder(work / "cont-sst2-s0")
    assert continued.get_output_embeddings().weight.data_ptr() == continued.get_input_embeddings().weight.data_ptr()
