"""``encoderkit pretrain``: masked-language-model pretraining, from scratch or continued.

Data: a token store (``--data``, from ``encoderkit data prepare``) or a corpus plus tokenizer
(``--corpus ... --tokenizer DIR``, prepared on the fly into a cache). Model: an HF folder
(``--model``, continued pretraining; a folder without an MLM head gets a fresh tied one) or a
fresh encoder (``--preset`` and/or explicit sizes). Masks come from the seeded
:class:`~encoderkit.data.masking.Masker` (a block's mask depends only on seed, epoch and block
index), the loss from the masked-only head, the loop from :func:`encoderkit.train.engine.fit`.

Checkpoints live in ``--run-dir`` (default ``<out>-run``); ``--resume`` continues from the latest
one after checking that it was made with the same config and data. The final ``--out`` is a
standard HF folder (``AutoModelForMaskedLM``, ``pipeline("fill-mask")``) with the tokenizer and
``encoderkit.json`` (held-out MLM loss, masked-token accuracy, perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.config import arg, check
from encoderkit.data.masking import Masker, MaskingSpec
from encoderkit.data.prepare import PrepareConfig, ensure_prepared, open_blocks, read_meta
from encoderkit.errors import EncoderkitError
from encoderkit.io import cache_dir, check_output_dir, output_dir, write_card
from encoderkit.models.load import build_encoder, check_fits, load_encoder
from encoderkit.models.mlm import MaskedOnlyMLM, evaluate_mlm, mlm_loss_fn
from encoderkit.models.presets import ARCHS, PRESETS, build_config
from encoderkit.tokenizer import load_tokenizer
from encoderkit.train import distributed as dist_util
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
    doc_split: str = arg("file", help="How --corpus text files become documents.", choices=("file", "blank_line", "line"))
    model: str = arg("", help="HF model folder to continue pretraining from (instead of --preset).")
    preset: str = arg("", help="Architecture preset for a model from scratch.", choices=("", *PRESETS))
    arch: str = arg("bert", help="Architecture family for a model from scratch.", choices=ARCHS)
    layers: int = arg(0, help="Encoder layers (overrides the preset).")
    hidden: int = arg(0, help="Hidden size (overrides the preset).")
    heads: int = arg(0, help="Attention heads (overrides the preset).")
    ffn: int = arg(0, help="Feed-forward size (overrides the preset).")
    dropout: float = arg(0.1, help="Dropout of a model from scratch.")
    mask_rate: float = arg(0.15, help="Fraction of tokens picked for prediction.")
    mask_frac: float = arg(0.8, help="Of the picked tokens, the fraction replaced by [MASK].")
    random_frac: float = arg(0.1, help="Of the picked tokens, the fraction replaced by a random token.")
    whole_word: bool = arg(False, help="Pick whole words instead of single tokens.")
    eval_blocks: int = arg(256, help="Held-out blocks used for evaluation (0: all).")
    run_dir: str = arg("", help="Checkpoint folder (default: <out>-run).", speed=True)
    cache_dir: str = arg("", help="Where --corpus is prepared (default: ~/.cache/encoderkit/prepared).", speed=True)
    resume: bool = arg(False, help="Continue from the latest checkpoint in --run-dir.", speed=True)
    overwrite: bool = arg(False, help="Replace an existing --out.", speed=True)

    def validate(self) -> None:
        check(bool(self.data) != bool(self.corpus),
              "pretrain: give either --data (a prepared token store) or --corpus with --tokenizer")
        check(not self.corpus or bool(self.tokenizer), "pretrain: --corpus needs --tokenizer (a tokenizer folder)")
        check(bool(self.model) != bool(self.preset or self.layers or self.hidden),
              "pretrain: give either --model (continue pretraining) or --preset / --layers --hidden --heads --ffn")
        check(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")

    def masking_spec(self) -> MaskingSpec:
        return MaskingSpec(rate=self.mask_rate, mask_frac=self.mask_frac, random_frac=self.random_frac,
                           whole_word=self.whole_word)

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
    tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "steps": self.steps, "tokens_per_s": round(self.tokens_per_s, 1),
                **{k: round(v, 4) for k, v in self.metrics.items()}, **self.extra}


def resolve_data(cfg: PretrainConfig, dist: dist_util.DistInfo) -> Path:
    """The token store: ``--data`` as given, or ``--corpus`` prepared into the cache (rank 0 first)."""
    if cfg.data:
        read_meta(cfg.data)
        return Path(cfg.data)
    prep = PrepareConfig(corpus=cfg.corpus, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len, heldout=cfg.heldout,
                         doc_split=cfg.doc_split, seed=cfg.seed)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_CACHE
    folder = ensure_prepared(prep, cache) if dist.is_main else None
    dist.barrier()
    return folder if folder is not None else ensure_prepared(prep, cache)


def make_model(cfg: PretrainConfig, meta: dict[str, Any], tokenizer: Any) -> torch.nn.Module:
    """The model to train: loaded (--model) or fresh (--preset / sizes), checked against the data."""
    vocab, seq_len = int(meta["vocab_size"]), int(meta["seq_len"])
    if cfg.model:
        _check_same_tokenizer(Path(cfg.model), tokenizer)
        return load_encoder(cfg.model, vocab_size=vocab, seq_len=seq_len)
    config = build_config(cfg.preset or None, vocab, max(512, seq_len), layers=cfg.layers or None,
                          hidden=cfg.hidden or None, heads=cfg.heads or None, ffn=cfg.ffn or None, arch=cfg.arch,
                          dropout=cfg.dropout, special_ids=meta.get("special_ids"))
    check_fits(config, vocab, seq_len, "pretrain")
    return build_encoder(config, cfg.seed)


def _check_same_tokenizer(model_dir: Path, tokenizer: Any) -> None:
    """A model folder that carries a tokenizer must carry the one the data was prepared with."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(model_dir).get_vocab()
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
        raise EncoderkitError(f"{store}: not a token store; --task mlm takes a folder made by `encoderkit data prepare`")
    meta = read_meta(store)
    store_tokenizer = load_tokenizer(store)
    _check_same_tokenizer(Path(model_dir), store_tokenizer)
    model = load_encoder(model_dir, vocab_size=int(meta["vocab_size"]), seq_len=int(meta["seq_len"]))
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
    data = resolve_data(cfg, dist)
    meta = read_meta(data)
    tokenizer = load_tokenizer(data)
    model = make_model(cfg, meta, tokenizer)
    mlm = MaskedOnlyMLM(model)
    masker = Masker.from_tokenizer(tokenizer, cfg.masking_spec(), seed=cfg.seed)
    train_blocks = open_blocks(data, "train")

    def make_batch(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        return masker(train_blocks[np.sort(idx)], np.sort(idx), epoch)  # sorted: memmap reads in order

    source = IndexedBatches(len(train_blocks), cfg.batch_size, make_batch, seed=cfg.seed)
    eval_batches = heldout_batches(data, masker, cfg.eval_blocks, cfg.batch_size)
    evaluate = (lambda m: evaluate_mlm(m, eval_batches)) if eval_batches else None
    before = evaluate_mlm(mlm.eval(), eval_batches) if eval_batches and dist.is_main and not cfg.resume else {}
    fingerprint = {"config": cfg.identity(), "data": meta.get("fingerprint"), "parent": cfg.model or None}
    result: FitResult = fit(mlm, mlm_loss_fn, source, cfg.train_settings(), run_dir, evaluate=evaluate,
                            primary=("loss", "min"), fingerprint=fingerprint, resume=cfg.resume)
    metrics = {f"heldout_{k}": v for k, v in result.eval_metrics.items()}
    metrics.update({f"initial_heldout_{k}": v for k, v in before.items()})
    metrics["train_loss"] = result.train_logs.get("loss", float("nan"))
    if dist.is_main:
        with output_dir(out, cfg.overwrite) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(str(tmp))
            write_card(tmp, stage="pretrain", parent=cfg.model or None, config=cfg.to_dict(),
                       metrics={**metrics, "steps": result.steps, "tokens_per_s": result.tokens_per_s,
                                "data": str(data), "data_fingerprint": meta.get("fingerprint")},
                       task="mlm", max_length=int(meta["seq_len"]))
    dist.barrier()
    return PretrainResult(out, metrics, result.steps, result.tokens_per_s,
                          extra={"run_dir": str(run_dir), "best_checkpoint": str(result.best_checkpoint)})
