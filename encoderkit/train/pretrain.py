"""``encoderkit pretrain``: masked-language-model pretraining, from scratch or continued.

From scratch (``--arch``, ``--preset``) or continued from any folder whose family has a masked-LM class (its own
MLM head, or a fresh tied one); on a token store (``--data``) or a corpus prepared on the fly. ``--objective mlm``
trains on packed blocks, ``mlm+nsp`` is BERT's original recipe (:mod:`encoderkit.data.nsp`); the held-out MLM
metrics are on the same blocks either way, so recipes compare on one footing. The output is a standard HF folder
(``AutoModelForMaskedLM``, ``pipeline("fill-mask")``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.config import arg, check
from encoderkit.data.function_words import read_skip_words
from encoderkit.data.masking import Masker, MaskingSpec
from encoderkit.data.nsp import PairBuilder
from encoderkit.data.prepare import PrepareConfig, ensure_prepared, open_blocks, open_documents, read_meta
from encoderkit.errors import EncoderkitError
from encoderkit.io import cache_dir, check_output_dir, check_writable, output_dir, write_json_atomic
from encoderkit.models.card import write_card
from encoderkit.models.heads import PRETRAINED
from encoderkit.models.load import build_encoder, check_fits, load_encoder
from encoderkit.models.mlm import (
    MaskedOnlyMLM,
    MaskedOnlyPreTraining,
    evaluate_mlm,
    evaluate_nsp,
    mlm_loss_fn,
    mlm_nsp_loss_fn,
)
from encoderkit.models.presets import ARCHS, PRESETS, build_config
from encoderkit.models.tokenizer import load_tokenizer
from encoderkit.progress import note
from encoderkit.train import distributed as dist_util
from encoderkit.train.dropout import auto_train_dropout, dropout_set, planned_passes
from encoderkit.train.engine import FitResult, IndexedBatches, TrainArgs, fit

DEFAULT_CACHE = cache_dir("prepared")


@dataclass
class PretrainConfig(TrainArgs):
    out: str = arg(help="Output model folder (HF layout + encoderkit.json).", required=True)
    data: str = arg("", help="Token store folder from `encoderkit data prepare` (or use --corpus and --tokenizer).")
    corpus: list[str] = arg([], help="Text files/folders/globs to prepare on the fly (with --tokenizer).")
    tokenizer: str = arg("", help="Tokenizer folder for --corpus.")
    seq_len: int = arg(128, help="Block length when preparing --corpus.")
    heldout: float = arg(0.01, help="Held-out document fraction when preparing --corpus.")
    doc_split: str = arg("file", help="How --corpus text files become documents.",
                         choices=("file", "blank_line", "line"))
    follow_links: bool = arg(False, help="--corpus: also read files that symbolic links inside a corpus folder point "
                                         "to outside it (by default such links are skipped and counted).")
    model: str = arg("", help="HF model folder to continue pretraining from (instead of --preset).")
    preset: str = arg("", help="Architecture preset for a model from scratch.", choices=("", *PRESETS))
    arch: str = arg("bert", help="Architecture family for a model from scratch (deberta: DeBERTa-v2/v3 disentangled "
                    "attention).", choices=ARCHS)
    layers: int = arg(0, help="Encoder layers (overrides the preset); with --model, continue from the model's first "
                      "N layers (a shallower copy: cheaper steps, the layers above N dropped).")
    hidden: int = arg(0, help="Hidden size (overrides the preset).")
    heads: int = arg(0, help="Attention heads (overrides the preset).")
    ffn: int = arg(0, help="Feed-forward size (overrides the preset).")
    dropout: float = arg(0.1, help="Dropout of a model from scratch, as its config.json keeps it for fine-tuning.")
    train_dropout: float = arg(-1.0, help="Dropout while pretraining; -1 (auto): 0 where the run passes over its "
                               "corpus at most once (each block is seen about once: dropout only slows the steps), "
                               "else the model's own. The written model keeps its own dropout (from scratch: "
                               "--dropout) for fine-tuning.")
    objective: str = arg("mlm", help="mlm: masked LM on packed blocks (RoBERTa's recipe); mlm+nsp: BERT's original "
                         "masked LM + next-sentence prediction on [CLS] A [SEP] B [SEP] pairs (BERT models only).",
                         choices=("mlm", "mlm+nsp"))
    masking: str = arg("dynamic", help="dynamic: new masks every epoch (RoBERTa); static: epoch 0's masks and "
                       "pairs every epoch (BERT's pre-generated data).", choices=("dynamic", "static"))
    mask_rate: float = arg(0.15, help="Fraction of tokens picked for prediction.")
    mask_frac: float = arg(0.8, help="Of the picked tokens, the fraction replaced by [MASK].")
    random_frac: float = arg(0.1, help="Of the picked tokens, the fraction replaced by a random token.")
    whole_word: bool = arg(False, help="Pick whole words instead of single tokens.")
    mask_words_only: bool = arg(False, help="Pick only tokens of words of letters (any script): punctuation, digits "
                                "and symbols are never masked.")
    mask_skip_words: str = arg("", help="Words never picked: 'english' (a built-in list of English function words: "
                               "the, of, and, is, ...) or a UTF-8 file with one word per line (any language). With "
                               "--mask-words-only a short run learns to predict content words, which fill-mask "
                               "prompts ask for, instead of punctuation and 'the'.")
    freeze_embeddings: bool = arg(False, help="Keep the word embeddings (and so the MLM decoder tied to them) fixed: "
                                  "with --model, its trained embeddings stay as they are and each step is cheaper "
                                  "(no gradient or optimizer update for the vocabulary matrix).")
    eval_blocks: int = arg(256, help="Held-out blocks used for evaluation (0: all).")
    run_dir: str = arg("", help="Checkpoint folder (default: <out>-run).", speed=True)
    cache_dir: str = arg("", help="Where --corpus is prepared (default: ~/.cache/encoderkit/prepared).", speed=True)
    resume: bool = arg(False, help="Continue from the latest checkpoint in --run-dir.", speed=True)
    overwrite: bool = arg(False, help="Replace an existing --out.", speed=True)

    def validate(self) -> None:
        check(bool(self.data) != bool(self.corpus),
              "pretrain: give either --data (a prepared token store) or --corpus with --tokenizer")
        check(not self.corpus or bool(self.tokenizer), "pretrain: --corpus needs --tokenizer (a tokenizer folder)")
        sizes = bool(self.preset or self.hidden or self.heads or self.ffn)  # a model from scratch (--layers: either)
        check(not (self.model and sizes) and bool(self.model or sizes or self.layers),
              "pretrain: give either --model (continue pretraining, optionally --layers N of it) or --preset / "
              "--layers --hidden --heads --ffn")
        check(self.layers >= 0, f"layers must be 0 (all) or more, got {self.layers}")
        if self.mask_skip_words:  # a missing or empty word file is named before any model is loaded
            read_skip_words(self.mask_skip_words)
        check(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.train_dropout == -1 or 0 <= self.train_dropout < 1,
              f"train-dropout must be -1 (auto) or in [0, 1), got {self.train_dropout}")
        check(self.objective == "mlm" or bool(self.model) or self.arch == "bert",
              f"pretrain: --objective mlm+nsp needs --arch bert (next-sentence prediction is BERT's pretraining "
              f"head), got --arch {self.arch}; use --objective mlm")

    def masking_spec(self) -> MaskingSpec:
        return MaskingSpec(rate=self.mask_rate, mask_frac=self.mask_frac, random_frac=self.random_frac,
                           whole_word=self.whole_word, words_only=self.mask_words_only,
                           skip_words=read_skip_words(self.mask_skip_words))

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (result settings, minus where it goes)."""
        d = self.result_dict()
        for k in ("out", "data", "corpus", "tokenizer", "cache_dir"):
            d.pop(k, None)
        return d


