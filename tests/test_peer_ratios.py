"""The per-CPU-class ratios to the best peer that doctor and auto's reason print are data beside the policy
(inference/peer_ratios.json); their home is docs/deploy.md's per-class table, and the two must agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

from encoderkit.inference.policy import CPU_CLASSES, MEASURED

ROOT = Path(__file__).resolve().parents[1]
RATIO = re.compile(r"\d+\.\d+(?:-\d+\.\d+)?x")


def test_every_cpu_class_has_an_entry_and_no_figure_lives_in_the_code():
    assert set(MEASURED) == set(CPU_CLASSES)
    source = (ROOT / "encoderkit" / "inference" / "policy.py").read_text(encoding="utf-8")
    assert not RATIO.search(source)


def test_every_ratio_in_the_data_is_on_the_deploy_page():
    page = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    data = json.loads((ROOT / "encoderkit" / "inference" / "peer_ratios.json").read_text(encoding="utf-8"))
    figures = [f for key, text in data.items() if not key.startswith("_") for f in RATIO.findall(text)]
    assert figures  # the measured classes carry figures
    assert [f for f in figures if f not in page] == []
