"""``--ray``: the corpus commands on a local Ray cluster give the single-process output, row for row: the same
values (1e-6) under dynamic INT8 too, whose vectors depend on the batch, since the driver ships the single-process
run's engine calls whole.

One local cluster (2 CPUs) for the module; tiny in-process models. A worker that exits mid-batch is restarted by
Ray and every row still comes back once, in order. A bad address and a missing Ray are clear errors.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_bert_config
from deploy_models import export_task_model, make_task_model, tiny_root

from encoderkit.errors import EncoderkitError

TESTS = Path(__file__).resolve().parent
WORDS = ["the", "great", "movie", "dull", "film", "story", "fun", "boring", "best", "worst", "love", "plot"]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster with 2 CPUs for the module (its workers import this file's helpers: tests/ on their path)."""
    ray = pytest.importorskip("ray", reason='Ray is an optional extra: pip install "encoderkit[ray]"')
    pytest.importorskip("ray.data", reason='Ray Data is missing: pip install "encoderkit[ray]"')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    root = tiny_root(tmp_path_factory)
    out = {t: make_task_model(root, tiny_tokenizer_dir, t) for t in ("classify", "embed")}
    out["embed_int8"] = export_task_model(root, tiny_tokenizer_dir, "embed")  # backend auto: its INT8 graph
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    out["mlm"] = root / "tiny_mlm_ray"
    BertForMaskedLM(tiny_bert_config(len(tok))).save_pretrained(out["mlm"])
    tok.save_pretrained(out["mlm"])
    return out


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, 3 + i % 9)) for i in range(n)]  # lengths vary: batches pad differently


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _same_records(a: list[dict], b: list[dict], floats: tuple[str, ...], atol: float = 1e-5) -> None:
    """Same rows in the same order; the fields in ``floats`` within ``atol``, the rest equal."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if k in floats and isinstance(x[k], dict):  # label -> probability
                assert x[k].keys() == y[k].keys()
                np.testing.assert_allclose(list(x[k].values()), list(y[k].values()), atol=atol)
            elif k in floats and x[k] is not None:
                np.testing.assert_allclose(np.asarray(x[k], float), np.asarray(y[k], float), atol=atol)
            else:
                assert x[k] == y[k], k


# -- helpers the workers run (importable from tests/, see the fixture) -----------------------------------------

def times_ten(model: int, rows: list[dict]) -> list[int]:
    return [r["x"] * model for r in rows]


def die_once(marker: str, row: int) -> tuple[str, int]:
    return marker, row


def exit_on_row_once(model: tuple[str, int], rows: list[dict]) -> list[int]:
    """Exits the worker process (no exception: the process is gone) the first time it is given ``row``."""
    marker, row = model
    if any(r["x"] == row for r in rows) and not Path(marker).exists():
        Path(marker).write_text("died")
        os._exit(1)
    return [r["x"] * 10 for r in rows]


def refuse_model() -> None:
    raise EncoderkitError("models/x is a 'classify' model; this needs an embed model")


# -- the shared machinery ----------------------------------------------------------------------------------------

def test_rows_come_back_once_in_input_order_after_a_worker_dies(cluster, tmp_path):
    from encoderkit.ray_jobs import map_rows

    rows = [{"x": i} for i in range(103)]
    assert (map_rows(rows, partial(int, 10), times_ten, address="auto", actors=2, batch=8)
            == [i * 10 for i in range(103)])
    marker = tmp_path / "died"
    got = map_rows(rows, partial(die_once, str(marker), 50), exit_on_row_once, address="auto", actors=2, batch=8)
    assert marker.exists()  # the worker really died on the batch holding row 50
    assert got == [i * 10 for i in range(103)]  # that batch was retried; each row once, in order


def group_of(model: int, rows: list[dict]) -> list[tuple[int, ...]]:
    return [tuple(r["x"] for r in rows)] * len(rows)


def test_each_group_is_one_call_and_blocks_never_split_one(cluster):
    from encoderkit.ray_jobs import map_rows, pack

    groups = [[4, 0, 7], [1], [2, 3, 5, 6, 8, 9, 10], [11, 12]]
    assert [[len(g) for g in b] for b in pack(groups, 4)] == [[3, 1], [7], [2]]
    got = map_rows([{"x": i} for i in range(13)], partial(int, 0), group_of, address="auto", actors=2, batch=4,
                   groups=groups)
    assert got == [next(tuple(g) for g in groups if i in g) for i in range(13)]  # each row saw exactly its group
    with pytest.raises(ValueError, match="each of the 13 rows once"):
        map_rows([{"x": i} for i in range(13)], partial(int, 0), group_of, address="auto", groups=groups[:3])


def test_the_local_runs_engine_calls_run_one_by_one_give_its_int8_vectors(models):
    """The proof of the driver's plan, without Ray: each call of engine_batches run alone (as_one_call) gives the
    vectors of the whole local run, exactly; and another batching gives them too (INT8 runs one text at a time)."""
    from encoderkit.inference.predictor import Predictor, as_one_call, engine_batches, text_lengths

    texts = _texts(70)
    p = Predictor.load(models["embed_int8"], max_batch=8)
    assert p.backend == "onnx-int8"
    local = p.embed_raw(texts)
    other = Predictor.load(models["embed_int8"], max_batch=5).embed_raw(texts)
    assert np.abs(other - local).max() <= 1e-6  # batch-independent: another batching gives the same vectors
    got = np.zeros_like(local)
    groups = engine_batches(p, text_lengths(p, texts))
    assert sorted(i for g in groups for i in g) == list(range(70)) and max(map(len, groups)) <= 8
    for g in groups:
        got[g] = as_one_call(Predictor.embed_raw, p, [texts[i] for i in g])
    assert np.abs(got - local).max() <= 1e-6
    chunked = engine_batches(p, text_lengths(p, texts), chunk=32)  # a caller's chunks: no call crosses one
    assert all(len({i // 32 for i in g}) == 1 for g in chunked)


def test_a_stream_of_chunks_comes_back_chunk_by_chunk_in_order_after_a_worker_dies(cluster, tmp_path):
    from encoderkit.ray_jobs import map_chunks

    chunks = [([{"x": i} for i in range(a, min(a + 10, 43))], None) for a in range(0, 43, 10)]
    marker = tmp_path / "died"
    got = list(map_chunks(iter(chunks), partial(die_once, str(marker), 25), exit_on_row_once, address="auto",
                          actors=2, batch=4))
    assert marker.exists()  # the actor really died on the block holding row 25
    assert got == [[r["x"] * 10 for r in rows] for rows, _ in chunks]  # restarted, its block rerun; in order
    groups = [[4, 0, 7], [1], [2, 3, 5, 6, 8, 9], []]
    got = list(map_chunks([([{"x": i} for i in range(10)], groups)], partial(int, 0), group_of, address="auto",
                          batch=4))
    assert got == [[next(tuple(g) for g in groups if i in g) for i in range(10)]]  # each row saw exactly its group
    with pytest.raises(EncoderkitError, match="^models/x is a 'classify' model"):  # itself, not Ray's wrapper
        list(map_chunks([([{"x": 1}], None)], refuse_model, times_ten, address="auto", actors=1))


def test_a_workers_user_error_reaches_the_caller_as_itself(cluster):
    from encoderkit.ray_jobs import map_rows

    with pytest.raises(EncoderkitError, match="^models/x is a 'classify' model"):  # itself, not Ray's wrapper
        map_rows([{"x": 1}], refuse_model, times_ten, address="auto", actors=1, batch=8)


# -- each command: --ray against the local run -------------------------------------------------------------------

@pytest.mark.parametrize("model,backend,floats,atol", [("classify", "torch-fp32", ("score", "scores"), 1e-5),
                                                       ("embed_int8", "auto", ("embedding",), 1e-6)])
def test_predict_on_ray_equals_the_local_run(cluster, models, tmp_path, model, backend, floats, atol):
    from encoderkit.inference.predictor import PredictConfig, run

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                                               for i, t in enumerate(_texts(45))))
    common = {"model": str(models[model]), "input": str(tmp_path / "in.jsonl"), "backend": backend, "max_batch": 4}
    run(PredictConfig(**common, output=str(tmp_path / "local.jsonl")))
    res = run(PredictConfig(**common, output=str(tmp_path / "ray.jsonl"), ray="auto", ray_actors=2, ray_batch=8))
    assert res.records == 45
    local, remote = _jsonl(tmp_path / "local.jsonl"), _jsonl(tmp_path / "ray.jsonl")
    assert [r["id"] for r in remote] == [f"r{i}" for i in range(45)]
    _same_records(local, remote, floats=floats, atol=atol)


def test_predict_on_ray_streams_its_input_in_chunks_and_equals_the_local_run(cluster, models, tmp_path, monkeypatch):
    """With a chunk of 7 records, 30 records: the local run and --ray write the same rows (INT8: the same batches per
    chunk), the Ray driver reads at most IN_FLIGHT chunks ahead of what it has written, and a bad record in a later
    chunk is its file:line, with no output file left."""
    from test_runtime import read_ahead

    from encoderkit import ray_jobs
    from encoderkit.inference import predictor

    monkeypatch.setattr(predictor, "CHUNK", 7)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(_texts(30))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"model": str(models["embed_int8"]), "input": str(tmp_path / "in.jsonl"), "max_batch": 4}  # auto: INT8
    predictor.run(predictor.PredictConfig(**common, output=str(tmp_path / "local.jsonl")))
    ahead = read_ahead(monkeypatch, predictor, tmp_path / "ray.jsonl")
    res = predictor.run(predictor.PredictConfig(**common, output=str(tmp_path / "ray.jsonl"), ray="auto", ray_actors=2,
                                                ray_batch=8))
    assert res.records == 30 and max(ahead) == ray_jobs.IN_FLIGHT * 7 < 30  # chunks in flight, never the whole input
    local, remote = _jsonl(tmp_path / "local.jsonl"), _jsonl(tmp_path / "ray.jsonl")
    assert [r["id"] for r in remote] == [f"r{i}" for i in range(30)]
    _same_records(local, remote, floats=("embedding",), atol=1e-6)
    rows[24] = {"id": "r24"}  # line 25, in the fourth chunk
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EncoderkitError, match=rf"^{tmp_path / 'bad.jsonl'}:25: "):
        predictor.run(predictor.PredictConfig(**common | {"input": str(tmp_path / "bad.jsonl")},
                                              output=str(tmp_path / "bad.out.jsonl"), ray="auto", ray_batch=8))
    assert not [x for x in tmp_path.iterdir() if x.name.startswith((".bad.out", "bad.out"))]


def test_index_on_ray_equals_the_local_run(cluster, models, tmp_path, monkeypatch):
    from encoderkit.retrieval import index
    from encoderkit.retrieval.index import IndexConfig, run
    from encoderkit.retrieval.store import open_generation

    monkeypatch.setattr(index, "EMBED_CHUNK", 16)  # several chunks, streamed to the actors a few at a time
    monkeypatch.setattr(index, "BLOCK_TEXTS", 32)  # and several blocks of documents read, embedded and written
    monkeypatch.setattr(index, "BLOCK_ROWS", 32)

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                              for i, t in enumerate(_texts(60))))
    common = {"model": str(models["embed_int8"]), "corpus": [str(tmp_path / "c.jsonl")], "batch_size": 4,
              "passage_tokens": 6, "overlap": 2, "float16": True}  # backend auto: INT8
    run(IndexConfig(**common, out=str(tmp_path / "local")))
    run(IndexConfig(**common, out=str(tmp_path / "ray"), ray="auto", ray_actors=2, ray_batch=16))
    a, b = open_generation(tmp_path / "local"), open_generation(tmp_path / "ray")
    assert len(a.passages) > 3 * 32 and a.passages == b.passages  # long texts were split: more rows than documents
    assert (np.abs(np.asarray(a.arrays["float16"], np.float32) - np.asarray(b.arrays["float16"], np.float32)).max()
            <= 1e-6)
    np.testing.assert_allclose(a.arrays["int8_calibration"], b.arrays["int8_calibration"], atol=1e-6)
    assert np.array_equal(np.asarray(a.arrays["binary"]), np.asarray(b.arrays["binary"]))


def test_index_on_ray_reads_its_corpus_in_flight_blocks_only(cluster, models, tmp_path, monkeypatch):
    """20 blocks of documents: the --ray driver reads at most IN_FLIGHT blocks ahead of the rows it has written, and
    writes the local run's files, byte for byte."""
    from test_search_index import documents_read_ahead

    from encoderkit import ray_jobs
    from encoderkit.retrieval import index

    monkeypatch.setattr(index, "EMBED_CHUNK", 8)
    monkeypatch.setattr(index, "BLOCK_TEXTS", 16)
    monkeypatch.setattr(index, "BLOCK_ROWS", 16)
    ahead = documents_read_ahead(monkeypatch)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                              for i, t in enumerate(_texts(320))))
    common = {"model": str(models["embed_int8"]), "corpus": [str(tmp_path / "c.jsonl")], "batch_size": 4,
              "passage_tokens": -1}  # one passage per document; backend auto: INT8
    index.run(index.IndexConfig(**common, out=str(tmp_path / "local")))
    assert max(ahead) == 16
    ahead.clear()
    st = index.run(index.IndexConfig(**common, out=str(tmp_path / "ray"), ray="auto", ray_actors=2, ray_batch=8)).stats
    assert st["passages"] == 320 and max(ahead) == ray_jobs.IN_FLIGHT * 16 < 320  # blocks in flight, never the corpus
    files = [json.loads((tmp_path / x / (tmp_path / x / "CURRENT").read_text().strip() / "manifest.json").read_text())
             ["files"] for x in ("local", "ray")]
    assert files[0] == files[1]  # every file's size and sha256


