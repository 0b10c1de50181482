"""BERT's three successor axes side by side: the training recipe, the attention, and distillation.

Five encoders pretrained on the same corpus (Gutenberg novels, ``../shared/data``), with the same
tokenizer (a WordPiece trained here on those novels) and the same token budget:

    bert-original   BERT, static masks + next-sentence prediction ([CLS] A [SEP] B [SEP] pairs)
    bert-roberta    BERT, dynamic masks, MLM only on packed blocks (RoBERTa's recipe)
    deberta         DeBERTa-v2 (disentangled attention), the RoBERTa recipe, same parameter count
    modernbert      ModernBERT (rotary, GeGLU, alternating local/global attention), same recipe and count
    distilled       a half-depth student of the best of the four (by held-out masked-token loss),
                    DistilBERT-style (every other layer, MLM distillation on the same blocks)

The budget is token slots: steps x batch x seq_len (a padded slot counts: NSP pairs of short
paragraphs carry padding, which is a cost of that recipe). The default, 6M slots of 128, is about
20 minutes per model at ~5k tokens/s (BERT-mini shape on 2 cores); ``--smoke`` runs everything
tiny in a couple of minutes. "Same parameter count": DeBERTa keeps BERT's shape (its relative
position table replaces BERT's absolute one); ModernBERT's FFN width is chosen so that its
non-embedding parameters match BERT's (GeGLU has three matrices, not two).

For each model: pretraining tokens/s (for the student: distillation tokens/s, teacher forward included), held-out
masked-token loss and accuracy (the same held-out
paragraphs and the same seed-0 masks for every model), and SST-2 dev accuracy after the same short
fine-tune. The best two pretrained models are run again with a second seed (``--seeds``), and the
spread is printed beside the mean. Documents are paragraphs (blank-line split), so NSP's true next
segment is the rest of a paragraph and its random one a segment of another paragraph.

    python bench/axes.py --smoke                 # the whole pipeline, tiny, a few minutes
    nice -n 5 python bench/axes.py --threads 2   # the measurement (~2-2.5 hours on 2 cores)
    nice -n 10 python bench/axes.py --threads 1 --minutes-per-model 1 --sst2-train 256 --sst2-dev 200 \
        --eval-blocks 64                         # the full-size models on a small budget: proves the pipeline runs

``--minutes-per-model M`` sets a smaller (or larger) budget in minutes instead of token slots: a short
calibration run of BERT (the RoBERTa recipe) measures this machine's pretraining tokens/s, and every
model then gets the same M x 60 x that many token slots (stated in the ``plan:`` line and the RESULT
line). The other models' minutes differ by their speed; the token budget is what stays the same.

A run stopped part-way resumes: each finished model's row is kept in ``<work>/rows/`` with the plan and
the hardware line that made it, and a rerun with the same ``--work`` and plan (``--tokens N``, the slots
its ``plan:`` line printed) reuses those rows and continues an interrupted pretraining from its last
checkpoint; rows from different machines are pointed out (their tokens/s do not compare).

Ends with one ``RESULT`` line; the full table is written to ``<work>/axes.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.hardware import describe, result_field
from encoderkit.io import write_json_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gutenberg_common import SST2, corpus, heldout_mlm, tokenizer_and_store


@dataclass(frozen=True)
class Plan:
    """Everything that sets the size of the run (the defaults, or --smoke's)."""

    books: int = 0  # 0: every novel
    chars_per_book: int = 0  # 0: whole books
    vocab: int = 8192
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 1024
    seq_len: int = 128
    batch: int = 32
    tokens: int = 6_000_000
    lr: float = 1e-3
    eval_blocks: int = 512
    sst2_train: int = 8000
    sst2_dev: int = 0  # 0: the whole dev set (872)
    finetune_epochs: float = 1.0
    distill_fraction: float = 0.5  # of the pretraining steps

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch * self.seq_len))


SMOKE = Plan(books=2, chars_per_book=150_000, vocab=2000, layers=2, hidden=64, heads=2, ffn=128, seq_len=64,
             batch=8, tokens=8 * 64 * 6, lr=1e-3, eval_blocks=32, sst2_train=64, sst2_dev=64, finetune_epochs=1.0)

