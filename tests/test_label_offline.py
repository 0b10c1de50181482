"""Offline labellers (cloze on a tiny trained MLM; embed on MiniLM) and the terminal review through a pty."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_bert_config

from encoderkit.errors import EncoderkitError
from encoderkit.label.offline import ClozeLabeller

REPO = Path(__file__).resolve().parents[1]
POS, NEG = ["great", "fun", "best", "love"], ["dull", "boring", "worst"]
PATTERN = "{text} . it was {mask} ."


@pytest.fixture(scope="module")
def tiny_mlm(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny BERT MLM trained (160 steps, a few seconds) to fill "<review> . it was [MASK] ." with good/bad."""
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_bert_config(len(tok)))
    rng = np.random.default_rng(0)
    texts, words = [], []
    for _ in range(512):
        positive = rng.random() < 0.5
        adj = rng.choice(POS if positive else NEG)
        det, noun = rng.choice(["the", "a", "this", "that"]), rng.choice(["movie", "film", "story", "plot"])
        texts.append(f"{det} {adj} {noun} . it was {tok.mask_token} .")
        words.append("good" if positive else "bad")
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = torch.full_like(enc["input_ids"], -100)
    at = enc["input_ids"] == tok.mask_token_id
    labels[at] = torch.tensor(tok.convert_tokens_to_ids(words))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(160):
        idx = torch.arange(step * 32, step * 32 + 32) % len(texts)
        loss = model(**{k: v[idx] for k, v in enc.items()}, labels=labels[idx]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("tiny_mlm")
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_cloze_labeller_reads_the_verbalizer_at_the_mask(tiny_mlm):
    texts = [f"this {a} story" for a in POS + NEG] + [f"a {a} film" for a in POS + NEG]
    gold = (["pos"] * len(POS) + ["neg"] * len(NEG)) * 2
    got = ClozeLabeller(tiny_mlm, ["neg", "pos"], {"neg": "bad", "pos": "good"}, PATTERN).label(texts)
    assert [r.label for r in got] == gold
    assert all(0.5 < r.confidence <= 1.0 for r in got)
    swapped = ClozeLabeller(tiny_mlm, ["neg", "pos"], {"neg": "good", "pos": "bad"}, PATTERN).label(texts)
    assert [r.label for r in swapped] == ["neg" if g == "pos" else "pos" for g in gold]


def test_cloze_labeller_loads_a_quantized_mlm_folder(tmp_path, tiny_mlm):
    """A quantized MLM folder holds ``model.quantized.safetensors``, which plain ``from_pretrained`` cannot read
    (there is no ``model.safetensors``): the labeller loads through ``ModelFolder.load``, which rebuilds it, and
    INT8 weights label as the fp32 model does."""
    import torch
    from transformers import BertForMaskedLM

    from encoderkit.compress.packing import QuantSpec, rtn_quantize, save_quantized

    model = BertForMaskedLM.from_pretrained(tiny_mlm)
    qtensors = {}
    with torch.no_grad():
        for name, lin in model.bert.encoder.named_modules():
            if isinstance(lin, torch.nn.Linear):
                qtensors[f"bert.encoder.{name}.weight"] = qt = rtn_quantize(lin.weight, QuantSpec(8, -1, True))
                lin.weight.copy_(qt.dequantize())
    out = tmp_path / "int8"
    out.mkdir()
    save_quantized(model, tiny_mlm, out, qtensors, {"method": "rtn", "bits": 8, "group_size": -1,
                                                    "runtime": "dequantized-fp32"})
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").is_file()
    texts = [f"this {a} story" for a in POS + NEG]
    verbalizer = {"neg": "bad", "pos": "good"}
    got = ClozeLabeller(out, ["neg", "pos"], verbalizer, PATTERN).label(texts)
    want = ClozeLabeller(tiny_mlm, ["neg", "pos"], verbalizer, PATTERN).label(texts)
    assert [r.label for r in got] == [r.label for r in want] == ["pos"] * len(POS) + ["neg"] * len(NEG)
    assert max(abs(a.confidence - b.confidence) for a, b in zip(got, want, strict=True)) < 0.05


def test_cloze_bad_verbalizer_and_pattern_are_clear_errors(tiny_mlm):
    with pytest.raises(EncoderkitError, match="no word for pos"):
        ClozeLabeller(tiny_mlm, ["neg", "pos"], {"neg": "bad"}, PATTERN)
    with pytest.raises(EncoderkitError, match="pick a word that is one token"):
        ClozeLabeller(tiny_mlm, ["neg", "pos"], {"neg": "bad", "pos": "wonderfulness"}, PATTERN)
    with pytest.raises(EncoderkitError, match=r"\{mask\} exactly once"):
        ClozeLabeller(tiny_mlm, ["neg", "pos"], {"neg": "bad", "pos": "good"}, "{text} was it")


def test_label_stage_with_cloze_writes_records_with_the_inputs_fields(tmp_path, tiny_mlm):
    from encoderkit.label.run import LabelConfig, run

    (tmp_path / "in.tsv").write_text("sentence\tlabel\nthe great movie\t1\nthe dull movie\t0\n")
    res = run(LabelConfig(input=str(tmp_path / "in.tsv"), labels="0,1", output=str(tmp_path / "out.jsonl"),
                          labeller="cloze", model=str(tiny_mlm), pattern=PATTERN, verbalizer=["0=bad", "1=good"]))
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["label"] for r in recs] == ["1", "0"] and [r["input_label"] for r in recs] == ["1", "0"]
    assert (recs[0]["text"] == recs[0]["sentence"] == "the great movie"
            and recs[0]["labeller"] == f"cloze:{tiny_mlm.name}")
    assert res.ledger["requests"] == 2 and json.loads((tmp_path / "out.jsonl.ledger.json").read_text())["texts"] == 2


