"""`encoderkit quickstart`: the whole pipeline on an embedded default corpus, no downloads.

The corpus is the docstrings of the running interpreter's standard library (``builtin:stdlib``),
present on any machine with Python. The stages run in order, each reading the folder the one
before wrote:

    tokenizer train  ->  data prepare  ->  pretrain (MLM, from scratch)  ->  fill-mask demo

and everything lands under ``--out`` (tokenizer/, data/, model/), written atomically.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.config import StageConfig, arg, check
from encoderkit.io import output_dir, relocate_paths


@dataclass
class QuickstartConfig(StageConfig):
    out: str = arg("runs/quickstart", help="Output folder; holds tokenizer/, data/ and model/.")
    corpus: list[str] = arg(["builtin:stdlib"], help="Corpus sources (default: the stdlib's docstrings).")
    vocab_size: int = arg(8000, help="WordPiece vocabulary size.")
    preset: str = arg("tiny", help="Architecture preset of the model trained from scratch.")
    seq_len: int = arg(128, help="Tokens per packed block.")
    steps: int = arg(150, help="Pretraining optimizer steps.")
    batch_size: int = arg(16, help="Blocks per step.")
    lr: float = arg(2e-3, help="Peak learning rate.")
    seed: int = arg(0, help="Seed for the split, initialisation, data order and masks.")
    overwrite: bool = arg(False, help="Replace an existing --out.")

    def validate(self) -> None:
        check(self.steps >= 1, "steps must be at least 1")


@dataclass
class QuickstartResult:
    out: Path
    lines: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        return "\n".join(self.lines)


def run(cfg: QuickstartConfig) -> QuickstartResult:
    """Train a tokenizer and a small MLM on the embedded corpus, then show fill-mask predictions."""
    from encoderkit import tokenizer as tok_stage
    from encoderkit.data import prepare as prep_stage
    from encoderkit.train import pretrain as pre_stage

    lines: list[str] = []
    t0 = time.perf_counter()
    with output_dir(cfg.out, cfg.overwrite) as tmp:
        tok = tok_stage.run(tok_stage.TokenizerConfig(corpus=cfg.corpus, out=str(tmp / "tokenizer"),
                                                      vocab_size=cfg.vocab_size))
        lines.append(f"tokenizer  {cfg.out}/tokenizer  ({tok.summary()['vocab_size']} tokens, WordPiece, uncased)")
        data = prep_stage.run(prep_stage.PrepareConfig(corpus=cfg.corpus, tokenizer=str(tmp / "tokenizer"),
                                                       out=str(tmp / "data"), seq_len=cfg.seq_len, heldout=0.02,
                                                       seed=cfg.seed))
        meta = prep_stage.read_meta(tmp / "data")
        counts = meta["counts"]
        lines.append(f"data       {cfg.out}/data  ({_fmt_counts(counts)})")
        pre = pre_stage.run(pre_stage.PretrainConfig(
            data=str(tmp / "data"), out=str(tmp / "model"), run_dir=str(tmp / "model-run"), preset=cfg.preset,
            seq_len=cfg.seq_len, max_steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed,
            warmup=0.1, eval_blocks=128))
        m = pre.summary()
        lines.append(f"model      {cfg.out}/model  (preset {cfg.preset}, {pre.steps} steps, "
                     f"{m['tokens_per_s']:.0f} tokens/s)")
        for k in ("loss", "accuracy", "perplexity"):
            before, after = pre.metrics.get(f"initial_heldout_{k}"), pre.metrics.get(f"heldout_{k}")
            if after is not None:
                lines.append(f"  held-out masked-token {k:<10} {before:9.3f} -> {after:9.3f}")
        lines += _fill_mask_demo(tmp / "model")
        shutil.rmtree(tmp / "model-run", ignore_errors=True)  # checkpoints: only needed to resume
        relocate_paths(tmp, tmp, Path(cfg.out))  # cards name the final folders, not the temporary one
        del data
    lines.append(f"done in {time.perf_counter() - t0:.0f} s; load it with "
                 f"transformers.AutoModelForMaskedLM.from_pretrained('{cfg.out}/model')")
    return QuickstartResult(Path(cfg.out), lines, m)


def _fmt_counts(counts: dict[str, Any]) -> str:
    parts = []
    for split, c in counts.items():
        if isinstance(c, dict):
            parts.append(f"{split}: " + ", ".join(f"{v} {k}" for k, v in c.items()))
        else:
            parts.append(f"{split}={c}")
    return "; ".join(parts)


def _fill_mask_demo(model_dir: Path) -> list[str]:
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(model_dir), tokenizer=str(model_dir), device="cpu")
    mask = fill.tokenizer.mask_token
    out = ["fill-mask:"]
    for text in (f"Return the {mask} of the list.", f"If the file does not {mask}, raise an error."):
        preds = fill(text, top_k=3)
        out.append(f"  {text}  ->  " + ", ".join(f"{p['token_str']} ({p['score']:.2f})" for p in preds))
    return out
