"""Learned sparse retrieval (SPLADE, ``--task sparse``) on tiny in-process models: the pooling against a hand
computation, the FLOPS term and its warm-up, training lowers the loss, the folder loads in plain transformers
and sentence-transformers with the same numbers, ONNX parity, predict/serve shapes, the inverted index and its
search, fusion with a dense index, and the bad inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WORDS, tiny_bert_config

from encoderkit.errors import EncoderkitError

TOPICS = ["python code", "movie story", "love film", "data model", "great fun", "boring worst", "first time",
          "good man"]


def _pairs(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """(query, positive) rows whose positive shares the query's words, with filler from the vocabulary."""
    rng = random.Random(seed)
    filler = [w for w in WORDS if w not in " ".join(TOPICS).split()]
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        rows.append({"query": topic,
                     "positive": " ".join(rng.sample(filler, 4) + topic.split() + rng.sample(filler, 3))})
    return rows


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sparse_data") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _pairs()))
    return path


def _finetune(model: Path, train: Path, out: Path, **kw):
    from encoderkit.train.finetune import FinetuneConfig, run

    settings = {"task": "sparse", "model": str(model), "train": str(train), "out": str(out), "epochs": 4,
                "batch_size": 8, "lr": 1e-3, "max_length": 32, "max_query_length": 16, "bf16": False, **kw}
    return run(FinetuneConfig(**settings))


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory, tiny_mlm_dir, pairs_file) -> Path:
    out = tmp_path_factory.mktemp("sparse_runs") / "sparse"
    _finetune(tiny_mlm_dir, pairs_file, out)
    return out


# -- the math -----------------------------------------------------------------------------------------