@dataclass
class PretrainResult:
    out: Path
    metrics: dict[str, float]
    steps: int
    tokens_per_s: float | None  # None when no step ran in this call (a finished run resumed)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def r(v: Any, n: int) -> Any:  # strict JSON: a missing or non-finite value is null, never NaN
            return round(v, n) if isinstance(v, float) and math.isfinite(v) else (v if isinstance(v, int) else None)

        return {"out": str(self.out), "steps": self.steps, "tokens_per_s": r(self.tokens_per_s, 1),
                **{k: r(v, 4) for k, v in self.metrics.items()}, **self.extra}


def resolve_data(cfg: PretrainConfig, dist: dist_util.DistInfo) -> Path:
    """The token store: ``--data`` as given, or ``--corpus`` prepared into the cache (rank 0 first)."""
    if cfg.data:
        read_meta(cfg.data)
        return Path(cfg.data)
    prep = PrepareConfig(corpus=cfg.corpus, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len, heldout=cfg.heldout,
                         doc_split=cfg.doc_split, seed=cfg.seed, follow_links=cfg.follow_links)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_CACHE
    folder = ensure_prepared(prep, cache) if dist.is_main else None
    dist.barrier()
    return folder if folder is not None else ensure_prepared(prep, cache)


def make_model(cfg: PretrainConfig, meta: dict[str, Any], tokenizer: Any) -> torch.nn.Module:
    """The model to train: loaded (--model) or fresh (--preset / sizes), checked against the data."""
    vocab, seq_len = int(meta["vocab_size"]), int(meta["seq_len"])
    nsp = cfg.objective == "mlm+nsp"
    if cfg.model:
        _check_same_tokenizer(Path(cfg.model), tokenizer)
        # a new MLM head's initialisation follows --seed, as build_encoder's does
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return load_encoder(cfg.model, vocab_size=vocab, seq_len=seq_len, pretraining=nsp,
                                layers=cfg.layers or None)
    config = build_config(cfg.preset or None, vocab, max(512, seq_len), layers=cfg.layers or None,
                          hidden=cfg.hidden or None, heads=cfg.heads or None, ffn=cfg.ffn or None, arch=cfg.arch,
                          dropout=cfg.dropout, special_ids=meta.get("special_ids"))
    check_fits(config, vocab, seq_len, "pretrain")
    return build_encoder(config, cfg.seed, pretraining=nsp)


