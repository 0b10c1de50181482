"""The quickstart's steps. Each writes sub-folders of the quickstart's temporary folder ``tmp``
(renamed to ``final`` at the end) by calling the stage functions the CLI runs, reports through
``say`` and returns its figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import pipeline

from encoderkit.compress import stack
from encoderkit.compress.plan import PlanConfig, make_plan
from encoderkit.data import prepare as prep_stage
from encoderkit.data.prepare import open_documents
from encoderkit.quickstart.data import (
    SEARCH_QUESTIONS,
    Record,
    family_task,
    fill_mask_prompts,
    search_subset,
    summary,
)
from encoderkit.retrieval import index as index_stage
from encoderkit.retrieval.search import Searcher, SearchSettings
from encoderkit.train import finetune as ft_stage
from encoderkit.train import pretrain as pre_stage

Say = Callable[[str], None]


@dataclass
class Context:
    """What every step gets: the temporary folder it writes into and the final name it will have,
    the encoder (folder and display name), the docstrings, the sizes, the seed and the report."""

    tmp: Path
    final: Path
    model_dir: Path
    model_name: str
    records: list[Record]
    sizes: Any
    seed: int
    say: Say

    def unpack(self) -> tuple[Path, Path, Path, list[Record], Any, int, Say]:
        return self.tmp, self.final, self.model_dir, self.records, self.sizes, self.seed, self.say


MLM_SEQ_LEN = 64  # tokens per packed block of step 1's continued pretraining
HELDOUT = 0.05  # share of modules the MLM never trains on (its held-out set and the prompts' source)
# Every picked token becomes [MASK] (none kept or random): the new head learns only what fill-mask asks, and its
# accuracy is not inflated by copying kept tokens. Only content words are picked (`pretrain --mask-words-only
# --mask-skip-words english`): a short run that picks every kind of token learns the frequent ones first, and its
# fill-mask answers ".", "the", "of".
MLM_MASKING = {"mask_rate": 0.15, "mask_frac": 1.0, "random_frac": 0.0, "mask_words_only": True,
               "mask_skip_words": "english"}
MLM_LR = 5e-4
# all-MiniLM-L6-v2 was tuned for sentence embeddings and keeps little word identity at a [MASK], so its body has to
# learn MLM again with the new head, and a short run is limited by how many updates it gets: its first 2 layers learn
# as fast per step as all 6 for less, fixed word embeddings (the tied decoder) make a step cheaper still, and small
# batches give more updates for the same tokens (the measurements: docs/results/adapt-from-code.md).
MLM_LAYERS = 2
PROMPTS_SCORED = 30  # held-out fill-mask prompts whose top answers are counted (the shown ones first)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# -- 1. MLM --------------------------------------------------------------------------------------

def mlm_step(ctx: Context) -> dict[str, Any]:
    """Continued pretraining of the encoder with a new tied MLM head; fill-mask on held-out sentences."""
    tmp, final, model_dir, records, sizes, seed, say = ctx.unpack()

    modules: dict[str, list[str]] = {}
    for r in records:
        modules.setdefault(r.module, []).append(r.text)
    texts = ["\n\n".join(docs) for docs in modules.values()]  # one document per module, as builtin:stdlib has
    corpus = write_jsonl(tmp / "corpus" / "modules.jsonl",
                         [{"module": m, "text": text} for m, text in zip(modules, texts, strict=True)])
    say(f"1. MLM: continued pretraining of the first {MLM_LAYERS} layers of {ctx.model_name} with a new tied MLM "
        f"head on the docstrings (word embeddings fixed; content words masked)")
    prep_stage.run(prep_stage.PrepareConfig(corpus=[str(corpus)], tokenizer=str(model_dir), out=str(tmp / "mlm-data"),
                                            seq_len=MLM_SEQ_LEN, heldout=HELDOUT, seed=seed))
    counts = prep_stage.read_meta(tmp / "mlm-data")["counts"]
    pre = pre_stage.run(pre_stage.PretrainConfig(  # the new MLM head is seeded from ``seed`` by the stage
        data=str(tmp / "mlm-data"), model=str(model_dir), out=str(tmp / "mlm"), run_dir=str(tmp / "mlm-run"),
        layers=MLM_LAYERS, freeze_embeddings=True, max_steps=sizes.mlm_steps, batch_size=sizes.mlm_batch, lr=MLM_LR,
        warmup=0.06, eval_blocks=sizes.mlm_eval_blocks, seed=seed, **MLM_MASKING))
    m = pre.metrics
    say(f"   made {final}/mlm-data (token store: {counts['train']['docs']} modules, {counts['train']['tokens']} tokens "
        f"for training; {counts['heldout']['docs']} modules held out) and {final}/mlm ({pre.steps} steps x "
        f"{sizes.mlm_batch} blocks of {MLM_SEQ_LEN} tokens, {pre.tokens_per_s:.0f} tokens/s)")
    say(f"   held-out masked content-word accuracy {m['initial_heldout_accuracy']:.3f} -> {m['heldout_accuracy']:.3f}, "
        f"loss {m['initial_heldout_loss']:.2f} -> {m['heldout_loss']:.2f}")

    flags = open_documents(tmp / "mlm-data")[2]
    if len(flags) != len(texts):  # one document per line of the corpus file, in order
        raise RuntimeError(f"token store has {len(flags)} documents for {len(texts)} modules")
    fill = _fill_mask(tmp / "mlm")
    prompts = fill_mask_prompts([t for t, f in zip(texts, flags) if f], [t for t, f in zip(texts, flags) if not f],
                                fill.tokenizer.get_vocab(), fill.tokenizer.mask_token, PROMPTS_SCORED)
    say("   fill-mask on sentences of held-out modules (top 3; the word that was there in brackets):")
    scored = []
    for i, (prompt, answer) in enumerate(prompts):
        preds = fill(prompt, top_k=3)
        words = [p["token_str"].strip() for p in preds]
        scored.append({"prompt": prompt, "answer": answer, "top3": words})
        if i < sizes.prompts:
            say(f"     {prompt}  ->  " + ", ".join(f"{w} ({p['score']:.2f})" for w, p in zip(words, preds))
                + f"  [{answer}]")
    words_first = sum(is_word(s["top3"][0]) for s in scored)
    in_top3 = sum(s["answer"].lower() in s["top3"] for s in scored)
    say(f"   on all {len(scored)} held-out prompts: the top answer is a word on {words_first} (not punctuation, a "
        f"word piece or an article), and the masked word is in the top 3 on {in_top3}")
    return {"heldout_accuracy_before": m["initial_heldout_accuracy"], "heldout_accuracy": m["heldout_accuracy"],
            "heldout_loss_before": m["initial_heldout_loss"], "heldout_loss": m["heldout_loss"], "steps": pre.steps,
            "tokens_per_s": round(pre.tokens_per_s, 1), "fill_mask": scored[:sizes.prompts],
            "prompts_scored": len(scored), "word_first": words_first, "answer_in_top3": in_top3}


def is_word(token: str) -> bool:
    """A fill-mask answer that is a word: letters only (no punctuation or ``##`` piece), not an article."""
    return token.isalpha() and token.lower() not in ("the", "a", "an")


def _fill_mask(model_dir: Path) -> Any:
    return pipeline("fill-mask", model=str(model_dir), tokenizer=str(model_dir), device="cpu")


# -- 2. search -----------------------------------------------------------------------------------

def search_step(ctx: Context) -> dict[str, Any]:
    """A semantic index over the docstrings (their first paragraph, titled by their dotted name),
    asked :data:`SEARCH_QUESTIONS`."""
    tmp, final, model_dir, records, sizes, _seed, say = ctx.unpack()
    subset = search_subset(records, sizes.search_every)
    corpus = write_jsonl(tmp / "corpus" / "docstrings.jsonl",
                         [{"id": r.id, "title": r.id, "text": summary(r.text)} for r in subset])
    n_modules = len({r.module for r in subset})
    say(f"2. search: a semantic index over {len(subset)} docstrings of {n_modules} modules "
        f"(first paragraph, titled by the dotted name), embedded by {ctx.model_name}")
    answers, stats = search_questions(model_dir, corpus, tmp / "search", [q for q, _ in SEARCH_QUESTIONS], k=3)
    say(f"   made {final}/search ({stats['passages']} passages, {stats['dims']} dims, binary + int8 codes)")
    found = 0
    shown = []
    for (question, expected), hits in zip(SEARCH_QUESTIONS, answers, strict=True):
        ok = any(h.split(".")[0] in expected for h in hits[:3])
        found += ok
        shown.append({"question": question, "expected": list(expected), "top3": hits, "found": ok})
        say(f"     {question!r:<48} -> {', '.join(hits[:3])}  {'ok' if ok else 'MISSED'} "
            f"(expected {'/'.join(expected)})")
    say(f"   {found} of {len(SEARCH_QUESTIONS)} questions find an expected module in the top 3")
    return {"documents": len(subset), "modules": n_modules, "found": found, "questions": shown}


def search_questions(model_dir: Path, corpus: Path, out: Path, questions: list[str],
                     k: int) -> tuple[list[list[str]], dict[str, Any]]:
    """Build the index ``out`` of ``corpus`` (JSONL id/title/text) with ``encoderkit index`` and the
    top ``k`` document ids of each question with its ``Searcher`` (binary first stage, int8
    rescoring: the defaults of ``encoderkit search``). The one place the quickstart touches the
    search API."""
    threads = torch.get_num_threads()
    res = index_stage.run(index_stage.IndexConfig(model=str(model_dir), corpus=[str(corpus)], out=str(out),
                                                  threads=threads))
    searcher = Searcher.open(out, threads=threads)
    results = searcher.search(questions, SearchSettings(k=k))
    return [[h.doc_id for h in r.hits] for r in results], res.stats


# -- 3. classify + compress ----------------------------------------------------------------------

def classify_step(ctx: Context) -> dict[str, Any]:
    """Which package a docstring comes from: fine-tune, then compress with the planner's CPU recipe."""
    tmp, final, model_dir, records, sizes, seed, say = ctx.unpack()

    task = family_task(records, sizes.train_per_label, sizes.dev_per_label, seed)
    train = write_jsonl(tmp / "corpus" / "family-train.jsonl", task.train)
    dev = write_jsonl(tmp / "corpus" / "family-dev.jsonl", task.dev)
    say(f"3. classify: which package a docstring comes from ({', '.join(task.labels)}); {len(task.train)} train / "
        f"{len(task.dev)} dev docstrings, split by module (dev modules never trained on)")
    ft = ft_stage.run(ft_stage.FinetuneConfig(
        task="classify", model=str(model_dir), train=str(train), dev=str(dev), out=str(tmp / "classifier"),
        text_column="text", label_column="label", max_length=sizes.max_length, epochs=sizes.epochs, batch_size=16,
        lr=1e-4, seed=seed, few_label="off"))  # the standard route at every size (--fast's 32 a label would
    # take the few-label route; the full run's 80 would not), so the fast run shows what the full one does
    acc = float(ft.metrics.get("accuracy", float("nan")))
    majority = task.majority_accuracy()
    say(f"   made {final}/classifier ({ft.steps} steps, {ft.seconds:.0f} s); dev accuracy {acc:.3f} "
        f"(majority class {majority:.3f})")

    plan = make_plan(PlanConfig(budget="none", goal="latency"))
    say(f"   compress: the planner's plan for no training budget on this machine ({plan.hardware}: "
        f"{plan.hardware_why}): {', '.join(f'{s.lever}({_params(s.params)})' for s in plan.steps)}")
    recipe = tmp / "compressed.recipe.yaml"
    recipe.write_text(yaml.safe_dump(plan.recipe(), sort_keys=False), encoding="utf-8")
    comp = stack.run(stack.CompressConfig(recipe=str(recipe), model=str(tmp / "classifier"), dev=str(dev),
                                          out=str(tmp / "compressed"), train=str(train),
                                          seq_len=sizes.measure_seq_len, repeats=sizes.repeats))
    before, after = comp.rows[0], comp.rows[-1]
    last = Path(after["folder"]).name
    b32 = "latency_b32_ms"
    say(f"   made {final}/compressed/{last} (report: {final}/compressed/report.md); measured on "
        f"{torch.get_num_threads()} thread(s), batches of 32 dev sentences (at most {sizes.measure_seq_len} tokens):")
    say(f"     {'':<10} {'accuracy':>9} {'size MB':>9} {'ms/batch':>9}")
    for name, row in (("before", before), ("after", after)):
        say(f"     {name:<10} {row['quality']:>9.3f} {row['bytes'] / 1e6:>9.1f} {row[b32]:>9.1f}   "
            f"({row.get('runtime', '')})")
    return {"labels": task.labels, "train": len(task.train), "dev": len(task.dev), "dev_accuracy": acc,
            "majority_accuracy": majority, "plan": plan.levers(), "hardware": plan.hardware,
            "compressed_folder": last,
            "before": {k: before[k] for k in ("quality", "bytes", b32, "latency_b1_ms")},
            "after": {k: after[k] for k in ("quality", "bytes", b32, "latency_b1_ms")}}


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


# -- 4. commands ---------------------------------------------------------------------------------

def commands_step(final: Path, metrics: dict[str, Any], say: Say) -> None:
    """The commands that serve and query each result (paths of the final folders)."""
    q = SEARCH_QUESTIONS[2][0]
    served = f"{final}/compressed/{metrics['classify']['compressed_folder']}"
    example = "Return the payload of the message as a list of parts."
    say("4. serve and query what was made:")
    say("   # fill-mask with the continued-pretrained MLM (a standard BertForMaskedLM folder)")
    say(f"   python -c \"from transformers import pipeline; print(pipeline('fill-mask', model='{final}/mlm')"
        f"('Return the [MASK] of the list.'))\"")
    say("   # search the docstrings from the command line")
    say(f"   encoderkit search --index {final}/search --query '{q}' --k 3")
    say("   # one service for the compressed classifier (POST /v1/classify; its folder holds only the INT8 ONNX graph)")
    say("   # and the index (POST /v1/search)")
    say(f"   encoderkit serve --model {served} --backend onnx-int8 --index {final}/search --port 8000 &")
    say("   curl -s localhost:8000/v1/classify -H 'content-type: application/json' "
        f"-d '{{\"texts\": [\"{example}\"]}}'")
    say("   curl -s localhost:8000/v1/search -H 'content-type: application/json' "
        f"-d '{{\"query\": \"{q}\", \"k\": 3}}'")
