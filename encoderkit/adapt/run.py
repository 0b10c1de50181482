"""``encoderkit adapt``: adapt an embedding model to a corpus with no labels (generated queries, mined hard
negatives, fine-tuning), and report nDCG@10 before and after when judged queries are given.

Each step keeps its result under ``adapt/`` in the run folder (``.<out>.partial`` until the end), so a killed
run continues with ``--resume``. The output is the adapted embed folder itself.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoderkit.adapt.cloze import NEEDS_MODEL, ClozeWriter
from encoderkit.adapt.negatives import doc_length, margin_build, mine
from encoderkit.adapt.passages import eval_data, read_passages
from encoderkit.adapt.queries import (
    ANSWER_TOKENS,
    OFFLINE_KINDS,
    QUERY_TEMPLATE,
    QueryLog,
    endpoint_maker,
    generate,
    offline_maker,
)
from encoderkit.compress.distill_embed import check_plain_embedder
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import open_text_atomic, resumable_dir, write_json_atomic
from encoderkit.label.cache import AnswerCache
from encoderkit.label.endpoint import EndpointLabeller
from encoderkit.label.prompt import load_template
from encoderkit.metrics.ranking import retrieval_scores
from encoderkit.models.card import card_facts, read_card, write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import note, progress
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.common import load_tokenizer, resolve_model, seeded_subset
from encoderkit.tasks.embed.exact import retrieve
from encoderkit.tasks.embed.features import load_bi_encoder
from encoderkit.tasks.margin_mse import open_cross_encoder
from encoderkit.train.finetune import FinetuneConfig
from encoderkit.train.finetune import run as finetune

GENERATORS = ("offline", "endpoint")


@dataclass
class AdaptConfig(StageConfig):
    """Adapt an embedding model to a corpus without labels: generated queries, mined negatives, fine-tuning."""

    model: str = arg(help="Embedding model folder to adapt (task embed, e.g. a sentence-transformers folder; "
                          "'minilm' = all-MiniLM-L6-v2).", required=True)
    corpus: str = arg(help="The passages: a BEIR folder or the SciFact zip (titles kept), a .jsonl/.csv of records "
                           "(--id-field, --text-field, --title-field), or files of text as `index` reads them.",
                      required=True)
    out: str = arg(help="Output folder: the adapted embed model.", required=True)
    overwrite: bool = arg(False, help="Replace an existing --out folder.")
    resume: bool = arg(False, help="Continue a killed or failed run from its folder (.<out>.partial): logged queries "
                                   "are not asked again, training continues from its last checkpoint.")
    generator: str = arg("offline", choices=GENERATORS, help=(
        "offline: queries from the passage itself (--offline-kinds); endpoint: an OpenAI-compatible "
        "chat-completions server writes them (--endpoint, --llm)."))
    queries_per_passage: int = arg(3, help="Queries generated per passage (at most).")
    offline_kinds: list[str] = arg(["title", "sentence"], help=(
        "offline: what becomes a query, in order, until --queries-per-passage: title (the passage's title, 3+ "
        "words), first (its first sentence), sentence (other sentences at random, taken out of the positive: "
        "the inverse cloze task), cloze (other sentences with ~30%% of their content words replaced by a "
        "masked-LM's top other prediction: needs --cloze-model)."))
    cloze_model: str = arg("", help="--offline-kinds cloze: a folder with a masked-LM head that rewrites the sentences "
                                    "(the output of `encoderkit pretrain`, or a *ForMaskedLM folder; all-MiniLM-L6-v2 "
                                    "as shipped has none).")
    max_passages: int = arg(0, help="Generate queries for a seeded random subset of this many passages (0: all); "
                                    "the whole corpus is still mined for negatives and evaluated.")
    id_field: str = arg("id", help="Corpus records: the id field (default id, else _id).")
    text_field: str = arg("text", help="Corpus records: the text field.")
    title_field: str = arg("title", help="Corpus records: the title field (optional in each record).")
    follow_links: bool = arg(False, help="Also read files that symbolic links inside a corpus folder point to "
                                         "outside it (by default such links are skipped and counted).")
    # endpoint
    endpoint: str = arg("", help="endpoint: the server's base URL, e.g. http://127.0.0.1:8080/v1.")
    llm: str = arg("", help="endpoint: the model name the server expects.")
    api_key_env: str = arg("OPENAI_API_KEY",
                           help="endpoint: environment variable holding the API key (unset: none sent).")
    template: str = arg("", help="endpoint: prompt template (a file or the text) with {text} and optionally {n} "
                                 "(the queries asked for); default: a short instruction, one query per line.")
    temperature: float = arg(0.7, help="endpoint: sampling temperature (some variety between the queries).")
    max_tokens: int = arg(ANSWER_TOKENS, help="endpoint: longest answer in tokens.")
    retries: int = arg(5, help="endpoint: tries again after 429/5xx/timeouts/refused connections (backoff doubling).")
    # negatives and training
    num_negatives: int = arg(1, help="Hard negatives per query, mined with --model from its top 30.")
    margin: float = arg(0.05, help="A candidate whose cosine to the query is within this of the positive's is a "
                                   "likely positive, not a negative: skipped.")
    cross_encoder: str = arg("", help="GPL: a cross-encoder (rerank folder) that scores (query, positive, negative); "
                                      "the model is trained with MarginMSE on its margins instead of in-batch "
                                      "negatives.")
    ce_margin: float = arg(0.0, help="--cross-encoder: a negative it scores within this of the positive is skipped.")
    lr: float = arg(2e-5, help="Peak learning rate (AdamW).")
    epochs: float = arg(1.0, help="Passes over the generated queries (ignored when --max-steps is set).")
    max_steps: int = arg(0, help="Optimizer steps (0: use --epochs).")
    batch_size: int = arg(32, help="Queries per optimizer step (in-batch negatives: the more the better).")
    warmup: float = arg(0.1, help="Warmup: a fraction of the steps (< 1) or a number of steps.")
    scale: float = arg(20.0, help="Similarity scale: of the in-batch loss, and of the cosine margins MarginMSE fits.")
    max_length: int = arg(0, help="Sub-tokens per passage in training (0: the model's own; longer ones are truncated); "
                                  "the adapted folder searches at the model's own length either way.")
    max_query_length: int = arg(64, help="Sub-tokens per query.")
    seed: int = arg(0, help="Seed of the passage subset, offline sentences, negatives and shuffling.")
    # evaluation
    eval: str = arg("", help="Judged queries to report nDCG@10 on before and after: a BEIR source (folder or SciFact "
                             "zip, with #split). Never used for training.")
    eval_queries: str = arg("", help="Judged queries as a file (.jsonl of {_id, text} or id<TAB>text), with "
                                     "--eval-qrels over the corpus's passage ids.")
    eval_qrels: str = arg("", help="Relevance judgments (query-id<TAB>corpus-id<TAB>score) of --eval-queries.")
    # speed
    concurrency: int = arg(4, help="endpoint: requests in flight at once.", speed=True)
    timeout: float = arg(60.0, help="endpoint: seconds to wait for one answer.", speed=True)
    backoff: float = arg(1.0, help="endpoint: first retry delay in seconds (doubles each retry, at most 30).",
                         speed=True)
    block: int = arg(32, help="Passages per append to queries.jsonl (what a kill can lose; the endpoint's cache "
                              "keeps even those answers).", speed=True)
    batch_size_eval: int = arg(64, help="Texts per forward pass when encoding (mining, evaluation).", speed=True)
    save_every: int = arg(50, help="Training checkpoint every N steps (what --resume can lose).", speed=True)
    bf16: bool | None = arg(None, help="bf16 autocast in training (default: where the hardware has native bf16).",
                            speed=True)

    def validate(self) -> None:
        check(self.queries_per_passage >= 1, "--queries-per-passage must be at least 1")
        check(self.num_negatives >= 0, "--num-negatives must be 0 or more")
        check(self.batch_size >= 2, "--batch-size must be at least 2 (in-batch negatives)")
        check(self.block >= 1, "--block must be at least 1")

        bad = [k for k in self.offline_kinds if k not in OFFLINE_KINDS]
        check(not bad and bool(self.offline_kinds),
              f"--offline-kinds {', '.join(bad) or '(none)'}: choose from {', '.join(OFFLINE_KINDS)}")
        cloze = self.generator == "offline" and "cloze" in self.offline_kinds
        check(not cloze or bool(self.cloze_model), NEEDS_MODEL)
        check(cloze or not self.cloze_model, "--cloze-model is read by --offline-kinds cloze (with --generator "
                                             "offline) only; add cloze to --offline-kinds, or drop the flag")
        if self.generator == "endpoint":
            check(bool(self.endpoint), "--generator endpoint needs --endpoint URL (the server's base URL, e.g. "
                                       "http://127.0.0.1:8080/v1)")
            check(bool(self.llm), "--generator endpoint needs --llm NAME (the model name the server expects)")
        check(not (self.cross_encoder and self.num_negatives == 0), "--cross-encoder needs --num-negatives 1 or more "
                                                                    "(it scores each query's negatives)")
        check(not (self.eval and (self.eval_queries or self.eval_qrels)),
              "give --eval (a BEIR source) or --eval-queries with --eval-qrels, not both")


@dataclass
class AdaptResult:
    out: Path
    generation: dict[str, int]
    negatives: dict[str, int]
    training: dict[str, Any]
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    skipped_links: int = 0  # links that leave a corpus folder, left out (no --follow-links)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"out": str(self.out), "queries": self.generation, "negatives": self.negatives,
                               "training": self.training, "skipped_links": self.skipped_links}
        if self.before:
            out["eval"] = {"before": self.before, "after": self.after,
                           "ndcg@10_change": round(self.after["ndcg@10"] - self.before["ndcg@10"], 4)}
        return out


def check_embed_model(name: str) -> Path:
    """The folder of ``--model`` (or ``minilm``), refused unless it is a transformer embedding model."""
    path = resolve_model(name)
    info = ModelFolder.open(path)
    task = get_task(info.task) if info.task in TASKS else None
    if task is None or task.endpoint != "embed" or info.static_weights is not None:
        what = "a static embedding model" if info.static_weights is not None else f"a {info.task!r} model"
        raise EncoderkitError(f"--model {name} is {what}; adapt fine-tunes a transformer embedding model (task embed: "
                              "a sentence-transformers folder, 'minilm', or the output of finetune --task embed)")
    check_plain_embedder(path)
    return path


def evaluate(model: Path, data: Any, max_query_length: int, batch_size: int) -> dict[str, float]:
    """nDCG@10 / MRR@10 / recall of exact search by ``model`` over ``data``'s corpus (embeddings cached)."""
    ranked = retrieve(load_bi_encoder(model), load_tokenizer(model), data, doc_length(model),
                      max_query_length, batch_size, progress=True, cache_for=model)
    return {k: round(v, 4) for k, v in retrieval_scores(ranked, data.qrels).items()}


