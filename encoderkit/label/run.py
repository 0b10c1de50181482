"""``encoderkit label``: label a file of texts with an endpoint, an embedding model or an MLM; with ``--task embed``
or ``rerank``, have the endpoint write search queries for a file of passages (:mod:`encoderkit.label.pairs`).

Output: one JSONL line per input row (``text``, ``label``, ``confidence``, ``labeller``, then the row's own
fields), and ``<output>.ledger.json`` (requests, tokens, seconds) for the audit report's costs. The endpoint's
answers are cached as they arrive, so rerunning after a kill repeats no answered request.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from encoderkit.adapt.queries import MAX_WORDS, MIN_WORDS
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import as_one_call, chunks, engine_batches, text_lengths
from encoderkit.io import check_output_file, open_text_atomic, write_json_atomic
from encoderkit.label.cache import AnswerCache
from encoderkit.label.endpoint import EndpointLabeller
from encoderkit.label.offline import ClozeLabeller, EmbedLabeller
from encoderkit.label.pairs import PAIR_TASKS, drop_summary, label_pairs
from encoderkit.label.prompt import load_template, render
from encoderkit.label.records import dumps, find_text_field, iter_texts, output_record, parse_labels, parse_pairs
from encoderkit.label.spans import MULTILABEL_TEMPLATE, NER_TEMPLATE, parse_label_set, parse_spans, span_cell
from encoderkit.progress import note, progress
from encoderkit.ray_jobs import RayJob, check_ray_args, ray_actors_arg, ray_address_arg, ray_batch_arg
from encoderkit.tasks.common import resolve_model, seeded_subset
from encoderkit.tasks.tabular import read_rows

LABELLERS = ("endpoint", "embed", "cloze")
TASKS = ("classify", "ner", "multilabel", *PAIR_TASKS)


@dataclass
class LabelConfig(StageConfig):
    """Label texts with a general-purpose model or an offline encoder."""

    input: str = arg(help="Texts to label: .txt (one per line), .jsonl, .tsv or .csv; --task embed/rerank: the "
                          "passages: .txt (one per line), .jsonl/.csv records (--id-field, --text-field, a title "
                          "field), a BEIR folder or a folder of text files.", required=True)
    labels: str = arg("", help="The label set, comma-separated (e.g. negative,positive); --task ner: the entity types "
                               "(e.g. PER,ORG,LOC). Required except for --task embed/rerank.")
    task: str = arg("classify", help="classify: one label per text; ner: entity spans (endpoint labeller), asked as "
                                     "JSON (text + type), kept only where they occur in the text, written as "
                                     "'entities' that `finetune --task ner` trains on; multilabel: a set of labels "
                                     "per text (endpoint labeller), asked as a JSON list, written as 'labels' that "
                                     "`finetune --task multilabel` trains on; embed, rerank: the LLM writes "
                                     "search queries for each passage (endpoint labeller), written as {query, "
                                     "positive, negatives} pairs that `finetune --task embed` / `--task rerank` "
                                     "train on.", choices=TASKS)
    output: str = arg(help="Output JSONL file (labeled.jsonl).", required=True)
    overwrite: bool = arg(False, help="Replace an existing --output file.")
    labeller: str = arg("endpoint", help="endpoint: an OpenAI-compatible chat-completions server; embed: nearest label "
                                         "description in embedding space; cloze: a masked-LM pattern and verbalizer.",
                        choices=LABELLERS)
    text_field: str = arg("", help=(
        "Input field holding the text (default: found as finetune finds its text column: one named text, sentence, "
        "content, review, document, body, comment, ... in any case, else the only column of non-numeric text; "
        "--task embed/rerank: text)."))
    id_field: str = arg("id", help="--task embed/rerank: the passages' id field (default id, else _id).")
    # query generation (--task embed/rerank)
    queries_per_passage: int = arg(3, help=(
        "embed/rerank: queries the LLM is asked to write per passage; a passage keeps 1 to this many, those that "
        "pass the checks (1 gives the most distinct pairs per request; 2-3 cover more of each passage)."))
    max_query_words: int = arg(MAX_WORDS, help="embed/rerank: a query longer than this many words is dropped "
                                               "(counted as too_long).")
    copied_words: int = arg(8, help="embed/rerank: a query repeating this many consecutive words of its passage "
                                    "(case and punctuation aside) is dropped (counted as copied): it would teach "
                                    "string matching, not search; 0: no check.")
    num_negatives: int = arg(-1, help=(
        "embed/rerank: other passages written as each pair's 'negatives': mined with --model (an embedding model; "
        "its top candidates, less likely positives, as `adapt` mines them), else drawn at random; -1: 3 for "
        "rerank (what `finetune --task rerank` draws from), 0 for embed (its in-batch negatives suffice; "
        "`finetune --negatives mined` reads them)."))
    max_examples: int = arg(0, help="Label a seeded random subset of this many rows (0: all).")
    seed: int = arg(0, help="Seed of --max-examples' subset.")
    descriptions: list[str] = arg([], help="LABEL=TEXT per label: a description (endpoint prompt; embed: the text "
                                           "embedded for the label, default its name).")
    # endpoint
    endpoint: str = arg("", help="endpoint: the server's base URL, e.g. http://127.0.0.1:8080/v1.")
    llm: list[str] = arg([], help="endpoint: model name(s); several models vote (their agreement is the confidence).")
    api_key_env: str = arg("OPENAI_API_KEY",
                           help="endpoint: environment variable holding the API key (unset: none sent).")
    template: str = arg("", help="endpoint: prompt template (a file or the text) with {text} and optionally {labels}, "
                                 "{descriptions}, {examples}; --task embed/rerank: {text} and optionally {n}, the "
                                 "queries asked for; default: a short instruction.")
    examples: str = arg("", help="endpoint: few-shot examples file (text and label fields) shown in the prompt.")
    samples: int = arg(1, help="endpoint: requests per text and model; the label is the majority, the confidence the "
                               "share that agrees (1: no confidence).")
    temperature: float = arg(-1.0, help="endpoint: sampling temperature (-1: 0 for one sample, 0.7 for several; "
                                        "--task embed/rerank: 0.7, some variety between the queries).")
    parse_retries: int = arg(1, help="endpoint: new requests after an answer that names no label, before the text is "
                                     "recorded unlabeled with its raw answer (--task embed/rerank: none; an answer "
                                     "with no query is counted).")
    retries: int = arg(5, help="endpoint: tries again after 429/5xx/timeouts/refused connections (backoff doubling).")
    cache: str = arg("", help="endpoint: answer cache (default <output>.cache.sqlite).")
    # offline
    model: str = arg("", help="embed/cloze: model folder (embed: a sentence-transformers folder or 'minilm'; cloze: "
                              "an MLM folder); --task embed/rerank: the embedding model that mines the negatives "
                              "(optional).")
    seeds: str = arg("", help="embed: a few labelled texts per class (file with text and label fields) added to the "
                              "label prototypes.")
    pattern: str = arg("{text} It was {mask}.", help="cloze: the pattern, with {text} and {mask} once each.")
    verbalizer: list[str] = arg([], help="cloze: LABEL=WORD per label (one token each), e.g. negative=bad "
                                         "positive=good.")
    embed_temperature: float = arg(0.05, help="embed: softmax temperature over cosines for the confidence.")
    # speed
    concurrency: int = arg(4, help="endpoint: requests in flight at once.", speed=True)
    timeout: float = arg(60.0, help="endpoint: seconds to wait for one answer.", speed=True)
    backoff: float = arg(1.0, help="endpoint: first retry delay in seconds (doubles each retry, at most 30).",
                         speed=True)
    backend: str = arg("auto", help="embed: Predictor backend.", speed=True,
                       choices=("auto", "torch-fp32", "torch-bf16", "onnx-fp32", "onnx-int8", "openvino"))
    batch_size: int = arg(32, help="embed/cloze: texts per forward pass (--task embed/rerank: when --model mines "
                                   "the negatives).", speed=True)
    ray: str | None = ray_address_arg()
    ray_actors: int = ray_actors_arg()
    ray_batch: int = ray_batch_arg()

    def validate(self) -> None:
        if self.task in PAIR_TASKS:
            self._validate_pairs()
        else:
            check(bool(self.labels), f"--task {self.task} needs --labels (the label set, comma-separated, e.g. "
                                     "negative,positive)")
            parse_labels(self.labels, least=1 if self.task == "ner" else 2)
        check(self.task == "classify" or self.labeller == "endpoint", f"--task {self.task} labels with --labeller "
                                                                      "endpoint only (embed and cloze pick one label "
                                                                      "per text)")
        check(self.task == "classify" or not self.examples, f"--task {self.task}: --examples holds one label per "
                                                            "text; put example answers in --template instead")
        check_ray_args(self.ray_actors, self.ray_batch)
        check(not self.ray or self.labeller != "endpoint", "--ray runs the embed and cloze labellers; the endpoint "
                                                           "labeller's model runs on its server (raise --concurrency)")
        check(self.samples >= 1, "samples must be at least 1")
        check(self.concurrency >= 1, "concurrency must be at least 1")
        check(self.retries >= 0 and self.parse_retries >= 0, "retries and parse_retries must be 0 or more")
        if self.labeller == "endpoint":
            check(bool(self.endpoint), "--labeller endpoint needs --endpoint URL (the server's base URL, e.g. "
                                       "http://127.0.0.1:8080/v1)")
            check(bool(self.llm), "--labeller endpoint needs --llm NAME (the model name the server expects)")
        else:
            check(bool(self.model), f"--labeller {self.labeller} needs --model FOLDER")
        if self.labeller == "cloze":
            check(bool(self.verbalizer), "--labeller cloze needs --verbalizer LABEL=WORD for every label")

    def _validate_pairs(self) -> None:
        t = f"--task {self.task}"
        check(self.labeller == "endpoint", f"{t}: the queries are written by --labeller endpoint (an LLM server)")
        check(not (self.labels or self.descriptions or self.examples or self.seeds),
              f"{t} writes queries, not labels: drop --labels, --descriptions, --examples and --seeds")
        check(self.samples == 1 and len(self.llm) <= 1, f"{t} asks one model once per passage (--samples and "
                                                        "several --llm vote on labels)")
        check(self.queries_per_passage >= 1, "--queries-per-passage must be at least 1")
        check(self.max_query_words >= MIN_WORDS, f"--max-query-words must be at least {MIN_WORDS}")
        check(self.copied_words >= 0, "--copied-words must be 0 (no check) or more")
        check(self.num_negatives >= -1, "--num-negatives must be -1 (the task's default), 0 or more")


@dataclass
class LabelResult:
    output: Path
    counts: dict[str, Any]
    ledger: dict[str, Any]
    kind: str = "labels"  # what counts counts: labels, or (--task embed/rerank) queries

    def summary(self) -> dict[str, Any]:
        return {"output": str(self.output), self.kind: self.counts, "ledger": self.ledger}


def ledger_path(output: str | Path) -> Path:
    return Path(f"{output}.ledger.json")


def labelled_pairs(path: str, labels: list[str], flag: str) -> list[tuple[str, str]]:
    """(text, label) rows of a few-shot or seed file; labels must be in the label set."""
    rows = read_rows(path)
    name = find_text_field(rows, "", path)
    out = []
    for r in rows:
        lab = str(r.fields.get("label", "")).strip()
        if lab not in labels:
            raise EncoderkitError(f"{r.where}: label {lab!r} (field 'label') of {flag} is not one of "
                                  f"{', '.join(labels)}")
        out.append((str(r.fields[name]), lab))
    return out


LABEL_CHUNK = 256  # texts per labeller call
LABEL_BLOCK = 16  # labeller calls per block of rows the driver reads, labels and writes (one --ray chunk)


def _ray_calls(lab: Any, texts: list[str]) -> tuple[Any, list[list[int]]]:
    """What ``--ray`` runs per group and the groups: the local run's calls of :data:`LABEL_CHUNK` texts, and
    for an embed labeller each of its engine calls inside them (see :func:`as_one_call`)."""
    p, n = getattr(lab, "predictor", None), len(texts)
    if p is None:
        return type(lab).label, [list(range(a, min(a + LABEL_CHUNK, n))) for a in range(0, n, LABEL_CHUNK)]
    return partial(_label_in_one_call, type(lab).label), engine_batches(p, text_lengths(p, texts), LABEL_CHUNK)


def _label_in_one_call(label: Any, lab: Any, texts: list[str]) -> Any:
    """``label(lab, texts)`` with its Predictor's ``texts`` as one engine call."""
    def labelled(p: Any, rows: list[str]) -> Any:
        one = copy.copy(lab)
        one.predictor = p
        return label(one, rows)

    return as_one_call(labelled, lab.predictor, texts)