@pytest.mark.parametrize("labeller", ["embed", "cloze"])
def test_label_on_ray_equals_the_local_run(cluster, models, tmp_path, labeller):
    from encoderkit.label.run import LabelConfig, run

    (tmp_path / "in.txt").write_text("\n".join(_texts(37)) + "\n")
    kw = ({"model": str(models["embed_int8"])} if labeller == "embed" else  # backend auto: INT8
          {"model": str(models["mlm"]), "verbalizer": ["neg=bad", "pos=good"], "pattern": "{text} . it was {mask} ."})
    common = {"input": str(tmp_path / "in.txt"), "labels": "neg,pos", "labeller": labeller, "batch_size": 4, **kw}
    run(LabelConfig(**common, output=str(tmp_path / "local.jsonl")))
    run(LabelConfig(**common, output=str(tmp_path / "ray.jsonl"), ray="auto", ray_actors=2, ray_batch=8))
    local, remote = _jsonl(tmp_path / "local.jsonl"), _jsonl(tmp_path / "ray.jsonl")
    assert [r["text"] for r in remote] == _texts(37)
    _same_records(local, remote, floats=("confidence",), atol=1e-6)
    ledgers = [json.loads((tmp_path / f"{x}.jsonl.ledger.json").read_text()) for x in ("local", "ray")]
    if labeller == "embed":  # the engine the driver chose, recorded in the ledger
        assert ledgers[0]["engine"] == ledgers[1]["engine"] and "int8" in ledgers[0]["engine"]["backend"]
    else:
        assert "engine" not in ledgers[0]


