"""Tiny random encoders of every family encoderkit supports, built in-process (hidden 32, 2 layers),
each saved with a tokenizer of the kind the family ships with. Bring the fixtures into a test
module with ``family_dir, tuned = families.family_dir, families.tuned`` (and ``bpe_tokenizer_dir``).

- bert, electra, deberta-v2, modernbert: the tiny WordPiece tokenizer of ``conftest`` (token types on);
- distilbert: the same vocabulary in DistilBERT's tokenizer class (no token type ids: its model takes none);
- roberta: a byte-level BPE tokenizer trained here (<s> </s> <pad> <mask>, no token type ids).

The folder holds the family's masked-LM model where the family has an MLM head; ELECTRA's is the
discriminator (``ElectraForPreTraining``), which has none, as on the Hub. ``headless=True`` saves the
bare encoder (``AutoModel``) instead. ``tuned(family, task)`` is that bare encoder fine-tuned 2 steps on
a tiny seeded data set of ``task`` (``task_data``), shared by the matrix's modules.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import WORDS

FAMILIES = ("bert", "roberta", "deberta-v2", "electra", "distilbert", "modernbert")
TASKS = ("classify", "ner", "qa", "rerank", "embed")
# the words of the tiny task data sets (task_data)
FILL = ["the", "a", "of", "to", "and", "in", "is", "was", "it", "that", "for", "on", "with", "as", "at", "by"]
TOPICS = ["python", "code", "data", "model", "movie", "film", "story", "love"]
# the class `AutoModelForMaskedLM` gives for each family's folder
MLM_CLASS = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "deberta-v2": "DebertaV2ForMaskedLM",
             "electra": "ElectraForMaskedLM", "distilbert": "DistilBertForMaskedLM",
             "modernbert": "ModernBertForMaskedLM"}


def corpus_text(n_lines: int = 200, seed: int = 0) -> str:
    """Lines of 8-20 words of ``conftest.WORDS`` (seeded), for tokenizers and token stores."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(WORDS, int(rng.integers(8, 21)))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory) -> Path:
    """A RoBERTa-style byte-level BPE tokenizer (about 400 tokens) trained with `encoderkit tokenizer train`."""
    from encoderkit.train.tokenizer import TokenizerConfig
    from encoderkit.train.tokenizer import run as train_tokenizer

    tmp = tmp_path_factory.mktemp("bpe")
    (tmp / "corpus.txt").write_text(corpus_text())
    train_tokenizer(TokenizerConfig(corpus=[str(tmp / "corpus.txt")], out=str(tmp / "tok"), kind="bpe",
                                    vocab_size=400, min_frequency=1))
    return tmp / "tok"


def tiny_config(family: str, tok: Any) -> Any:
    """A tiny config of ``family`` whose embeddings and special ids fit ``tok``."""
    import transformers as tf

    v, pad, cls, sep = len(tok), tok.pad_token_id, tok.cls_token_id, tok.sep_token_id
    common = {"vocab_size": v, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 128, "pad_token_id": pad}
    if family == "bert":
        return tf.BertConfig(**common, type_vocab_size=2)
    if family == "roberta":  # positions start after the padding index, as in roberta-base (514 for 512)
        return tf.RobertaConfig(**{**common, "max_position_embeddings": 130}, type_vocab_size=1,
                                bos_token_id=cls, eos_token_id=sep)
    if family == "deberta-v2":  # DeBERTa-v3's shape
        return tf.DebertaV2Config(**common, type_vocab_size=0, relative_attention=True, max_relative_positions=-1,
                                  position_buckets=64, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                  norm_rel_ebd="layer_norm", share_att_key=True, legacy=False)
    if family == "electra":
        return tf.ElectraConfig(**common, embedding_size=32, type_vocab_size=2)
    if family == "distilbert":
        return tf.DistilBertConfig(vocab_size=v, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                   max_position_embeddings=128, pad_token_id=pad)
    if family == "modernbert":
        return tf.ModernBertConfig(**common, cls_token_id=cls, sep_token_id=sep, bos_token_id=cls, eos_token_id=sep,
                                   global_attn_every_n_layers=2, local_attention=16)
    raise ValueError(family)


def family_tokenizer(family: str, wordpiece_dir: Path, bpe_dir: Path) -> Any:
    from transformers import AutoTokenizer, DistilBertTokenizerFast

    if family == "roberta":
        return AutoTokenizer.from_pretrained(bpe_dir)
    if family == "distilbert":  # DistilBERT's own tokenizer class: the same WordPiece, no token type ids
        return DistilBertTokenizerFast(vocab=str(wordpiece_dir / "vocab.txt"), do_lower_case=True)
    return AutoTokenizer.from_pretrained(wordpiece_dir)


