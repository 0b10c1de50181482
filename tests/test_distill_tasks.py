"""Rerank, NER and QA distillation on tiny models: the distilled student agrees with the teacher
better than the same student undistilled."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.distill import run as distill
from encoderkit.compress.distill_tasks import masked_token_kl, position_kl
from encoderkit.compress.students import build_student_from_teacher
from encoderkit.errors import EncoderkitError
from encoderkit.models.folder import load_model as load_task_model
from tests.conftest import WORDS, tiny_bert_config


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own cache: the teacher's scores are cached by weights and pairs, and two tests' tiny
    teachers are the same model."""
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))


def sentence(g: np.random.Generator, lo: int = 3, hi: int = 10) -> str:
    return " ".join(WORDS[j] for j in g.integers(0, len(WORDS), g.integers(lo, hi)))


def save_tiny(cls_name: str, out: Path, tokenizer_dir: Path, head_scale: float, **cfg_kw) -> Path:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(7)
    model = getattr(transformers, cls_name)(tiny_bert_config(len(tok), num_hidden_layers=4, initializer_range=0.2,
                                                             **cfg_kw))
    head = model.qa_outputs if hasattr(model, "qa_outputs") else model.classifier
    with torch.no_grad():
        head.weight.mul_(head_scale)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def kendall(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of Kendall's tau between two (N, L) score arrays."""
    taus = []
    for x, y in zip(a, b):
        i, j = np.triu_indices(len(x), 1)
        taus.append(np.mean(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])))
    return float(np.mean(taus))


def test_position_and_token_kl_ignore_padding():
    t = torch.randn(2, 5)
    s = t.clone()
    s[:, 3:] = 50.0  # differences only where the mask is 0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    assert position_kl(s, t, mask, 2.0).item() == pytest.approx(0.0, abs=1e-5)
    assert position_kl(torch.randn(2, 5), t, mask, 2.0).item() > 0
    logits = torch.randn(2, 5, 3)
    noisy = logits.clone()
    noisy[:, 3:] = torch.randn(2, 2, 3) * 9
    assert masked_token_kl(noisy, logits, mask, 1.0).item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("loss", ["mse", "kl"])
def test_rerank_student_orders_candidates_like_the_teacher(tmp_path, tiny_tokenizer_dir, loss, capsys):
    from transformers import AutoTokenizer

    from encoderkit.tasks.rerank.features import score_pairs

    teacher = save_tiny("BertForSequenceClassification", tmp_path / "ce", tiny_tokenizer_dir, 30.0, num_labels=1)
    g = np.random.default_rng(0)
    rows = [{"query": sentence(g, 2, 5), "positive": sentence(g), "negatives": [sentence(g) for _ in range(5)]}
            for _ in range(96)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "student"
    res = distill(DistillConfig(teacher=str(teacher), out=str(out), train=str(train), layers="0,2", loss=loss,
                                candidates=6,
                                epochs=8, lr=1e-3, batch_size=8, seq_len=48, bf16=False))
    assert res.layers == [0, 2]
    assert json.loads((out / "encoderkit.json").read_text())["task"] == "rerank"
    # 96 lists of 6, the teacher's pass shows progress
    assert "teacher scores 576/576 (100.0%)" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(teacher)
    g = np.random.default_rng(123)  # held-out lists
    lists = [(sentence(g, 2, 5), [sentence(g) for _ in range(6)]) for _ in range(30)]

    def scores(model) -> np.ndarray:
        return np.stack([score_pairs(model, tok, q, ps, 48) for q, ps in lists])

    t_model = load_task_model(teacher)
    base = build_student_from_teacher(t_model, [0, 2])
    ref = scores(t_model)
    distilled, undistilled = kendall(scores(load_task_model(out)), ref), kendall(scores(base), ref)
    assert distilled > undistilled + 0.1, (distilled, undistilled)


def test_a_second_rerank_distillation_reuses_the_teachers_scores_until_the_teacher_changes(
        tmp_path, tiny_tokenizer_dir, capsys):
    from safetensors.torch import load_file, save_file

    teacher = save_tiny("BertForSequenceClassification", tmp_path / "ce", tiny_tokenizer_dir, 30.0, num_labels=1)
    g = np.random.default_rng(0)
    rows = [{"query": sentence(g, 2, 5), "positive": sentence(g), "negatives": [sentence(g) for _ in range(3)]}
            for _ in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(out: str, **kw) -> str:
        settings = {"layers": "0,2", "candidates": 4, "max_steps": 2, "batch_size": 8, "seq_len": 32, "bf16": False,
                    **kw}
        distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / out), train=str(train), **settings))
        return capsys.readouterr().err

    assert "teacher scores 64/64" in run("a")
    # no lr given: a rerank student starts from chance and is trained at 3e-4, not a classifier's 1e-4
    assert json.loads((tmp_path / "a" / "encoderkit.json").read_text())["config"]["lr"] == 3e-4
    assert "teacher scores" not in run("b", layers="1,3", lr=1e-3)  # same teacher, same pairs: read from the cache
    assert "teacher scores" not in run("b2", candidates=3)  # shorter lists: pairs it has scored, each kept on its own
    more = [{"query": sentence(g, 2, 5), "positive": sentence(g), "negatives": [sentence(g) for _ in range(3)]}
            for _ in range(4)]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows + more))
    assert "teacher scores 16/16" in run("b3")  # only the 4 new lists' pairs
    # other token ids (the pairs cut shorter; those under 12 are the same)
    assert "teacher scores" in run("c", seq_len=12)
    weights = load_file(teacher / "model.safetensors")
    weights["classifier.bias"] = weights["classifier.bias"] + 1.0
    save_file(weights, teacher / "model.safetensors", metadata={"format": "pt"})
    assert "teacher scores 80/80" in run("d")  # the teacher changed: every pair of the 20 lists