def _reading_ahead(monkeypatch, module, out: Path) -> list[list[int]]:
    """Wraps ``module.iter_texts``: per pass over the input (label's first pass only checks and counts the rows,
    keeping none), for each row read, how many rows were read and not yet in the (temporary) output file then."""
    real, ahead = module.iter_texts, []

    def counting(*a):
        ahead.append([])
        for n, row in enumerate(real(*a), 1):
            tmp = list(out.parent.glob(f".{out.name}.tmp-*"))
            ahead[-1].append(n - (len(tmp[0].read_text().splitlines()) if tmp else 0))
            yield row

    monkeypatch.setattr(module, "iter_texts", counting)
    return ahead


@pytest.mark.parametrize("labeller", ["embed", "cloze"])
def test_label_reads_labels_and_writes_a_block_at_a_time(cluster, models, tmp_path, monkeypatch, labeller):
    """Blocks of 2 calls of 8 rows over 150 rows: the local run reads one block ahead of the lines it has written,
    --ray at most IN_FLIGHT blocks, and both write the lines of a run that read every row first (the calls of 8
    rows are the same), in order."""
    from encoderkit import ray_jobs
    from encoderkit.label import run as label

    monkeypatch.setattr(label, "LABEL_CHUNK", 8)
    monkeypatch.setattr(label, "LABEL_BLOCK", 2)
    texts = _texts(150)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"review": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    kw = ({"model": str(models["embed_int8"])} if labeller == "embed" else
          {"model": str(models["mlm"]), "verbalizer": ["neg=bad", "pos=good"], "pattern": "{text} . it was {mask} ."})
    common = {"input": str(tmp_path / "in.jsonl"), "labels": "neg,pos", "labeller": labeller, "batch_size": 4, **kw}
    from encoderkit.label.offline import ClozeLabeller, EmbedLabeller
    from encoderkit.label.records import dumps, output_record, parse_pairs

    if labeller == "embed":
        model = EmbedLabeller(str(models["embed_int8"]), ["neg", "pos"], {}, None, 0.05, "auto", 4)
    else:
        model = ClozeLabeller(str(models["mlm"]), ["neg", "pos"], parse_pairs(kw["verbalizer"], ["neg", "pos"], "v"),
                              kw["pattern"], batch_size=4)
    results = [r for a in range(0, 150, 8) for r in model.label(texts[a : a + 8])]  # every row read first
    name = f"{labeller}:{Path(kw['model']).name}"
    want = [json.loads(dumps(output_record(t, r.label, r.confidence, name, {"review": t, "n": i})))
            for i, (t, r) in enumerate(zip(texts, results, strict=True))]
    for ray, bound in ((None, 16), ("auto", ray_jobs.IN_FLIGHT * 16)):
        out = tmp_path / f"{ray}.jsonl"
        ahead = _reading_ahead(monkeypatch, label, out)
        label.run(label.LabelConfig(**common, output=str(out), ray=ray, ray_actors=2, ray_batch=8))
        assert len(ahead) == 2 and max(ahead[-1]) == bound < 150  # the check pass, then the labelling pass
        _same_records(want, _jsonl(out), floats=("confidence",), atol=1e-6)


