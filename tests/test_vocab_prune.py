"""Vocabulary pruning keeps the task data's tokenisation identical and shrinks the embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.compress.prune import PruneConfig, prune
from encoderkit.errors import EncoderkitError
from tests.conftest import WORDS, tiny_bert_config

TEXTS = [" ".join(WORDS[(i * 3 + j * 11) % 40] for j in range(4 + i % 6)) + " zz!" for i in range(30)]


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny_cls_vocab")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tok), num_labels=2)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _logits(folder: Path, texts: list[str]) -> tuple[torch.Tensor, list[list[str]]]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = AutoModelForSequenceClassification.from_pretrained(folder)(**enc).logits
    return logits, [tok.convert_ids_to_tokens(r) for r in enc["input_ids"]]


def test_vocab_prune_keeps_tokenisation_and_predictions(tiny_classifier, tmp_path) -> None:
    data = tmp_path / "train.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "v"
    rep = prune(tiny_classifier, PruneConfig(method="vocab", vocab_data=[str(data)], measure=False), out)
    old_v, new_v = rep.details["vocab_size"]
    assert new_v < old_v / 2
    from transformers import AutoTokenizer

    new_tok = AutoTokenizer.from_pretrained(out)
    assert len(new_tok) == new_v and json.loads((out / "config.json").read_text())["vocab_size"] == new_v
    assert len((out / "vocab.txt").read_text().splitlines()) == new_v
    # same token strings, same logits (plain transformers reloads the folder)
    ref_logits, ref_tokens = _logits(tiny_classifier, TEXTS)
    new_logits, new_tokens = _logits(out, TEXTS)
    assert new_tokens == ref_tokens
    torch.testing.assert_close(new_logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert new_tok.pad_token_id == 0 and new_tok.convert_ids_to_tokens(new_tok("the")["input_ids"])[0] == "[CLS]"
    assert rep.after["weight_bytes"] < rep.before["weight_bytes"] - (old_v - new_v) * 32 * 4 * 0.9
    # text outside the data loses its rare pieces to [UNK] rather than mapping to wrong tokens
    assert "[UNK]" in new_tok.convert_ids_to_tokens(new_tok("python code")["input_ids"])


def test_vocab_prune_needs_data(tiny_classifier, tmp_path) -> None:
    with pytest.raises(EncoderkitError, match="vocab-data"):
        prune(tiny_classifier, PruneConfig(method="vocab", measure=False), tmp_path / "v")


@pytest.mark.slow
def test_vocab_prune_real_minilm_on_sst2_dev(minilm_dir, shared_data, tmp_path) -> None:
    """On all-MiniLM-L6-v2 with SST-2 dev: identical tokens and embeddings, far fewer bytes."""
    from transformers import AutoModel, AutoTokenizer

    dev = shared_data / "glue_sst2" / "dev.tsv"
    rep = prune(minilm_dir, PruneConfig(method="vocab", vocab_data=[str(dev)], measure=False), tmp_path / "v")
    texts = [line.split("\t")[0] for line in dev.read_text().splitlines()[1:]]
    old_tok, new_tok = AutoTokenizer.from_pretrained(minilm_dir), AutoTokenizer.from_pretrained(tmp_path / "v")
    old_ids, new_ids = old_tok(texts)["input_ids"], new_tok(texts)["input_ids"]
    assert [old_tok.convert_ids_to_tokens(r) for r in old_ids] == [new_tok.convert_ids_to_tokens(r) for r in new_ids]
    assert rep.details["vocab_size"][0] == 30522 and rep.details["vocab_size"][1] < 6000
    assert rep.after["weight_bytes"] < 0.7 * rep.before["weight_bytes"]
    enc_old = old_tok(texts[:16], padding=True, return_tensors="pt")
    enc_new = new_tok(texts[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        a = AutoModel.from_pretrained(minilm_dir)(**enc_old).last_hidden_state
        b = AutoModel.from_pretrained(tmp_path / "v")(**enc_new).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (tmp_path / "v" / "modules.json").is_file()  # still a sentence-transformers folder


def test_rerank_vocab_on_a_beir_source_keeps_every_corpus_document_and_query(tmp_path_factory, tiny_tokenizer_dir,
                                                                             tmp_path) -> None:
    """A reranker serves the whole corpus: a document no query judges keeps its tokens (the judged pairs
    alone would turn its words into [UNK])."""
    from deploy_models import make_task_model, tiny_root
    from transformers import AutoTokenizer

    from encoderkit.compress.task_data import LeverData

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = {f"d{i}": " ".join(WORDS[i:i + 5]) for i in range(5)} | {"d5": "python code data model"}
    queries = {f"q{i}": " ".join(WORDS[i:i + 2]) for i in range(5)} | {"q9": "movie film story"}
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                               for k, v in docs.items()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                             + "".join(f"q{i}\td{i}\t1\n" for i in range(5)))
    model = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")
    out = tmp_path / "v"
    rep = prune(model, PruneConfig(method="vocab", measure=False), out,
                data=LeverData("rerank", {"train": f"{beir}#test"}))
    old, new = AutoTokenizer.from_pretrained(model), AutoTokenizer.from_pretrained(out)
    for text in (docs["d5"], queries["q9"]):  # the unjudged document, the query without judgements
        assert new.convert_ids_to_tokens(new(text)["input_ids"]) == old.convert_ids_to_tokens(old(text)["input_ids"])
        assert "[UNK]" not in new.convert_ids_to_tokens(new(text)["input_ids"])
    assert rep.details["vocab_size"][1] < rep.details["vocab_size"][0]
    assert "[UNK]" in new.convert_ids_to_tokens(new("boring worst dull")["input_ids"])
