"""`distill --to static`: a tiny embed teacher becomes a static embedding folder that sentence-transformers and every
encoderkit stage that embeds load, with the same vectors; its vocabulary is the corpus's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import WORDS
from deploy_models import make_task_model, tiny_root

from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.distill import run as distill
from encoderkit.compress.distill_static import fit_table, frequency_weights, token_vectors
from encoderkit.compress.levers import run_distill
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor

CORPUS_WORDS = WORDS[40:70]  # the corpus uses these words only; the tokenizer knows more
TEXTS = ["the movie was great fun", "what time is it", "a dull story", "zzzz python code", "movie"]


def _docs() -> list[str]:
    return [" ".join(CORPUS_WORDS[(i * 7 + j * 3) % len(CORPUS_WORDS)] for j in range(4 + i % 9)) for i in range(40)]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("static_corpus") / "corpus.txt"
    path.write_text("\n\n".join(_docs()) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def static_dir(teacher, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static") / "s"
    res = run_distill(DistillConfig(teacher=str(teacher), out=str(out), to="static", train=str(corpus), dims=16,
                                    epochs=20,
                                batch_size=8))
    assert res.dims == 16 and res.documents == 40
    return out


def test_vocabulary_is_the_corpus_tokens(static_dir, teacher):
    from safetensors.numpy import load_file

    tok = Predictor.load(teacher, backend="torch-fp32").tokenizer
    seen = {i for d in _docs() for i in tok(d, add_special_tokens=False)["input_ids"]} - set(tok.all_special_ids)
    t = load_file(str(static_dir / "model.safetensors"))
    kept = set(np.flatnonzero(t["mapping"] != len(t["embeddings"]) - 1).tolist())
    assert kept == seen and len(t["embeddings"]) == len(seen) + 1
    assert not t["embeddings"][-1].any()  # unseen tokens share the zero row
    assert set(np.flatnonzero(t["weights"]).tolist()) == seen
    card = json.loads((static_dir / "encoderkit.json").read_text())
    assert card["task"] == "embed" and card["kind"] == "static" and card["metrics"]["kept_tokens"] == len(seen)


def test_token_vectors_are_the_teachers_embedding_of_each_token_alone(teacher):
    p = Predictor.load(teacher, backend="torch-fp32")
    words = ["movie", "python", "story"]
    ids = np.asarray([p.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words])
    np.testing.assert_allclose(token_vectors(p, ids), p.embed_raw(words), atol=1e-5)


def test_the_fit_brings_the_static_vectors_closer_to_the_teacher(static_dir, teacher, corpus, tmp_path):
    unfitted = tmp_path / "unfitted"
    distill(DistillConfig(teacher=str(teacher), out=str(unfitted), to="static", train=str(corpus), dims=16,
                          fit_texts=0))
    want = Predictor.load(teacher, backend="torch-fp32").embed(_docs())

    def agreement(folder: Path) -> float:  # how well the static model's similarities follow the teacher's
        got = Predictor.load(folder).embed(_docs())
        return float(np.corrcoef((got @ got.T).ravel(), (want @ want.T).ravel())[0, 1])

    # a random tiny teacher's embeddings are nearly parallel (similarities spread by 0.04), so the gain is small
    assert agreement(static_dir) > agreement(unfitted) + 0.01


def test_fit_table_points_each_texts_mean_at_its_target():
    rng = np.random.default_rng(0)
    table = np.concatenate([rng.normal(size=(20, 8)), np.zeros((1, 8))]).astype(np.float32)
    # row 20: unseen
    ids = [np.append(rng.choice(21, size=int(rng.integers(0, 5))), rng.integers(20)) for _ in range(64)]
    truth = np.concatenate([rng.normal(size=(20, 8)), np.zeros((1, 8))])
    targets = np.stack([truth[r].mean(0) for r in ids]).astype(np.float32)  # reachable: the means of another table

    def mean_cos(t: np.ndarray) -> float:
        means = np.stack([t[r].mean(0) for r in ids])
        return float(np.mean(np.sum(means * targets, 1) / np.linalg.norm(means, axis=1)
                             / np.linalg.norm(targets, axis=1)))

    fitted = fit_table(table, ids, targets, epochs=200, lr=0.05, batch_size=16, seed=0)
    assert mean_cos(table) < 0.2 and mean_cos(fitted) > 0.8
    assert not fitted[-1].any()  # the unseen tokens' row stays zero


def test_frequency_weights_fall_with_frequency():
    counts = np.array([1000, 10, 1, 100])
    sif, zipf = frequency_weights(counts, "sif"), frequency_weights(counts, "zipf")
    assert list(np.argsort(sif)) == [0, 3, 1, 2] and list(np.argsort(zipf)) == [0, 3, 1, 2]
    assert (frequency_weights(counts, "none") == 1).all()


def test_sentence_transformers_gives_encoderkits_vectors(static_dir):
    from sentence_transformers import SentenceTransformer

    p = Predictor.load(static_dir)
    assert p.backend == "static"
    ours = p.embed(TEXTS)
    st = SentenceTransformer(str(static_dir), device="cpu").encode(TEXTS, normalize_embeddings=False)
    assert ours.shape == st.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(ours, st, atol=1e-5)
    assert not ours[3].any()  # a text of tokens the corpus never showed: the zero vector, in both
    assert np.allclose(np.linalg.norm(ours[[0, 1, 2, 4]], axis=1), 1.0, atol=1e-5)
    # the padded-batch path (run over token rows with [CLS]/[SEP]) pools as the whole-text path does
    from encoderkit.tasks.embed.embedder import Embedder, tokenize

    embedder = Embedder.of_runner(p)
    np.testing.assert_allclose(embedder.pooled_rows(tokenize(p.tokenizer, TEXTS, 64)), p.embed_raw(TEXTS), atol=1e-6)
    # the raw mean equals the EmbeddingBag mean of the same text without [CLS]/[SEP]
    raw = p.embed_raw(["movie"])[0]
    model = SentenceTransformer(str(static_dir), device="cpu")
    features = model[0].preprocess(["movie"])
    np.testing.assert_allclose(raw, model[0](features)["sentence_embedding"][0].detach().numpy(), atol=1e-6)


def test_index_search_and_predict_run_on_the_static_folder(static_dir, tmp_path):
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings

    docs = {f"d{i}": d for i, d in enumerate(_docs())}
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    index(IndexConfig(model=str(static_dir), corpus=[str(corpus)], out=str(tmp_path / "idx"), float16=True))
    s = Searcher.open(tmp_path / "idx")
    hits = s.search([docs["d5"]], SearchSettings(first_stage="float", rescore="none"))[0].hits
    assert hits[0].doc_id == "d5"

    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:3]) + "\n")
    predict(PredictConfig(model=str(static_dir), input=str(tmp_path / "in.txt"), output=str(tmp_path / "out.jsonl")))
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), Predictor.load(static_dir).embed(TEXTS[:3]),
                               atol=1e-6)


def test_serve_embeds_with_the_static_folder(static_dir):
    import httpx

    from encoderkit.deploy.guard import Limits
    from encoderkit.deploy.serve import BackgroundServer, create_app

    p = Predictor.load(static_dir)
    app = create_app({"static": p}, Limits(max_texts=8, max_chars=300), max_batch=8, max_wait_ms=5)
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        own = http.post("/v1/embed", json={"texts": TEXTS[:3]}).json()
        openai = http.post("/v1/embeddings", json={"model": "static", "input": TEXTS[:3]}).json()
    np.testing.assert_allclose(np.array(own["embeddings"]), p.embed(TEXTS[:3]), atol=1e-5)
    np.testing.assert_allclose(np.array([d["embedding"] for d in openai["data"]]), p.embed(TEXTS[:3]), atol=1e-5)


def test_bad_input_is_refused_with_a_clear_message(teacher, static_dir, tmp_path, tmp_path_factory, tiny_tokenizer_dir):
    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(EncoderkitError, match="holds no non-empty document"):  # the corpus reader's refusal
        distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / "a"), to="static", train=str(empty)))
    unknown = tmp_path / "unknown.txt"  # text, but no token the tokenizer knows: nothing to take vectors of
    unknown.write_text("\u2603\u2603 \u2603\n")
    with pytest.raises(EncoderkitError, match="1 passages with 2 tokens.*needs a corpus of text"):
        distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / "a"), to="static", train=str(unknown)))
    classifier = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    with pytest.raises(EncoderkitError, match="'classify' model; it needs a sentence-embedding"):
        distill(DistillConfig(teacher=str(classifier), out=str(tmp_path / "b"), to="static", train=str(empty)))
    with pytest.raises(EncoderkitError, match="static embedding model; it needs a sentence-embedding"):
        distill(DistillConfig(teacher=str(static_dir), out=str(tmp_path / "c"), to="static", train=str(empty)))
    with pytest.raises(EncoderkitError, match="cannot be loaded as a torch model"):
        export(ExportConfig(model=str(static_dir), out=str(tmp_path / "onnx")))
    with pytest.raises(EncoderkitError, match="use --backend auto"):
        Predictor.load(static_dir, backend="onnx-int8")
    assert not any(tmp_path.glob("[abc]")) and not (tmp_path / "onnx").exists()


def test_model2vec_loads_the_folder_with_the_same_vectors(static_dir):
    model2vec = pytest.importorskip("model2vec", reason="optional: pip install model2vec")
    got = model2vec.StaticModel.from_pretrained(str(static_dir)).encode(TEXTS[:3])
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    np.testing.assert_allclose(got, Predictor.load(static_dir).embed(TEXTS[:3]), atol=1e-5)


# -- the static tier as the first stage of the index (encoderkit.retrieval.first_stage) --------------------------

def _corpus_jsonl(path: Path) -> dict[str, str]:
    docs = {f"d{i}": d for i, d in enumerate(_docs())}
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return docs


def test_tiered_index_lazy_codes_rescore_as_the_full_encoder_does(static_dir, teacher, tmp_path, monkeypatch):
    from encoderkit.retrieval import first_stage
    from encoderkit.retrieval.codes import int8_codes, int8_dequantize
    from encoderkit.retrieval.first_stage import CODES_DIR, FullCodes
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings

    docs = _corpus_jsonl(tmp_path / "c.jsonl")
    idx = tmp_path / "idx"
    monkeypatch.setattr(first_stage, "CALIBRATION_SAMPLE", 8)  # of 40 passages
    stats = index(IndexConfig(model=str(teacher), corpus=[str(tmp_path / "c.jsonl")], out=str(idx),
                              first_stage_model=str(static_dir))).stats
    assert stats["passages"] == 40 and stats["full_codes"] == "lazy" and stats["first_stage_dims"] == 16
    assert stats["full_codes_kept"] == 8  # only the calibration sample was embedded by the full encoder
    s = Searcher.open(idx)
    assert s.tier is not None and "int8" not in s.gen.arrays  # no full-encoder codes in the generation
    queries = [docs["d3"], docs["d17"], "movie story"]
    got = s.search(queries, SearchSettings(k=5, first_stage="int8", rescore="int8", rescore_multiplier=8))
    # the static int8 stage's 40 candidates are the whole corpus here: the order and scores are the full encoder's,
    # through its int8 codes (calibrated on the 8-passage sample)
    kept = FullCodes.open(idx, s.fingerprint, s.gen.dims)
    full = Predictor.load(teacher, backend=s.predictor.backend)
    d_vec = int8_dequantize(int8_codes(full.embed(list(docs.values())), kept.calibration), kept.calibration)
    for res, q in zip(got, full.embed(queries), strict=True):
        want = np.sort(d_vec @ q)[::-1][:5]
        np.testing.assert_allclose([h.score for h in res.hits], want, atol=1e-3)  # ONNX INT8: scales per batch
    assert len(kept.row) == 40 and len(list((idx / CODES_DIR).glob("part-*.npz"))) >= 2  # the search kept its codes
    # without rescoring the scores are the static stage's: the static query against the dequantized static codes
    static_order = s.search(queries, SearchSettings(k=5, first_stage="int8", rescore="none"))
    a = s.gen.arrays
    static_docs = int8_dequantize(np.asarray(a["static_int8"]), a["static_int8_calibration"])
    for res, q in zip(static_order, Predictor.load(static_dir).embed(queries), strict=True):
        np.testing.assert_allclose([h.score for h in res.hits], np.sort(static_docs @ q)[::-1][:5], atol=1e-4)
    # an update keeps the codes of unchanged passages and drops the changed one's; parts are merged into one
    docs["d5"] = "python code data model"
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    again = index(IndexConfig(model=str(teacher), corpus=[str(tmp_path / "c.jsonl")], out=str(idx),
                              first_stage_model=str(static_dir))).stats
    assert again["full_codes_kept"] == 39 and again["full_codes_stale"] == 1
    assert len(list((idx / CODES_DIR).glob("part-*.npz"))) == 1


def test_tiered_index_eager_codes_and_what_it_refuses(static_dir, teacher, tmp_path):
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index
    from encoderkit.retrieval.search import Searcher, SearchSettings

    docs = _corpus_jsonl(tmp_path / "c.jsonl")
    corpus = [str(tmp_path / "c.jsonl")]
    stats = index(IndexConfig(model=str(teacher), corpus=corpus, out=str(tmp_path / "idx"),
                              first_stage_model=str(static_dir),
                              full_codes="eager")).stats
    assert stats["full_codes_kept"] == 40
    s = Searcher.open(tmp_path / "idx")
    assert s.search([docs["d9"]], SearchSettings(first_stage="binary"))[0].hits[0].doc_id == "d9"
    with pytest.raises(EncoderkitError, match="static first stage searches --first-stage binary or int8"):
        s.search(["movie"], SearchSettings(first_stage="float", rescore="int8"))
    with pytest.raises(EncoderkitError, match="pass --first-stage-model"):  # an update must keep the first stage
        index(IndexConfig(model=str(teacher), corpus=corpus, out=str(tmp_path / "idx")))
    with pytest.raises(EncoderkitError, match="is not a static embedding model"):
        index(IndexConfig(model=str(teacher), corpus=corpus, out=str(tmp_path / "b"), first_stage_model=str(teacher)))
    with pytest.raises(EncoderkitError, match="is a static embedding model; with --first-stage-model it is the full"):
        index(IndexConfig(model=str(static_dir), corpus=corpus, out=str(tmp_path / "c"),
                          first_stage_model=str(static_dir)))
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_distill_to_static_refuses_bad_input_naming_the_file_and_the_fix(teacher, tmp_path, monkeypatch):
    import builtins

    from encoderkit.data import files

    good = tmp_path / "good.txt"
    good.write_text("\n\n".join(_docs()) + "\n")

    def refused(match: str, **kw) -> None:
        out = tmp_path / "out"
        with pytest.raises(EncoderkitError, match=match):
            distill(DistillConfig(**{"teacher": str(teacher), "train": str(good), "to": "static", "out": str(out),
                                     **kw}))
        assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing half-written

    (tmp_path / "empty").mkdir()
    refused("corpus folder .*empty holds no", train=str(tmp_path / "empty"))  # zero passages
    random = tmp_path / "random"
    random.mkdir()
    (random / "notes.txt").write_text("not a model")
    refused(f"--teacher {random}: .*has no config.json.*sentence-embedding model folder", teacher=str(random))
    refused(r"--dims 64 is more than the teacher .*'s 32 dimensions; pass --dims 32 or fewer", dims=64, fit_texts=0)
    short = tmp_path / "short.txt"
    short.write_text("movie\n")
    refused("no text of at least 20 characters.*pass --fit-texts 0", train=str(short))
    # a file the process may not read (as root chmod is not enough: the reader's open is refused as the OS would)
    locked = tmp_path / "locked.txt"
    locked.write_text("the movie was great fun\n")

    def denied(path, *args, **kw):
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kw)

    monkeypatch.setattr(files, "open", denied, raising=False)
    refused(f"--train {locked}: cannot read {locked}.*Permission denied.*; fix its permissions", train=str(locked))
    # the default --dims of a teacher narrower than 256 is the teacher's width (PCA: at most the kept tokens' count)
    res = distill(DistillConfig(teacher=str(teacher), train=str(good), to="static", out=str(tmp_path / "ok"),
                                fit_texts=0))
    assert res.dims == min(32, res.kept) and res.kept == 30


def _beir(tmp_path: Path) -> Path:
    """A BEIR folder of the corpus documents, 8 test queries each judging the document it was cut from."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = _docs()
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": d}) + "\n"
                                               for i, d in enumerate(docs)))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": " ".join(docs[i].split()[:3])})
                                                + "\n"
                                                for i in range(8)))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                             + "".join(f"q{i}\td{i}\t1\n" for i in range(8)))
    return beir


