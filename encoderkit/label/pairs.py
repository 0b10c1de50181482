"""``label --task embed`` and ``--task rerank``: (query, passage) pairs whose queries an LLM wrote, and their audit.

Each passage goes to the endpoint once, with ``adapt``'s prompt (:data:`~encoderkit.adapt.queries.QUERY_TEMPLATE`
through :func:`~encoderkit.adapt.queries.query_prompt`; ``--template`` replaces it) asking for
``--queries-per-passage`` queries, through the labeller's client, answer cache and ledger: a rerun after a kill
asks nothing already answered. Each answer is screened (:func:`~encoderkit.adapt.queries.screen_queries`): a query
that is empty, not a query, too short or longer than ``--max-query-words``, copies ``--copied-words`` consecutive
words of its passage, repeats one kept before (for this passage or an earlier one) or goes beyond the number asked
for is dropped and counted by reason (:data:`~encoderkit.adapt.queries.DROP_REASONS`).

Output: one JSONL line per pair, the ``{query, positive, negatives}`` rows ``finetune --task embed`` and ``--task
rerank`` read (``positive``: the passage's title and text, as ``index`` and ``adapt`` encode it; ``negatives``:
other passages, mined with ``--model`` the way ``adapt`` mines them, else drawn at random), plus ``passage_id``
and ``labeller``.

The audit sheet holds one sampled pair per row: ``query``, ``text`` (its passage), ``label`` (``yes``: the
labeller's claim that the passage answers the query) and ``gold`` (the reviewer's ``yes`` or ``no``), so the
agreement is the share of good queries.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.adapt.negatives import mine
from encoderkit.adapt.passages import Passage, read_passages
from encoderkit.adapt.queries import ANSWER_TOKENS, DROP_REASONS, QUERY_TEMPLATE, query_prompt, screen_queries
from encoderkit.adapt.run import AdaptConfig, check_embed_model
from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines, records
from encoderkit.label.cache import AnswerCache
from encoderkit.label.endpoint import EndpointLabeller
from encoderkit.label.prompt import load_template
from encoderkit.label.sheet import VERDICTS, numbered
from encoderkit.progress import note, progress
from encoderkit.tasks.common import seeded_subset
from encoderkit.tasks.rerank.options import RerankOptions
from encoderkit.tasks.tabular import iter_rows

PAIR_TASKS = ("embed", "rerank")
CLAIM = VERDICTS[0]  # a pair's label on the sheet: the passage answers the query


@dataclass
class Pairs:
    rows: list[dict[str, Any]]  # the output lines
    counts: dict[str, Any]
    ledger: dict[str, Any]


def negatives_per_pair(task: str, given: int) -> int:
    """``--num-negatives``, or its default: the negatives ``finetune --task rerank`` draws per pair; 0 for embed
    (its in-batch negatives)."""
    return given if given >= 0 else (RerankOptions.num_negatives if task == "rerank" else 0)


def read_input_passages(spec: str, id_field: str, text_field: str) -> list[Passage]:
    """The passages of ``--input``: a ``.txt`` file one per line (its line number the id), else what ``adapt
    --corpus`` reads (JSONL/CSV records with an id, a BEIR folder, the SciFact zip, a folder of text files)."""
    path = Path(spec)
    if path.suffix == ".txt" and path.is_file():
        out = [Passage(str(n), "", line.strip()) for n, line in records(read_lines(path, "--input"), str(path))]
        if not out:
            raise EncoderkitError(f"--input {path} holds no passage; give one passage per line")
        return out
    return read_passages(spec, id_field or "id", text_field or "text")


def label_pairs(cfg: Any, name: str) -> Pairs:
    """The pairs of ``cfg`` (a :class:`~encoderkit.label.run.LabelConfig` with ``task`` embed or rerank): ask,
    screen, add negatives (see the module docstring)."""
    passages = read_input_passages(cfg.input, cfg.id_field, cfg.text_field)
    chosen = seeded_subset(passages, cfg.max_examples, cfg.seed)
    k = negatives_per_pair(cfg.task, cfg.num_negatives)
    if k and len(passages) <= k:
        raise EncoderkitError(f"--num-negatives {k} needs at least {k + 1} passages (each pair's negatives are other "
                              f"passages); --input {cfg.input} holds {len(passages)}: lower --num-negatives")
    model = check_embed_model(cfg.model) if cfg.model and k else None  # before any request is sent
    template = load_template(cfg.template) if cfg.template else QUERY_TEMPLATE
    answers, ledger = _ask(cfg, template, chosen)
    queries: dict[str, list[str]] = {}
    dropped: Counter = Counter()
    seen: set[str] = set()  # a query already kept for another passage would train two positives for one query
    for p, answer in zip(chosen, answers, strict=True):
        s = screen_queries(answer, cfg.queries_per_passage, p.full, max_words=cfg.max_query_words,
                           copy_words=cfg.copied_words)
        dropped.update(s.dropped)
        kept = []
        for q in s.kept:
            if q.lower() in seen:
                dropped["duplicate"] += 1
            else:
                seen.add(q.lower())
                kept.append(q)
        if kept:
            queries[p.id] = kept
    counts: dict[str, Any] = {"passages": len(chosen), "passages_with_queries": len(queries),
                              "pairs": sum(map(len, queries.values())),
                              **{f"dropped_{r}": dropped[r] for r in DROP_REASONS}}
    if not queries:
        raise EncoderkitError(f"no passage of --input {cfg.input} got a usable query ({drop_summary(counts)}); "
                              f"every answer is kept in {cfg.cache or f'{cfg.output}.cache.sqlite'}: check what the "
                              "endpoint answers (or --template), then rerun")
    negatives, how = _negatives(passages, queries, k, model, cfg)
    counts.update(negatives_per_pair=k, **how)
    by_id = {p.id: p for p in chosen}
    rows = []
    for n, (pid, q) in enumerate((d, q) for d in queries for q in queries[d]):
        row: dict[str, Any] = {"query": q, "positive": by_id[pid].full}
        if k:
            row["negatives"] = negatives[n]
        rows.append({**row, "passage_id": pid, "labeller": name})
    ledger["screening"] = counts
    return Pairs(rows, counts, ledger)


def drop_summary(counts: dict[str, Any]) -> str:
    words = {"empty": "empty", "not_a_query": "not a query", "too_short": "under 2 words",
             "too_long": "over --max-query-words", "copied": "copied from the passage", "duplicate": "duplicates",
             "extra": "beyond --queries-per-passage"}
    return "dropped: " + ", ".join(f"{counts[f'dropped_{r}']} {words[r]}" for r in DROP_REASONS)


def _ask(cfg: Any, template: str, passages: list[Passage]) -> tuple[list[str], dict[str, Any]]:
    """Each passage's raw answer (cached; one request per passage) and the ledger of the cache."""
    cache = AnswerCache(cfg.cache or f"{cfg.output}.cache.sqlite")
    bar = progress(total=len(passages), desc="queries", unit="passage")
    try:
        lab = EndpointLabeller(cfg.endpoint, cfg.llm, [], cache,
                               temperature=cfg.temperature if cfg.temperature >= 0 else AdaptConfig.temperature,
                               concurrency=cfg.concurrency, retries=cfg.retries, timeout=cfg.timeout,
                               backoff=cfg.backoff, api_key=os.environ.get(cfg.api_key_env, ""),
                               max_tokens=ANSWER_TOKENS)
        prompts = [query_prompt(template, cfg.queries_per_passage, p.full) for p in passages]
        answers = lab.ask(prompts, [p.full for p in passages], lambda i, a: bar.update(1))
        ledger = cache.ledger()
        ledger.update(sent_this_run=lab.sent)
        if lab.sent < len(passages):
            note(f"label: {len(passages) - lab.sent} answers came from the cache {cache.path}")
    finally:
        bar.close()
        cache.close()
    return answers, ledger


