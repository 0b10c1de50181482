"""Predictor: same results on every backend, independent of batch order and padding; NER/QA structure; predict CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from deploy_models import export_task_model, make_task_model, tiny_root

from encoderkit import hardware
from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.hardware import Hardware
from encoderkit.inference.predictor import Predictor, finish_embeddings
from encoderkit.tasks.batching import length_batches
from encoderkit.tasks.inference import run_rows
from tests.test_hardware import VNNI_NO_BF16

TEXTS = ["the movie was great fun", "dull", "a boring story that never ends , and the worst film of all time",
         "she said that he had a good time", "python code and data", "love it !"]
LONG = " ".join(["the man said that paris was a great city"] * 30)  # ~300 tokens, over the tiny model's 128


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer_dir):
    root = tiny_root(tmp_path_factory)
    return {t: export_task_model(root, tiny_tokenizer_dir, t) for t in ("classify", "rerank", "ner", "qa", "embed")}


def _load_all(folder, **kw):
    return {b: Predictor.load(folder, backend=b, **kw) for b in ("torch-fp32", "onnx-fp32", "onnx-int8")}


def _cost(lengths, groups, call_cost):
    return sum(call_cost + len(g) * max(lengths[i] for i in g) for g in groups)


def test_length_batches_are_the_cheapest_cuts_of_the_sorted_rows():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n, max_batch = int(rng.integers(1, 11)), int(rng.integers(1, 6))
        lengths = [int(x) for x in rng.integers(3, 60, n)]
        groups = length_batches(lengths, max_batch, call_cost=8)
        assert sorted(int(i) for g in groups for i in g) == list(range(n))  # every row once
        assert all(1 <= len(g) <= max_batch for g in groups)
        order = sorted(range(n), key=lambda i: lengths[i])
        best = min(  # brute force over every way to cut the sorted order into runs of <= max_batch
            _cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, n), strict=True)], 8)
            for mask in range(2 ** (n - 1))
            for cuts in [tuple(k + 1 for k in range(n - 1) if mask >> k & 1)]
            if all(b - a <= max_batch for a, b in zip((0, *cuts), (*cuts, n), strict=True)))
        assert _cost(lengths, groups, 8) == best, (trial, lengths, max_batch)
    assert [len(g) for g in length_batches([20] * 70, 32)] == [32, 32, 6]  # like lengths: full batches
    assert [len(g) for g in length_batches([5] * 16 + [60] * 16, 32)] == [16, 16]  # no padding 5 -> 60
    assert length_batches([], 4) == []


def test_length_batches_count_lengths_as_an_engine_that_pads_to_a_step_runs_them():
    lengths = [9, 16, 10, 15, 12, 11, 14, 13]  # one shape for an engine that pads to 8: one call, not several
    assert len(length_batches(lengths, 8, call_cost=8)) > 1
    assert [sorted(g.tolist()) for g in length_batches(lengths, 8, call_cost=8, step=8)] == [list(range(8))]
    assert [g.tolist() for g in length_batches([17, 3, 9], 1, step=8)] == [[1], [2], [0]]  # still shortest first


def test_run_rows_groups_by_the_engines_own_padding_step():
    seen = []

    class Padding:
        length_step = 8

        def run(self, inputs):
            seen.append(inputs["input_ids"].shape)
            return [inputs["input_ids"].astype(np.float32)]

    rows = [{"input_ids": np.arange(1, n + 1), "attention_mask": np.ones(n, dtype=np.int64)}
            for n in (9, 16, 10, 15, 12)]
    out = run_rows(Padding(), rows, 0, 8, per_token=True)
    assert seen == [(5, 16)] and [len(o[0]) for o in out] == [9, 16, 10, 15, 12]


def test_classify_backends_agree_and_order_does_not_matter(folders):
    ps = _load_all(folders["classify"], max_batch=2)
    ref = ps["torch-fp32"].classify(TEXTS)
    for name, p in ps.items():
        got = p.classify(TEXTS)
        tol = 2e-2 if name == "onnx-int8" else 1e-5
        for r, g in zip(ref, got, strict=True):
            assert set(g) == {"label", "score", "scores"} and set(g["scores"]) == {"negative", "positive"}
            assert abs(sum(g["scores"].values()) - 1) < 1e-5
            assert abs(r["scores"]["positive"] - g["scores"]["positive"]) < tol
    # shuffled inputs, other batch size: each result follows its text
    perm = np.random.default_rng(0).permutation(len(TEXTS))
    big = Predictor.load(folders["classify"], backend="onnx-fp32", max_batch=64)
    shuffled = big.classify([TEXTS[i] for i in perm])
    for k, i in enumerate(perm):
        assert abs(shuffled[k]["score"] - ref[i]["score"]) < 1e-5
    # a text alone equals the same text batched with a long one (padding does not leak)
    alone = big.classify([TEXTS[1]])[0]["scores"]["positive"]
    assert abs(alone - big.classify([LONG, TEXTS[1]])[1]["scores"]["positive"]) < 1e-5


def test_classify_truncates_long_text_and_takes_pairs(folders):
    p = Predictor.load(folders["classify"], backend="onnx-fp32")
    ids = p.tokenizer(LONG, truncation=True, max_length=p.max_length)["input_ids"]
    cut = p.tokenizer.decode(ids[1:-1])
    assert p.max_length == 128 and len(p.tokenizer(LONG)["input_ids"]) > 128
    assert abs(p.classify([LONG])[0]["score"] - p.classify([cut])[0]["score"]) < 1e-5
    pair = p.classify([("the movie", "was great")])[0]
    assert abs(pair["score"] - p.classify(["the movie"])[0]["score"]) > 1e-7  # the pair's second text counts


def test_embed_backends_matryoshka_and_pooling(folders):
    ps = _load_all(folders["embed"], max_batch=3)
    ref = ps["torch-fp32"].embed(TEXTS)
    assert ref.shape == (6, 32) and np.allclose(np.linalg.norm(ref, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(ps["onnx-fp32"].embed(TEXTS), ref, atol=1e-5)
    assert ((ps["onnx-int8"].embed(TEXTS) * ref).sum(1) > 0.98).all()
    p = ps["onnx-fp32"]
    raw = p.embed_raw(TEXTS)
    small = p.embed(TEXTS, dim=8)
    np.testing.assert_allclose(small, raw[:, :8] / np.linalg.norm(raw[:, :8], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(p.embed(TEXTS, normalize=False), raw, atol=1e-6)
    with pytest.raises(EncoderkitError, match="dim=64"):
        finish_embeddings(raw, 64, True)
    # mean pooling over real tokens only: the same text alone or beside a long one
    np.testing.assert_allclose(p.embed([TEXTS[1]]), p.embed([LONG, TEXTS[1]])[1:], atol=1e-5)


def test_rerank_scores_and_ranking(folders):
    ps = _load_all(folders["rerank"])
    scores = ps["torch-fp32"].score_pairs(["good movie"] * len(TEXTS), TEXTS)
    np.testing.assert_allclose(ps["onnx-fp32"].score_pairs(["good movie"] * len(TEXTS), TEXTS), scores, atol=1e-5)
    ranking = ps["onnx-fp32"].rerank("good movie", TEXTS)
    assert sorted(r["index"] for r in ranking) == list(range(len(TEXTS)))
    assert [r["index"] for r in ranking] == list(np.argsort(-scores, kind="stable"))


def test_extract_spans_and_striding(folders):
    ps = _load_all(folders["ner"], max_batch=2)
    texts = ["Angela said that Paris was great", LONG]
    ref = ps["torch-fp32"].extract(texts)
    got = ps["onnx-fp32"].extract(texts)
    assert [[(e["start"], e["end"], e["label"]) for e in ents] for ents in got] == \
        [[(e["start"], e["end"], e["label"]) for e in ents] for ents in ref]
    assert all(abs(a["score"] - b["score"]) < 1e-5
               for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    labels = {"PER", "LOC"}
    for text, ents in zip(texts, ref, strict=True):
        for e in ents:
            assert set(e) == {"entity", "label", "start", "end", "score"}
            assert text[e["start"]:e["end"]] == e["entity"] and e["label"] in labels and 0 <= e["score"] <= 1
    # the long text is cut into windows, not truncated: words past the first window are tagged too
    p = ps["onnx-fp32"]
    first_window_chars = len(p.tokenizer.decode(p.tokenizer(LONG, truncation=True, max_length=128)["input_ids"][1:-1]))
    tagged = {(e["start"], e["end"]) for e in ref[1]}
    assert tagged and max(s for s, _ in tagged) > first_window_chars


def test_answer_spans_and_long_context(folders):
    ps = _load_all(folders["qa"])
    questions = ["who was in paris ?", "what was great ?"]
    contexts = ["the man was in paris and it was great", LONG]
    ref = ps["torch-fp32"].answer(questions, contexts)
    got = ps["onnx-fp32"].answer(questions, contexts)
    for c, r, g in zip(contexts, ref, got, strict=True):
        assert set(r) == {"answer", "start", "end", "score"}
        assert c[r["start"]:r["end"]] == r["answer"] and r["answer"]
        assert (g["start"], g["end"]) == (r["start"], r["end"]) and abs(g["score"] - r["score"]) < 1e-4
    with pytest.raises(EncoderkitError, match="2 questions but 1 contexts"):
        ps["onnx-fp32"].answer(questions, contexts[:1])


def test_auto_backend_and_wrong_task_calls(folders, tmp_path_factory, tiny_tokenizer_dir):
    assert Predictor.load(folders["classify"]).backend == "onnx-fp32"
    assert Predictor.load(folders["ner"]).backend == "onnx-fp32"
    assert Predictor.load(folders["embed"]).backend == "onnx-int8"
    with pytest.raises(EncoderkitError, match="is a 'ner' model"):
        Predictor.load(folders["ner"], backend="onnx-fp32").classify(["x"])
    with pytest.raises(EncoderkitError, match="backend 'gpu'"):
        Predictor.load(folders["ner"], backend="gpu")


def test_auto_runs_a_folder_holding_only_the_int8_graph_on_it(folders, tmp_path, monkeypatch, capsys):
    """An INT8-only export of a classifier (no model.onnx, no weights): auto, serve's default, runs
    model.int8.onnx rather than trying to export an FP32 graph it has nothing to export from."""
    import shutil

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    only = tmp_path / "int8-only"
    shutil.copytree(folders["classify"], only)
    for f in ["model.onnx", "model.safetensors", "pytorch_model.bin"]:
        (only / f).unlink(missing_ok=True)
    assert sorted(p.name for p in only.glob("*.onnx")) == ["model.int8.onnx"]
    p = Predictor.load(only)
    assert p.backend == "onnx-int8" and Predictor.load(folders["classify"]).backend == "onnx-fp32"
    ref = Predictor.load(folders["classify"], backend="onnx-int8").classify(TEXTS)
    assert [r["scores"] for r in p.classify(TEXTS)] == [r["scores"] for r in ref]
    assert not (tmp_path / "cache").exists()  # nothing was exported
    from encoderkit.deploy.serve import load_models

    assert load_models([f"c={only}"])["c"].backend == "onnx-int8"  # `encoderkit serve --model c=DIR`
    assert main(["predict", "--model", str(only), "--input", str(_txt(tmp_path)),
                 "--output", str(tmp_path / "o.jsonl")]) == 0
    lines = (tmp_path / "o.jsonl").read_text().splitlines()
    assert [json.loads(x)["scores"] for x in lines] == [r["scores"] for r in ref]
    assert main(["predict", "--model", str(only), "--backend", "onnx-fp32", "--input", str(_txt(tmp_path)),
                 "--output", str(tmp_path / "f.jsonl")]) == 2  # asked for FP32 explicitly: a clear refusal
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err, err


def test_predict_refuses_an_output_it_cannot_write_before_loading_the_model(folders, tmp_path, monkeypatch, capsys):
    from encoderkit.inference import predictor as runtime
    from tests.test_write_failures import read_only

    loaded = []
    monkeypatch.setattr(runtime.Predictor, "load", classmethod(lambda cls, *a, **k: loaded.append(a)))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = ["predict", "--model", str(folders["classify"]), "--input", str(_txt(tmp_path)), "--output"]
    assert main([*args, str(blocker / "sub" / "out.jsonl")]) == 2
    assert f"--output {blocker / 'sub' / 'out.jsonl'} cannot be created: {blocker} is a file" in capsys.readouterr().err
    assert main([*args, str(tmp_path)]) == 2
    assert f"--output {tmp_path} is a folder; give a file name" in capsys.readouterr().err
    parent = read_only(tmp_path / "read-only", monkeypatch)
    assert main([*args, str(parent / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"--output {parent / 'out.jsonl'} cannot be written: creating a folder in {parent} failed" in err, err
    assert loaded == [] and list(parent.iterdir()) == []


def _txt(tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(TEXTS) + "\n")
    return tmp_path / "in.txt"


def test_auto_exports_a_plain_folder_once(tmp_path_factory, tiny_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    from encoderkit.inference import engines

    # auto: ONNX INT8, one text at a time (AVX-512 VNNI without OpenVINO)
    monkeypatch.setattr(hardware, "detect", lambda: Hardware.from_cpuinfo(VNNI_NO_BF16, threads=2))
    monkeypatch.setattr(engines, "openvino_ready", lambda: False)
    src = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    p = Predictor.load(src)
    assert p.backend == "onnx-int8" and p.engine.per_row
    made = sorted((tmp_path / "cache" / "onnx").iterdir())
    cached = [p for p in made if not p.name.endswith("-plain")]  # and the plain FP32 graph INT8 is checked against
    assert len(cached) == 1 and (cached[0] / "model.int8.onnx").is_file() and (cached[0] / "model.onnx").is_file()
    assert [p.name for p in made if p not in cached] == [cached[0].name + "-plain"]
    Predictor.load(src, backend="onnx-fp32")
    assert sorted((tmp_path / "cache" / "onnx").iterdir()) == made  # reused, not exported again


def test_predict_cli_txt_and_jsonl(folders, tmp_path):
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:3]) + "\n\n")
    out = tmp_path / "out.jsonl"
    assert main(["predict", "--model", str(folders["classify"]), "--input", str(tmp_path / "in.txt"),
                 "--output", str(out), "--backend", "onnx-fp32", "--max-batch", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ref = Predictor.load(folders["classify"], backend="onnx-fp32").classify(TEXTS[:3])
    assert [r["label"] for r in rows] == [r["label"] for r in ref]
    assert main(["predict", "--model", str(folders["classify"]), "--input", str(tmp_path / "in.txt"),
                 "--output", str(out)]) == 2  # exists, no --overwrite
    qa_in = tmp_path / "qa.jsonl"
    qa_in.write_text(json.dumps({"id": 7, "question": "who ?", "context": "the man"}) + "\n")
    assert main(["predict", "--model", str(folders["qa"]), "--input", str(qa_in),
                 "--output", str(tmp_path / "qa.out")]) == 0
    row = json.loads((tmp_path / "qa.out").read_text())
    assert row["id"] == 7 and "the man"[row["start"]:row["end"]] == row["answer"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "who ?"}\n')
    assert main(["predict", "--model", str(folders["qa"]), "--input", str(bad), "--output", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_minilm_int8_matches_sentence_transformers(minilm_dir, shared_data, tmp_path, monkeypatch):
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    lines = (shared_data / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:129]
    texts = [line.split("\t")[0] for line in lines]
    ref = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, normalize_embeddings=True)
    p = Predictor.load(minilm_dir)
    assert p.backend in ("onnx-int8", "openvino-int8") and p.info.pooling == "mean" and p.max_length == 256
    cos = (p.embed(texts) * ref).sum(1)  # OpenVINO's static INT8 (on its CPU class) calibrated on the vocabulary
    assert cos.mean() >= 0.99 and cos.min() >= 0.95


def _numbered(tmp_path, n: int, bad_line: int | None = None):
    """``n`` records with ids and texts of varied lengths; line ``bad_line`` lacks its text."""
    words = TEXTS[2].split(" ")
    lines = [json.dumps({"id": i, "text": " ".join(words[:2 + i % 9])} if i + 1 != bad_line else {"id": i})
             for i in range(n)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in.jsonl"


def read_ahead(monkeypatch, module, out):
    """Wraps ``module.iter_records``: for each record read, how many records were read and not yet in the (temporary)
    output file then; the list it fills."""
    real, ahead = module.iter_records, []

    def counting(path, task, *rest):
        for n, rec in enumerate(real(path, task, *rest), 1):
            tmp = list(out.parent.glob(f".{out.name}.tmp-*"))
            ahead.append(n - (len(tmp[0].read_text().splitlines()) if tmp else 0))
            yield rec

    monkeypatch.setattr(module, "iter_records", counting)
    return ahead


def test_predict_reads_runs_and_writes_its_input_a_chunk_at_a_time(folders, tmp_path, monkeypatch):
    from encoderkit.inference import predictor

    monkeypatch.setattr(predictor, "CHUNK", 7)
    src, out = _numbered(tmp_path, 30), tmp_path / "out.jsonl"
    ahead = read_ahead(monkeypatch, predictor, out)
    res = predictor.run(predictor.PredictConfig(model=str(folders["embed"]), input=str(src), output=str(out),
                                                max_batch=4))  # auto: INT8, whose vectors depend on their batch
    assert res.records == 30 and max(ahead) == 7  # one chunk read ahead of what is written, never the whole input
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(30))
    p = Predictor.load(folders["embed"], max_batch=4)
    records = [json.loads(x) for x in src.read_text().splitlines()]
    want = [r for a in range(0, 30, 7) for r in predictor.predict_records(p, records[a:a + 7])]  # batched per chunk
    assert np.abs(np.array([r["embedding"] for r in rows]) - np.array([r["embedding"] for r in want])).max() <= 1e-6
    out.unlink()
    _numbered(tmp_path, 30, bad_line=26)  # in the fourth chunk: three chunks were run (and written) first
    with pytest.raises(EncoderkitError, match=rf"^{tmp_path / 'in.jsonl'}:26: "):
        predictor.run(predictor.PredictConfig(model=str(folders["embed"]), input=str(src), output=str(out)))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.jsonl"]  # no output, no temporary file
