"""The local search index: codes, updates, atomicity, refusals, the tiered search and its CLI.

A tiny in-process embed model (random weights) is enough for the mechanics; the real MiniLM on a
SciFact slice checks rescoring recall (tests/test_search_real.py)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.codes import binary_codes, hamming, int8_calibration, int8_codes, int8_dequantize, top_k
from encoderkit.retrieval.index import IndexConfig
from encoderkit.retrieval.index import run as index
from encoderkit.retrieval.search import QueryVectors, Searcher, SearchSettings

WORDS = ["python", "data", "movie", "story", "fun", "great", "dull", "film"]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


def _doc(i: int, n: int | None = None) -> str:
    n = n if n is not None else 3 + i % 30
    return f"document {i} " + " ".join(WORDS[(i * 7 + j * (1 + i % 3)) % len(WORDS)] for j in range(n))


def _corpus(path: Path, docs: dict[str, str]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return path


def _cfg(embed_dir, corpus, out, **kw) -> IndexConfig:
    base = {"model": str(embed_dir), "corpus": [str(corpus)], "out": str(out), "backend": "torch-fp32",
            "passage_tokens": 16, "overlap": 4}
    return IndexConfig(**{**base, **kw})


def _sizes(out: Path) -> dict[str, int]:
    gen = out / (out / "CURRENT").read_text().strip()
    return {p.name: p.stat().st_size for p in gen.iterdir()}


# -- codes ----------------------------------------------------------------------------------
def test_hamming_search_equals_brute_force():
    rng = np.random.default_rng(0)
    docs, qs = rng.standard_normal((300, 72)), rng.standard_normal((5, 72))  # 72 bits: 9 bytes, not a multiple of 8
    for d in (72, 64):
        a, b = binary_codes(docs[:, :d]), binary_codes(qs[:, :d])
        brute = np.array([[int(((docs[j, :d] > 0) != (qs[i, :d] > 0)).sum()) for j in range(300)] for i in range(5)])
        assert np.array_equal(hamming(b, a), brute)
        rows = top_k(hamming(b, a), 10, largest=False)
        for i in range(5):
            assert list(rows[i]) == sorted(range(300), key=lambda j: (brute[i, j], j))[:10]


@pytest.mark.parametrize("use_faiss", [True, False])
def test_exact_binary_first_stage_equals_brute_force(use_faiss, monkeypatch):
    """The exact Hamming first stage (faiss IndexBinaryFlat, or numpy without faiss) returns the
    brute-force nearest codes in the brute-force order, ties to the lower row: 16 bits over 500
    codes (half of them duplicates) make ties everywhere."""
    from encoderkit.retrieval import ann
    from encoderkit.retrieval.calibrate import in_memory

    if use_faiss:
        pytest.importorskip("faiss")
    else:
        monkeypatch.setattr(ann, "available", lambda: False)
    rng = np.random.default_rng(3)
    docs = rng.standard_normal((500, 16)).astype(np.float32)
    docs[250:] = docs[:250]
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    qs = rng.standard_normal((6, 16)).astype(np.float32)
    qs /= np.linalg.norm(qs, axis=1, keepdims=True)
    s = Searcher(in_memory(docs, [{"id": str(i), "doc_id": str(i), "text": ""} for i in range(500)], "fp"), Path("."))
    brute = ((docs[None, :, :] > 0) != (qs[:, None, :] > 0)).sum(axis=2)
    for fetch in (1, 40, 600):
        rows, scores = s.dense(qs, SearchSettings(rescore="none"), fetch)
        assert (s._flat is not None) == use_faiss
        for i in range(6):
            want = sorted(range(500), key=lambda j: (brute[i, j], j))[:fetch]
            assert list(rows[i]) == want
            assert np.array_equal(-scores[i], brute[i, want].astype(np.float32))


def test_int8_codes_round_trip_within_one_step():
    x = np.random.default_rng(1).standard_normal((200, 16)).astype(np.float32)
    cal = int8_calibration(x)
    back = int8_dequantize(int8_codes(x, cal), cal)
    assert np.abs(back - x).max() <= ((cal[1] - cal[0]) / 255).max() / 2 + 1e-6
    assert int8_codes(x * 10, cal).min() == -128  # out of range: clipped, not wrapped


# -- build, update, reload -------------------------------------------------------------------
def test_updates_keep_ids_reembed_only_changed_and_really_delete(embed_dir, tmp_path, monkeypatch):
    from encoderkit.retrieval import index as index_mod

    embedded: list[str] = []
    real = index_mod.embed_blocks
    monkeypatch.setattr(index_mod, "embed_blocks",
                        lambda p, blocks, *a: real(p, (embedded.extend(texts) or texts for texts in blocks), *a))
    docs = {f"d{i}": _doc(i) for i in range(40)}
    out = tmp_path / "idx"
    first = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out)).stats
    assert first["added"] == 40 and first["passages"] > 40  # long documents were split
    sizes = _sizes(out)
    embedded.clear()
    again = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out)).stats
    assert embedded == [] and again["unchanged"] == 40 and _sizes(out) == sizes  # identical re-run: no growth
    assert sorted(p.name for p in out.iterdir()) == ["CURRENT", again["generation"]]  # the old generation is gone

    docs2 = dict(docs)
    docs2["d3"] = _doc(3) + " changed"
    del docs2["d5"]
    docs2["new"] = _doc(99)
    st = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs2), out)).stats
    assert (st["added"], st["changed"], st["deleted"], st["unchanged"]) == (1, 1, 1, 38)
    assert embedded and all(t in docs2["d3"] or t in docs2["new"] for t in embedded)  # only these were re-embedded
    s = Searcher.open(out, backend="torch-fp32")
    ids = {p["doc_id"] for p in s.gen.passages}
    assert "d5" not in ids and {"d3", "new"} <= ids
    assert '"doc_id": "d5"' not in (out / st["generation"] / "passages.jsonl").read_text()
    # stable ids: an unchanged document's passage ids and codes are what they were
    before = {p["id"] for p in s.gen.passages if p["doc_id"] == "d7"}
    assert before == {f"d7#{j}" for j in range(len(before))}
    # back to the first corpus: same size as the first build
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out))
    assert _sizes(out) == sizes


def test_reload_after_restart_gives_identical_results(embed_dir, tmp_path):
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(30)}), out, float16=True))
    q = ["python movie fun", "dull story data"]
    settings = [SearchSettings(), SearchSettings(first_stage="float", rescore="none"), SearchSettings(rescore="float"),
                SearchSettings(first_stage="int8", rescore="none"), SearchSettings(bm25=True)]
    a = [Searcher.open(out, backend="torch-fp32").search(q, st) for st in settings]
    b = [Searcher.open(out, backend="torch-fp32").search(q, st) for st in settings]
    assert a == b and all(len(r[0].hits) == 10 for r in a)
    # exact float over the float16 vectors equals a brute-force cosine ranking of best passages
    s = Searcher.open(out, backend="torch-fp32")
    qv = s.embed(q[:1]).vectors[0]
    sc = np.asarray(s.gen.arrays["float16"], dtype=np.float32) @ qv
    best: dict[str, float] = {}
    for row in np.argsort(-sc, kind="stable"):
        best.setdefault(s.gen.passages[row]["doc_id"], float(sc[row]))
    assert [h.doc_id for h in a[1][0].hits] == list(best)[:10]


def test_query_from_another_model_is_refused(embed_dir, tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(10)}), out))
    other = (make_task_model(tmp_path / "other", tiny_tokenizer_dir, "embed", seed=1)
             if (tmp_path / "other").mkdir() is None else None)
    with pytest.raises(EncoderkitError, match="not the model index"):
        Searcher.open(out, model=other, backend="torch-fp32")
    s = Searcher.open(out, backend="torch-fp32")
    with pytest.raises(EncoderkitError, match="fingerprint"):
        s.search_vectors(QueryVectors(s.embed(["python"]).vectors, "0123456789abcdef"))
    with pytest.raises(EncoderkitError, match="pass --rebuild"):
        index(_cfg(other, _corpus(tmp_path / "c.jsonl", {"a": "python"}), out))


def test_crash_mid_update_leaves_the_previous_index_readable(embed_dir, tmp_path, monkeypatch):
    from encoderkit.retrieval import store

    out = tmp_path / "idx"
    docs = {f"d{i}": _doc(i) for i in range(20)}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out))
    before = Searcher.open(out, backend="torch-fp32").search(["python data"])

    real = np.save

    def dying_save(f, arr, **kw):
        real(f, arr[: len(arr) // 2], **kw)  # half a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(store.np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {**docs, "x": "new movie"}), out))
    monkeypatch.setattr(store.np, "save", real)
    assert Searcher.open(out, backend="torch-fp32").search(["python data"]) == before
    # a leftover temporary generation (SIGKILL) is cleared by the next write
    (out / ".gen-000009.tmp").mkdir()
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out))
    assert not list(out.glob(".gen-*"))


def test_corrupt_or_partly_written_index_is_detected_on_open(embed_dir, tmp_path):
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(10)}), out))
    gen = out / (out / "CURRENT").read_text().strip()
    data = bytearray((gen / "binary.npy").read_bytes())
    data[-1] ^= 0xFF
    (gen / "binary.npy").write_bytes(bytes(data))
    with pytest.raises(EncoderkitError, match=r"binary\.npy does not match its sha256"):
        Searcher.open(out, backend="torch-fp32")
    data[-1] ^= 0xFF
    (gen / "binary.npy").write_bytes(bytes(data))
    (gen / "int8.npy").write_bytes((gen / "int8.npy").read_bytes()[:100])
    with pytest.raises(EncoderkitError, match=r"int8\.npy has 100 bytes"):
        Searcher.open(out, backend="torch-fp32")
    (gen / "manifest.json").unlink()
    with pytest.raises(EncoderkitError, match="no manifest.json"):
        Searcher.open(out, backend="torch-fp32")
    (out / "CURRENT").unlink()
    with pytest.raises(EncoderkitError, match="no CURRENT"):
        Searcher.open(out, backend="torch-fp32")
    with pytest.raises(EncoderkitError, match="does not exist"):
        Searcher.open(tmp_path / "nothing", backend="torch-fp32")


# -- bad input --------------------------------------------------------------------------------
def test_empty_corpus_and_duplicate_ids_are_refused(embed_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(EncoderkitError, match="holds no document"):
        index(_cfg(embed_dir, tmp_path / "empty.jsonl", tmp_path / "i1"))
    assert not (tmp_path / "i1" / "CURRENT").exists()
    (tmp_path / "dup.jsonl").write_text('{"id": "a", "text": "python"}\n{"id": "b", "text": "movie"}\n'
                                        '{"id": "a", "text": "x"}\n')
    with pytest.raises(EncoderkitError, match=r"'a' appears twice \(.*dup.jsonl:1 and .*dup.jsonl:3\)"):
        index(_cfg(embed_dir, tmp_path / "dup.jsonl", tmp_path / "i2"))


def test_non_utf8_documents_are_skipped_named_and_counted(embed_dir, tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("python data movie")
    (folder / "sub" / "b.txt").write_text("a dull story")
    (folder / "latin1.txt").write_bytes("caf\xe9 story".encode("latin-1"))
    st = index(_cfg(embed_dir, folder, tmp_path / "idx")).stats
    assert st["documents"] == 2 and st["skipped"] == 1 and "latin1.txt: not UTF-8" in st["skipped_examples"][0]
    ids = {p["doc_id"] for p in Searcher.open(tmp_path / "idx", backend="torch-fp32").gen.passages}
    assert ids == {"a.txt", "sub/b.txt"}  # stable ids: paths relative to the folder
    (tmp_path / "mixed.jsonl").write_bytes(b'{"id": "1", "text": "python"}\n{"id": "2", "text": "caf\xe9"}\n')
    st = index(_cfg(embed_dir, tmp_path / "mixed.jsonl", tmp_path / "idx2")).stats
    assert st["documents"] == 1 and "mixed.jsonl:2: not UTF-8" in st["skipped_examples"][0]


def test_passages_overlap_and_map_back_to_documents(embed_dir, tmp_path):
    from transformers import AutoTokenizer

    from encoderkit.retrieval.corpus import passage_spans

    tok = AutoTokenizer.from_pretrained(embed_dir)
    text = _doc(1, 40)
    spans = passage_spans(tok, text, 16, 4)
    n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    assert len(spans) == -(-(n_tokens - 4) // 12)  # windows of 16 advancing by 12
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    for (a0, a1), (b0, _) in itertools.pairwise(spans):
        assert b0 < a1  # consecutive windows share text
        assert len(tok(text[a0:a1], add_special_tokens=False)["input_ids"]) == 16
    assert passage_spans(tok, "short text", 16, 4) == [(0, 10)]
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {"long": text, "short": "python"}), out))
    hits = Searcher.open(out, backend="torch-fp32").search(["python"], SearchSettings(k=5))[0].hits
    assert sorted(h.doc_id for h in hits) == ["long", "short"]  # a document appears once, as its best passage
    assert all(h.text in (text, "python") or h.text in text for h in hits)


def test_over_long_query_is_truncated_and_said(embed_dir, tmp_path, capsys):
    from encoderkit.retrieval.search import SearchConfig
    from encoderkit.retrieval.search import run as search

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(10)}), out))
    long_q = " ".join(["python movie"] * 400)
    r = search(SearchConfig(index=str(out), query=long_q, backend="torch-fp32"))
    assert r.results[0]["truncated"] is True and len(r.results[0]["hits"]) == 10
    assert "truncated" in capsys.readouterr().err
    assert (search(SearchConfig(index=str(out), query="python movie", backend="torch-fp32")).results[0]["truncated"]
            is False)


# -- stages and the CLI --------------------------------------------------------------------------
def test_bm25_fusion_and_rerank_stages(embed_dir, tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    from encoderkit.inference.predictor import Predictor
    from encoderkit.metrics.ranking import rrf_scores

    out = tmp_path / "idx"
    docs = {f"d{i}": _doc(i) for i in range(30)}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out))
    ce = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")
    s = Searcher.open(out, backend="torch-fp32", rerank=ce)
    q = "dull film story"
    dense = s.search([q], SearchSettings(k=20))[0].hits
    fused = s.search([q], SearchSettings(k=20, bm25=True))[0].hits
    lexical = s._collapse(*s.bm25(q, 80))
    want = rrf_scores([[h.doc_id for h in s.search([q], SearchSettings(k=80))[0].hits][:20],
                       [d for d, _, _ in lexical][:20]])
    assert [h.doc_id for h in fused][:3] == sorted(want, key=lambda d: -want[d])[:3]
    assert [h.doc_id for h in fused] != [h.doc_id for h in dense]
    reranked = s.search([q], SearchSettings(k=10, rerank_top=20))[0].hits
    r = Predictor.load(ce, backend="torch-fp32")
    top20 = s.search([q], SearchSettings(k=20))[0].hits
    scores = r.score_pairs([q] * 20, [h.text for h in top20])
    ce_order = [top20[j].doc_id for j in np.argsort(-scores, kind="stable")]
    assert [h.doc_id for h in reranked] == ce_order[:10]
    # --rerank-fuse: the cross-encoder's order fused by reciprocal rank with the order it was handed
    fused_ce = s.search([q], SearchSettings(k=10, rerank_top=20, rerank_fuse=True))[0].hits
    want = rrf_scores([ce_order, [h.doc_id for h in top20]])
    assert [h.doc_id for h in fused_ce] == sorted(want, key=lambda d: (-want[d], ce_order.index(d)))[:10]
    assert [h.score for h in fused_ce] == pytest.approx([want[h.doc_id] for h in fused_ce])
    with pytest.raises(EncoderkitError, match="float16"):
        s.search([q], SearchSettings(first_stage="float"))


def test_search_cli_queries_file_to_jsonl(embed_dir, tmp_path):
    from encoderkit.cli import main

    corpus = _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(12)})
    out = tmp_path / "idx"
    assert main(["index", "--model", str(embed_dir), "--corpus", str(corpus), "--out", str(out), "--backend",
                 "torch-fp32",
                 "--passage-tokens", "16", "--overlap", "4"]) in (0, None)
    (tmp_path / "q.jsonl").write_text('{"id": "a", "query": "python data"}\n{"id": "b", "query": "dull story"}\n')
    assert main(["search", "--index", str(out), "--queries", str(tmp_path / "q.jsonl"), "--output",
                 str(tmp_path / "o.jsonl"),
                 "--k", "3", "--bm25"]) in (0, None)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"] and all(len(r["hits"]) == 3 for r in rows)
    assert set(rows[0]["hits"][0]) >= {"doc_id", "score", "text"}
    assert main(["search", "--index", str(tmp_path / "nope"), "--query", "x"]) == 2


def test_calibration_reports_and_recommends(embed_dir, tmp_path):
    out = tmp_path / "idx"
    res = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(40)}), out,
                     calibrate=True, min_overlap=0.5))
    rep = res.calibration
    rows = rep["settings"]
    assert {r["precision"] for r in rows} >= {"float16", "int8", "int8+float rescore", "binary", "binary+int8 rescore"}
    full = next(r for r in rows if r["precision"] == "float16" and r["dims"] == 32)
    assert full["overlap@10"] > 0.99  # float16 at full dims is the reference, up to rounding
    rec = rep["recommended"]
    assert rec["overlap@10"] >= 0.5
    assert all(r["bytes_per_doc"] >= rec["bytes_per_doc"] for r in rows if r["overlap@10"] >= 0.5)
    assert json.loads((out / "calibration.json").read_text())["recommended"] == rec
    assert os.path.exists(out / "CURRENT")


def test_matryoshka_dims_and_the_approximate_first_stage(embed_dir, tmp_path, monkeypatch):
    pytest.importorskip("faiss")
    out = tmp_path / "idx"
    docs = {f"d{i}": _doc(i) for i in range(40)}
    st = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, dims=16, ann_threshold=10)).stats
    s = Searcher.open(out, backend="torch-fp32")
    assert s.gen.arrays["binary"].shape == (st["passages"], 2) and s.gen.arrays["int8"].shape[1] == 16
    assert "binary.ivf" in st["bytes"] and s._ivf is not None
    assert s.embed(["python"]).vectors.shape == (1, 16)
    q = ["python movie fun", "dull story", "great film data"]
    qv = s.embed(q).vectors
    _, approx = s.dense(qv, SearchSettings(rescore="none"), 20)
    _, exact = s.dense(qv, SearchSettings(rescore="none", exact=True), 20)
    # this small IVF probes every cell, so it finds codes as near as the exact search does (ties may differ)
    assert np.array_equal(np.sort(approx, axis=1), np.sort(exact, axis=1))
    assert all(len(r.hits) == 5 for r in s.search(q, SearchSettings(k=5)))
    # the default rescore multiplier follows the first stage: larger behind the IVF
    from encoderkit.retrieval import search as search_mod

    fetched = []
    real_dense = s.dense
    s.dense = lambda qq, st, fetch: fetched.append(fetch) or real_dense(qq, st, fetch)
    settings = (SearchSettings(k=5), SearchSettings(k=5, exact=True), SearchSettings(k=5, first_stage="int8"),
                SearchSettings(k=5, rescore_multiplier=3))
    for st_ in settings:
        s.search(q, st_)
    small, large = search_mod.RESCORE_MULTIPLIER, search_mod.RESCORE_MULTIPLIER_LARGE
    assert fetched == [5 * small, 5 * small, 5 * small, 15] and large > small
    fetched.clear()
    monkeypatch.setattr(search_mod, "LARGE_INDEX", st["passages"] - 1)  # this index counts as large
    for st_ in settings:
        s.search(q, st_)
    assert fetched == [5 * large, 5 * large, 5 * small, 15]  # binary first stages read more; int8 and explicit do not
    with pytest.raises(EncoderkitError, match="dims=16, this run asks 32"):
        index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, dims=32))
    assert index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, dims=32, rebuild=True)).stats["dims"] == 32


# -- streaming: blocks of documents in, blocks of rows out ---------------------------------------------------------
def _files(out: Path) -> dict[str, str]:
    gen = out / (out / "CURRENT").read_text().strip()
    return {k: v["sha256"] for k, v in json.loads((gen / "manifest.json").read_text())["files"].items()}


def _blocks(monkeypatch, texts: int, rows: int) -> None:
    from encoderkit.retrieval import index as index_mod

    monkeypatch.setattr(index_mod, "EMBED_CHUNK", 8)  # the Predictor calls: the same in every run of a test
    monkeypatch.setattr(index_mod, "BLOCK_TEXTS", texts)
    monkeypatch.setattr(index_mod, "BLOCK_ROWS", rows)


def test_a_streamed_build_and_update_write_the_files_of_the_whole_corpus_run(embed_dir, tmp_path, monkeypatch):
    """Blocks of 16 new passages (24 rows in an update) write, byte for byte, the files of one block holding the
    whole corpus (the run before streaming): a build, and an update that reorders, changes, deletes and adds
    documents (kept rows copied in runs that are not contiguous in the old generation); and those files hold the
    whole-corpus codes: each passage embedded 8 at a time, the int8 calibration fit on every vector."""
    from encoderkit.inference.predictor import Predictor, finish_embeddings
    from encoderkit.retrieval.store import open_generation

    docs = {f"d{i}": _doc(i) for i in range(90)}
    docs2 = dict(reversed(list(docs.items())))
    docs2["d3"] += " changed"
    del docs2["d5"], docs2["d60"]
    docs2["new"] = _doc(99)
    got = {}
    for name, texts, rows in (("whole", 10**6, 10**6), ("blocks", 16, 24)):
        _blocks(monkeypatch, texts, rows)
        out = tmp_path / name
        st = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, float16=True)).stats
        got[name] = [_files(out), {k: v for k, v in st.items() if k != "seconds"}]
        st = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs2), out, float16=True)).stats
        got[name] += [_files(out), {k: v for k, v in st.items() if k != "seconds"}]
    assert got["blocks"][1]["passages"] > 3 * 16 and got["blocks"][3]["unchanged"] == 87  # several blocks each time
    assert got["blocks"] == got["whole"]
    # the first build's codes are the whole corpus's, computed here apart from the index
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), tmp_path / "again", float16=True))
    gen = open_generation(tmp_path / "again")
    p = Predictor.load(embed_dir, backend="torch-fp32")
    texts = [x["text"] for x in gen.passages]
    raw = np.concatenate([p.embed_raw(texts[i : i + 8]) for i in range(0, len(texts), 8)])
    vecs = finish_embeddings(raw, None, True)
    cal = int8_calibration(vecs)
    assert np.array_equal(gen.arrays["int8_calibration"], cal)
    assert np.array_equal(gen.arrays["int8"], int8_codes(vecs, cal))
    assert np.array_equal(gen.arrays["binary"], binary_codes(vecs))
    assert np.array_equal(gen.arrays["float16"], vecs.astype(np.float16))


def test_a_build_past_the_calibration_bound_fits_int8_on_its_first_vectors(embed_dir, tmp_path, monkeypatch):
    from encoderkit.retrieval import index as index_mod
    from encoderkit.retrieval.store import open_generation

    _blocks(monkeypatch, 16, 16)
    monkeypatch.setattr(index_mod, "CALIBRATION_ROWS", 20)  # fit on the first 20 of ~100 vectors (two blocks held)
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {f"d{i}": _doc(i) for i in range(40)}), out, float16=True))
    gen = open_generation(out)
    vecs = np.asarray(gen.arrays["float16"], np.float32)  # the unit vectors, to float16 rounding
    cal = np.asarray(gen.arrays["int8_calibration"])
    assert len(vecs) > 60 and np.abs(cal - int8_calibration(vecs[:20])).max() < 1e-3
    assert np.abs(cal - int8_calibration(vecs)).max() > 1e-3  # later vectors reach further: not the whole corpus's
    assert np.abs(gen.arrays["int8"].astype(int) - int8_codes(vecs, cal).astype(int)).max() <= 1  # clipped, same ranges


def documents_read_ahead(monkeypatch) -> list[int]:
    """Wraps the index's corpus reader and block writer: for each document read, how many documents were read and
    not yet written then (one passage each); the list it fills (cleared by each run's first document)."""
    from encoderkit.retrieval import index as index_mod

    written, ahead = [0], []
    real_write, real_iter = index_mod._write_block, index_mod.iter_corpus

    def write(w, codes, block, vecs, old):
        real_write(w, codes, block, vecs, old)
        written[0] += block.rows

    def reading(*a, **kw):
        written[0] = 0
        for n, d in enumerate(real_iter(*a, **kw), 1):
            ahead.append(n - written[0])
            yield d

    monkeypatch.setattr(index_mod, "_write_block", write)
    monkeypatch.setattr(index_mod, "iter_corpus", reading)
    return ahead


def test_the_index_reads_its_corpus_a_block_at_a_time(embed_dir, tmp_path, monkeypatch):
    """Bounded memory by construction: 20 blocks of documents, and the driver never reads more than one block
    of documents ahead of the rows it has written (texts and vectors of the corpus are never held whole); a bad
    record late in the corpus is its file:line, and nothing is left behind."""
    from encoderkit.retrieval import store

    _blocks(monkeypatch, 16, 16)
    ahead = documents_read_ahead(monkeypatch)
    docs = {f"d{i}": f"document {i} " + WORDS[i % len(WORDS)] for i in range(320)}  # one passage each
    st = index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), tmp_path / "idx", passage_tokens=-1)).stats
    assert st["passages"] == 320 and max(ahead) == 16  # one block read ahead of what is written: 16 of 320
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    lines[300] = "{not json"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(EncoderkitError, match=r"bad\.jsonl:301: not valid JSON"):
        index(_cfg(embed_dir, tmp_path / "bad.jsonl", tmp_path / "bad", passage_tokens=-1))
    assert not (tmp_path / "bad").exists()  # its temporary generation (and the folder it made) removed

    real_append = store.NpyRows.append  # a crash mid-array leaves the live generation readable

    def dying(self, block):
        if self.rows > 100:
            raise KeyboardInterrupt
        real_append(self, block)

    monkeypatch.setattr(store.NpyRows, "append", dying)
    before = _files(tmp_path / "idx")
    with pytest.raises(KeyboardInterrupt):
        index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {**docs, "x": "new"}), tmp_path / "idx", rebuild=True,
                   passage_tokens=-1))
    assert _files(tmp_path / "idx") == before and not list((tmp_path / "idx").glob(".gen-*"))