def test_pooling_is_the_max_over_real_tokens_of_log1p_relu_of_the_logits(tiny_mlm_dir):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from encoderkit.tasks.sparse.features import OUTPUT, Splade

    tok = AutoTokenizer.from_pretrained(tiny_mlm_dir)
    model = AutoModelForMaskedLM.from_pretrained(tiny_mlm_dir).eval()
    enc = tok(["the python code", "a dull boring story that never ends"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits.numpy()  # (B, T, V)
        got_whole = Splade(model, chunk=0)(**enc)[OUTPUT].numpy()
        got_chunked = Splade(model, chunk=3)(**enc)[OUTPUT].numpy()
    mask = enc["attention_mask"].numpy()
    for b in range(2):
        real = logits[b, mask[b] == 1]  # (T_real, V): padding never counts
        hand = np.log1p(np.maximum(real, 0)).max(axis=0)
        np.testing.assert_allclose(got_whole[b], hand, atol=1e-5)
        np.testing.assert_allclose(got_chunked[b], hand, atol=1e-5)
    assert (got_whole >= 0).all()
    # a padding position with the largest logit would change the max: the mask is what keeps it out
    assert not np.allclose(np.log1p(np.maximum(logits[0], 0)).max(axis=0), got_whole[0])


def test_flops_term_and_its_quadratic_warmup():
    from encoderkit.tasks.sparse.features import flops, splade_loss, warmup_factor

    w = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    assert float(flops(w)) == pytest.approx((2.0 ** 2) + 0.0 + (1.0 ** 2))  # means per column: 2, 0, 1
    assert [warmup_factor(s, 10) for s in (0, 5, 10, 20)] == [0.0, 0.25, 1.0, 1.0]
    assert warmup_factor(3, 0) == 1.0
    q, d = torch.rand(4, 7), torch.rand(4, 7)
    base, _ = splade_loss(q, d, 0.0, 0.0)
    reg, logs = splade_loss(q, d, 0.5, 0.25)
    assert float(reg - base) == pytest.approx(0.5 * float(flops(q)) + 0.25 * float(flops(d)), rel=1e-5)
    assert logs["q_nnz"] == 7.0


# -- training and the folder ----------------------------------------------------------------------------

def test_training_lowers_the_loss_and_writes_a_card(sparse_dir):
    lines = [json.loads(x) for x in (sparse_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) >= 4 and np.mean(losses[-2:]) < np.mean(losses[:2])
    card = json.loads((sparse_dir / "encoderkit.json").read_text())
    assert card["task"] == "sparse" and card["head"] == "the folder's own MLM head"


def test_folder_loads_in_transformers_and_sentence_transformers_with_the_same_numbers(sparse_dir):
    from sentence_transformers import SparseEncoder
    from transformers import AutoModelForMaskedLM

    from encoderkit.inference.predictor import Predictor
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks import get_task
    from encoderkit.tasks.sparse.train import load_splade

    folder = ModelFolder.open(sparse_dir)
    ours = load_splade(folder)
    plain = AutoModelForMaskedLM.from_pretrained(sparse_dir).eval()
    tok = folder.tokenizer()
    enc = tok(["the python code is good"], return_tensors="pt")
    with torch.no_grad():
        np.testing.assert_allclose(plain(**enc).logits.numpy(), ours.model(**enc).logits.numpy(), atol=1e-5)
    texts = ["the python code is good", "a great movie"]
    p = Predictor.load(sparse_dir, backend="torch-fp32")
    mine = get_task("sparse").vectors(p, texts).toarray()
    st = SparseEncoder(str(sparse_dir), device="cpu")
    theirs = st.encode(texts, convert_to_tensor=True).to_dense().numpy()
    assert theirs.shape == mine.shape
    assert float(np.abs(theirs - mine).max()) < 1e-4


def test_a_model_without_an_mlm_head_gets_one_from_its_tied_word_embeddings(tmp_path, tiny_bert_dir, pairs_file):
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.sparse.features import load_mlm, mlm_layout

    model, how = load_mlm(ModelFolder.open(tiny_bert_dir))
    assert "tied word embeddings" in how
    layout = mlm_layout(model)
    assert layout.decoder.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    dense = model.cls.predictions.transform.dense
    assert torch.equal(dense.weight, torch.eye(dense.weight.shape[0]))  # the fresh transform starts as the identity
    out = tmp_path / "from_bare"
    _finetune(tiny_bert_dir, pairs_file, out, epochs=1)
    card = json.loads((out / "encoderkit.json").read_text())
    assert "tied word embeddings" in card["head"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


# -- export, predict, serve ----------------------------------------------------------------------------

def test_onnx_graph_outputs_the_pooled_vector_within_tolerance_of_torch(sparse_dir, tmp_path):
    from encoderkit.inference.export import ExportConfig, run
    from encoderkit.inference.predictor import Predictor
    from encoderkit.tasks import get_task

    out = tmp_path / "onnx"
    res = run(ExportConfig(model=str(sparse_dir), out=str(out)))
    assert res.parity["fp32_max_abs_diff"] < 1e-4
    texts = ["the python code", "a dull boring story that never ends and never gets anywhere", "fun"]
    onnx = get_task("sparse").vectors(Predictor.load(out, backend="onnx-fp32"), texts).toarray()
    torch_ = get_task("sparse").vectors(Predictor.load(sparse_dir, backend="torch-fp32"), texts).toarray()
    assert onnx.shape == (3, json.loads((sparse_dir / "config.json").read_text())["vocab_size"])
    assert float(np.abs(onnx - torch_).max()) < 1e-4


def test_predict_and_serve_give_token_weights(sparse_dir, tmp_path):
    from fastapi.testclient import TestClient

    from encoderkit.deploy.serve import create_app
    from encoderkit.inference.predictor import PredictConfig, Predictor
    from encoderkit.inference.predictor import run as predict

    inp = tmp_path / "in.txt"
    inp.write_text("the python code\nlove film\n")
    predict(PredictConfig(model=str(sparse_dir), input=str(inp), output=str(tmp_path / "out.jsonl"),
                          backend="torch-fp32"))
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    weights = list(rows[0]["terms"].values())
    assert weights and all(w > 0 for w in weights) and weights == sorted(weights, reverse=True)
    assert "python" in rows[0]["terms"]  # the query's own word carries weight after training

    p = Predictor.load(sparse_dir, backend="torch-fp32")
    with TestClient(create_app({"splade": p})) as client:
        r = client.post("/v1/embed_sparse", json={"texts": ["the python code", "love film"], "top_k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["results"]) == 2 and all(0 < len(x) <= 3 for x in body["results"])
        assert body["results"][0] == dict(list(rows[0]["terms"].items())[:3])
        r = client.post("/v1/embed_sparse", json={"texts": ["the python code"], "threshold": 1e9})
        assert r.json()["results"] == [{}]
        assert client.post("/v1/embed_sparse", json={"texts": []}).status_code == 422
        assert client.post("/v1/embed", json={"texts": ["x"]}).status_code == 404  # no dense model served


# -- index, search, fusion -----------------------------------------------------------------------------

CORPUS = [
    {"id": "d1", "text": "the python code was good"},
    {"id": "d2", "text": "a great movie story"},
    {"id": "d3", "text": "love film and fun"},
    {"id": "d4", "text": "data model for the man"},
]


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return path


def test_sparse_index_ranks_the_document_sharing_the_query_term_first(sparse_dir, tmp_path):
    from scipy import sparse

    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import SearchConfig, Searcher
    from encoderkit.retrieval.search import run as search
    from encoderkit.retrieval.store import current_folder

    corpus, idx = _corpus(tmp_path), tmp_path / "idx"
    res = index(IndexConfig(model=str(sparse_dir), corpus=[str(corpus)], out=str(idx), backend="torch-fp32"))
    assert res.stats["passages"] == 4 and res.stats["kind"] == "sparse"
    gen = current_folder(idx)
    manifest = json.loads((gen / "manifest.json").read_text())
    assert "sparse.npz" in manifest["files"] and manifest["kind"] == "sparse"
    m = sparse.load_npz(gen / "sparse.npz")
    assert m.shape == (4, json.loads((sparse_dir / "config.json").read_text())["vocab_size"])
    s = Searcher.open(idx)
    for query, want in (("python code", "d1"), ("love film", "d3")):
        hits = s.search([query])[0].hits
        assert hits[0].doc_id == want
        # the score is the dot product of the two sparse vectors
        q = s.sparse.embed([query])  # (1, V)
        row = next(i for i, r in enumerate(s.gen.passages) if r["doc_id"] == want)
        assert hits[0].score == pytest.approx(float((m[row] @ q[0])[0]), rel=1e-5)
    out = search(SearchConfig(index=str(idx), query="python code", k=2))
    assert out.results[0]["hits"][0]["doc_id"] == "d1"
    # an unchanged corpus re-indexed: nothing is re-encoded
    again = index(IndexConfig(model=str(sparse_dir), corpus=[str(corpus)], out=str(idx), backend="torch-fp32"))
    assert again.stats["unchanged"] == 4 and again.stats["embedded_passages"] == 0
    # a damaged matrix is refused by the manifest check
    (current_folder(idx) / "sparse.npz").write_bytes(b"broken")
    with pytest.raises(EncoderkitError, match="sparse.npz"):
        Searcher.open(idx)


def test_a_sparse_index_fuses_with_a_dense_index_by_reciprocal_rank(sparse_dir, tmp_path, tiny_tokenizer_dir):
    from deploy_models import make_task_model

    from encoderkit.metrics.ranking import rrf_scores
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import SearchConfig, Searcher, SearchSettings
    from encoderkit.retrieval.search import run as search

    corpus = _corpus(tmp_path)
    dense_model = make_task_model(tmp_path, tiny_tokenizer_dir, "embed")
    index(IndexConfig(model=str(dense_model), corpus=[str(corpus)], out=str(tmp_path / "dense"), backend="torch-fp32"))
    index(IndexConfig(model=str(sparse_dir), corpus=[str(corpus)], out=str(tmp_path / "sparse"), backend="torch-fp32"))
    dense, sparse_ = Searcher.open(tmp_path / "dense"), Searcher.open(tmp_path / "sparse")
    query = "python code"
    a = [h.doc_id for h in dense.search([query], SearchSettings(k=4))[0].hits]
    b = [h.doc_id for h in sparse_.search([query], SearchSettings(k=4))[0].hits]
    want = rrf_scores([a, b])
    fused_s = Searcher.open(tmp_path / "dense")
    fused_s.fuse_with([tmp_path / "sparse"])
    fused = fused_s.search([query], SearchSettings(k=4))[0].hits
    assert [h.doc_id for h in fused] == sorted(want, key=lambda d: -want[d])[:4]
    assert fused[0].score == pytest.approx(max(want.values()))
    out = search(SearchConfig(index=str(tmp_path / "dense"), query=query, k=4, fuse_with=[str(tmp_path / "sparse")]))
    assert [h["doc_id"] for h in out.results[0]["hits"]] == [h.doc_id for h in fused]
    # two indexes of different corpora are not fused
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x9", "text": "the python"}) + "\n")
    index(IndexConfig(model=str(sparse_dir), corpus=[str(other)], out=str(tmp_path / "other"), backend="torch-fp32"))
    with pytest.raises(EncoderkitError, match="same corpus"):
        Searcher.open(tmp_path / "dense").fuse_with([tmp_path / "other"])


# -- bad input -----------------------------------------------------------------------------------------

def test_bad_inputs_are_clear_errors(tmp_path, tiny_mlm_dir, tiny_tokenizer_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EncoderkitError, match="holds no rows"):
        _finetune(tiny_mlm_dir, empty, tmp_path / "a")
    # a family without a masked-LM head class in transformers
    from transformers import AutoTokenizer, GPT2Config, GPT2Model

    gpt = tmp_path / "gpt2"
    GPT2Model(GPT2Config(n_layer=1, n_head=2, n_embd=16,
                         vocab_size=len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir)),
                         n_positions=64)).save_pretrained(gpt)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(gpt)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _pairs(16)))
    with pytest.raises(EncoderkitError, match="no masked-LM head"):
        _finetune(gpt, pairs, tmp_path / "b")
    # a folder without tokenizer files
    bare = tmp_path / "no_tok"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((tiny_mlm_dir / f).read_bytes())
    with pytest.raises(EncoderkitError, match="no tokenizer files"):
        _finetune(bare, pairs, tmp_path / "c")
    # a tokenizer larger than the model's vocabulary
    from transformers import BertForMaskedLM

    small = tmp_path / "small_vocab"
    BertForMaskedLM(tiny_bert_config(20)).save_pretrained(small)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(small)
    with pytest.raises(EncoderkitError, match="tokenizer has"):
        _finetune(small, pairs, tmp_path / "d")
    # the sparse index refuses a dense model's existing index and vice versa
    with pytest.raises(EncoderkitError, match="--flops-query"):
        _finetune(tiny_mlm_dir, pairs, tmp_path / "e", flops_query=-1.0)


def test_evaluate_scores_exact_sparse_retrieval_on_a_beir_folder(sparse_dir, tmp_path):
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": r["id"], "title": "", "text": r["text"]}) + "\n"
                                               for r in CORPUS))
    queries = {"q1": "python code", "q2": "love film"}
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td3\t1\n")
    res = evaluate(EvaluateConfig(model=str(sparse_dir), data=f"{beir}#test"))
    metrics = res.metrics if hasattr(res, "metrics") else res.summary()
    flat = json.dumps(metrics)
    assert '"ndcg@10": 1.0' in flat and '"queries": 2' in flat  # each query's document shares its words: ranked first
