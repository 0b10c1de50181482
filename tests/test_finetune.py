"""Fine-tuning end to end on tiny models: each head learns an easy synthetic task, its folder
loads in plain transformers (and sentence-transformers for embed) with the same predictions,
and bad input fails with a clear error and no output folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.train.finetune import FinetuneConfig, run

POS, NEG, FILL = (["good", "great", "best", "love", "fun"], ["bad", "worst", "dull", "boring"],
                  ["the", "a", "movie", "film", "story", "was", "it"])
TOPICS = ["python", "data", "code", "movie", "love", "time", "man", "story"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (and far faster on a shared machine); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tsv(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for _ in range(n):
        y = rng.randint(0, 1)
        words = rng.sample(FILL, 3) + [rng.choice(POS if y else NEG)]
        rng.shuffle(words)
        lines.append(" ".join(words) + f"\t{'pos' if y else 'neg'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _evaluate(model: Path, data: Path | str) -> dict:
    """`encoderkit evaluate` on a saved folder (task from its encoderkit.json)."""
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    return evaluate(EvaluateConfig(model=str(model), data=str(data))).metrics


def _cfg(tmp_path: Path, model: Path, **kw) -> FinetuneConfig:
    base = {"model": str(model), "out": str(tmp_path / "out"), "lr": 1e-3, "epochs": 3, "batch_size": 16,
            "eval_batch_size": 64, "seed": 0}
    base.update(kw)
    return FinetuneConfig(**base)


@pytest.mark.slow
def test_classify_learns_saves_and_loads_in_plain_transformers(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    train, dev = _tsv(tmp_path / "train.tsv", 320, 0), _tsv(tmp_path / "dev.tsv", 64, 1)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), dev=str(dev), epochs=5))
    assert res.metrics["accuracy"] >= 0.95  # chance is ~0.5: the keyword decides the label
    card = json.loads((res.out / "encoderkit.json").read_text())
    assert card["task"] == "classify" and card["labels"] == ["neg", "pos"] and card["pooling"] == "first"
    model = AutoModelForSequenceClassification.from_pretrained(res.out).eval()
    assert model.config.id2label == {0: "neg", 1: "pos"}
    tok = AutoTokenizer.from_pretrained(res.out)
    with torch.no_grad():
        logits = model(**tok(["the movie was great", "the film was dull"], return_tensors="pt", padding=True)).logits
    assert logits.argmax(-1).tolist() == [1, 0]
    ev = evaluate(EvaluateConfig(model=str(res.out), data=str(dev)))  # task from encoderkit.json
    assert ev.task == "classify" and ev.metrics["accuracy"] == pytest.approx(res.metrics["accuracy"])


def _conll(path: Path, n: int, rng: random.Random, begin: str = "I") -> Path:
    """A CoNLL file of n sentences: LANG ("python code") and PER entities among filler words; ``begin``
    is the first tag's prefix ("I": IOB1, "B": IOB2)."""
    lines = []
    for _ in range(n):
        for _ in range(rng.randint(3, 7)):
            r = rng.random()
            if r < 0.2:
                lines += [f"python X {begin}-LANG", "code X I-LANG"]
            elif r < 0.4:
                lines.append(f"{rng.choice(['he', 'she', 'man'])} X {begin}-PER")
            else:
                lines.append(f"{rng.choice(FILL)} X O")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_ner_learns_and_loads(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForTokenClassification

    rng = random.Random(0)
    train, dev = _conll(tmp_path / "train.conll", 240, rng), _conll(tmp_path / "dev.conll", 40, rng)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="ner", train=str(train), dev=str(dev), max_length=16, stride=4,
                   epochs=10, lr=3e-3))
    assert res.metrics["f1"] >= 0.8  # an untrained head finds almost no entity
    model = AutoModelForTokenClassification.from_pretrained(res.out)
    assert set(model.config.id2label.values()) == {"O", "B-LANG", "I-LANG", "B-PER", "I-PER"}
    assert _evaluate(res.out, dev)["f1"] == pytest.approx(res.metrics["f1"])