def test_rows_written_a_block_at_a_time_are_what_np_save_writes(tmp_path):
    from encoderkit.retrieval.store import NpyRows

    x = np.random.default_rng(0).standard_normal((37, 5)).astype(np.float16)
    w = NpyRows(tmp_path / "a.npy")
    for a in range(0, 37, 8):
        w.append(x[a : a + 8])
    w.close()
    np.save(tmp_path / "b.npy", x)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def test_the_corpus_reader_streams_with_the_errors_and_skips_of_a_whole_read(tmp_path):
    from encoderkit.retrieval.corpus import first_bad_utf8, iter_corpus, read_corpus

    bad = b"id,text\n1,caf\xc3\xa9\n2,ok\n" + b"3," + b"x" * 5000 + b"\xe9\n"
    (tmp_path / "a.csv").write_bytes(bad)
    at = bad.index(b"\xe9")
    assert first_bad_utf8(tmp_path / "a.csv") == at
    with pytest.MonkeyPatch.context() as mp:  # a multi-byte character cut by a read
        from encoderkit.retrieval import corpus as corpus_mod

        mp.setattr(corpus_mod, "READ_BYTES", 13)
        assert first_bad_utf8(tmp_path / "a.csv") == at
        (tmp_path / "ok.csv").write_bytes(b"id,text\n1,caf\xc3\xa9 \xe2\x82\xac\n")
        assert first_bad_utf8(tmp_path / "ok.csv") is None
    (tmp_path / "b.jsonl").write_bytes(b'{"id": "x", "text": "a\xe2\x80\xa8b"}\n\n{"id": "y", "text": " "}\n')
    read = read_corpus([str(tmp_path / "a.csv"), str(tmp_path / "b.jsonl"), str(tmp_path / "ok.csv")])
    assert [d.id for d in read.docs] == ["x", "1"] and read.docs[0].text == "a\u2028b"  # U+2028 ends no line
    assert read.skipped == [f"{tmp_path / 'a.csv'}: not UTF-8 (first bad byte at offset {at})",
                            f"{tmp_path / 'b.jsonl'}:3: empty text"]
    docs = iter_corpus([str(tmp_path / "b.jsonl"), str(tmp_path / "b.jsonl")])
    assert next(docs).id == "x"  # read lazily: the repeated id is an error only when reached
    with pytest.raises(EncoderkitError, match=r"'x' appears twice \(.*b\.jsonl:1 and .*b\.jsonl:1\)"):
        next(docs)