def test_audit_suspect_on_ray_equals_the_local_run(cluster, models, tmp_path):
    pytest.importorskip("cleanlab")
    from encoderkit.label.suspicion import SuspectConfig, run

    texts = _texts(60)
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t, "label": "pos" if "fun" in t or i % 3 else "neg"})
                                              + "\n" for i, t in enumerate(texts)))
    common = {"input": str(tmp_path / "l.jsonl"), "features": "embed", "model": str(models["embed_int8"]), "folds": 3}
    run(SuspectConfig(**common, output=str(tmp_path / "local.jsonl")))
    run(SuspectConfig(**common, output=str(tmp_path / "ray.jsonl"), ray="auto", ray_actors=2, ray_batch=16))
    local, remote = _jsonl(tmp_path / "local.jsonl"), _jsonl(tmp_path / "ray.jsonl")
    assert [r["text"] for r in remote] == texts
    for x, y in zip(local, remote, strict=True):
        assert x["label"] == y["label"] and abs(x["suspicion"] - y["suspicion"]) <= 1e-6


# -- bad input ------------------------------------------------------------------------------------------------

def test_an_address_that_does_not_answer_fails_in_seconds_and_writes_nothing(models, tmp_path):
    pytest.importorskip("ray.data", reason='Ray is an optional extra: pip install "encoderkit[ray]"')
    from encoderkit.inference.predictor import PredictConfig, run

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "in.txt").write_text("a great movie\n")
    t0 = time.perf_counter()
    with pytest.raises(EncoderkitError, match=rf"--ray 127\.0\.0\.1:{port}: nothing answers.*ray start --head"):
        run(PredictConfig(model=str(models["classify"]), input=str(tmp_path / "in.txt"),
                          output=str(tmp_path / "out.jsonl"), ray=f"127.0.0.1:{port}"))
    assert time.perf_counter() - t0 < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_without_ray_the_flag_names_the_install_command(models, tmp_path, monkeypatch):
    from encoderkit.label.suspicion import SuspectConfig
    from encoderkit.label.suspicion import run as suspect
    from encoderkit.retrieval.index import IndexConfig
    from encoderkit.retrieval.index import run as index

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "a", "text": "a great movie", "label": "pos"}) + "\n")
    for call in (lambda: index(IndexConfig(model=str(models["embed"]), corpus=[str(tmp_path / "c.jsonl")],
                                           out=str(tmp_path / "idx"), ray="auto")),
                 lambda: suspect(SuspectConfig(input=str(tmp_path / "c.jsonl"), output=str(tmp_path / "s.jsonl"),
                                               features="embed", ray="auto"))):
        with pytest.raises(EncoderkitError, match=r'install it with: pip install "encoderkit\[ray\]"'):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_ray_flags_that_would_run_no_model_are_refused():
    from encoderkit.label.run import LabelConfig
    from encoderkit.label.suspicion import SuspectConfig

    with pytest.raises(EncoderkitError, match="endpoint labeller's model runs on its server"):
        LabelConfig(input="x.txt", labels="a,b", output="o.jsonl", endpoint="http://127.0.0.1:1/v1", llm=["m"],
                    ray="auto")
    with pytest.raises(EncoderkitError, match="--features tfidf runs no model"):
        SuspectConfig(input="x.jsonl", output="o.jsonl", ray="auto")
    with pytest.raises(EncoderkitError, match="--ray-actors must be at least 1"):
        SuspectConfig(input="x.jsonl", output="o.jsonl", features="embed", ray="auto", ray_actors=0)