def _squad(path: Path, n: int, rng: random.Random, fill: list[str], articles: int) -> Path:
    """A SQuAD file of ``n`` one-question paragraphs over ``articles`` articles: 8 ``fill`` words with the
    answer (python, data or code) inserted at a random place; the question is always "which one ?"."""
    paras = []
    for i in range(n):
        words = rng.sample(fill, 8)
        ans = rng.choice(["python", "data", "code"])
        words.insert(rng.randint(0, 8), ans)
        ctx = " ".join(words)
        paras.append({"context": ctx, "qas": [{"id": str(i), "question": "which one ?",
                                               "answers": [{"text": ans, "answer_start": ctx.index(ans)}]}]})
    path.write_text(json.dumps({"data": [{"title": f"t{j}", "paragraphs": paras[j::articles]}
                                         for j in range(articles)]}))
    return path


@pytest.mark.slow
def test_qa_learns_and_loads(tmp_path, tiny_bert_dir):
    from transformers import AutoModelForQuestionAnswering

    rng, fill = random.Random(0), FILL + ["he", "she", "time", "story"]
    train, dev = _squad(tmp_path / "train.json", 320, rng, fill, 4), _squad(tmp_path / "dev.json", 48, rng, fill, 4)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="qa", train=str(train), dev=str(dev), max_length=32, doc_stride=8))
    assert res.metrics["exact_match"] >= 0.9
    assert isinstance(AutoModelForQuestionAnswering.from_pretrained(res.out).qa_outputs, torch.nn.Linear)
    assert _evaluate(res.out, dev)["exact_match"] == pytest.approx(res.metrics["exact_match"])


def _pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic, *others = rng.sample(TOPICS, 4)
        passage = lambda t: " ".join(rng.sample(FILL, 3) + [t])
        rows.append({"query": topic, "positive": passage(topic), "negatives": [passage(t) for t in others]})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_rerank_learns_and_loads(tmp_path, tiny_bert_dir, monkeypatch, capsys):
    from transformers import AutoModelForSequenceClassification

    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.rerank.features import score_pairs

    train, dev = _jsonl(tmp_path / "train.jsonl", _pairs(320, 0)), _jsonl(tmp_path / "dev.jsonl", _pairs(40, 1))
    # fp32 on every CPU: bf16 autocast turns itself on where it is native (AVX512-BF16/AMX), and this tiny model at
    # lr 3e-3 then ends with near-equal scores for the two probe pairs below; the test is about the mechanics. A random
    # tiny encoder has to learn at 3e-3 everywhere: the head at HEAD_LR_SCALE x that (what helps a pretrained encoder,
    # test_a_new_rerank_head_learns_faster_than_the_encoder) would overshoot here
    from encoderkit.tasks.rerank import train as rerank

    monkeypatch.setattr(rerank, "HEAD_LR_SCALE", 1.0)
    res = run(_cfg(tmp_path, tiny_bert_dir, task="rerank", train=str(train), dev=str(dev), max_length=16, epochs=10,
                   lr=3e-3, bf16=False))
    assert res.metrics["mrr@10"] >= 0.7  # chance MRR over 4 candidates is ~0.52
    model = AutoModelForSequenceClassification.from_pretrained(res.out)
    assert model.config.num_labels == 1
    s = score_pairs(model, load_tokenizer(res.out), "python", ["the movie python", "the movie data"], 16)
    assert s[0] > s[1]
    assert _evaluate(res.out, dev)["mrr@10"] == pytest.approx(res.metrics["mrr@10"])

    # evaluate reuses the saved max length (16) unless --max-length asks for another
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    seen, real = [], rerank.score_pairs
    monkeypatch.setattr(rerank, "score_pairs", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    evaluate(EvaluateConfig(model=str(res.out), data=str(dev), max_examples=2))
    evaluate(EvaluateConfig(model=str(res.out), data=str(dev), max_examples=2, max_length=24))
    assert seen == [16, 16, 24, 24]
    assert "fine-tuned at 16" in capsys.readouterr().err


def test_rerank_draws_fresh_negatives_each_epoch(tmp_path, tiny_bert_dir):
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.train.finetune import task_inputs

    rows = [{"query": f"q{i}", "positive": f"pos {i}", "negatives": [f"neg {i} {j}" for j in range(12)]}
            for i in range(8)]
    cfg = _cfg(tmp_path, tiny_bert_dir, task="rerank", train=str(_jsonl(tmp_path / "t.jsonl", rows)), max_length=16,
               num_negatives=2, batch_size=2)
    tok = load_tokenizer(tiny_bert_dir)
    folder = ModelFolder.open(tiny_bert_dir)
    module, data, options = task_inputs(cfg, folder)
    task = module.build(data, options, tok, folder)
    idx = np.arange(8)

    def texts(epoch: int) -> list[str]:
        ids = task.source.make_batch(idx, epoch)["input_ids"]
        return [tok.decode(r, skip_special_tokens=True) for r in ids]

    e0, e1 = texts(0), texts(1)
    assert e0 == texts(0)  # seeded by (seed, epoch, row): reproducible, so --resume stays exact
    assert all(t.endswith(f"pos {i // 3}") for i, t in enumerate(e0) if i % 3 == 0)  # the positive leads each group
    negs0 = {t for i, t in enumerate(e0) if i % 3}
    negs1 = {t for i, t in enumerate(e1) if i % 3}
    assert all(" neg " in f" {t}" for t in negs0 | negs1)
    assert len(negs0) == 16 and negs0 != negs1  # 2 distinct per row, and a new draw next epoch


def test_a_new_rerank_head_learns_faster_than_the_encoder(tmp_path, tiny_bert_dir, tiny_tokenizer_dir):
    """A randomly initialised relevance head learns at HEAD_LR_SCALE x --lr (at the encoder's rate the listwise loss
    stays at log(1 + negatives) for a whole epoch of SciFact pairs); a trained cross-encoder keeps --lr."""
    import transformers
    from conftest import tiny_bert_config

    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.rerank import train as rerank
    from encoderkit.train.engine import param_groups
    from encoderkit.train.finetune import task_inputs

    assert rerank.HEAD_LR_SCALE >= 10
    rows = [{"query": f"q{i}", "positive": f"pos {i}", "negatives": [f"neg {i} {j}" for j in range(4)]}
            for i in range(4)]
    cfg = _cfg(tmp_path, tiny_bert_dir, task="rerank", train=str(_jsonl(tmp_path / "t.jsonl", rows)), max_length=16,
               num_negatives=2, batch_size=2)

    def built(model_dir: Path):
        folder = ModelFolder.open(model_dir)
        module, data, options = task_inputs(cfg, folder)
        return module.build(data, options, folder.tokenizer(), folder)

    run = built(tiny_bert_dir)
    assert run.lr_scale == {"classifier": rerank.HEAD_LR_SCALE}
    assert run.card["head"] == {"lr_scale": rerank.HEAD_LR_SCALE}
    head = {id(p) for p in run.module.classifier.parameters()}
    for g in param_groups(run.module, 0.01, run.lr_scale):
        assert g["lr_scale"] == (rerank.HEAD_LR_SCALE if {id(p) for p in g["params"]} <= head else 1.0)
    trained = tmp_path / "cross"
    config = tiny_bert_config(len(transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)))
    config.num_labels = 1
    transformers.BertForSequenceClassification(config).save_pretrained(trained)
    transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(trained)
    assert ModelFolder.open(trained).task == "rerank"
    assert built(trained).lr_scale == {}