def run(cfg: AdaptConfig) -> AdaptResult:
    """Generate queries, mine negatives, fine-tune and write the adapted embed folder (see the module docstring)."""
    model = check_embed_model(cfg.model)
    ce = None
    if cfg.cross_encoder:
        ce = open_cross_encoder(cfg.cross_encoder)
    cloze = None
    if cfg.cloze_model:
        cloze = ClozeWriter(cfg.cloze_model)
    links: list[str] = []  # links that leave a corpus folder, skipped (no --follow-links)
    passages = read_passages(cfg.corpus, cfg.id_field, cfg.text_field, cfg.title_field, cfg.follow_links, links)
    judged = eval_data(passages, cfg.eval, cfg.eval_queries, cfg.eval_qrels)
    before = evaluate(model, judged, cfg.max_query_length, cfg.batch_size_eval) if judged else {}
    if before:
        note(f"adapt: nDCG@10 before {before['ndcg@10']:.4f} on {len(judged.qrels)} judged queries")  # type: ignore[union-attr]
    chosen = seeded_subset(passages, cfg.max_passages, cfg.seed)
    with resumable_dir(cfg.out, cfg.overwrite, cfg.resume) as work:
        state = work / "adapt"
        state.mkdir(exist_ok=True)
        _same_settings(state / "settings.json", cfg.result_dict())
        gen = _generate(cfg, chosen, state, cloze)
        counts = gen.counts()
        note(f"adapt: {counts['queries']} queries for {counts['with_queries']} of {counts['passages']} passages "
             f"({counts['skipped_empty']} empty and {counts['skipped_unparsable']} unparsable answers skipped)"
             + (f"; cloze: {counts['cloze_queries']} rewritten, {counts['cloze_skipped']} sentences with nothing to "
                "replace skipped (this run)" if cloze is not None else ""))
        if not gen.queries:
            raise EncoderkitError(f"no passage of --corpus {cfg.corpus} got a query ({counts['skipped_empty']} empty, "
                                  f"{counts['skipped_unparsable']} unparsable answers; see {state / 'queries.jsonl'}): "
                                  "check the endpoint's answers, or --offline-kinds for passages without titles")
        negatives, margins = _training_file(cfg, passages, gen.queries, model, ce, state / "train.jsonl")
        training = _train(cfg, model, state / "train.jsonl", work, margins)
        after = evaluate(work, judged, cfg.max_query_length, cfg.batch_size_eval) if judged else {}
        _write_card(cfg, work, model, counts, negatives, training, before, after)
        write_json_atomic(state / "report.json", {"queries": counts, "negatives": negatives, "training": training,
                                                  "before": before, "after": after})
    return AdaptResult(Path(cfg.out), counts, negatives, training, before, after, skipped_links=len(links))


