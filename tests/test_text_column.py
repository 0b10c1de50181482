"""classify finds its text column by name or as the only text column, and says which in the log."""

from __future__ import annotations

import json

import pytest
from test_finetune import one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.tasks.tabular import find_text_column, read_rows


def _write(path, header, rows):
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(r) + "\n" for r in rows))
    return path


def test_a_text_label_tsv_fine_tunes_and_evaluates_without_column_flags(tmp_path, tiny_bert_dir, capsys):
    rows = [(f"the movie was {w}", lab) for w, lab in [("great", "pos"), ("dull", "neg")] * 8]
    data = _write(tmp_path / "train.tsv", ["text", "label"], rows)
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(tiny_bert_dir), "--task", "classify", "--train", str(data), "--dev",
                 str(data),
                 "--out", str(out), "--max-steps", "2", "--batch-size", "8"]) == 0
    err = capsys.readouterr().err
    assert f"{data}: text column 'text' (found by its name)" in err
    assert "LOAD REPORT" not in err and "new classification head: 2 weights initialised" in err
    assert json.loads((out / "encoderkit.json").read_text())["text_column"] == "text"
    assert main(["evaluate", "--model", str(out), "--data", str(data)]) == 0  # the card's column, no flag
    assert json.loads(capsys.readouterr().out)["examples"] == 16


def test_the_only_text_column_is_found_and_ambiguity_is_an_error(tmp_path):
    one = read_rows(_write(tmp_path / "a.tsv", ["id", "utterance_raw", "label"],
                           [("1", "hello there", "greet"), ("2", "bye now", "bye")]))
    assert find_text_column(one, "a.tsv", exclude=("label",)) == ("utterance_raw", "the only text column")
    two = read_rows(_write(tmp_path / "b.tsv", ["left", "right", "label"], [("a b", "c d", "x")]))
    with pytest.raises(EncoderkitError, match=r"several look like text \(left, right\)\); set --text-column"):
        find_text_column(two, "b.tsv", exclude=("label",))
    assert (find_text_column(read_rows(_write(tmp_path / "c.tsv", ["Review", "label"], [("ok", "1")])), "c.tsv")
            == ("Review", "found by its name"))