def run(cfg: LabelConfig) -> LabelResult:
    """Label every input row; write the JSONL output and its ledger. The embed and cloze labellers read, label and
    write :data:`LABEL_BLOCK` calls of :data:`LABEL_CHUNK` rows at a time (``ray_jobs.IN_FLIGHT`` blocks out with
    ``--ray``); the endpoint labeller reads every row first (its requests go out ``--concurrency`` at a time)."""
    if cfg.task in PAIR_TASKS:
        return _run_pairs(cfg)
    labels = parse_labels(cfg.labels, least=1 if cfg.task == "ner" else 2)
    # a rerun with --overwrite reads its answer cache and sends nothing already answered
    out = check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input, cfg.model, cfg.cache])
    descriptions = parse_pairs(cfg.descriptions, labels, "--descriptions")
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before any model is loaded
    rows, total = _input_rows(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    bar = progress(total=total, desc="label", unit="text")
    counts: dict[str, int] = dict.fromkeys({"ner": NER_COUNTS, "multilabel": [*labels, "none", "refused_labels"]}
                                           .get(cfg.task, labels), 0)
    counts["unlabeled"] = 0
    n = 0
    engine: dict[str, Any] = {}  # the embed labeller's engine, recorded in the ledger
    try:
        if cfg.labeller == "endpoint":
            pairs = list(rows)
            results, ledger = _run_endpoint(cfg, labels, descriptions, [t for t, _ in pairs], bar)
            if cfg.task != "classify":
                extra = [_set_fields(cfg.task, r, t, labels) for (t, _), r in zip(pairs, results, strict=True)]
            else:
                extra = [{"raw": r.raw} if r.label is None else {} for r in results]
            name = "endpoint:" + "+".join(cfg.llm)
            blocks: Any = [(pairs, results, extra)]
        else:
            name = f"{cfg.labeller}:{Path(cfg.model).name}"
            offline = _offline_blocks(cfg, labels, descriptions, rows, ray, bar, engine)
            blocks = ((pairs, results, [{}] * len(pairs)) for pairs, results in offline)
        with open_text_atomic(out) as f:
            for pairs, results, extra in blocks:
                f.write("".join(dumps(output_record(t, r.label, r.confidence, name, o, e)) + "\n"
                                for (t, o), r, e in zip(pairs, results, extra, strict=True)))
                f.flush()  # a block's lines leave the driver as they are written
                for r, e in zip(results, extra, strict=True):
                    _count(counts, r.label, e, cfg.task)
                n += len(pairs)
    finally:
        bar.close()
    if cfg.labeller != "endpoint":
        ledger = {"requests": n, "tokens": 0, **engine}
    ledger.update(texts=n, wall_seconds=round(time.perf_counter() - t0, 3),
                  cpu_seconds=round(time.process_time() - c0, 3), labeller=name)
    write_json_atomic(ledger_path(out), ledger)
    if counts.get("refused_labels"):
        note(f"label: {counts['refused_labels']} label(s) the LLM named are not in --labels: listed under 'refused' "
             "in their lines, never in 'labels'")
    if counts.get("refused_spans"):
        note(f"label: {counts['refused_spans']} span(s) the LLM named were refused (not in the text, a type not asked "
             "for, or overlapping a longer one): listed under 'refused' in their lines, never in 'entities'")
    return LabelResult(out, counts, ledger)


def _run_pairs(cfg: LabelConfig) -> LabelResult:
    """``--task embed``/``rerank``: the pairs file and its ledger (see :mod:`encoderkit.label.pairs`)."""
    out = check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.input, cfg.model, cfg.cache])
    t0, c0 = time.perf_counter(), time.process_time()
    name = "endpoint:" + cfg.llm[0]
    got = label_pairs(cfg, name)
    with open_text_atomic(out) as f:
        f.write("".join(dumps(r) + "\n" for r in got.rows))
    ledger = got.ledger
    ledger.update(texts=got.counts["passages"], wall_seconds=round(time.perf_counter() - t0, 3),
                  cpu_seconds=round(time.process_time() - c0, 3), labeller=name)
    write_json_atomic(ledger_path(out), ledger)
    c = got.counts
    note(f"label: {c['pairs']} pairs from {c['passages_with_queries']} of {c['passages']} passages; "
         f"{drop_summary(c)}")
    return LabelResult(out, got.counts, ledger, kind="queries")