def test_a_text_with_a_unicode_line_separator_is_one_passage_read_either_way(embed_dir, tmp_path):
    from encoderkit.retrieval.store import open_generation

    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", {"a": "python\u2028data movie", "b": "dull\u0085story"}), out))
    whole, lazy = open_generation(out), open_generation(out, lazy_passages=True)
    assert [x["text"] for x in whole.passages] == ["python\u2028data movie", "dull\u0085story"]
    assert list(lazy.passages) == whole.passages and lazy.passages[1] == whole.passages[1] and len(lazy.passages) == 2
    lazy.passages.close()


def test_an_update_of_an_auto_openvino_index_keeps_the_default_calibration(embed_dir, tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from encoderkit import hardware
    from encoderkit.hardware import Hardware
    from encoderkit.inference import predictor as predictor_module
    from encoderkit.inference.engines import DEFAULT_CALIBRATION
    from tests.test_hardware import VNNI_NO_BF16

    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))  # auto: OpenVINO
    seen = []
    load = predictor_module.Predictor.load.__func__
    monkeypatch.setattr(predictor_module.Predictor, "load",
                        classmethod(lambda cls, *a, **k: seen.append(k.get("backend")) or load(cls, *a, **k)))
    out = tmp_path / "idx"
    docs = {f"d{i}": _doc(i) for i in range(20)}
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, backend="auto"))
    built = seen[-1]  # the policy's choice, resolved once by index and handed to the Predictor
    assert (built.backend, built.calibration) == ("openvino-int8", DEFAULT_CALIBRATION)
    more = {f"n{i}": _doc(i + 500) for i in range(10)} | docs
    index(_cfg(embed_dir, _corpus(tmp_path / "c2.jsonl", more), out, backend="openvino-int8"))
    assert seen[-1] == built  # the build's default-calibrated graph, not the update's corpus head