def _same_settings(path: Path, settings: dict[str, Any]) -> None:
    want = {k: v for k, v in settings.items() if k not in ("resume", "overwrite")}
    if path.is_file():
        had = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(k for k in set(had) | set(want) if had.get(k) != want.get(k))
        if changed:
            raise EncoderkitError(f"--resume: {path.parent.parent} was started with other settings "
                                  f"({', '.join(changed)}); rerun with the same ones, or without --resume to start "
                                  "again")
    else:
        write_json_atomic(path, want)


def _generate(cfg: AdaptConfig, passages: list[Any], state: Path, cloze: Any = None) -> Any:
    n = cfg.queries_per_passage
    if cfg.generator == "offline":
        settings = {"generator": "offline", "n": n, "kinds": list(cfg.offline_kinds), "seed": cfg.seed}
        if cloze is not None:
            settings["cloze_model"] = cfg.cloze_model
        make = offline_maker(n, tuple(cfg.offline_kinds), cfg.seed, cloze)
        cache = labeller = None
    else:
        template = load_template(cfg.template) if cfg.template else QUERY_TEMPLATE
        settings = {"generator": "endpoint", "n": n, "llm": cfg.llm, "template": template,
                    "temperature": cfg.temperature}
        cache = AnswerCache(state / "cache.sqlite")
        labeller = EndpointLabeller(cfg.endpoint, [cfg.llm], [], cache, temperature=cfg.temperature,
                                    concurrency=cfg.concurrency, retries=cfg.retries, timeout=cfg.timeout,
                                    backoff=cfg.backoff, api_key=os.environ.get(cfg.api_key_env, ""),
                                    max_tokens=cfg.max_tokens)
        make = endpoint_maker(labeller, template, n)
    log = QueryLog(state / "queries.jsonl", settings)
    bar = progress(total=len(passages), desc="queries", unit="passage")
    try:
        gen = generate(passages, log, make, cfg.block, bar)
        if cloze is not None:
            gen.cloze = cloze.counts()
        return gen
    finally:
        bar.close()
        if cache is not None:
            cache.close()