def test_a_student_card_keeps_the_teachers_task_facts_not_its_run_facts_and_can_teach_again(
        tmp_path, tiny_tokenizer_dir):
    teacher = save_tiny("BertForSequenceClassification", tmp_path / "ce", tiny_tokenizer_dir, 30.0, num_labels=1)
    (teacher / "encoderkit.json").write_text(json.dumps({
        "stage": "finetune", "parent": None, "config": {}, "metrics": {}, "created": "2026-01-01T00:00:00Z",
        "task": "rerank", "max_length": 32, "num_labels": 1, "loss": "listwise softmax", "steps": 114,
        "train_examples": 919, "stopped_early": False}))
    g = np.random.default_rng(0)
    rows = [{"query": sentence(g, 2, 5), "positive": sentence(g), "negatives": [sentence(g) for _ in range(3)]}
            for _ in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"train": str(train), "candidates": 4, "max_steps": 2, "batch_size": 8, "bf16": False}
    distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / "a"), layers="0,2", **settings))
    card = json.loads((tmp_path / "a" / "encoderkit.json").read_text())
    assert card["task"] == "rerank" and card["max_length"] == 32 and card["layers_from_teacher"] == [0, 2]
    # the teacher's fine-tuning, not this run
    assert not {"loss", "steps", "train_examples", "stopped_early"} & set(card)
    assert card["metrics"]["steps"] == 2
    # the student teaches a smaller one (its card's layers_from_teacher is not passed on twice)
    distill(DistillConfig(teacher=str(tmp_path / "a"), out=str(tmp_path / "b"), layers="1", **settings))
    card = json.loads((tmp_path / "b" / "encoderkit.json").read_text())
    assert card["layers_from_teacher"] == [1] and card["task"] == "rerank"


def test_rerank_distillation_refuses_beir_without_a_miner_and_lists_without_negatives(tmp_path, tiny_tokenizer_dir):
    teacher = save_tiny("BertForSequenceClassification", tmp_path / "ce", tiny_tokenizer_dir, 1.0, num_labels=1)
    (tmp_path / "beir").mkdir()
    with pytest.raises(EncoderkitError, match="--miner"):
        distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / "s"), train=str(tmp_path / "beir")))
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"query": "a", "positive": "the film"}) + "\n")
    with pytest.raises(EncoderkitError, match="at least 2"):
        distill(DistillConfig(teacher=str(teacher), out=str(tmp_path / "s"), train=str(bare)))