def train_dropout(cfg: PretrainConfig, n_examples: int, world_size: int) -> float | None:
    """The dropout rate while training (None: the model's own): ``--train-dropout``, or for -1 (auto)
    :func:`~encoderkit.train.dropout.auto_train_dropout` of the passes over the corpus the run plans."""
    if cfg.train_dropout != -1:
        return cfg.train_dropout
    global_batch = cfg.batch_size * cfg.grad_accum * world_size
    return auto_train_dropout(planned_passes(cfg.max_steps, cfg.epochs, global_batch, n_examples))


def training_batches(cfg: PretrainConfig, data: Path, meta: dict[str, Any], masker: Masker
                     ) -> tuple[int, Any]:
    """``(n_examples, make_batch(idx, epoch))`` for the engine: masked packed blocks (``mlm``) or
    masked NSP pairs with ``token_type_ids`` and ``next_sentence_label`` (``mlm+nsp``). Static
    masking asks for epoch 0 every epoch."""
    def data_epoch(epoch: int) -> int:
        return epoch if cfg.masking == "dynamic" else 0

    if cfg.objective == "mlm":
        blocks = open_blocks(data, "train")

        def make_blocks(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
            idx = np.sort(idx)  # memmap reads in order
            return masker(blocks[idx], idx, data_epoch(epoch))

        return len(blocks), make_blocks
    tokens, offsets, heldout = open_documents(data)
    pairs = PairBuilder(tokens, offsets, np.flatnonzero(~heldout), seq_len=int(meta["seq_len"]),
                        ids=meta["special_ids"], seed=cfg.seed)

    def make_pairs(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        return masked_pairs(pairs, masker, np.sort(idx), data_epoch(epoch))

    return len(pairs), make_pairs


def masked_pairs(pairs: PairBuilder, masker: Masker, idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
    """NSP pairs ``idx`` of ``epoch``, masked: input_ids, attention_mask, labels, token_type_ids
    (B, L) and next_sentence_label (B,)."""
    built = pairs(idx, epoch)
    return {**masker(built["input_ids"], idx, epoch), "token_type_ids": built["token_type_ids"],
            "next_sentence_label": built["next_sentence_label"]}


def heldout_pairs(data: Path, meta: dict[str, Any], masker: Masker, n_examples: int, batch_size: int,
                  seed: int) -> list[dict[str, torch.Tensor]]:
    """Fixed masked NSP batches from the held-out documents (epoch 0); B is drawn from the other
    held-out documents, or from every document when only one is held out. Empty without held-out text."""
    tokens, offsets, heldout = open_documents(data)
    docs = np.flatnonzero(heldout)
    if len(docs) == 0:
        return []
    pool = docs if len(docs) >= 2 else np.arange(len(heldout))
    pairs = PairBuilder(tokens, offsets, docs, seq_len=int(meta["seq_len"]), ids=meta["special_ids"], seed=seed,
                        pool=pool)
    n = len(pairs) if n_examples <= 0 else min(n_examples, len(pairs))
    return [masked_pairs(pairs, masker, np.arange(i, min(i + batch_size, n)), 0) for i in range(0, n, batch_size)]


def _check_same_tokenizer(model_dir: Path, tokenizer: Any) -> None:
    """A model folder that carries a tokenizer must carry the one the data was prepared with."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return
    theirs = load_tokenizer(model_dir).get_vocab()
    if theirs != tokenizer.get_vocab():
        raise EncoderkitError(
            f"the data was prepared with a different tokenizer than {model_dir}'s own "
            f"({len(tokenizer)} vs {len(theirs)} tokens or different ids); prepare the corpus with "
            f"--tokenizer {model_dir}"
        )


def heldout_batches(folder: Path, masker: Masker, n_blocks: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Fixed masked batches of the first ``n_blocks`` held-out blocks (0: all), epoch 0 masks."""
    blocks = open_blocks(folder, "heldout")
    n = len(blocks) if n_blocks <= 0 else min(n_blocks, len(blocks))
    return [masker(np.asarray(blocks[i:min(i + batch_size, n)]), np.arange(i, min(i + batch_size, n)), 0)
            for i in range(0, n, batch_size)]


def evaluate_folder(folder: Any, tokenizer: Any, data: str | Path, cfg: Any) -> dict[str, float]:
    """``encoderkit evaluate --task mlm``: held-out MLM loss, masked-token accuracy and perplexity
    of a model folder on a token store's held-out blocks (epoch-0 masks of ``cfg.seed``, the same
    masks ``pretrain`` evaluates with at the same ``cfg.mask_rate``). ``cfg.max_examples`` caps the blocks (0: all)."""
    model_dir = folder.path  # a ModelFolder
    store = Path(data)
    if not (store / "meta.json").is_file():
        raise EncoderkitError(f"{store}: not a token store; --task mlm takes a folder made by "
                              "`encoderkit data prepare`")
    meta = read_meta(store)
    store_tokenizer = load_tokenizer(store)
    _check_same_tokenizer(Path(model_dir), store_tokenizer)
    model = load_encoder(model_dir, vocab_size=int(meta["vocab_size"]), seq_len=int(meta["seq_len"]),
                         stage="evaluate --task mlm")
    masker = Masker.from_tokenizer(store_tokenizer, MaskingSpec(rate=cfg.mask_rate), seed=cfg.seed)
    batches = heldout_batches(store, masker, cfg.max_examples, cfg.batch_size)
    if not batches:
        raise EncoderkitError(f"{store}: the token store has no held-out blocks; prepare it with --heldout > 0")
    with torch.no_grad():
        metrics = evaluate_mlm(MaskedOnlyMLM(model).eval(), batches)
    return {**metrics, "blocks": sum(len(b["input_ids"]) for b in batches)}


def run(cfg: PretrainConfig) -> PretrainResult:
    """Pretrain an encoder with masked language modelling (from scratch or continued)."""
    dist = dist_util.current()
    out = Path(cfg.out)
    if dist.is_main:
        check_output_dir(out, cfg.overwrite)  # before hours of training, not after
    run_dir = Path(cfg.run_dir) if cfg.run_dir else out.with_name(out.name + "-run")
    if dist.is_main:
        check_writable(run_dir / "checkpoints", "--run-dir")
    data = resolve_data(cfg, dist)
    meta = read_meta(data)
    tokenizer = load_tokenizer(data)
    model = make_model(cfg, meta, tokenizer)
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    nsp = cfg.objective == "mlm+nsp"
    mlm_view = MaskedOnlyMLM(model)  # held-out MLM metrics: the same packed blocks for every objective
    module = MaskedOnlyPreTraining(model) if nsp else mlm_view
    masker = Masker.from_tokenizer(tokenizer, cfg.masking_spec(), seed=cfg.seed)
    n_examples, make_batch = training_batches(cfg, data, meta, masker)
    source = IndexedBatches(n_examples, cfg.batch_size, make_batch, seed=cfg.seed)
    eval_batches = heldout_batches(data, masker, cfg.eval_blocks, cfg.batch_size)
    nsp_batches = heldout_pairs(data, meta, masker, cfg.eval_blocks, cfg.batch_size, cfg.seed) if nsp else []

    def evaluate_all(m: torch.nn.Module) -> dict[str, float]:
        metrics = evaluate_mlm(mlm_view, eval_batches) if eval_batches else {}
        if nsp_batches:
            metrics.update(evaluate_nsp(module, nsp_batches))
        return metrics

    evaluate = evaluate_all if eval_batches or nsp_batches else None
    before = {}
    if evaluate is not None and dist.is_main and not cfg.resume:
        module.eval()
        before = evaluate_all(module)
    fingerprint = {"config": cfg.identity(), "data": meta.get("fingerprint"), "parent": cfg.model or None}
    rate = train_dropout(cfg, n_examples, dist.world_size)
    if dist.is_main:
        note(f"pretrain: dropout while training {'as the model has it' if rate is None else rate} "
             f"(--train-dropout {cfg.train_dropout:g}); the written model keeps its own")
    with dropout_set(module, rate):
        result: FitResult = fit(module, mlm_nsp_loss_fn if nsp else mlm_loss_fn, source, cfg.train_settings(),
                                run_dir, evaluate=evaluate,
                                primary=("loss", "min") if eval_batches else ("nsp_loss", "min"),
                                fingerprint=fingerprint, resume=cfg.resume)
    metrics = {f"heldout_{k}": v for k, v in result.eval_metrics.items()}
    if rate is not None:
        metrics["train_dropout"] = rate
    metrics.update({f"initial_heldout_{k}": v for k, v in before.items()})
    metrics["train_loss"] = result.train_logs.get("loss")
    if dist.is_main:
        retry = f"rerun with --resume (the checkpoints are kept in {run_dir})"
        with output_dir(out, cfg.overwrite, retry=retry) as tmp:
            model.save_pretrained(tmp)
            if nsp:  # the weights keep BertForPreTraining's layout (pooler, NSP head); by name the folder is an
                # MLM model, for every reader that picks the class from config.json (distill, the folder reader)
                config_file = tmp / "config.json"
                config = json.loads(config_file.read_text())
                write_json_atomic(config_file, {**config, "architectures": ["BertForMaskedLM"]})
            tokenizer.save_pretrained(str(tmp))
            write_card(tmp, stage="pretrain", parent=cfg.model or None, config=cfg.to_dict(),
                       metrics={**metrics, "steps": result.steps, "tokens_per_s": result.tokens_per_s,
                                "data": str(data), "data_fingerprint": meta.get("fingerprint")},
                       task=PRETRAINED, max_length=int(meta["seq_len"]))
    dist.barrier()
    return PretrainResult(out, metrics, result.steps, result.tokens_per_s,
                          extra={"run_dir": str(run_dir), "best_checkpoint": str(result.best_checkpoint),
                                 **({"skipped_links": meta.get("skipped_links", 0)} if cfg.corpus else {})})