NER_COUNTS = ("texts_with_spans", "spans", "refused_spans")


def _count(counts: dict[str, int], label: str | None, extra: dict[str, Any], task: str) -> None:
    if label is None:
        counts["unlabeled"] += 1
    elif task == "classify":
        counts[label] += 1
    elif task == "multilabel":
        for name in extra["labels"]:
            counts[name] += 1
        counts["refused_labels"] += len(extra["refused"])
    else:
        counts["texts_with_spans"] += bool(extra["entities"])
        counts["spans"] += len(extra["entities"])
        counts["refused_spans"] += len(extra["refused"])


def _ner_vote(types: list[str], answer: str, text: str) -> str | None:
    """An NER answer as one vote: its checked span set (compact JSON), None when it holds no span list."""
    spans = parse_spans(answer, text, types)
    return None if spans is None else span_cell(spans.kept)


def _set_vote(labels: list[str], answer: str, text: str) -> str | None:
    """A multi-label answer as one vote: the labels it names in the set (compact JSON), None when it holds no
    list."""
    found = parse_label_set(answer, labels)
    return None if found is None else span_cell(found[0])


def _set_fields(task: str, result: Any, text: str, labels: list[str]) -> dict[str, Any]:
    """What an NER or multi-label line carries beside its label: the winning answer's entities (NER) or label
    list (multilabel: ``["none"]`` for the empty set, as its reader expects) and what it refused; the raw answers
    when none parsed."""
    if result.label is None:
        return {"raw": result.raw}
    vote = _ner_vote if task == "ner" else _set_vote
    answer = next(a for a in result.raw if vote(labels, a, text) == result.label)
    if task == "ner":
        spans = parse_spans(answer, text, labels)
        return {"entities": spans.entities, "refused": spans.refused}
    kept, refused = parse_label_set(answer, labels)
    return {"labels": kept or ["none"], "refused": refused}