def _beir(tmp_path: Path) -> Path:
    """A tiny BEIR folder: 40 one-topic queries; every document on the query's topic is relevant."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    rows = _pairs(40, 1)
    docs = {f"d{i}": r["positive"] for i, r in enumerate(rows)}
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                               for k, v in docs.items()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": r["query"]}) + "\n"
                                                for i, r in enumerate(rows)))
    qrels = [f"q{i}\td{j}\t1" for i, r in enumerate(rows) for j, s in enumerate(rows)
             if s["positive"].split()[-1] == r["query"]]
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(qrels) + "\n")
    return beir


def test_rerank_on_beir_reorders_the_first_stage_top_k(tmp_path, tiny_bert_dir, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    beir, ce = _beir(tmp_path), tmp_path / "ce"
    AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=1).save_pretrained(ce)
    for f in tiny_bert_dir.iterdir():
        if "token" in f.name or f.name == "vocab.txt":
            (ce / f.name).write_bytes(f.read_bytes())
    common = {"model": str(ce), "data": f"{beir}#test", "task": "rerank", "miner": str(tiny_bert_dir), "max_length": 16}
    one = evaluate(EvaluateConfig(**common, candidates=1)).metrics
    assert one["ndcg@10"] == pytest.approx(one["first_stage_ndcg@10"])  # one candidate: nothing to reorder
    assert one["fused_ndcg@10"] == pytest.approx(one["first_stage_ndcg@10"])
    five = evaluate(EvaluateConfig(**common, candidates=5)).metrics
    assert five["recall@100"] == pytest.approx(five["first_stage_recall@100"])  # the same 5 documents, reordered


@pytest.mark.slow
def test_embed_learns_and_loads_in_sentence_transformers(tmp_path, tiny_bert_dir):
    st = pytest.importorskip("sentence_transformers")
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed.features import encode, load_bi_encoder

    beir = _beir(tmp_path)
    train = _jsonl(tmp_path / "train.jsonl", _pairs(320, 0))
    res = run(_cfg(tmp_path, tiny_bert_dir, task="embed", train=str(train), dev=f"{beir}#test", max_length=16,
                   matryoshka_dims=[16], epochs=2))
    assert res.metrics["ndcg@10"] >= 0.9
    for f in ("modules.json", "1_Pooling/config.json", "sentence_bert_config.json"):
        assert (res.out / f).is_file()
    texts = ["the movie python", "a story data"]
    ours = encode(load_bi_encoder(res.out), load_tokenizer(res.out), texts, 16)
    theirs = st.SentenceTransformer(str(res.out), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert _evaluate(res.out, f"{beir}#test")["ndcg@10"] == pytest.approx(res.metrics["ndcg@10"], abs=1e-6)
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    some = evaluate(EvaluateConfig(model=str(res.out), data=f"{beir}#test", max_examples=7)).metrics
    assert some["queries"] == 7 and some["documents"] == 40  # fewer queries, the whole corpus


# -- bad input: clear errors, no output ------------------------------------------------------


def test_bad_inputs_raise_and_leave_no_output(tmp_path, tiny_bert_dir):
    train = _tsv(tmp_path / "train.tsv", 64, 0)
    out = tmp_path / "out"
    with pytest.raises(EncoderkitError, match=r"no column 'text'.*--label-column"):
        run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), label_column="text"))
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tlabel\nthe movie\tneutral\n")
    with pytest.raises(EncoderkitError, match=r"dev.tsv:2: label 'neutral' does not occur in the training data"):
        run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), dev=str(dev)))
    dev.write_text("sentence\tlabel\n  \tpos\n")
    with pytest.raises(EncoderkitError, match=r"dev.tsv:2: column 'sentence' is empty"):
        run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), dev=str(dev)))
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((tiny_bert_dir / "config.json").read_text())
    with pytest.raises(EncoderkitError, match="holds no weights"):
        run(_cfg(tmp_path, no_tok, task="classify", train=str(train)))
    (no_tok / "model.safetensors").write_bytes((tiny_bert_dir / "model.safetensors").read_bytes())
    with pytest.raises(EncoderkitError, match="no tokenizer files"):
        run(_cfg(tmp_path, no_tok, task="classify", train=str(train)))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_long_texts_are_truncated_for_classify(tiny_bert_dir):
    from encoderkit.tasks.classify.features import featurize
    from encoderkit.tasks.common import load_tokenizer

    tok = load_tokenizer(tiny_bert_dir)
    rows = featurize(tok, ["the movie " * 100, "good"], ["a story " * 100, "fun"], max_length=24)
    assert len(rows[0]["input_ids"]) == 24 and rows[0]["input_ids"][-1] == tok.sep_token_id
    assert 1 in rows[0]["token_type_ids"]  # the pair's second text survives truncation
    assert len(rows[1]["input_ids"]) == 5  # [CLS] good [SEP] fun [SEP]


def test_max_length_default_fits_the_model_and_a_longer_request_is_refused(tmp_path, tiny_bert_dir):
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.common import settle_max_length

    folder = ModelFolder.open(tiny_bert_dir)
    assert folder.positions == 128
    assert settle_max_length(0, 256, folder) == 128  # the embed/qa/rerank default, cut to the model
    assert settle_max_length(0, 64, folder) == 64 and settle_max_length(100, 256, folder) == 100
    train = _tsv(tmp_path / "train.tsv", 32, 0)
    with pytest.raises(EncoderkitError, match=r"--max-length 512 is longer than the 128 positions"):
        run(_cfg(tmp_path, tiny_bert_dir, task="classify", train=str(train), max_length=512))
    assert not (tmp_path / "out").exists()


def test_rerank_pairs_cut_a_query_longer_than_max_length(tiny_bert_dir):
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.rerank.features import pair_rows

    tok = load_tokenizer(tiny_bert_dir)
    rows = pair_rows(tok, ["python data " * 40, "python"], ["the movie " * 40, "the movie"], 24)
    assert [len(r["input_ids"]) for r in rows] == [24, 6]
    assert 1 in rows[0]["token_type_ids"]  # the passage keeps a share of the window


def test_early_stopping_wrapper_stops_after_patience():
    from encoderkit.train.finetune import _EarlyStop, _with_early_stopping

    values = iter([0.5, 0.7, 0.6, 0.65, 0.9])
    wrapped = _with_early_stopping(lambda m: {"accuracy": next(values)}, ("accuracy", "max"), patience=2)
    assert wrapped(None)["accuracy"] == 0.5
    assert wrapped(None)["accuracy"] == 0.7
    assert wrapped(None)["accuracy"] == 0.6  # one evaluation without improvement: go on
    with pytest.raises(_EarlyStop) as stop:
        wrapped(None)  # two in a row: stop, reporting the best metrics seen
    assert stop.value.args[1] == {"accuracy": 0.7}


def test_freeze_prefix_must_match(tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification

    from encoderkit.train.finetune import _freeze

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2)
    _freeze(model, ["bert.embeddings"])
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("bert.embeddings"))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("classifier"))
    with pytest.raises(EncoderkitError, match="matches no parameter"):
        _freeze(model, ["encoder.nope"])


KILLED_CHILD = '''
import json, sys, time
import encoderkit.train.finetune as ft

real_fit = ft.fit

def slow_fit(module, loss_fn, *args, **kw):  # slow enough that the parent can kill it mid-run
    def slow(m, batch):
        time.sleep(0.1)
        return loss_fn(m, batch)
    return real_fit(module, slow, *args, **kw)

ft.fit = slow_fit  # finetune binds fit at import: patch the name it calls
ft.run(ft.FinetuneConfig(**json.loads(sys.argv[1])))
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_finetune_killed_and_resumed_matches_uninterrupted(tmp_path, tiny_bert_dir):
    from safetensors.torch import load_file

    from tests.kill import run_until_then_kill

    train, dev = _tsv(tmp_path / "train.tsv", 160, 0), _tsv(tmp_path / "dev.tsv", 32, 1)
    settings = {"model": str(tiny_bert_dir), "task": "classify", "train": str(train), "dev": str(dev), "lr": 1e-3,
                "max_steps": 14, "batch_size": 8, "eval_every": 5, "save_every": 2, "seed": 0}
    marker = tmp_path / ".killed.run" / "checkpoints" / "step-0000006"
    run_until_then_kill(KILLED_CHILD, {**settings, "out": str(tmp_path / "killed")}, marker, tmp_path, 1, timeout=200)
    assert not (tmp_path / "killed").exists()  # nothing half-written under the output name
    resumed = run(FinetuneConfig(**settings, out=str(tmp_path / "killed"), resume=True))
    reference = run(FinetuneConfig(**settings, out=str(tmp_path / "reference")))
    assert resumed.steps == reference.steps == 14
    assert resumed.metrics == pytest.approx(reference.metrics)
    a, b = load_file(tmp_path / "killed" / "model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert not (tmp_path / ".killed.run").exists()  # checkpoints go once the output is written


def test_corpus_embeddings_are_cached_per_model_and_texts(tmp_path, tiny_bert_dir, monkeypatch):
    from transformers import AutoModel

    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed import features as embed

    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    calls = []
    real = embed.encode
    monkeypatch.setattr(embed, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, tok = embed.load_bi_encoder(tiny_bert_dir, "mean"), load_tokenizer(tiny_bert_dir)
    texts = ["the movie python", "a story data", "it was fun"]
    first = embed.encode_cached(model, tok, texts, 16, 8, False, tiny_bert_dir)
    again = embed.encode_cached(model, tok, texts, 16, 8, False, tiny_bert_dir)
    assert len(calls) == 1 and np.array_equal(first, again)  # the second call read the cache
    embed.encode_cached(model, tok, texts[:2], 16, 8, False, tiny_bert_dir)
    embed.encode_cached(model, tok, texts, 12, 8, False, tiny_bert_dir)
    assert len(calls) == 3  # other texts, other max_length: encoded afresh
    other = tmp_path / "other"  # same architecture, other weights
    changed = AutoModel.from_pretrained(tiny_bert_dir)
    with torch.no_grad():
        changed.embeddings.word_embeddings.weight.mul_(2)
    changed.save_pretrained(other)
    tok.save_pretrained(other)
    out = embed.encode_cached(embed.load_bi_encoder(other, "mean"), tok, texts, 16, 8, False, other)
    assert len(calls) == 4 and not np.allclose(out, first)