def test_a_compress_recipe_step_distils_the_static_tier_and_the_runner_measures_it(teacher, tmp_path):
    from encoderkit.compress.stack import CompressConfig, load_recipe
    from encoderkit.compress.stack import run as compress

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "static-tier.yaml"
    (step,) = load_recipe(recipe)
    assert step.lever == "distill" and step.params["to"] == "static"
    small = tmp_path / "r.yaml"  # the shipped recipe at this tiny teacher's size
    small.write_text("task: embed\nsteps:\n  - {lever: distill, to: static, dims: 16, fit_texts: 40, epochs: 5}\n")
    beir = _beir(tmp_path)
    res = compress(CompressConfig(recipe=str(small), model=str(teacher), dev=f"{beir}#test", train=str(beir),
                                  out=str(tmp_path / "out"), repeats=1))
    start, static = res.rows
    assert static["lever"] == "distill" and static["metric"] == start["metric"] == "ndcg@10"
    folder = tmp_path / "out" / "01-distill"
    assert json.loads((folder / "encoderkit.json").read_text())["kind"] == "static"
    # the row is the static folder's own measurement: its nDCG@10 as evaluate computes it, its table's bytes
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    own = evaluate(EvaluateConfig(model=str(folder), data=f"{beir}#test")).metrics["ndcg@10"]
    assert static["quality"] == pytest.approx(own, abs=1e-6)
    assert static["bytes"] == (folder / "model.safetensors").stat().st_size
    assert static["runtime"].endswith("static") and static["latency_ms"] > 0