def _input_rows(cfg: LabelConfig) -> tuple[Iterator[tuple[str, dict[str, Any]]], int]:
    """(text, own fields) of the rows to label, read as asked for, and how many. A first pass reads and checks every
    row before any model is loaded, so a bad input fails at once, not after the model loads (it is the one line
    reader's pass without tokenising: cheap beside labelling); it also counts the rows, and ``--max-examples`` keeps
    its seeded subset's row numbers (the rows themselves are read in the second pass)."""
    with contextlib.redirect_stderr(io.StringIO()):  # its notes (blank lines skipped) are the second pass's to say
        n = sum(1 for _ in iter_texts(cfg.input, cfg.text_field))
    rows = iter_texts(cfg.input, cfg.text_field)
    if not cfg.max_examples:
        return rows, n
    keep = seeded_subset(range(n), cfg.max_examples, cfg.seed)
    if len(keep) == n:
        return rows, n
    wanted = set(keep)
    return (pair for i, pair in enumerate(rows) if i in wanted), len(keep)


def _offline_blocks(cfg: LabelConfig, labels: list[str], descriptions: dict[str, str],
                    rows: Iterator[tuple[str, dict[str, Any]]], ray: RayJob | None, bar: Any,
                    record: dict[str, Any] | None = None,
                    ) -> Iterator[tuple[list[tuple[str, dict[str, Any]]], list[Any]]]:
    """(rows, their results) a block at a time, in input order: the embed or cloze labeller on
    :data:`LABEL_CHUNK` texts per call, here or on ``ray``'s actors (one labeller each, the same calls). The embed
    labeller's engine goes into ``record["engine"]`` (its :meth:`~encoderkit.inference.policy.EngineChoice.to_dict`)."""
    model = resolve_model(cfg.model)
    if cfg.labeller == "embed":
        seeds = labelled_pairs(cfg.seeds, labels, "--seeds") if cfg.seeds else None
        make: Any = partial(EmbedLabeller, model, labels, descriptions, seeds, cfg.embed_temperature, cfg.backend,
                            cfg.batch_size, threads=None if ray is None else ray.threads)
    else:
        make = partial(ClozeLabeller, model, labels, parse_pairs(cfg.verbalizer, labels, "--verbalizer"),
                       cfg.pattern, batch_size=cfg.batch_size)
    lab = make()  # with --ray too: it checks the model here, before any actor starts
    if cfg.labeller == "embed":  # each actor on the engine chosen here, not one it would pick on its own CPU
        make = partial(EmbedLabeller, model, labels, descriptions, seeds, cfg.embed_temperature, lab.predictor.choice,
                       cfg.batch_size, threads=None if ray is None else ray.threads)
        if record is not None:
            record["engine"] = lab.predictor.choice.to_dict()
    blocks = chunks(rows, LABEL_BLOCK * LABEL_CHUNK)
    if ray is None:
        for pairs in blocks:
            texts = [t for t, _ in pairs]
            results = [r for a in range(0, len(texts), LABEL_CHUNK) for r in lab.label(texts[a : a + LABEL_CHUNK])]
            bar.update(len(pairs))
            yield pairs, results
        return
    held: collections.deque[list[tuple[str, dict[str, Any]]]] = collections.deque()  # read, not yet written

    def shipped() -> Iterator[tuple[list[str], list[list[int]]]]:
        for pairs in blocks:  # one labeller per actor (a cloze one's torch threads: Ray's OMP_NUM_THREADS), each
            held.append(pairs)  # call the local loop makes
            texts = [t for t, _ in pairs]
            yield texts, _ray_calls(lab, texts)[1]

    for results in ray.map_chunks(shipped(), make, _ray_calls(lab, [])[0]):
        pairs = held.popleft()
        bar.update(len(pairs))
        yield pairs, results


