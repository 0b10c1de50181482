"""`encoderkit quickstart`: the README's first command, on the stdlib's docstrings and MiniLM.

The slow test runs ``quickstart --fast`` once and checks each step's figure; the others test the
data it cuts from the corpus (labels, splits, prompts) on small hand-made records.
"""

from __future__ import annotations

import json

import pytest

from encoderkit.quickstart.data import (
    FAMILIES,
    SEARCH_QUESTIONS,
    Record,
    family_task,
    fill_mask_prompts,
    search_subset,
    summary,
)
from encoderkit.quickstart.steps import is_word


def _records() -> list[Record]:
    out = []
    for f in FAMILIES[:5]:
        for m in range(4):
            for i in range(10):
                out.append(Record(f"{f}.mod{m}.fn{i}", f"{f}.mod{m}", f"Docstring {i} of {f} module {m}."))
    out += [Record(f"other.fn{i}", "other", "Not in any family.") for i in range(30)]
    return out


def test_family_task_splits_by_module_and_caps_each_label() -> None:
    task = family_task(_records(), per_label_train=12, per_label_dev=5, seed=0)
    assert task.labels == list(FAMILIES[:5])  # families absent from this "stdlib" are left out
    train_modules = {r["module"] for r in task.train}
    dev_modules = {r["module"] for r in task.dev}
    assert train_modules and dev_modules and not train_modules & dev_modules
    for label in task.labels:
        assert 0 < sum(r["label"] == label for r in task.train) <= 12
        assert 0 < sum(r["label"] == label for r in task.dev) <= 5
        assert all(r["module"].startswith(label + ".") for r in task.train + task.dev if r["label"] == label)
    assert abs(task.majority_accuracy() - 0.2) < 1e-9  # 5 balanced labels
    again = family_task(_records(), per_label_train=12, per_label_dev=5, seed=0)
    assert again.train == task.train and again.dev == task.dev  # seeded


def test_family_task_needs_enough_families() -> None:
    from encoderkit.errors import EncoderkitError

    few = [r for r in _records() if r.package in FAMILIES[:2]]
    with pytest.raises(EncoderkitError, match="needs 4"):
        family_task(few, 10, 5, 0)


def test_fill_mask_prompts_mask_a_frequent_whole_word_of_a_heldout_sentence() -> None:
    train = ["Return the value of the file. " * 30, "Open the file and return its lines. " * 30]
    heldout = ["Short one.\n\nRead the whole file into one string and return it.", "x = 1; no sentence here"]
    vocab = {w: i for i, w in enumerate(["the", "file", "return", "read", "whole", "into", "string", "and", "it"])}
    prompts = fill_mask_prompts(heldout, train, vocab, "[MASK]", n=5)
    # "file" and "return" are used 60 times each in training (the tie goes to the earlier word);
    # "the" is too short, "string" never used in training
    assert prompts == [("Read the whole [MASK] into one string and return it.", "file")]
    seen = ["Read the whole file into one string and return it."]  # a sentence trained on is no prompt
    assert fill_mask_prompts(heldout, train + seen, vocab, "[MASK]", n=5) == []


def test_search_subset_keeps_the_demo_questions_modules() -> None:
    recs = [Record(f"m{i:03d}", f"m{i:03d}", "text") for i in range(40)]
    recs += [Record(m, m, "text") for _, mods in SEARCH_QUESTIONS for m in mods]
    sub = {r.module for r in search_subset(recs, 8)}
    assert {m for _, mods in SEARCH_QUESTIONS for m in mods} <= sub
    assert len(sub) < len({r.module for r in recs})
    assert search_subset(recs, 1) == recs
    assert summary("First line\nstill first.\n\nSecond paragraph.") == "First line still first."


@pytest.fixture(scope="module")
def quickstart_fast(tmp_path_factory, minilm_dir):
    import torch

    from encoderkit.quickstart import QuickstartConfig, run

    root = tmp_path_factory.mktemp("quickstart")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = run(QuickstartConfig(out=str(root / "qs"), fast=True, seed=0))
    finally:
        torch.set_num_threads(threads)
    return root, res


