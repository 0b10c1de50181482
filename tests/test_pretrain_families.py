"""Continued pretraining for every encoder family, with the family's own MLM head where it has one
(an ELECTRA discriminator gets a fresh tied generator-style head), DeBERTa from scratch, and the
refusals that name the family and the stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.errors import EncoderkitError
from encoderkit.models.load import load_encoder
from encoderkit.models.mlm import MaskedOnlyMLM, mlm_layout
from encoderkit.train.pretrain import PretrainConfig, run
from tests import families
from tests.families import FAMILIES, MLM_CLASS, cli_error, corpus_text
from tests.test_pretrain import SENTENCE, make_store

bpe_tokenizer_dir, family_dir = families.bpe_tokenizer_dir, families.family_dir  # the fixtures


def store_for(folder: Path, tmp: Path) -> Path:
    return make_store(tmp, folder, corpus_text(120, seed=1), seq_len=32)


def continued(folder: Path, store: Path, out: Path, **kw) -> PretrainConfig:
    base = {"data": str(store), "model": str(folder), "out": str(out), "batch_size": 4, "lr": 1e-3,
            "max_steps": 3, "warmup": 1, "eval_blocks": 8, "bf16": "off"}
    return PretrainConfig(**{**base, **kw})


def head_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The MLM head's own parameters (the tied decoder weight is the embedding matrix: left out)."""
    layout = mlm_layout(model)
    skip = {id(model.get_input_embeddings().weight)}
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(layout.modules)
            for n, p in m.named_parameters() if id(p) not in skip}


@pytest.mark.parametrize("family", FAMILIES)
def test_continued_pretraining_keeps_the_family_head_and_loads_as_masked_lm(family, family_dir, tmp_path) -> None:
    from transformers import AutoModelForMaskedLM

    folder = family_dir(family)
    store = store_for(folder, tmp_path)
    start = load_encoder(folder)
    assert type(start).__name__ == MLM_CLASS[family]
    saved = AutoModelForMaskedLM.from_pretrained(folder) if family != "electra" else None
    if saved is not None:  # the family's own head, not a fresh one
        for (name, p), q in zip(head_params(start).items(), head_params(saved).values()):
            assert torch.equal(p, q), (family, name)
    else:  # the discriminator has no MLM head: a fresh one, tied to the word embeddings, zero bias
        layout = mlm_layout(start)
        assert layout.decoder.weight is start.get_input_embeddings().weight
        assert torch.count_nonzero(layout.decoder.bias) == 0
    result = run(continued(folder, store, tmp_path / "out"))
    assert result.steps == 3
    card = json.loads((tmp_path / "out" / "encoderkit.json").read_text())
    assert card["task"] == "mlm" and (tmp_path / "out" / card["parent"]).resolve() == Path(folder).resolve()
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == MLM_CLASS[family]
    # the saved folder is the trained model: its masked-only loss is the one pretrain measured
    from encoderkit.data.masking import Masker, MaskingSpec
    from encoderkit.models.tokenizer import load_tokenizer
    from encoderkit.train.pretrain import heldout_batches

    tok = load_tokenizer(store)
    batches = heldout_batches(store, Masker.from_tokenizer(tok, MaskingSpec(rate=0.15), seed=0), 8, 4)
    from encoderkit.models.mlm import evaluate_mlm

    loss = evaluate_mlm(MaskedOnlyMLM(again), batches)["loss"]
    assert loss == pytest.approx(result.metrics["heldout_loss"], abs=1e-4)
    assert any(not torch.equal(p, q) for p, q in zip(head_params(again).values(), head_params(start).values()))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_headless_folder_gets_a_fresh_tied_head(family, family_dir, tmp_path) -> None:
    from transformers import AutoModel, AutoModelForMaskedLM

    folder = family_dir(family, headless=True)
    model = load_encoder(folder).eval()
    layout = mlm_layout(model)
    words = model.get_input_embeddings().weight
    if layout.decoder is not None:
        assert layout.decoder.weight is words
    for part in layout.modules:
        for m in part.modules():
            if isinstance(m, torch.nn.LayerNorm):
                assert torch.all(m.weight == 1) and (m.bias is None or torch.all(m.bias == 0))
            bias = m._parameters.get("bias")
            if bias is not None and not isinstance(m, torch.nn.LayerNorm):
                assert torch.count_nonzero(bias) == 0, family
    # the encoder weights are the saved ones, and the folder it writes reloads to the same outputs
    base = AutoModel.from_pretrained(folder)
    assert torch.equal(base.get_input_embeddings().weight, words)
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5)