def test_plan_run_measures_the_static_tier_it_proposes(teacher, tmp_path):
    from encoderkit.compress.plan import PlanConfig, make_plan, run_recipe_for_plan
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    beir = _beir(tmp_path)
    cfg = PlanConfig(budget="some", hardware="cpu", speedup=50, max_quality_drop=0.5, run=True, model=str(teacher),
                     dev=f"{beir}#test", train=str(beir), out=str(tmp_path / "plan"))
    plan = make_plan(cfg)  # the task comes from the folder: embed
    assert plan.task == "embed" and plan.levers() == ["distill"] and plan.steps[0].params["to"] == "static"
    res = run_recipe_for_plan(plan.recipe(), cfg)
    folder = tmp_path / "plan" / "try0" / "01-distill"
    start = evaluate(EvaluateConfig(model=str(teacher), data=f"{beir}#test")).metrics["ndcg@10"]
    measured = evaluate(EvaluateConfig(model=str(folder), data=f"{beir}#test")).metrics["ndcg@10"]
    assert res.tried[0]["quality"] == pytest.approx(measured, abs=1e-6)  # measured on --dev, not the planner's 96%
    assert res.floor == pytest.approx(0.5 * start) and res.ok == (measured >= 0.5 * start)


def test_static_folder_is_portable_and_model2vec_reads_whole_texts(static_dir, tmp_path):
    """No absolute path in the folder's files, and model2vec (which cuts at 512 tokens unless the config says
    otherwise) reads a long text whole, as encoderkit does, from a copy of the folder."""
    import json
    import shutil

    for f in static_dir.rglob("*.json"):  # the card's parent too: recorded relative to the folder
        assert str(static_dir.parent.parent) not in f.read_text(), f
    config = json.loads((static_dir / "config.json").read_text())
    assert config["max_length"] == config["seq_length"] and not Path(config["tokenizer_name"]).is_absolute()
    model2vec = pytest.importorskip("model2vec", reason="optional: pip install model2vec")
    copy = tmp_path / "copied"
    shutil.copytree(static_dir, copy)
    long = " ".join(TEXTS * 200)  # thousands of tokens
    got = model2vec.StaticModel.from_pretrained(str(copy)).encode([long])
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    np.testing.assert_allclose(got, Predictor.load(copy).embed([long]), atol=1e-5)