def _negatives(passages: list[Passage], queries: dict[str, list[str]], k: int, model: Path | None,
               cfg: Any) -> tuple[list[list[str]], dict[str, Any]]:
    """``k`` other passages per pair (in the order of ``queries``): mined by ``model`` as ``adapt`` mines them
    (candidates scoring within its margin of the positive skipped as likely positives), else drawn at random."""
    pairs = [pid for pid in queries for _ in queries[pid]]
    if not k:
        return [[] for _ in pairs], {"negatives": "none"}
    if model is not None:
        mined = mine(passages, queries, model, num_negatives=k, margin=AdaptConfig.margin, ce=None, ce_margin=0.0,
                     seed=cfg.seed, max_query_length=AdaptConfig.max_query_length, batch_size=cfg.batch_size)
        return [r["negatives"] for r in mined.rows], {"negatives": "mined", "skipped_likely_positives":
                                                      mined.skipped_positives, "random_top_up": mined.topped_up}
    where = {p.id: i for i, p in enumerate(passages)}
    rng = np.random.default_rng(cfg.seed)
    out = []
    for pid in pairs:
        own = where[pid]
        picks = [int(j) for j in rng.choice(len(passages) - 1, size=k, replace=False)]
        out.append([passages[j + (j >= own)].full for j in picks])  # every index but the passage's own
    return out, {"negatives": "random"}


def is_pairs_file(path: str | Path) -> bool:
    """Whether ``path`` is a pairs file (its first line has ``query`` and ``positive``, no ``label``)."""
    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        return False
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(rec, dict) and "query" in rec and "positive" in rec and "label" not in rec
    return False


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a pairs file, each with a non-empty ``query`` and ``positive``."""
    out = []
    for r in iter_rows(path):
        q, pos = r.fields.get("query"), r.fields.get("positive")
        if not (isinstance(q, str) and q.strip() and isinstance(pos, str) and pos.strip()):
            raise EncoderkitError(f"{r.where}: not a pair (needs non-empty 'query' and 'positive' strings); give the "
                                  "output of `encoderkit label --task embed`")
        out.append(r.fields)
    return out


def sheet_row(i: int, rec: dict[str, Any]) -> dict[str, Any]:
    return {"row": i, "query": rec["query"], "text": rec["positive"], "label": CLAIM, "gold": ""}


def check_pair_rows(path: str | Path, rows: list[dict[str, str]], recs: list[dict[str, Any]],
                    source: str | Path) -> None:
    """Each sheet row must name a pair of ``source`` with the same query and passage."""
    if rows and "query" not in rows[0]:
        raise EncoderkitError(f"{path}: no column query; {source} is a pairs file: draw its sheet with `encoderkit "
                              "audit sample` on it")
    for n, r in numbered(rows):
        i = int(r["row"])
        if i >= len(recs) or (str(recs[i]["query"]).strip(), str(recs[i]["positive"]).strip()) != (
                r["query"].strip(), r["text"].strip()):
            raise EncoderkitError(f"{path}:{n}: row {i} does not match line {i + 1} of {source} (another query or "
                                  "passage, or missing); use the sheet made from this pairs file")


def verdict(cell: str, where: str) -> bool:
    """A gold cell of a pairs sheet: ``yes`` (the passage answers the query) or ``no``, case aside."""
    v = cell.strip().lower()
    if v not in VERDICTS:
        raise EncoderkitError(f"{where}: gold {cell!r} is neither yes nor no; write yes where the passage answers the "
                              "query, no where it does not")
    return v == "yes"