def _training_file(cfg: AdaptConfig, passages: list[Any], queries: dict[str, list[str]], model: Path, ce: Any,
                   path: Path) -> tuple[dict[str, int], list[list[float]] | None]:
    """``train.jsonl`` (finetune --task embed's {query, positive, negatives}), written once; its counts."""
    counts_path = path.with_name("negatives.json")
    if not (path.is_file() and counts_path.is_file()):
        t0 = time.perf_counter()
        mined = mine(passages, queries, model, num_negatives=cfg.num_negatives, margin=cfg.margin, ce=ce,
                     ce_margin=cfg.ce_margin, seed=cfg.seed, max_query_length=cfg.max_query_length,
                     batch_size=cfg.batch_size_eval)
        if len(mined.rows) < cfg.batch_size:
            raise EncoderkitError(f"{len(mined.rows)} training queries, fewer than one batch (--batch-size "
                                  f"{cfg.batch_size}): lower --batch-size, or raise --queries-per-passage")
        with open_text_atomic(path) as f:
            for r in mined.rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        counts = {"rows": len(mined.rows), "skipped_likely_positives": mined.skipped_positives,
                  "random_top_up": mined.topped_up, "dropped_without_scored_negatives": mined.dropped,
                  "seconds": round(time.perf_counter() - t0, 1)}
        counts_path.write_text(json.dumps(counts), encoding="utf-8")
    counts = json.loads(counts_path.read_text(encoding="utf-8"))
    margins = None
    if ce is not None:
        margins = [json.loads(line)["margins"] for line in path.read_text(encoding="utf-8").splitlines() if line]
    return counts, margins


