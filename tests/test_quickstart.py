"""`encoderkit quickstart`: the README's first command, on the embedded corpus."""

from __future__ import annotations

import json
from pathlib import Path

import encoderkit
from encoderkit.quickstart import QuickstartConfig, run


def test_quickstart_writes_final_paths_and_a_loadable_model(tmp_path) -> None:
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "qs"
    corpus = str(Path(encoderkit.__file__).parent / "*.py")  # small and always there (the default reads the stdlib)
    res = run(QuickstartConfig(out=str(out), corpus=[corpus], steps=3, vocab_size=1000, batch_size=4, seq_len=64))
    assert sorted(p.name for p in out.iterdir()) == ["data", "model", "tokenizer"]
    assert [p.name for p in tmp_path.iterdir()] == ["qs"]  # no temporary folder left beside it
    card = json.loads((out / "model" / "encoderkit.json").read_text())
    assert card["config"]["data"] == str(out / "data")  # the final folder, not the temporary one
    for path in out.rglob("*.json"):
        assert ".tmp-" not in path.read_text(), path
    from encoderkit.data.prepare import open_blocks, read_meta

    assert AutoModelForMaskedLM.from_pretrained(out / "model").config.vocab_size == read_meta(out / "data")["vocab_size"]
    assert open_blocks(out / "data", "heldout").shape[1] == 64
    assert any("held-out masked-token loss" in line for line in res.lines)