@pytest.mark.slow
def test_embed_labeller_zero_shot_and_seeds_on_minilm(minilm_dir):
    from encoderkit.label.offline import EmbedLabeller

    desc = {"negative": "a negative, bad review", "positive": "a positive, good review"}
    texts = ["a wonderful, moving film with superb acting", "a tedious, boring mess i hated every minute of",
             "one of the best movies of the year", "dull, lifeless and far too long"]
    lab = EmbedLabeller(minilm_dir, ["negative", "positive"], desc, backend="torch-fp32")
    assert [r.label for r in lab.label(texts)] == ["positive", "negative", "positive", "negative"]
    seeded = EmbedLabeller(minilm_dir, ["negative", "positive"], desc, seeds=[("dreadful", "negative")],
                           backend="torch-fp32")
    assert (not np.allclose(seeded.prototypes[0], lab.prototypes[0])
            and np.allclose(seeded.prototypes[1], lab.prototypes[1]))


def write_sheet(path: Path) -> None:
    rows = [("0", "first text", "neg"), ("1", "second text", "neg"), ("2", "third text", "pos"),
            ("3", "fourth text", "pos")]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["row", "text", "label", "confidence", "suspicion", "suspect", "gold"])
        for r in rows:
            w.writerow([*r, "0.9", "0.1", "False", ""])


def read_gold(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return [r["gold"] for r in csv.DictReader(f)]


def test_review_in_a_pseudo_terminal_accepts_corrects_skips_and_resumes(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    sheet = tmp_path / "sheet.csv"
    write_sheet(sheet)
    cmd = [sys.executable, "-m", "encoderkit.cli", "audit", "review", "--sheet", str(sheet), "--labels", "neg,pos"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=60)
    child.expect(r"\[1/4\] first text")
    child.expect("q quit > ")
    child.send("\r")                        # Enter: accept
    child.expect(r"\[2/4\] second text")
    child.expect("q quit > ")
    child.send("2")                         # correct to pos (single key, no Enter: cbreak mode)
    child.expect(r"\[3/4\] third text")
    child.expect("q quit > ")
    child.send("s")                         # skip
    child.expect("fourth text")
    child.expect("q quit > ")
    child.send("q")
    child.expect("2/4 reviewed, 1 corrected")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert read_gold(sheet) == ["neg", "pos", "", ""]
    # a new session starts at the first line without gold; u undoes the last answer
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=60)
    child.expect(r"\[3/4\] third text")
    child.expect("q quit > ")
    child.send("1")
    child.expect("fourth text")
    child.expect("q quit > ")
    child.send("u")
    child.expect(r"\[3/4\] third text")
    child.expect("q quit > ")
    child.send("a")
    child.expect("fourth text")
    child.expect("q quit > ")
    child.send("a")
    child.expect("4/4 reviewed, 1 corrected")
    child.expect(pexpect.EOF)
    child.close()
    assert read_gold(sheet) == ["neg", "pos", "pos", "pos"]