CONFIGS = {
    "bert-original": {"arch": "bert", "objective": "mlm+nsp", "masking": "static"},
    "bert-roberta": {"arch": "bert", "objective": "mlm", "masking": "dynamic"},
    "deberta": {"arch": "deberta", "objective": "mlm", "masking": "dynamic"},
    "modernbert": {"arch": "modernbert", "objective": "mlm", "masking": "dynamic"},
}


def non_embedding_params(arch: str, plan: Plan, ffn: int, vocab: int) -> int:
    from encoderkit.models.load import build_encoder
    from encoderkit.models.mlm import mlm_layout
    from encoderkit.models.presets import build_config

    model = build_encoder(build_config(None, vocab, max(512, plan.seq_len), layers=plan.layers, hidden=plan.hidden,
                                       heads=plan.heads, ffn=ffn, arch=arch), seed=0)
    encoder = mlm_layout(model).encoder
    return sum(p.numel() for p in encoder.parameters()) - model.get_input_embeddings().weight.numel()


def matched_ffn(arch: str, plan: Plan, vocab: int) -> tuple[int, int, int]:
    """(ffn, its non-embedding parameters, BERT's): the FFN width (a multiple of 32) whose encoder
    matches BERT's parameter count best."""
    target = non_embedding_params("bert", plan, plan.ffn, vocab)
    if arch != "modernbert":
        return plan.ffn, non_embedding_params(arch, plan, plan.ffn, vocab), target
    candidates = range(32, 2 * plan.ffn + 1, 32)
    best = min(candidates, key=lambda f: abs(non_embedding_params(arch, plan, f, vocab) - target))
    return best, non_embedding_params(arch, plan, best, vocab), target


