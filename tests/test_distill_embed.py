"""Embedding distillation: the student reproduces the teacher's sentence embeddings on held-out text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from encoderkit.compress.distill import DistillConfig
from encoderkit.compress.distill import run as distill
from encoderkit.compress.distill_embed import embedding_mse
from encoderkit.compress.students import build_student_from_teacher, parse_layer_map
from encoderkit.errors import EncoderkitError
from encoderkit.tasks.embed.texts import split_sentences, training_texts
from tests.conftest import WORDS, tiny_bert_config


def sentences(n: int, seed: int) -> list[str]:
    g = np.random.default_rng(seed)
    return [" ".join(WORDS[j] for j in g.integers(0, len(WORDS), g.integers(4, 14))).capitalize() + "."
            for _ in range(n)]


@pytest.fixture(scope="module")
def embed_teacher(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny 4-layer sentence-transformers folder (mean pooling, normalised)."""
    from transformers import AutoTokenizer, BertModel

    from encoderkit.tasks.embed.features import BiEncoder, save_sentence_transformers

    out = tmp_path_factory.mktemp("embed_teacher")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(3)
    enc = BertModel(tiny_bert_config(len(tok), num_hidden_layers=4, initializer_range=0.2))
    save_sentence_transformers(BiEncoder(enc, "mean"), tok, out, max_length=64)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "train.txt"
    p.write_text("\n\n".join(" ".join(sentences(7, i)) for i in range(90)) + "\n")
    return p


def cosines(folder_a, model_b, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    a = SentenceTransformer(str(folder_a), device="cpu").encode(texts, normalize_embeddings=True)
    b = model_b.encode(texts, normalize_embeddings=True) if hasattr(model_b, "encode") else model_b
    return (a * b).sum(1)


def test_embedding_mse_is_zero_when_directions_agree_and_covers_matryoshka_slices():
    t = torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    loss, parts = embedding_mse(3.0 * t, t, [4])
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and set(parts) == {"mse_8", "mse_4"}
    loss, _ = embedding_mse(torch.randn(5, 8), t, [])
    assert loss.item() > 0.1


def test_training_texts_pieces_and_seeded_limit(corpus):
    assert split_sentences("One two. Three four! 5 six?  Seven") == ["One two.", "Three four!", "5 six?", "Seven"]
    pieces = training_texts(str(corpus))
    assert {len(split_sentences(p)) for p in pieces} == {1, 2, 4}
    sample = training_texts(f"{corpus},{corpus}", limit=40, seed=1)
    assert len(sample) == 40 and sample == training_texts(f"{corpus},{corpus}", limit=40, seed=1)


def test_distilled_student_matches_teacher_better_than_undistilled(tmp_path, embed_teacher, corpus):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    out = tmp_path / "student"
    res = distill(DistillConfig(teacher=str(embed_teacher), out=str(out), train=str(corpus), layers="0,2",
                                matryoshka_dims=[16], epochs=6, lr=1e-3, batch_size=16, seq_len=64, bf16=False))
    assert res.layers == [0, 2] and res.student_params < res.teacher_params
    held_out = sentences(60, seed=999)
    st_student = SentenceTransformer(str(out), device="cpu")  # loads with the teacher's pooling and normalisation
    assert st_student.max_seq_length == 64 and len(st_student) == 3
    distilled = cosines(embed_teacher, st_student, held_out)
    teacher = AutoModel.from_pretrained(embed_teacher)
    base = build_student_from_teacher(teacher, parse_layer_map("0,2", 4))
    from encoderkit.tasks.embed.features import BiEncoder, encode

    tok = st_student.tokenizer
    undistilled = cosines(embed_teacher, encode(BiEncoder(base, "mean"), tok, held_out, 64), held_out)
    assert distilled.mean() > undistilled.mean() + 0.5 * (1 - undistilled.mean()), (
        distilled.mean(), undistilled.mean())
    import json

    card = json.loads((out / "encoderkit.json").read_text())
    assert card["task"] == "embed" and card["pooling"] == "mean" and card["matryoshka_dims"] == [16]
    from encoderkit.inference.predictor import Predictor  # the student serves like any embed folder (ONNX export)

    served = Predictor.load(out, backend="onnx-fp32", threads=1).embed(held_out[:8])
    assert (served * st_student.encode(held_out[:8], normalize_embeddings=True)).sum(1).min() > 0.999


def test_embed_distillation_refuses_a_teacher_with_a_dense_module(tmp_path, embed_teacher, corpus):
    import json
    import shutil

    bad = tmp_path / "dense_teacher"
    shutil.copytree(embed_teacher, bad)
    mods = json.loads((bad / "modules.json").read_text())
    mods.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (bad / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(EncoderkitError, match="3_Dense"):
        distill(DistillConfig(teacher=str(bad), out=str(tmp_path / "s"), train=str(corpus)))


@pytest.mark.slow
def test_minilm_three_layer_student_moves_towards_the_teacher(tmp_path, minilm_dir, shared_data):
    """The real all-MiniLM-L6-v2 distilled a few steps on SciFact text: held-out cosine to the teacher rises."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from encoderkit.tasks.embed.features import BiEncoder, encode

    scifact = shared_data / "scifact" / "scifact_hf_export.zip"
    texts = training_texts(str(scifact), seed=0)
    held_out = texts[-64:]  # the corpus's last documents; training samples from the first 3,000 pieces
    train = tmp_path / "train.txt"
    train.write_text("\n\n".join(texts[:3000:10]) + "\n")
    out = tmp_path / "student"
    distill(DistillConfig(teacher=str(minilm_dir), out=str(out), train=str(train), layers="0,3,5", max_steps=12,
                          lr=2e-4,
                          batch_size=16, seq_len=128, warmup=2))
    teacher = SentenceTransformer(str(minilm_dir), device="cpu")
    ref = teacher.encode(held_out, normalize_embeddings=True)
    student = SentenceTransformer(str(out), device="cpu")
    distilled = (student.encode(held_out, normalize_embeddings=True) * ref).sum(1).mean()
    base = build_student_from_teacher(AutoModel.from_pretrained(minilm_dir), [0, 3, 5])
    undistilled = (encode(BiEncoder(base, "mean"), student.tokenizer, held_out, 256) * ref).sum(1).mean()
    assert distilled > undistilled + 0.05, (distilled, undistilled)


def test_a_beir_source_gives_its_corpus_and_only_a_named_splits_queries(tmp_path):
    import json

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = {"d1": "Cells divide when the signal arrives. The signal is a protein.",
            "d2": "Aspirin lowers the risk of a stroke in adults."}
    queries = {"q1": "Which protein signals cell division", "q2": "Does aspirin prevent strokes"}
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                               for k, v in docs.items()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq2\td2\t1\n")
    corpus_only = training_texts(str(beir))
    assert "Aspirin lowers the risk of a stroke in adults." in corpus_only
    assert not set(queries.values()) & set(corpus_only)
    with_train = training_texts(f"{beir}#train")
    assert set(with_train) == set(corpus_only) | set(queries.values())
    assert set(training_texts(f"{beir}#test")) == set(corpus_only) | {queries["q2"]}
