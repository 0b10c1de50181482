"""Task data readers (tables, BEIR/SciFact) and the bi-encoder's parity with sentence-transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from encoderkit.data.beir import load_retrieval, parse_scifact_abstract, read_triples
from encoderkit.errors import EncoderkitError
from encoderkit.tasks.batching import BucketedBatches
from encoderkit.tasks.tabular import read_rows


def test_tables_tsv_csv_jsonl_and_errors(tmp_path):
    tsv = tmp_path / "a.tsv"
    tsv.write_text('sentence\tlabel\n"unbalanced quote\t1\n')
    assert read_rows(tsv)[0].fields == {"sentence": '"unbalanced quote', "label": "1"}
    csv = tmp_path / "a.csv"
    csv.write_text('text,label\n"a, quoted",x\n')
    assert read_rows(csv)[0].fields["text"] == "a, quoted"
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "hi", "label": ["a", "b"]}\n')
    assert read_rows(jl)[0].fields["label"] == ["a", "b"]
    tsv.write_text("sentence\tlabel\nonly one field\n")
    with pytest.raises(EncoderkitError, match=r"a.tsv:2: 1 fields but the header has 2"):
        read_rows(tsv)
    with pytest.raises(EncoderkitError, match="unknown table format"):
        read_rows(tmp_path / "a.tsv.bak") if (tmp_path / "a.tsv.bak").write_text("x") else None


def test_triples_reader_errors(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"query": "q", "positive": "p", "negatives": ["n"]}) + "\n"
                 + json.dumps({"query": "", "positive": "p"}) + "\n")
    with pytest.raises(EncoderkitError, match=r"t.jsonl:2: needs non-empty 'query'"):
        read_triples(f)


def test_bucketed_batches_cover_each_epoch_once_with_less_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 100, size=1000)
    src = BucketedBatches(lengths, 16, lambda idx, epoch: idx, seed=1)
    batches = src.batches(0)
    flat = np.concatenate(batches)
    assert len(batches) == 62 and len(set(flat.tolist())) == len(flat) == 992
    plain = BucketedBatches(lengths, 16, lambda idx, epoch: idx, seed=1, bucket=False).batches(0)
    assert sum(lengths[b].max() for b in batches) < 0.7 * sum(lengths[b].max() for b in plain)
    assert not np.array_equal(np.concatenate(src.batches(1)), flat)  # a fresh order every epoch
    assert [b.tolist() for b in src(0, 1, 2)] == [b.tolist() for b in batches[1::2]]  # addressable positions


def test_scifact_beir_test_set_rebuilt(shared_data):
    data = load_retrieval(f"{shared_data}/scifact/scifact_hf_export.zip#test")
    assert (len(data.corpus), len(data.queries), sum(len(r) for r in data.qrels.values())) == (5183, 300, 339)
    assert parse_scifact_abstract("['It was.'\n \"Don't.\"]", "x") == "It was. Don't."
    # BEIR's qrels file agrees with the claims' cited documents
    qrels = {}
    for line in (shared_data / "scifact" / "qrels.beir-v1.0.0-scifact.test.txt").read_text().split("\n"):
        if line.strip():
            q, _, d, r = line.split()
            qrels.setdefault(q, {})[d] = int(r)
    assert qrels == data.qrels


@pytest.mark.slow
def test_bi_encoder_matches_sentence_transformers(minilm_dir):
    import torch

    st = pytest.importorskip("sentence_transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # faster on a shared machine; restored below
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed.features import encode, load_bi_encoder

    texts = ["A man is eating food.", "Proteins fold into shapes " * 70, "x"]  # the long one is truncated at 256
    ours = encode(load_bi_encoder(minilm_dir), load_tokenizer(minilm_dir), texts, 256)
    theirs = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(texts)
    torch.set_num_threads(threads)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