def test_an_openvino_int8_index_calibrates_on_its_corpus_first_documents(embed_dir, tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from encoderkit.inference import predictor as predictor_module

    docs = {f"d{i}": _doc(i) for i in range(140)}
    seen = []
    load = predictor_module.Predictor.load.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("backend"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(predictor_module.Predictor, "load", classmethod(spy))
    out = tmp_path / "idx"
    index(_cfg(embed_dir, _corpus(tmp_path / "c.jsonl", docs), out, backend="openvino-int8"))
    assert seen[0].texts == list(docs.values())[:128]  # the first 128 documents, then every document is indexed
    from encoderkit.retrieval.store import current_folder

    manifest = json.loads((current_folder(out) / "manifest.json").read_text())
    assert manifest["engine"] == seen[0].to_dict() and manifest["engine"]["backend"] == "openvino-int8"
    assert "backend" not in manifest["model"] and "runtime" not in manifest["model"]
    searcher = Searcher.open(out)
    assert seen[-1] == seen[0]  # queries run on the graph the passages ran on
    hits = searcher.search(["python data movie"], SearchSettings())[0].hits
    assert hits and len({h.doc_id for h in hits}) == len(hits)
    more = {f"n{i}": _doc(i + 500) for i in range(130)} | docs  # new documents first: not what the build calibrated on
    index(_cfg(embed_dir, _corpus(tmp_path / "c2.jsonl", more), out, backend="openvino-int8"))
    assert seen[-1] == seen[0]  # an update keeps the build's calibration, so old and new vectors share one graph
    with pytest.raises(EncoderkitError, match="was embedded with --backend openvino-int8, this run asks onnx-fp32"):
        index(_cfg(embed_dir, _corpus(tmp_path / "c2.jsonl", more), out, backend="onnx-fp32"))
    index(_cfg(embed_dir, _corpus(tmp_path / "c2.jsonl", more), out, backend="auto"))  # auto: the build's engine
    assert seen[-1] == seen[0]
    assert Searcher.open(out, backend="onnx-fp32").predictor.backend == "onnx-fp32" and seen[-1].calibration is None