def test_deberta_from_scratch_learns_and_loads(tiny_tokenizer_dir, tmp_path) -> None:
    from transformers import AutoModelForMaskedLM

    store = make_store(tmp_path, tiny_tokenizer_dir, (SENTENCE + "\n") * 120, seq_len=33)
    result = run(PretrainConfig(data=str(store), out=str(tmp_path / "d"), arch="deberta", layers=2, hidden=32,
                                heads=4, ffn=64, dropout=0.0, batch_size=8, lr=1e-2, max_steps=60, warmup=5,
                                mask_rate=0.3, eval_blocks=16, bf16="off"))
    assert result.metrics["heldout_loss"] < 0.5 * result.metrics["initial_heldout_loss"]
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "d")
    assert type(model).__name__ == "DebertaV2ForMaskedLM"
    assert model.config.relative_attention and model.config.pos_att_type == ["p2c", "c2p"]
    assert not model.config.position_biased_input


def test_a_family_without_a_masked_lm_class_is_refused_by_name(tiny_tokenizer_dir, tmp_path) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2Model

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    folder = tmp_path / "gpt2"
    GPT2Model(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(folder)
    store = store_for(tiny_tokenizer_dir, tmp_path)
    with pytest.raises(EncoderkitError, match="pretrain: .* gpt2 model, and gpt2 has no masked-LM model class"):
        run(continued(folder, store, tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_a_hub_style_deberta_folder_keeps_its_lm_predictions_head(family_dir, tmp_path) -> None:
    """microsoft/deberta-v3-* folders hold `lm_predictions.*` weights but no `legacy` key in config.json
    (transformers then defaults to the legacy `cls` head and would drop them): the loader keeps them."""
    import shutil

    from transformers import AutoModelForMaskedLM

    folder = tmp_path / "hub-deberta"
    shutil.copytree(family_dir("deberta-v2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("legacy")
    config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    model = load_encoder(folder)
    saved = AutoModelForMaskedLM.from_pretrained(family_dir("deberta-v2"))
    assert hasattr(model, "lm_predictions") and not model.config.legacy
    assert torch.equal(model.lm_predictions.lm_head.dense.weight, saved.lm_predictions.lm_head.dense.weight)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
def test_nsp_on_another_family_is_a_cli_error_naming_family_and_stage(family, family_dir, tmp_path, capsys) -> None:
    folder = family_dir(family)
    store = store_for(folder, tmp_path)
    err = cli_error(["pretrain", "--data", str(store), "--model", str(folder), "--out", str(tmp_path / "o"),
                           "--objective", "mlm+nsp", "--max-steps", "1", "--bf16", "off"], capsys)
    assert "pretrain --objective mlm+nsp needs a BERT model" in err and f"holds a {family} model" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch", ["deberta", "modernbert"])
def test_nsp_from_scratch_on_another_arch_is_a_cli_error(arch, tiny_tokenizer_dir, tmp_path, capsys) -> None:
    store = store_for(tiny_tokenizer_dir, tmp_path)
    err = cli_error(["pretrain", "--data", str(store), "--out", str(tmp_path / "o"), "--arch", arch,
                           "--layers", "2", "--hidden", "32", "--heads", "4", "--ffn", "64",
                           "--objective", "mlm+nsp", "--max-steps", "1"], capsys)
    assert "pretrain: --objective mlm+nsp needs --arch bert" in err and f"got --arch {arch}" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_agnostic_distillation_gives_a_half_depth_student_of_the_family(family, family_dir, tmp_path, capsys) -> None:
    """DistilBERT-style distillation (every other layer copied, MLM distillation on token blocks) for each
    family's masked-LM folder; ModernBERT's student keeps the attention kind (global/local) of the layers copied.
    An ELECTRA discriminator (no masked-LM head) is refused through the CLI, naming the family and the stage."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill

    folder = family_dir(family)
    store = store_for(folder, tmp_path)
    if family == "electra":  # the discriminator has no masked-LM head: refused by name; its pretrained folder works
        err = cli_error(["distill", "--teacher", str(folder), "--out", str(tmp_path / "s"), "--mode", "agnostic",
                         "--data", str(store), "--max-steps", "2", "--batch-size", "4"], capsys)
        assert err.startswith("error: distill --mode agnostic: electra teachers without a masked-LM head are not "
                              "supported") and "ElectraForPreTraining" in err, err
        assert not (tmp_path / "s").exists()
        folder = tmp_path / "pretrained"
        run(continued(family_dir(family), store, folder, max_steps=1))
    result = distill(DistillConfig(teacher=str(folder), out=str(tmp_path / "s"), mode="agnostic",
                                   data=str(store), max_steps=2, batch_size=4))
    assert result.steps == 2 and result.student_params < result.teacher_params
    student = AutoModelForMaskedLM.from_pretrained(tmp_path / "s")
    teacher = AutoConfig.from_pretrained(folder)
    assert type(student).__name__ == MLM_CLASS[family]
    assert student.config.num_hidden_layers == teacher.num_hidden_layers // 2 == 1
    if family == "modernbert":
        assert student.config.layer_types == teacher.layer_types[:1]