def test_ner_student_tags_like_the_teacher(tmp_path, tiny_tokenizer_dir):
    labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    teacher = save_tiny("BertForTokenClassification", tmp_path / "ner", tiny_tokenizer_dir, 20.0, num_labels=5,
                        id2label=dict(enumerate(labels)), label2id={k: i for i, k in enumerate(labels)})
    g = np.random.default_rng(1)
    conll = tmp_path / "train.conll"
    conll.write_text("\n\n".join("\n".join(f"{w} O" for w in sentence(g, 4, 12).split()) for _ in range(160)) + "\n")
    out = tmp_path / "student"
    distill(DistillConfig(teacher=str(teacher), out=str(out), train=str(conll), layers="0,2", epochs=6, lr=1e-3,
                          batch_size=16, seq_len=32, temperature=1.0, bf16=False))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    g = np.random.default_rng(99)
    enc = tok([sentence(g, 4, 12) for _ in range(40)], padding=True, return_tensors="pt")
    t_model = load_task_model(teacher)

    def agree(model) -> float:
        with torch.no_grad():
            a, b = model(**enc).logits.argmax(-1), t_model(**enc).logits.argmax(-1)
        m = enc["attention_mask"].bool()
        return float((a[m] == b[m]).float().mean())

    distilled, undistilled = agree(load_task_model(out)), agree(build_student_from_teacher(t_model, [0, 2]))
    assert distilled > undistilled + 0.1 and distilled > 0.7, (distilled, undistilled)


def squad_file(path: Path, g: np.random.Generator, articles: int = 10, lo: int = 12, hi: int = 30) -> Path:
    """A SQuAD JSON of random articles (6 paragraphs of 4 questions each), answers at the context's start."""
    def article(i: int) -> dict:
        paras = []
        for p in range(6):
            ctx = sentence(g, lo, hi)
            qas = [{"id": f"{i}-{p}-{k}", "question": sentence(g, 3, 6),
                    "answers": [{"text": ctx.split()[0], "answer_start": 0}]}
                   for k in range(4)]
            paras.append({"context": ctx, "qas": qas})
        return {"title": f"a{i}", "paragraphs": paras}

    path.write_text(json.dumps({"data": [article(i) for i in range(articles)]}))
    return path


def test_qa_student_picks_the_teachers_start_and_end(tmp_path, tiny_tokenizer_dir):
    teacher = save_tiny("BertForQuestionAnswering", tmp_path / "qa", tiny_tokenizer_dir, 20.0)
    g = np.random.default_rng(2)
    squad = squad_file(tmp_path / "squad.json", g)  # 8 training articles: 192 questions
    out = tmp_path / "student"
    distill(DistillConfig(teacher=str(teacher), out=str(out), train=str(squad), layers="0,2", epochs=6, lr=1e-3,
                          batch_size=16, seq_len=48, temperature=1.0, bf16=False))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    g = np.random.default_rng(77)
    enc = tok([sentence(g, 3, 6) for _ in range(40)], [sentence(g, 12, 30) for _ in range(40)], padding=True,
              return_tensors="pt")
    t_model = load_task_model(teacher)

    def agree(model) -> float:
        with torch.no_grad():
            s, t = model(**enc), t_model(**enc)
        pad = ~enc["attention_mask"].bool()
        hits = [(x.masked_fill(pad, -1e4).argmax(-1) == y.masked_fill(pad, -1e4).argmax(-1)).float().mean()
                for x, y in ((s.start_logits, t.start_logits), (s.end_logits, t.end_logits))]
        return float(sum(hits) / 2)

    distilled, undistilled = agree(load_task_model(out)), agree(build_student_from_teacher(t_model, [0, 2]))
    assert distilled > undistilled + 0.1, (distilled, undistilled)