def _train(cfg: AdaptConfig, model: Path, train: Path, work: Path, margins: list[list[float]] | None) -> dict[str, Any]:
    """``finetune --task embed`` on ``train`` into ``work/model`` (resumed from its checkpoints), whose files
    then become ``work``'s own."""
    target = work / "model"
    done = work / "adapt" / "training.json"
    if not done.is_file():
        ft = FinetuneConfig(task="embed", model=str(model), train=str(train), out=str(target), overwrite=True,
                            resume=cfg.resume, lr=cfg.lr, epochs=cfg.epochs, max_steps=cfg.max_steps,
                            batch_size=cfg.batch_size, warmup=cfg.warmup, scale=cfg.scale, max_length=cfg.max_length,
                            max_query_length=cfg.max_query_length, seed=cfg.seed,
                            negatives="mined" if cfg.num_negatives else "sampled", save_every=cfg.save_every,
                            bf16=cfg.bf16, bucket=False)  # bucketing by length puts a passage's queries in one batch
        res = finetune(ft, build=margin_build(margins, cfg.scale) if margins is not None else None)
        for entry in target.iterdir():  # the trained folder's files become the output's
            dest = work / entry.name
            if dest.is_dir():
                shutil.rmtree(dest)
            entry.replace(dest)
        target.rmdir()
        _serve_length(work, doc_length(model))
        summary = {"steps": res.steps, "seconds": round(res.seconds, 1), "loss": "margin-mse" if margins else "mnrl",
                   "train_examples_per_s": res.summary()["train_examples_per_s"]}
        done.write_text(json.dumps(summary), encoding="utf-8")
    return json.loads(done.read_text(encoding="utf-8"))


def _serve_length(folder: Path, length: int) -> None:
    """The adapted folder encodes passages at the length the model had (``--max-length`` is a training setting:
    a shorter one makes training cheaper without changing how the corpus is searched)."""
    st = folder / "sentence_bert_config.json"
    if st.is_file():
        write_json_atomic(st, {**json.loads(st.read_text(encoding="utf-8")), "max_seq_length": length})
    card = read_card(folder)
    if card:
        write_json_atomic(folder / "encoderkit.json", {**card, "max_length": length})


def _write_card(cfg: AdaptConfig, work: Path, model: Path, counts: dict[str, int], negatives: dict[str, int],
                training: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> None:
    facts = card_facts(read_card(work))  # finetune's: the task facts, and the steps it trained this folder for
    metrics: dict[str, Any] = {"queries": counts, "negatives": negatives, "training": training}
    if before:
        metrics.update(before=before, after=after)
    write_card(work, "adapt", model, cfg.result_dict(), metrics, **facts)
