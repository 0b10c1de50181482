"""``encoderkit adapt --offline-kinds cloze --cloze-model FOLDER``: sentences of the passage with a seeded ~30% of
their content words replaced by a tiny in-process masked-LM's top other prediction; the queries differ from their
sentence only in those words, are the same for a seed (and batch size), skip a sentence with nothing to replace,
go through a whole adapt run, and the refusals (no --cloze-model, a folder without an MLM head, a stray flag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.adapt.cloze import CLOZE_RATE, STOPWORDS, ClozeWriter
from encoderkit.adapt.passages import Passage
from encoderkit.adapt.queries import offline_queries, positive_text
from encoderkit.adapt.run import AdaptConfig, run
from encoderkit.errors import EncoderkitError

SENTENCES = ["the python code was a great story about data", "she had a good time with the movie and the film",
             "they said the model is not bad but boring", "a dull man was first in the story of love"]


@pytest.fixture(scope="module")
def writer(tiny_mlm_dir) -> ClozeWriter:
    return ClozeWriter(tiny_mlm_dir)


def test_a_seeded_share_of_the_content_words_is_replaced_by_other_words(writer):
    out = writer.rewrite(SENTENCES, [1, 2, 3, 4])
    for src, q in zip(SENTENCES, out, strict=True):
        assert q is not None and q != src
        a, b = src.split(), q.split()
        assert len(a) == len(b)  # one-piece words replaced by whole words
        changed = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        content = [w for w in a if w not in STOPWORDS]
        assert len(changed) == max(1, round(CLOZE_RATE * len(content)))
        assert all(a[i] not in STOPWORDS and b[i] not in STOPWORDS and b[i].isalpha() for i in changed)


def test_the_same_seed_gives_the_same_queries_whatever_the_batch(tiny_mlm_dir, writer):
    seeds = [7, 8, 9, 10]
    first = writer.rewrite(SENTENCES, seeds)
    one_by_one = ClozeWriter(tiny_mlm_dir, batch_size=1)
    assert [one_by_one.rewrite([s], [k])[0] for s, k in zip(SENTENCES, seeds, strict=True)] == first
    others = [writer.rewrite(SENTENCES, [k + 100 for k in seeds]) for _ in range(2)]
    assert others[0] == others[1] and others[0] != first  # other seeds mask other words


def test_a_sentence_with_nothing_to_replace_is_skipped_and_counted(tiny_mlm_dir):
    w = ClozeWriter(tiny_mlm_dir)
    assert w.rewrite(["it was what they had to do", SENTENCES[0]], [0, 0])[0] is None
    assert w.counts() == {"cloze_queries": 1, "cloze_skipped": 1}


def test_offline_cloze_queries_keep_the_whole_passage_as_their_positive(writer):
    p = Passage("p1", "", ". ".join(s.capitalize() for s in SENTENCES) + ".")
    qs = offline_queries(p, 2, ("cloze",), seed=3, cloze=writer)
    assert len(qs) == 2 and qs == offline_queries(p, 2, ("cloze",), seed=3, cloze=writer)
    sources = [s.lower() for s in SENTENCES]
    assert all(q not in p.text.lower() for q in qs)  # no longer a verbatim part of the passage ...
    assert all(sum(x != y for x, y in zip(q.split(), s.split(), strict=False)) >= 1 for q in qs for s in sources
               if len(q.split()) == len(s.split()))
    assert all(positive_text(p, q) == p.full for q in qs)  # ... so the positive is the whole passage


def _corpus(path: Path, n: int = 16) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Passage {i} starts here. " + " ".join(
        f"{SENTENCES[(i + j) % 4].capitalize()}." for j in range(3))}) + "\n" for i in range(n)))
    return path


def _cfg(embed: Path, corpus: Path, out: Path, **kw) -> AdaptConfig:
    base = {"model": str(embed), "corpus": str(corpus), "out": str(out), "batch_size": 8, "max_steps": 2,
            "queries_per_passage": 2, "num_negatives": 1, "lr": 1e-3, "save_every": 0, "bf16": False}
    return AdaptConfig(**{**base, **kw})


def test_adapt_trains_on_cloze_queries(tmp_path, tmp_path_factory, tiny_tokenizer_dir, tiny_mlm_dir):
    embed = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    corpus = _corpus(tmp_path / "corpus.jsonl")
    res = run(_cfg(embed, corpus, tmp_path / "out", offline_kinds=["cloze"], cloze_model=str(tiny_mlm_dir)))
    assert res.generation["cloze_queries"] == res.generation["queries"] == 32 and res.generation["cloze_skipped"] == 0
    log = (tmp_path / "out" / "adapt" / "queries.jsonl").read_text().splitlines()
    assert json.loads(log[0])["settings"]["cloze_model"] == str(tiny_mlm_dir)
    queries = [q for line in log[1:] for q in json.loads(line)["queries"]]
    assert queries and not any(q in {s.lower() for s in SENTENCES} for q in queries)
    assert res.training["steps"] == 2


def test_refusals(tmp_path, tiny_bert_dir, tiny_mlm_dir):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(EncoderkitError,
                       match=r"--offline-kinds cloze needs --cloze-model FOLDER: .*encoderkit pretrain"):
        _cfg(tiny_bert_dir, corpus, tmp_path / "o1", offline_kinds=["title", "cloze"])
    with pytest.raises(EncoderkitError, match="--cloze-model is read by --offline-kinds cloze"):
        _cfg(tiny_bert_dir, corpus, tmp_path / "o2", cloze_model=str(tiny_mlm_dir))
    with pytest.raises(EncoderkitError, match=r"--cloze-model .* has no masked-LM head \(BertModel\); give "
                                              r".*encoderkit "
                                              r"pretrain.*ForMaskedLM.*all-MiniLM-L6-v2 as shipped has no MLM head"):
        ClozeWriter(tiny_bert_dir)
    with pytest.raises(EncoderkitError, match="--offline-kinds cloze needs --cloze-model"):
        offline_queries(Passage("p", "", ". ".join(SENTENCES)), 1, ("cloze",))