def save_family(family: str, out: Path, wordpiece_dir: Path, bpe_dir: Path, *, headless: bool = False,
                seed: int = 0) -> Path:
    """Save a tiny random ``family`` model and its tokenizer to ``out``; returns ``out``."""
    import torch
    import transformers as tf

    tok = family_tokenizer(family, wordpiece_dir, bpe_dir)
    config = tiny_config(family, tok)
    torch.manual_seed(seed)
    if headless:
        model = tf.AutoModel.from_config(config)
    elif family == "electra":
        model = tf.ElectraForPreTraining(config)  # the discriminator: no MLM head
    else:
        model = tf.AutoModelForMaskedLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, tiny_tokenizer_dir, bpe_tokenizer_dir):
    """``family_dir(family, headless=False) -> Path``: a tiny random model folder of that family (cached)."""
    made: dict[tuple[str, bool], Path] = {}

    def get(family: str, headless: bool = False) -> Path:
        key = (family, headless)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{'base' if headless else 'mlm'}")
            made[key] = save_family(family, out, tiny_tokenizer_dir, bpe_tokenizer_dir, headless=headless)
        return made[key]

    return get


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_data(task: str, tmp: Path) -> tuple[Path, Path, dict]:
    """(train file, predict input file, finetune settings) of a tiny, seeded data set for ``task``."""
    rng = random.Random(0)
    if task == "classify":
        lines = ["sentence\tlabel"] + [f"{' '.join(rng.sample(FILL, 3))} {t}\t{'pos' if t in TOPICS[:4] else 'neg'}"
                                       for t in rng.choices(TOPICS, k=24)]
        (tmp / "train.tsv").write_text("\n".join(lines) + "\n")
        (tmp / "in.txt").write_text("the python code\na movie of love\nit was data\n")
        return tmp / "train.tsv", tmp / "in.txt", {"max_length": 16}
    if task == "ner":
        lines = []
        for _ in range(16):
            for _ in range(rng.randint(3, 6)):
                lines.append(f"{rng.choice(TOPICS[:2])} X I-LANG" if rng.random() < 0.3 else f"{rng.choice(FILL)} X O")
            lines.append("")
        (tmp / "train.conll").write_text("\n".join(lines) + "\n")
        (tmp / "in.txt").write_text("the python code is data\nit was a film\n")
        return tmp / "train.conll", tmp / "in.txt", {"max_length": 16, "stride": 4}
    if task == "qa":
        paras = []
        for i in range(16):
            words = rng.sample(FILL, 6)
            ans = rng.choice(TOPICS[:3])
            words.insert(rng.randint(0, 6), ans)
            ctx = " ".join(words)
            paras.append({"context": ctx, "qas": [{"id": str(i), "question": "which one ?",
                                                   "answers": [{"text": ans, "answer_start": ctx.index(ans)}]}]})
        (tmp / "train.json").write_text(json.dumps({"data": [{"title": "t", "paragraphs": paras}]}))
        _jsonl(tmp / "in.jsonl", [{"question": "which one ?", "context": "the data was in it"},
                                  {"question": "which one ?", "context": "a code of the model"}])
        return tmp / "train.json", tmp / "in.jsonl", {"max_length": 32, "doc_stride": 8}
    rows = []
    for _ in range(16):
        topic, *others = rng.sample(TOPICS, 4)
        rows.append({"query": topic, "positive": f"{' '.join(rng.sample(FILL, 3))} {topic}",
                     "negatives": [f"{' '.join(rng.sample(FILL, 3))} {t}" for t in others]})
    _jsonl(tmp / "train.jsonl", rows)
    if task == "rerank":
        _jsonl(tmp / "in.jsonl", [{"query": "python", "passages": ["the python code", "a movie", "of data"]}])
        return tmp / "train.jsonl", tmp / "in.jsonl", {"max_length": 16, "max_query_length": 8, "num_negatives": 1}
    (tmp / "in.txt").write_text("the python code\na movie of love\n")
    return tmp / "train.jsonl", tmp / "in.txt", {"max_length": 16, "max_query_length": 8}


def numbers(record: dict) -> np.ndarray:
    """Every float in a predict record, in order (labels and texts are compared apart)."""
    out: list[float] = []

    def walk(x) -> None:
        if isinstance(x, float):
            out.append(x)
        elif isinstance(x, dict):
            for k in sorted(x):
                walk(x[k])
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(record)
    return np.array(out)


def strings(record: dict) -> list:
    """Everything in a predict record but its floats (labels, answers, texts)."""
    if isinstance(record, dict):
        return [(k, strings(v)) for k, v in sorted(record.items()) if not isinstance(v, float)]
    if isinstance(record, list):
        return [strings(v) for v in record if not isinstance(v, float)]
    return record


def predict_records(folder: Path, inputs: Path, backend: str, out: Path) -> list[dict]:
    from encoderkit.inference.predictor import PredictConfig
    from encoderkit.inference.predictor import run as predict

    predict(PredictConfig(model=str(folder), input=str(inputs), output=str(out), backend=backend, overwrite=True))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.pop("line") for r in records] == list(range(1, len(records) + 1))  # predict numbers its input lines
    return records


@pytest.fixture(scope="session")
def tuned(family_dir, tmp_path_factory):
    """``tuned(family, task) -> (folder, predict input)``: the family's bare encoder fine-tuned 2 steps
    on ``task`` (cached per session, so the export, lever and serve cells reuse the fine-tuning cells' folders)."""
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, task: str) -> tuple[Path, Path]:
        if (family, task) not in made:
            tmp = tmp_path_factory.mktemp(f"{family}-{task}")
            train, inputs, kw = task_data(task, tmp)
            result = finetune(FinetuneConfig(model=str(family_dir(family, headless=True)), task=task, train=str(train),
                                             out=str(tmp / "ft"), max_steps=2, batch_size=4, lr=1e-3, bf16=False,
                                             few_label="off", **kw))  # the standard route, whatever the data
            assert result.steps == 2
            made[family, task] = (tmp / "ft", inputs)
        return made[family, task]

    return get


def cli_error(argv: list[str], capsys) -> str:
    """Run ``encoderkit argv`` in-process: it must exit 2 with one ``error:`` line and no traceback (progress
    bars may come before it); returns that line."""
    from encoderkit.cli import main

    capsys.readouterr()  # drop what the fixtures printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