@pytest.mark.slow
def test_quickstart_fast_writes_final_folders_atomically(quickstart_fast) -> None:
    from transformers import AutoModelForMaskedLM

    root, res = quickstart_fast
    out = root / "qs"
    assert [p.name for p in root.iterdir()] == ["qs"]  # no temporary folder left beside it
    assert ({"corpus", "mlm-data", "mlm", "search", "classifier", "compressed", "README.md"}
            <= {p.name for p in out.iterdir()})
    for path in out.rglob("*.json"):
        assert ".tmp-" not in path.read_text(), path
    card = json.loads((out / "mlm" / "encoderkit.json").read_text())
    assert card["config"]["data"] == "../mlm-data"  # relative to the card's folder: neither temporary nor absolute
    from encoderkit.data.prepare import open_blocks, read_meta

    assert (AutoModelForMaskedLM.from_pretrained(out / "mlm").config.vocab_size
            == read_meta(out / "mlm-data")["vocab_size"])
    assert open_blocks(out / "mlm-data", "heldout").shape[1] == 64
    assert (out / "README.md").read_text().strip().splitlines() == res.lines


@pytest.mark.slow
def test_quickstart_fast_mlm_step_learns_and_prompts_come_from_heldout_modules(quickstart_fast) -> None:
    from encoderkit.data.prepare import open_documents

    root, res = quickstart_fast
    out = root / "qs"
    mlm = res.metrics["mlm"]
    assert mlm["heldout_accuracy"] > mlm["heldout_accuracy_before"]
    assert mlm["heldout_loss"] < mlm["heldout_loss_before"]
    modules = [json.loads(line)["text"] for line in (out / "corpus" / "modules.jsonl").read_text().splitlines()]
    flags = open_documents(out / "mlm-data")[2]
    heldout = " ".join(" ".join(t.split()) for t, f in zip(modules, flags) if f)
    trained = " ".join(" ".join(t.split()) for t, f in zip(modules, flags) if not f)
    assert mlm["fill_mask"], "no prompt found in the held-out modules"
    for shown in mlm["fill_mask"]:
        sentence = shown["prompt"].replace("[MASK]", shown["answer"]).rstrip(".")
        assert sentence in heldout and sentence not in trained  # a sentence the MLM never trained on
        assert len(shown["top3"]) == 3


@pytest.mark.slow
def test_quickstart_fast_fill_mask_answers_real_words(quickstart_fast) -> None:
    out, res = quickstart_fast
    mlm = res.metrics["mlm"]
    assert mlm["prompts_scored"] >= 10, mlm
    # content-word masking: three in four top answers are words, not "." "the" "##s" (all-token masking: about half)
    assert 4 * mlm["word_first"] >= 3 * mlm["prompts_scored"], mlm
    assert mlm["answer_in_top3"] >= 2, mlm  # and the masked word itself comes back
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "qs" / "mlm").num_hidden_layers == 2  # MiniLM's first 2 layers


def test_is_word_refuses_punctuation_pieces_and_articles() -> None:
    assert [is_word(t) for t in (".", ",", "##s", "the", "A", "_", "file", "Return")] == [False] * 6 + [True] * 2


@pytest.mark.slow
def test_quickstart_fast_search_step_finds_the_expected_modules(quickstart_fast) -> None:
    from encoderkit.retrieval.search import Searcher, SearchSettings

    root, res = quickstart_fast
    assert res.metrics["search"]["found"] == len(SEARCH_QUESTIONS)
    searcher = Searcher.open(root / "qs" / "search", threads=1)  # the index on disk, at its final path
    for (question, expected), hits in zip(SEARCH_QUESTIONS, searcher.search([q for q, _ in SEARCH_QUESTIONS],
                                                                            SearchSettings(k=3)), strict=True):
        assert any(h.doc_id.split(".")[0] in expected for h in hits.hits), (question, [h.doc_id for h in hits.hits])


@pytest.mark.slow
def test_quickstart_fast_classifier_beats_the_majority_and_compresses(quickstart_fast) -> None:
    root, res = quickstart_fast
    out = root / "qs"
    c = res.metrics["classify"]
    assert c["dev_accuracy"] > c["majority_accuracy"] + 0.1
    assert c["plan"] == ["quantize"]  # no training budget on a CPU: post-training INT8 only
    assert c["after"]["bytes"] < c["before"]["bytes"] / 2
    onnx = sum(p.stat().st_size for p in (out / "compressed" / c["compressed_folder"]).glob("*.onnx*"))
    assert 0 < onnx < (out / "classifier" / "model.safetensors").stat().st_size / 2
    assert c["after"]["quality"] > c["majority_accuracy"]
