"""`encoderkit pretrain` end to end: tiny runs on tiny data, the output in plain transformers,
a real Gutenberg slice, and every bad-input case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from encoderkit.errors import EncoderkitError
from encoderkit.train.pretrain import PretrainConfig, run

SENTENCE = "i love this movie . the story was great and the film was fun ."


def make_store(tmp: Path, tokenizer_dir: Path, text: str, seq_len: int = 32, name: str = "store") -> Path:
    from encoderkit.data.prepare import PrepareConfig
    from encoderkit.data.prepare import run as prepare

    corpus = tmp / f"{name}-corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(text)
    out = tmp / name
    prepare(PrepareConfig(corpus=[str(corpus)], tokenizer=str(tokenizer_dir), out=str(out), seq_len=seq_len,
                          heldout=0.2, doc_split="line"))
    return out


@pytest.fixture(scope="module")
def repetitive_store(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    # 15 tokens + [SEP] per line and 33-token blocks: every block is [CLS] s [SEP] s [SEP], so a
    # tiny model can memorise it in a few seconds (from positions alone)
    return make_store(tmp_path_factory.mktemp("rep"), tiny_tokenizer_dir, (SENTENCE + "\n") * 120, seq_len=33)


def tiny_cfg(store: Path, out: Path, **kw) -> PretrainConfig:
    base = {"data": str(store), "out": str(out), "layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "dropout": 0.0,
            "batch_size": 8,
                "lr": 5e-3, "max_steps": 12, "warmup": 2, "mask_rate": 0.2, "eval_blocks": 16, "bf16": "off"}
    return PretrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_overfit_output_is_a_standard_fill_mask_model(repetitive_store, tmp_path) -> None:
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    result = run(tiny_cfg(repetitive_store, tmp_path / "m", max_steps=150, lr=1e-2, warmup=10, mask_rate=0.3))
    card = json.loads((tmp_path / "m" / "encoderkit.json").read_text())
    assert card["stage"] == "pretrain" and card["task"] == "mlm"
    assert card["metrics"]["heldout_loss"] < 0.3 * card["metrics"]["initial_heldout_loss"]
    assert (result.metrics["heldout_perplexity"]
            == pytest.approx(2.718281828 ** result.metrics["heldout_loss"], rel=1e-4))
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "m")
    assert type(model).__name__ == "BertForMaskedLM"
    fill = pipeline("fill-mask", model=model, tokenizer=AutoTokenizer.from_pretrained(tmp_path / "m"))
    top = fill("i love this movie . the story was [MASK] and the film was fun .")[0]["token_str"]
    assert top == "great"


def test_resume_refuses_a_checkpoint_of_another_config(repetitive_store, tmp_path) -> None:
    run(tiny_cfg(repetitive_store, tmp_path / "m", run_dir=str(tmp_path / "run"), max_steps=4))
    with pytest.raises(EncoderkitError, match="different run .*mask_rate"):
        run(tiny_cfg(repetitive_store, tmp_path / "m2", run_dir=str(tmp_path / "run"), max_steps=4,
                     mask_rate=0.3, resume=True))
    with pytest.raises(EncoderkitError, match="--resume"):
        run(tiny_cfg(repetitive_store, tmp_path / "m3", run_dir=str(tmp_path / "run"), max_steps=4))


def test_resume_refuses_another_corpus(repetitive_store, tiny_tokenizer_dir, tmp_path) -> None:
    other = make_store(tmp_path, tiny_tokenizer_dir, "\n".join(["the man said he was good"] * 60) + "\n")
    run(tiny_cfg(repetitive_store, tmp_path / "m", run_dir=str(tmp_path / "run"), max_steps=4))
    with pytest.raises(EncoderkitError, match="different run .*fingerprint.data"):
        run(tiny_cfg(other, tmp_path / "m2", run_dir=str(tmp_path / "run"), max_steps=4, resume=True))


def test_existing_output_is_refused_before_training(repetitive_store, tmp_path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("x")
    with pytest.raises(EncoderkitError, match="already exists"):
        run(tiny_cfg(repetitive_store, tmp_path / "m"))
    assert not (tmp_path / "m-run").exists()


def test_model_vocab_and_positions_are_checked(tiny_tokenizer_dir, tmp_path, repetitive_store) -> None:
    import torch
    from transformers import BertModel

    from tests.conftest import tiny_bert_config

    small = tmp_path / "small_vocab"
    torch.manual_seed(0)
    BertModel(tiny_bert_config(50)).save_pretrained(small)  # fewer embeddings than the tokenizer has ids
    with pytest.raises(EncoderkitError, match="embeddings hold only 50"):
        run(PretrainConfig(data=str(repetitive_store), model=str(small), out=str(tmp_path / "o"), max_steps=2))
    long_store = make_store(tmp_path, tiny_tokenizer_dir, (SENTENCE + " ") * 200 + "\n", seq_len=256, name="long")
    short = tmp_path / "short_pos"
    BertModel(tiny_bert_config(200, max_position_embeddings=128)).save_pretrained(short)
    with pytest.raises(EncoderkitError, match="beyond the model's 128 positions"):
        run(PretrainConfig(data=str(long_store), model=str(short), out=str(tmp_path / "o"), max_steps=2))


def test_model_with_another_tokenizer_is_refused(repetitive_store, minilm_dir, tmp_path) -> None:
    with pytest.raises(EncoderkitError, match="different tokenizer"):
        run(PretrainConfig(data=str(repetitive_store), model=str(minilm_dir), out=str(tmp_path / "o"), max_steps=2))


def test_config_needs_one_data_and_one_model_source(tmp_path) -> None:
    with pytest.raises(EncoderkitError, match="either --data"):
        PretrainConfig(out=str(tmp_path / "o"), preset="tiny")
    with pytest.raises(EncoderkitError, match="either --model"):
        PretrainConfig(out=str(tmp_path / "o"), data="x", model="m", preset="tiny")
    with pytest.raises(EncoderkitError, match="--corpus needs --tokenizer"):
        PretrainConfig(out=str(tmp_path / "o"), corpus=["a.txt"], preset="tiny")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gutenberg_heldout_loss_falls(shared_data, minilm_dir, tmp_path) -> None:
    """A tiny model on a real Gutenberg slice through --corpus (prepared into a cache)."""
    import gzip

    book = min((shared_data / "mlm_corpus_gutenberg" / "gitenberg").glob("*.gz"))
    with gzip.open(book, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()[20_000:220_000]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.txt").write_text(text)
    cfg = PretrainConfig(corpus=[str(corpus)], tokenizer=str(minilm_dir), seq_len=64, heldout=0.05,
                         doc_split="blank_line",
                         cache_dir=str(tmp_path / "cache"), out=str(tmp_path / "m"), layers=2, hidden=32, heads=4,
                         ffn=64, batch_size=16, max_steps=40, lr=1e-2, warmup=4, eval_blocks=64, bf16="off")
    result = run(cfg)
    start, end = result.metrics["initial_heldout_loss"], result.metrics["heldout_loss"]
    assert start > 9.5  # ~ln(30522): an untrained model
    assert end < start - 2.5, (start, end)


def test_cli_prints_a_clear_error_and_exits_2(tmp_path, capsys) -> None:
    from encoderkit.cli import main

    code = main(["pretrain", "--out", str(tmp_path / "o"), "--preset", "tiny", "--data", str(tmp_path / "missing")])
    assert code == 2
    assert "is not a token store" in capsys.readouterr().err


def test_evaluate_mlm_reproduces_the_heldout_metrics_and_checks_the_store(repetitive_store, tmp_path) -> None:
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate

    result = run(tiny_cfg(repetitive_store, tmp_path / "m", max_steps=6))
    ev = evaluate(EvaluateConfig(model=str(tmp_path / "m"), data=str(repetitive_store), max_examples=16, batch_size=5,
                                 mask_rate=0.2))
    assert ev.task == "mlm"  # read from the card
    from encoderkit.data.prepare import open_blocks

    assert ev.metrics["blocks"] == min(16, len(open_blocks(repetitive_store, "heldout")))
    capped = evaluate(EvaluateConfig(model=str(tmp_path / "m"), data=str(repetitive_store), max_examples=3,
                                     batch_size=2))
    assert capped.metrics["blocks"] == 3
    # the same blocks and epoch-0 masks as pretrain's own held-out evaluation
    assert ev.metrics["loss"] == pytest.approx(result.metrics["heldout_loss"], rel=1e-5)
    assert ev.metrics["accuracy"] == pytest.approx(result.metrics["heldout_accuracy"])
    other = evaluate(EvaluateConfig(model=str(tmp_path / "m"), data=str(repetitive_store), max_examples=16, seed=1,
                                    mask_rate=0.2))
    assert other.metrics["loss"] != pytest.approx(ev.metrics["loss"], rel=1e-6)  # another seed, other masks
    with pytest.raises(EncoderkitError, match="not a token store"):
        evaluate(EvaluateConfig(model=str(tmp_path / "m"), data=str(tmp_path), task="mlm"))


def test_layers_with_model_continues_from_its_first_layers(repetitive_store, tiny_bert_dir, tmp_path, capsys) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from encoderkit.models.load import load_encoder

    shallow = load_encoder(tiny_bert_dir, layers=1)
    assert len(shallow.bert.encoder.layer) == 1
    # the layer left out, in a few words
    assert "weights of the checkpoint not used (layer 1;" in capsys.readouterr().err
    ref = load_file(tiny_bert_dir / "model.safetensors")
    for name, t in shallow.bert.encoder.layer[0].state_dict().items():  # the checkpoint's layer 0, unchanged
        assert torch.equal(t, ref[f"encoder.layer.0.{name}"]), name
    with pytest.raises(EncoderkitError, match="--layers 3 asks for more layers than .* has \\(2\\)"):
        load_encoder(tiny_bert_dir, layers=3)
    res = run(PretrainConfig(data=str(repetitive_store), model=str(tiny_bert_dir), layers=1, out=str(tmp_path / "o"),
                             max_steps=2, batch_size=4, eval_blocks=4, bf16="off"))
    assert AutoConfig.from_pretrained(res.out).num_hidden_layers == 1
    assert not any(".layer.1." in k for k in load_file(res.out / "model.safetensors"))


def test_freeze_embeddings_keeps_the_vocabulary_matrix_and_trains_the_rest(repetitive_store, tiny_bert_dir,
                                                                           tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    ref = load_file(tiny_bert_dir / "model.safetensors")
    res = run(PretrainConfig(data=str(repetitive_store), model=str(tiny_bert_dir), freeze_embeddings=True, lr=1e-2,
                             out=str(tmp_path / "o"), max_steps=3, batch_size=4, eval_blocks=4, bf16="off"))
    got = load_file(res.out / "model.safetensors")
    emb = "embeddings.word_embeddings.weight"
    assert torch.equal(got[f"bert.{emb}"], ref[emb])
    assert not torch.equal(got["bert.encoder.layer.0.attention.self.query.weight"],
                           ref["encoder.layer.0.attention.self.query.weight"])


def test_content_word_masking_flags_train_and_a_missing_word_file_is_named(repetitive_store, tmp_path, capsys) -> None:
    import math

    from encoderkit.cli import main

    out = tmp_path / "o"
    code = main(["pretrain", "--out", str(out), "--preset", "tiny", "--data", str(repetitive_store),
                 "--mask-words-only", "--mask-skip-words", str(tmp_path / "stop.txt")])
    assert code == 2 and "stop.txt': no such file" in capsys.readouterr().err and not out.exists()
    res = run(PretrainConfig(data=str(repetitive_store), preset="tiny", out=str(out), max_steps=2, batch_size=4,
                             eval_blocks=4, bf16="off", mask_words_only=True, mask_skip_words="english"))
    assert math.isfinite(res.metrics["heldout_loss"])