def calibrated_tokens(plan: Plan, store: Path, work: Path, minutes: float, steps: int = 4) -> tuple[int, float]:
    """(token slots, measured tokens/s): ``minutes`` of BERT pretraining (the RoBERTa recipe, the plan's shape)
    at the rate a ``steps``-step run measures here, rounded down to whole steps (at least one)."""
    from encoderkit.train.pretrain import PretrainConfig
    from encoderkit.train.pretrain import run as pretrain

    res = pretrain(PretrainConfig(data=str(store), out=str(work / ".calibrate"), layers=plan.layers, hidden=plan.hidden,
                                  heads=plan.heads, ffn=plan.ffn, lr=plan.lr, batch_size=plan.batch, max_steps=steps,
                                  warmup=1, eval_blocks=8, overwrite=True, run_dir=str(work / ".calibrate-run"),
                                  **CONFIGS["bert-roberta"]))
    rate = float(res.tokens_per_s or 0.0)
    per_step = plan.batch * plan.seq_len
    return max(1, int(minutes * 60 * rate) // per_step) * per_step, rate


def sst2(model_dir: Path, out: Path, plan: Plan, seed: int) -> float:
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    res = finetune(FinetuneConfig(model=str(model_dir), task="classify", train=str(SST2 / "train.tsv"),
                                  dev=str(SST2 / "dev.tsv"), out=str(out), max_train_examples=plan.sst2_train,
                                  max_dev_examples=plan.sst2_dev, epochs=plan.finetune_epochs, lr=1e-4,
                                  batch_size=32, max_length=64, seed=seed, overwrite=True))
    return float(res.metrics["accuracy"])


def pretrain_one(name: str, plan: Plan, store: Path, work: Path, seed: int, ffn: int) -> dict[str, Any]:
    from encoderkit.train.pretrain import PretrainConfig
    from encoderkit.train.pretrain import run as pretrain

    spec = CONFIGS[name]
    out = work / f"{name}-s{seed}"
    t0 = time.perf_counter()
    res = pretrain(PretrainConfig(data=str(store), out=str(out), layers=plan.layers, hidden=plan.hidden,
                                  heads=plan.heads, ffn=ffn, lr=plan.lr, batch_size=plan.batch, max_steps=plan.steps,
                                  warmup=0.06, seed=seed, eval_blocks=plan.eval_blocks, overwrite=True, resume=True,
                                  run_dir=str(work / f".{name}-s{seed}-run"), **spec))
    seconds = time.perf_counter() - t0
    rate = res.tokens_per_s
    if rate is None:  # the run had finished before a stop (resumed with nothing left): its logged rate
        logged = [json.loads(line)
                  for line in (work / f".{name}-s{seed}-run" / "metrics.jsonl").read_text().splitlines()]
        rate = next(m["tokens_per_s"] for m in reversed(logged) if "tokens_per_s" in m)
    return {"model": name, "seed": seed, "out": str(out), "seconds": round(seconds, 1),
            "tokens_per_s": round(rate, 1), **heldout(out, store, plan),
            "sst2_dev_accuracy": sst2(out, work / f"{name}-s{seed}-sst2", plan, seed)}


def heldout(out: Path, store: Path, plan: Plan) -> dict[str, float]:
    m = heldout_mlm(out, store, plan.eval_blocks, batch_size=32)
    return {"heldout_loss": round(m["loss"], 4), "heldout_accuracy": round(m["accuracy"], 4)}


def distill_best(best: dict[str, Any], plan: Plan, store: Path, work: Path) -> dict[str, Any]:
    from encoderkit.compress.distill import DistillConfig
    from encoderkit.compress.distill import run as distill
    from encoderkit.errors import EncoderkitError

    out = work / f"distilled-{best['model']}"
    steps = max(1, int(plan.steps * plan.distill_fraction))
    t0 = time.perf_counter()
    try:
        res = distill(DistillConfig(teacher=best["out"], out=str(out), mode="agnostic", data=str(store),
                                    max_steps=steps, batch_size=plan.batch, lr=5e-4, overwrite=True))
    except EncoderkitError as e:  # a family the distiller refuses: report it, do not hide it
        return {"model": f"distilled-{best['model']}", "refused": str(e)}
    except Exception as e:  # noqa: BLE001 -- a crash inside the distiller is a finding of this bench too
        return {"model": f"distilled-{best['model']}", "refused": f"crashed: {type(e).__name__}: {e}"}
    seconds = time.perf_counter() - t0
    return {"model": f"distilled-{best['model']}", "seed": 0, "out": str(out), "seconds": round(seconds, 1),
            "tokens_per_s": round(steps * plan.batch * plan.seq_len / seconds, 1),
            "student_params": res.student_params, "teacher_params": res.teacher_params,
            **heldout(out, store, plan), "sst2_dev_accuracy": sst2(out, work / "distilled-sst2", plan, 0)}


def measured(work: Path, key: str, plan: Plan, make: Any) -> dict[str, Any]:
    """``make()``'s row, kept in ``<work>/rows/<key>.json`` with the plan and the hardware that made it: a
    rerun in the same ``--work`` with the same plan (``--tokens N`` fixes the budget) reuses finished rows,
    so a run stopped part-way resumes at the next model; a row from another plan is measured again."""
    path = work / "rows" / f"{key}.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("plan") == dataclasses.asdict(plan):
            print(f"{key}: reusing the row measured on {kept['row'].get('hardware', '?')} ({path})", flush=True)
            return kept["row"]
    row = {**make(), "hardware": describe()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"plan": dataclasses.asdict(plan), "row": row})
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: mean (and spread over seeds) of each figure."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name and "refused" not in r]
        if not mine:
            out[name] = {"refused": next(r["refused"] for r in rows if r["model"] == name)}
            continue
        s: dict[str, Any] = {"seeds": len(mine)}
        for key in ("heldout_loss", "heldout_accuracy", "sst2_dev_accuracy", "tokens_per_s"):
            vals = [r[key] for r in mine]
            s[key] = round(statistics.mean(vals), 4)
            if len(vals) > 1:
                s[key + "_spread"] = round(max(vals) - min(vals), 4)
        out[name] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true", help="everything tiny (2 short books, 2-layer models, a few steps)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, default=0, help="token slots per pretrained model (default 6,000,000)")
    budget.add_argument("--minutes-per-model", type=float, default=0.0, metavar="M",
                        help="budget in minutes instead: M x 60 x BERT's pretraining tokens/s measured here by a "
                             "short calibration run, the same token slots for every model (e.g. 1 for a quick run "
                             "of the full-size models)")
    ap.add_argument("--sst2-train", type=int, default=0, metavar="N",
                    help="SST-2 training sentences of the fine-tune after pretraining (default 8000; --smoke 64)")
    ap.add_argument("--sst2-dev", type=int, default=0, metavar="N",
                    help="SST-2 dev sentences scored (default: all 872)")
    ap.add_argument("--eval-blocks", type=int, default=0, metavar="N",
                    help="held-out blocks for the masked-token loss and accuracy (default 512; --smoke 32)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds for the best two pretrained models (others: 1)")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ", ".join(CONFIGS))
    ap.add_argument("--work", default="", help="work folder (default: a temporary one, kept and printed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    started = time.perf_counter()
    if min(args.tokens, args.minutes_per_model, args.sst2_train, args.sst2_dev, args.eval_blocks) < 0:
        ap.error("--tokens, --minutes-per-model, --sst2-train, --sst2-dev and --eval-blocks must be positive")
    print(f"hardware: {describe()}", flush=True)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    plan = SMOKE if args.smoke else Plan()
    if args.tokens:
        plan = dataclasses.replace(plan, tokens=args.tokens)
    sizes = {"sst2_train": args.sst2_train, "sst2_dev": args.sst2_dev, "eval_blocks": args.eval_blocks}
    plan = dataclasses.replace(plan, **{k: v for k, v in sizes.items() if v > 0})
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="axes-"))
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only.split(",") if args.only else CONFIGS) if n]
    _tok, store = tokenizer_and_store(corpus(work, plan.books, plan.chars_per_book), work, plan.vocab, plan.seq_len,
                                      heldout=0.02, reuse=True)
    vocab = json.loads((store / "meta.json").read_text())["vocab_size"]
    if args.minutes_per_model:
        tokens, rate = calibrated_tokens(plan, store, work, args.minutes_per_model)
        plan = dataclasses.replace(plan, tokens=tokens)
        print(f"budget: {args.minutes_per_model:g} min per model at BERT's calibrated {rate:,.0f} tokens/s here "
              f"-> {tokens:,} token slots", flush=True)
    print(f"plan: {plan.steps} steps x {plan.batch} x {plan.seq_len} = {plan.steps * plan.batch * plan.seq_len:,} "
          f"token slots per model; held-out {plan.eval_blocks} blocks; SST-2 fine-tune on {plan.sst2_train} sentences, "
          f"dev {plan.sst2_dev or 872}; work folder {work}", flush=True)
    ffn, params = {}, {}
    for name in names:
        ffn[name], params[name], bert_params = matched_ffn(CONFIGS[name]["arch"], plan, vocab)
        print(f"{name}: ffn {ffn[name]}, non-embedding parameters {params[name]:,} (BERT {bert_params:,})", flush=True)
    rows = []
    for name in names:
        rows.append(measured(work, f"{name}-s0", plan, lambda n=name: pretrain_one(n, plan, store, work, 0, ffn[n])))
        print(json.dumps(rows[-1]), flush=True)
    ranked = sorted(rows, key=lambda r: r["heldout_loss"])
    for r in ranked[:2]:
        for seed in range(1, args.seeds):
            n = r["model"]
            rows.append(measured(work, f"{n}-s{seed}", plan,
                                 lambda n=n, seed=seed: pretrain_one(n, plan, store, work, seed, ffn[n])))
            print(json.dumps(rows[-1]), flush=True)
    rows.append(measured(work, f"distilled-{ranked[0]['model']}", plan,
                         lambda: distill_best(ranked[0], plan, store, work)))
    print(json.dumps(rows[-1]), flush=True)
    machines = sorted({r.get("hardware", "?") for r in rows})
    if len(machines) > 1:  # a resumed run: tokens/s of rows from different machines do not compare
        print(f"note: rows measured on {len(machines)} machines: " + "; ".join(machines), flush=True)
    table = summarise(rows)
    (work / "axes.json").write_text(json.dumps({"plan": dataclasses.asdict(plan), "steps": plan.steps,
                                                "params": params, "runs": rows, "summary": table}, indent=2))
    for name, s in table.items():
        print(f"{name:28s} {s}")
    parts = [f"{name}:loss={s.get('heldout_loss')},acc={s.get('heldout_accuracy')},sst2={s.get('sst2_dev_accuracy')},"
             f"tok_s={s.get('tokens_per_s')},seeds={s.get('seeds', 0)}" for name, s in table.items()]
    print(f"RESULT smoke={int(args.smoke)} minutes_per_model={args.minutes_per_model:g} "
          f"token_slots={plan.steps * plan.batch * plan.seq_len} sst2_train={plan.sst2_train} "
          f"eval_blocks={plan.eval_blocks} best={ranked[0]['model']} "
          + " ".join(parts) + f" wall_s={time.perf_counter() - started:.0f} " + result_field())


if __name__ == "__main__":
    main()
