"""An embedding folder fine-tuned with first-token or mean pooling gives the same vectors through
every path: encoderkit's torch encoder, sentence-transformers, the exported ONNX graph, the
Predictor (ONNX and torch), ``predict`` and the HTTP service."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from test_finetune import _jsonl, _pairs, one_thread  # noqa: F401  (one_thread: autouse fixture)

from encoderkit.cli import main
from encoderkit.deploy.serve import BackgroundServer, create_app
from encoderkit.inference.predictor import Predictor
from encoderkit.tasks.common import load_tokenizer
from encoderkit.tasks.embed.features import encode, load_bi_encoder

TEXTS = ["the movie python", "a story data", "good code and a great film about the love of data"]


@pytest.mark.slow  # fine-tunes, exports and serves twice (~30 s each on a quiet core)
@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_embed_folder_pooled_either_way_exports_serves_and_loads_in_sentence_transformers(pooling, tmp_path,
                                                                                          tiny_bert_dir):
    st = pytest.importorskip("sentence_transformers")
    train = _jsonl(tmp_path / "train.jsonl", _pairs(32, 0))
    ft, onnx = tmp_path / "ft", tmp_path / "onnx"
    assert main(["finetune", "--model", str(tiny_bert_dir), "--task", "embed", "--train", str(train), "--out", str(ft),
                 "--max-steps", "3", "--batch-size", "8", "--max-length", "16", "--pooling", pooling]) == 0
    assert json.loads((ft / "encoderkit.json").read_text())["pooling"] == pooling
    assert json.loads((ft / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"] == (pooling == "first")

    ref = encode(load_bi_encoder(ft), load_tokenizer(ft), TEXTS, 16)
    other = encode(load_bi_encoder(ft, "mean" if pooling == "first" else "first"), load_tokenizer(ft), TEXTS, 16)
    assert np.abs(ref - other).max() > 1e-3  # the pooling really changes the vectors
    np.testing.assert_allclose(st.SentenceTransformer(str(ft), device="cpu").encode(TEXTS), ref, atol=1e-5)

    assert main(["export", "--model", str(ft), "--out", str(onnx)]) == 0
    assert json.loads((onnx / "encoderkit.json").read_text())["pooling"] == pooling
    onnx_pred = Predictor.load(onnx, backend="onnx-fp32")
    np.testing.assert_allclose(onnx_pred.embed(TEXTS), ref, atol=1e-4)
    np.testing.assert_allclose(Predictor.load(ft, backend="torch-fp32").embed(TEXTS), ref, atol=1e-5)

    (tmp_path / "in.txt").write_text("\n".join(TEXTS) + "\n")
    assert main(["predict", "--model", str(onnx), "--input", str(tmp_path / "in.txt"), "--output",
                 str(tmp_path / "p.jsonl"),
                 "--backend", "onnx-fp32"]) == 0
    got = [json.loads(line)["embedding"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)

    with BackgroundServer(create_app({"e": onnx_pred})) as url:
        r = httpx.post(url + "/v1/embed", json={"texts": TEXTS}, timeout=30)
    assert r.status_code == 200
    np.testing.assert_allclose(np.asarray(r.json()["embeddings"]), ref, atol=1e-4)


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_module_embedder_pools_on_the_device_as_the_engine_path_pools(pooling, tiny_bert_dir, monkeypatch):
    """``Embedder.of_module`` runs the BiEncoder (pooled there, one (B, H) vector per text back, un-normalised),
    and gives what the token-state engine path gives; ``encode``'s ``batch_size`` is honoured either way."""
    from encoderkit.tasks.embed.embedder import BiEncoderEngine, Embedder
    from encoderkit.tasks.inference import ModuleEngine

    model, tok = load_bi_encoder(tiny_bert_dir, pooling).eval(), load_tokenizer(tiny_bert_dir)
    texts = TEXTS * 3
    engine_path = Embedder(ModuleEngine(model.encoder, ("last_hidden_state",)), tok, pooling, max_length=16)
    shapes: list[tuple[int, ...]] = []
    run = BiEncoderEngine.run
    monkeypatch.setattr(BiEncoderEngine, "run",
                        lambda self, inputs: shapes.append((out := run(self, inputs))[0].shape) or out)
    got = encode(model, tok, texts, 16, batch_size=4)
    assert max(s[0] for s in shapes) == 4 and sum(s[0] for s in shapes) == 9 and {s[1:] for s in shapes} == {(32,)}
    np.testing.assert_allclose(got, engine_path.embed(texts), atol=1e-5)
    np.testing.assert_allclose(Embedder.of_module(model, tok, 16).embed(texts, dim=8), engine_path.embed(texts, dim=8),
                               atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    shapes.clear()
    encode(Embedder.of_module(model, tok, 16, max_batch=64), tok, texts, 16, batch_size=2)
    assert max(s[0] for s in shapes) == 2 and sum(s[0] for s in shapes) == 9