def test_qa_distillation_reads_contexts_at_the_teachers_length_by_default(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """Without seq_len, the student learns from (question, context) pairs as long as the teacher serves
    (a QA model reads 256 sub-tokens; a fixed 128 cut SQuAD contexts in half)."""
    import encoderkit.compress.distill_tasks as dt
    from encoderkit.models.folder import ModelFolder

    teacher = save_tiny("BertForQuestionAnswering", tmp_path / "qa", tiny_tokenizer_dir, 1.0,
                        max_position_embeddings=96)
    squad = squad_file(tmp_path / "squad.json", np.random.default_rng(3), lo=120, hi=160)  # contexts past 96 tokens
    seen: list[int] = []
    rows = dt.token_rows
    monkeypatch.setattr(dt, "token_rows",
                        lambda cfg, task, tok: seen.extend(len(r["input_ids"]) for r in rows(cfg, task, tok))
                        or rows(cfg, task, tok))
    out = tmp_path / "student"
    distill(DistillConfig(teacher=str(teacher), out=str(out), train=str(squad), layers="0", max_steps=1, batch_size=16,
                          bf16=False))
    length = ModelFolder.open(teacher, tokenizer=False).max_length
    assert length == 96 and max(seen) == length
    assert json.loads((out / "encoderkit.json").read_text())["config"]["seq_len"] == length
    with pytest.raises(EncoderkitError, match="seq_len"):
        DistillConfig(teacher=str(teacher), out=str(out), train=str(squad), seq_len=-1)


def test_pseudo_queries_are_titles_else_first_sentences_seeded_and_never_a_split_id():
    from encoderkit.data.beir import Retrieval, pseudo_queries

    corpus = {"a": ("Vitamin D lowers fracture risk", "We studied 300 adults. Fractures fell."),
              "b": ("", "Short. Then a longer sentence follows here."),
              "c": ("Two words", "Smoking raises the risk of stroke in adults! More text."),
              "d": ("", "no")}
    data = Retrieval(corpus, {"q1": "a claim"}, {"q1": {"a": 1}})
    pq = pseudo_queries(data, 10, seed=0)
    assert pq == {"pseudo:a": "Vitamin D lowers fracture risk",  # the title
                  "pseudo:c": "Smoking raises the risk of stroke in adults!"}  # a 2-word title: the first sentence
    # 'b': a 1-word first sentence and no title, 'd': too short: no query from either
    assert (list(pseudo_queries(data, 1, seed=3)) == list(pseudo_queries(data, 1, seed=3))
            and len(pseudo_queries(data, 1)) == 1)
    assert pseudo_queries(Retrieval({"a": ("", " ".join(["w"] * 50))}, {}, {}), 1)["pseudo:a"].count("w") == 32


def tiny_beir(tmp_path: Path, n_docs: int = 12) -> tuple[Path, dict[str, tuple[str, str]]]:
    """A BEIR folder: ``n_docs`` documents with 3-4 word titles, 5 train queries judged d0..d4."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    g = np.random.default_rng(5)
    docs = {f"d{i}": (sentence(g, 3, 5), sentence(g, 8, 14)) for i in range(n_docs)}
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": t, "text": x}) + "\n"
                                               for k, (t, x) in docs.items()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": sentence(g, 2, 4)}) + "\n"
                                                for i in range(5)))
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                              + "".join(f"q{i}\td{i}\t1\n" for i in range(5)))
    return beir, docs


def test_rerank_distillation_adds_corpus_titles_as_label_free_queries(tmp_path, tiny_tokenizer_dir, tmp_path_factory):
    from deploy_models import make_task_model, tiny_root

    from encoderkit.tasks.rerank.candidates import candidate_lists

    beir, docs = tiny_beir(tmp_path)
    miner = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    source = (f"{beir}#train", str(miner), 4)
    assert len(candidate_lists(*source)) == 5
    lists = candidate_lists(*source, pseudo_queries=6)
    titles = {t for t, _ in docs.values()}
    assert len(lists) == 11 and all(len(c) == 4 for _, c in lists)
    assert sum(q in titles for q, _ in lists) == 6  # the split's 5 queries, then 6 corpus titles
    top = [c for _, c in candidate_lists(*source)]
    deep = [c for _, c in candidate_lists(*source, candidate_depth=10)]
    assert all(len(c) == 4 and c[:2] == t[:2] for c, t in zip(deep, top))  # the top half stays the top half
    assert deep != top  # the rest is drawn from deeper ranks
    with pytest.raises(EncoderkitError, match="pseudo_queries"):
        DistillConfig(teacher="t", out="o", train="x", pseudo_queries=-1)
    with pytest.raises(EncoderkitError, match="candidate_depth"):
        DistillConfig(teacher="t", out="o", train="x", candidate_depth=-1)


def test_fresh_pseudo_queries_give_each_epoch_its_own_titles(tmp_path, tiny_tokenizer_dir, tmp_path_factory, capsys):
    from deploy_models import make_task_model, tiny_root

    from encoderkit.tasks.batching import RotatingBatches
    from encoderkit.tasks.rerank.candidates import candidate_groups, candidate_lists

    beir, _ = tiny_beir(tmp_path, n_docs=24)
    miner = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    source = (f"{beir}#train", str(miner), 4)
    split, sets = candidate_groups(*source, pseudo_queries=3, title_sets=3)
    assert len(split) == 5 and [len(t) for t in sets] == [3, 3, 3]
    assert len({q for t in sets for q, _ in t}) == 9  # no title in two sets
    assert candidate_lists(*source, pseudo_queries=3)[5:] == sets[0]  # the first set is the one-set run's titles
    assert len(candidate_groups(*source, pseudo_queries=10, title_sets=4)[1]) == 2  # 24 documents: two full sets of 10

    # each epoch: the fixed rows and its own set, in length-bucketed batches
    rot = RotatingBatches(np.arange(11), np.arange(5), [np.array([5, 6, 7]), np.array([8, 9, 10])], 2,
                          lambda idx, epoch: {"rows": torch.as_tensor(idx)})
    assert len(rot) == 4
    for epoch, own in ((0, {5, 6, 7}), (1, {8, 9, 10}), (2, {5, 6, 7})):
        seen = {int(i) for b in rot(epoch, 0, 1) for i in b["rows"]}
        assert seen <= set(range(5)) | own and seen & own
    with pytest.raises(ValueError, match="differ in size"):
        RotatingBatches(np.arange(6), np.arange(2), [np.array([2, 3]), np.array([4])], 2, lambda i, e: {})

    teacher = save_tiny("BertForSequenceClassification", tmp_path / "ce", tiny_tokenizer_dir, 30.0, num_labels=1)
    base = {"teacher": str(teacher), "train": source[0], "miner": str(miner), "candidates": 4, "pseudo_queries": 3,
            "layers": "0,2", "batch_size": 4, "seq_len": 32, "bf16": False}
    capsys.readouterr()
    distill(DistillConfig(out=str(tmp_path / "one"), epochs=3, **base))
    err = capsys.readouterr().err
    # (5 + 3) lists of 4, the same 3 titles every epoch
    assert "teacher scores 32/32" in err and "each epoch" not in err
    res = distill(DistillConfig(out=str(tmp_path / "fresh"), epochs=3, fresh_pseudo_queries=True, **base))
    err = capsys.readouterr().err
    assert "5 queries of the split + 9 corpus documents' titles" in err and "a new 3 each epoch" in err
    # set 0 from the cache, sets 1, 2 scored
    assert "teacher scores 32/32" not in err and err.count("teacher scores 12/12") == 2
    assert res.steps == 6  # 8 lists per epoch, batches of 4, 3 epochs
    distill(DistillConfig(out=str(tmp_path / "steps"), max_steps=5, fresh_pseudo_queries=True, overwrite=True, **base))
    assert "9 corpus documents' titles" in capsys.readouterr().err  # 5 steps of 4 lists: 3 epochs begun
    with pytest.raises(EncoderkitError, match="pseudo_queries > 0"):
        DistillConfig(teacher="t", out="o", train="x", fresh_pseudo_queries=True)


def test_pseudo_queries_on_a_file_of_lists_say_they_are_ignored(tmp_path, capsys):
    from encoderkit.tasks.rerank.candidates import candidate_lists

    train = tmp_path / "lists.jsonl"
    train.write_text("".join(json.dumps({"query": f"q{i}", "positive": "p", "negatives": ["n1", "n2"]}) + "\n"
                             for i in range(3)))
    assert len(candidate_lists(str(train), None, 4, pseudo_queries=5)) == 3
    assert "--pseudo-queries 5 ignored" in capsys.readouterr().err
    assert [len(c) for _, c in candidate_lists(str(train), None, 4)] == [3, 3, 3]  # the positive and 2 negatives
    assert "ignored" not in capsys.readouterr().err
    assert [len(c) for _, c in candidate_lists(str(train), None, 2)] == [2, 2, 2]  # cut to --candidates


def test_a_deep_candidate_list_keeps_the_top_half_and_samples_the_ranks_below_in_order():
    from encoderkit.tasks.rerank.candidates import spread

    ranked = [f"d{i}" for i in range(100)]
    lists = [spread(ranked, 16, np.random.default_rng(s)) for s in range(20)]
    for got in lists:
        pos = [ranked.index(d) for d in got]
        assert len(got) == 16 and pos[:8] == list(range(8)) and pos == sorted(set(pos)) and max(pos) < 100
    assert max(max(ranked.index(d) for d in got) for got in lists) >= 90  # the sample reaches the bottom of the list
    assert spread(ranked[:5], 16, np.random.default_rng(0)) == ranked[:5]
    assert spread(ranked, 16, np.random.default_rng(3)) == spread(ranked, 16, np.random.default_rng(3))