def _run_endpoint(cfg: LabelConfig, labels: list[str], descriptions: dict[str, str], texts: list[str],
                  bar: Any) -> tuple[list, dict[str, Any]]:
    ner = cfg.task == "ner"
    default = {"ner": NER_TEMPLATE, "multilabel": MULTILABEL_TEMPLATE}.get(cfg.task)
    template = load_template(cfg.template) if cfg.template or not default else default
    vote = {"ner": _ner_vote, "multilabel": _set_vote}.get(cfg.task)
    examples = labelled_pairs(cfg.examples, labels, "--examples") if cfg.examples else []
    cache = AnswerCache(cfg.cache or f"{cfg.output}.cache.sqlite")
    temperature = cfg.temperature if cfg.temperature >= 0 else (0.0 if cfg.samples == 1 else 0.7)
    try:
        lab = EndpointLabeller(cfg.endpoint, cfg.llm, labels, cache, samples=cfg.samples, temperature=temperature,
                               concurrency=cfg.concurrency, retries=cfg.retries, parse_retries=cfg.parse_retries,
                               timeout=cfg.timeout, backoff=cfg.backoff, api_key=os.environ.get(cfg.api_key_env, ""),
                               max_tokens=512 if ner else 128 if vote else 16,
                               parse=partial(vote, labels) if vote else None)
        prompts = [render(template, t, labels, descriptions, examples) for t in texts]
        results = lab.label(prompts, texts, lambda i, r: bar.update(1))
        ledger = cache.ledger()
        ledger.update(sent_this_run=lab.sent)
        if lab.sent < ledger["requests"]:
            note(f"label: {ledger['requests'] - lab.sent} answers came from the cache {cache.path}")
    finally:
        cache.close()
    return results, ledger