def test_audit_suspect_embeds_blocks_of_the_whole_files_calls_and_holds_no_text(cluster, models, tmp_path, monkeypatch):
    """The texts go to a temporary file as they are read; blocks of at most 40 rows of the engine calls of one
    `p.embed` over all 200 texts are fetched from it (here at most one block ahead of the vectors stored, on --ray
    IN_FLIGHT blocks): the vectors of that whole-input call under INT8, and the output of the local run."""
    pytest.importorskip("cleanlab")
    from encoderkit import ray_jobs
    from encoderkit.inference.predictor import Predictor
    from encoderkit.label import suspicion

    monkeypatch.setattr(suspicion, "SUSPECT_BLOCK", 40)
    texts = _texts(200)
    p = Predictor.load(models["embed_int8"])
    assert p.backend == "onnx-int8" and p.max_batch < 40
    fetched, stored = [0], [0]
    real_get, real_progress = suspicion.SpilledTexts.__getitem__, suspicion.progress

    def get(self, i):
        fetched[0] += 1
        ahead.append(fetched[0] - stored[0])
        return real_get(self, i)

    def bar(*a, **kw):
        b = real_progress(*a, **kw)
        real_update = b.update
        b.update = lambda n: stored.__setitem__(0, stored[0] + n) or real_update(n)
        return b

    monkeypatch.setattr(suspicion.SpilledTexts, "__getitem__", get)
    monkeypatch.setattr(suspicion, "progress", bar)
    spill = suspicion.SpilledTexts(tmp_path)
    for t in texts:
        spill.append(t)
    ahead: list[int] = []
    got = suspicion._embeddings(p, spill, None)
    assert np.abs(got - p.embed(texts, normalize=True)).max() <= 1e-6 and len(ahead) == 200  # each row read back once
    assert max(ahead) <= 40
    spill.close()
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t, "label": None if i % 9 == 0 else
                                                          ("pos" if "fun" in t or i % 3 else "neg")}) + "\n"
                                              for i, t in enumerate(texts)))
    common = {"input": str(tmp_path / "l.jsonl"), "features": "both", "model": str(models["embed_int8"]), "folds": 3}
    fetched[0] = stored[0] = 0
    ahead.clear()
    suspicion.run(suspicion.SuspectConfig(**common, output=str(tmp_path / "local.jsonl")))
    fetched[0] = stored[0] = 0
    ahead.clear()
    suspicion.run(suspicion.SuspectConfig(**common, output=str(tmp_path / "ray.jsonl"), ray="auto", ray_batch=16))
    assert 40 < max(ahead) <= ray_jobs.IN_FLIGHT * 40 < 200
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    rows = _jsonl(tmp_path / "local.jsonl")
    assert [r["text"] for r in rows] == texts and sum(r["suspicion"] is None for r in rows) == 23
    assert not list(tmp_path.glob(".suspect-texts-*"))  # the spilled texts are gone
