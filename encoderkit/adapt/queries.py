"""Queries for each passage: asked of an LLM endpoint, or made offline from the passage itself.

* ``endpoint``: the prompt (:data:`QUERY_TEMPLATE`, rendered by :func:`query_prompt`: also ``label --task
  embed``'s) goes through the labeller's client (retries, concurrency, answer cache); :func:`parse_queries` reads
  the queries out of the answer (:func:`screen_queries` also says why each dropped line was dropped); a passage
  with none is skipped and counted.
* ``offline``: the title, the first sentence, other sentences (the inverse cloze task, Lee et al. 2019: the
  sentence is taken out of the positive, else the model learns only to match a string), or ``cloze`` rewrites.

Results are appended to ``queries.jsonl`` a block at a time (:class:`QueryLog`), so a resumed run asks nothing
again for a logged passage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.adapt.cloze import NEEDS_MODEL
from encoderkit.adapt.passages import Passage
from encoderkit.errors import EncoderkitError

QUERY_TEMPLATE = """Write {n} different short search queries that someone would type into a search engine to find the \
passage below. Answer with the queries only, one per line, with no numbering and no other text.

Text: {text}"""
OFFLINE_KINDS = ("title", "first", "sentence", "cloze")
CLOZE_CHUNK = 64  # passages whose cloze sentences go to the masked-LM together
MIN_WORDS, MAX_WORDS = 2, 32
PROMPT_CHARS = 4000  # a passage longer than this is cut in the prompt (the whole passage is still the positive)
ANSWER_TOKENS = 200  # the longest answer asked for (room for a few queries)

_BULLET = re.compile(
    r"^\s*(?:[-*\u2022>]+|\(?\d{1,2}[.):]|\(?[a-z][.)]|q\d*[.:)]|(?:search\s+)?query\s*\d*\s*[:.)-])\s*",
    re.IGNORECASE)
_QUOTES = "\"'`\u201c\u201d\u2018\u2019*"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def query_prompt(template: str, n: int, text: str) -> str:
    """The prompt asking for ``n`` queries of a passage ``text`` (cut to :data:`PROMPT_CHARS`): ``template`` with
    ``{n}`` and ``{text}`` replaced literally."""
    return template.replace("{n}", str(n)).replace("{text}", text[:PROMPT_CHARS])


@dataclass
class Screened:
    """An answer's queries, and how many lines were dropped for each reason: ``empty`` (an empty answer, or a
    bullet or quotes with nothing in them), ``not_a_query`` (a header such as "Here are 3 queries:", a number),
    ``too_short``/``too_long`` (words outside :data:`MIN_WORDS`..``max_words``), ``copied`` (repeats
    ``copy_words`` consecutive words of the passage), ``duplicate`` (the same as an earlier one, case aside),
    ``extra`` (beyond the ``n`` asked for). Blank lines between queries are layout, not counted."""

    kept: list[str]
    dropped: Counter = field(default_factory=Counter)


DROP_REASONS = ("empty", "not_a_query", "too_short", "too_long", "copied", "duplicate", "extra")  # see Screened


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def copies(query: str, passage_grams: set[tuple[str, ...]], k: int) -> bool:
    """Whether ``query`` holds ``k`` consecutive words of a passage whose ``k``-word runs are ``passage_grams``
    (case and punctuation aside)."""
    w = _words(query)
    return any(tuple(w[i : i + k]) in passage_grams for i in range(len(w) - k + 1))


def word_runs(text: str, k: int) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + k]) for i in range(len(w) - k + 1)} if k > 0 else set()


def screen_queries(answer: str | None, n: int, passage: str = "", *, max_words: int = MAX_WORDS,
                   copy_words: int = 0) -> Screened:
    """Up to ``n`` distinct queries in an answer (a JSON list, else one per line; bullets, numbering and quotes
    stripped), and the count of each reason a line was dropped (see :class:`Screened`); ``copy_words`` > 0
    drops a query repeating that many consecutive words of ``passage``."""
    out = Screened([])
    if not answer or not answer.strip():
        out.dropped["empty"] += 1
        return out
    text = answer.strip()
    lines: list[str]
    try:
        parsed = json.loads(text)
        lines = [str(x).strip() or '""' for x in parsed] if isinstance(parsed, list) else text.splitlines()
    except json.JSONDecodeError:
        lines = text.splitlines()
    grams = word_runs(passage, copy_words) if copy_words and passage else set()
    seen: set[str] = set()
    for line in lines:
        if not line.strip():
            continue  # layout between queries
        q = _BULLET.sub("", line.strip()).strip().strip(_QUOTES).strip()
        words = q.split()
        reason = ("empty" if not q else "not_a_query" if q.endswith(":") or not any(c.isalpha() for c in q)
                  else "too_short" if len(words) < MIN_WORDS else "too_long" if len(words) > max_words
                  else "copied" if grams and copies(q, grams, copy_words)
                  else "duplicate" if " ".join(words).lower() in seen else "extra" if len(out.kept) >= n else "")
        if reason:
            out.dropped[reason] += 1
            continue
        q = " ".join(words)
        seen.add(q.lower())
        out.kept.append(q)
    return out


def parse_queries(answer: str | None, n: int) -> list[str]:
    """Up to ``n`` distinct queries in an answer (see :func:`screen_queries`); [] when there are none."""
    return screen_queries(answer, n).kept


def split_sentences(text: str) -> list[str]:
    return [s for s in (" ".join(p.split()) for p in _SENTENCE_END.split(text)) if s]


@dataclass(frozen=True)
class Cloze:
    """A sentence (cut to :data:`MAX_WORDS`) for the masked-LM to rewrite, and the seed of its masked words."""

    sentence: str
    seed: int


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def offline_plan(p: Passage, n: int, kinds: tuple[str, ...], seed: int = 0) -> list[str | Cloze]:
    """The passage's query candidates in the order of ``kinds``, a ``cloze`` one still to be rewritten."""
    out: list[str | Cloze] = []
    sentences = [s for s in split_sentences(p.text) if len(s.split()) >= 4]
    # sentences other than the first (a first sentence is often background)
    rest = sentences[1:] if len(sentences) > 2 else sentences
    for kind in kinds:
        if kind == "title" and len(p.title.split()) >= 3:
            out.append(p.title)
        elif kind == "first" and sentences:
            out.append(sentences[0])
        elif kind == "sentence":  # seeded per passage
            order = np.random.default_rng(_seed(f"{seed}:{p.id}")).permutation(len(rest))
            out.extend(rest[int(i)] for i in order[: max(0, n - len(out))])
        elif kind == "cloze":
            order = np.random.default_rng(_seed(f"{seed}:cloze:{p.id}")).permutation(len(rest))
            cut = [" ".join(rest[int(i)].split()[:MAX_WORDS]) for i in order[: max(0, n - len(out))]]
            out.extend(Cloze(s, _seed(f"{seed}:cloze:{p.id}:{s}")) for s in cut)
    return out


def rewrite_clozes(plans: list[list[str | Cloze]], writer: Any) -> list[list[str | None]]:
    """The plans with every :class:`Cloze` rewritten by ``writer`` (:class:`~encoderkit.adapt.cloze.ClozeWriter`)
    in one batched call; None where it could not be."""
    asks = [c for plan in plans for c in plan if isinstance(c, Cloze)]
    if asks and writer is None:
        raise EncoderkitError(NEEDS_MODEL)
    got = iter(writer.rewrite([c.sentence for c in asks], [c.seed for c in asks]) if asks else [])
    return [[next(got) if isinstance(c, Cloze) else c for c in plan] for plan in plans]


def finish_queries(candidates: list[str | None], n: int) -> list[str]:
    """Up to ``n`` distinct candidates, each cut to :data:`MAX_WORDS` words, none shorter than :data:`MIN_WORDS`."""
    cut = [" ".join(q.split()[:MAX_WORDS]) for q in candidates if q]
    return list(dict.fromkeys(q for q in cut if len(q.split()) >= MIN_WORDS))[:n]


def offline_queries(p: Passage, n: int, kinds: tuple[str, ...], seed: int = 0, cloze: Any = None) -> list[str]:
    """Up to ``n`` queries made from the passage alone, in the order of ``kinds`` (see the module docstring);
    ``cloze``: the :class:`~encoderkit.adapt.cloze.ClozeWriter` of the ``cloze`` kind."""
    return finish_queries(rewrite_clozes([offline_plan(p, n, kinds, seed)], cloze)[0], n)


def positive_text(p: Passage, query: str) -> str:
    """The passage a query is trained to find: the whole passage, less the query where it is a verbatim part of
    it (a title or a sentence taken out: the inverse cloze task), unless nothing would be left."""
    full = p.full
    cut = " ".join(full.replace(query, " ", 1).split()) if len(query) < len(full) else full
    return cut if len(cut.split()) >= 3 else full


@dataclass
class Generated:
    """Per passage: its queries, or why it has none (``empty``/``unparsable`` answers), with the raw answer."""

    queries: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # passage id -> empty | unparsable
    sent: int = 0  # requests sent by this run (cache hits and logged passages excluded)
    resumed: int = 0  # passages read back from the log
    cloze: dict[str, int] = field(default_factory=dict)  # the cloze kind's rewritten and skipped sentences (this run)

    def counts(self) -> dict[str, int]:
        reasons = list(self.skipped.values())
        return {"passages": len(self.queries) + len(self.skipped), "with_queries": len(self.queries),
                "queries": sum(len(q) for q in self.queries.values()), "skipped_empty": reasons.count("empty"),
                "skipped_unparsable": reasons.count("unparsable"), "requests_sent": self.sent,
                "resumed_passages": self.resumed, **self.cloze}


class QueryLog:
    """``queries.jsonl``: one line per finished passage (``{"id", "queries", "status"[, "raw"]}``), appended one
    block at a time (a single write, then fsync); a torn last line (a kill mid-write) is cut off on open."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        meta = {"settings": settings}
        if path.is_file():
            raw = path.read_bytes()
            keep = raw[: raw.rfind(b"\n") + 1]  # complete lines only
            lines = keep.decode("utf-8").split("\n")[:-1]  # only \n ends a line: a raw U+2028 is text
            if lines and json.loads(lines[0]) != meta:
                raise EncoderkitError(f"{path} was written with other query settings ({lines[0][:200]}); rerun without "
                                      "--resume to start again, or with the same settings")
            for line in lines[1:]:
                rec = json.loads(line)
                self.records[rec["id"]] = rec
            if len(keep) != len(raw):
                with open(path, "r+b") as f:
                    f.truncate(len(keep))
        if not self.records and not (path.is_file() and path.stat().st_size):
            self._append([meta])

    def add(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._append(records)
            self.records.update((r["id"], r) for r in records)

    def _append(self, records: Iterable[dict[str, Any]]) -> None:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def record(pid: str, answer: str | None, queries: list[str]) -> dict[str, Any]:
    if queries:
        return {"id": pid, "queries": queries, "status": "ok"}
    return {"id": pid, "queries": [], "status": "empty" if not (answer or "").strip() else "unparsable",
            "raw": (answer or "")[:500]}


Done = Callable[[int, str | None, list[str]], None]  # done(i, answer, queries), as each passage finishes


def generate(passages: list[Passage], log: QueryLog, make: Callable[[list[Passage], Done], int],
             block: int, bar: Any) -> Generated:
    """Queries for every passage the log lacks, through ``make(todo, done)`` (which calls ``done(i, answer,
    queries)`` per passage as each finishes and returns the requests it sent); finished passages are logged
    ``block`` at a time. The result covers every passage, the logged ones included."""
    todo = [p for p in passages if p.id not in log.records]
    out = Generated(resumed=len(passages) - len(todo))
    bar.update(out.resumed)
    pending: list[dict[str, Any]] = []

    def done(i: int, answer: str | None, queries: list[str]) -> None:
        pending.append(record(todo[i].id, answer, queries))
        bar.update(1)
        if len(pending) >= block:
            log.add(pending)
            pending.clear()

    try:
        out.sent = make(todo, done)
    finally:
        log.add(pending)  # what finished before a failure is kept
    for p in passages:
        rec = log.records[p.id]
        if rec["queries"]:
            out.queries[p.id] = list(rec["queries"])
        else:
            out.skipped[p.id] = rec["status"]
    return out


def endpoint_maker(labeller: Any, template: str, n: int) -> Callable[..., int]:
    """``make`` for :func:`generate` over an :class:`~encoderkit.label.endpoint.EndpointLabeller`."""

    def make(todo: list[Passage], done: Callable[[int, str | None, list[str]], None]) -> int:
        prompts = [query_prompt(template, n, p.full) for p in todo]
        sent0 = labeller.sent
        labeller.ask(prompts, [p.full for p in todo], lambda i, a: done(i, a, parse_queries(a, n)))
        return labeller.sent - sent0

    return make


def offline_maker(n: int, kinds: tuple[str, ...], seed: int, cloze: Any = None) -> Callable[..., int]:
    """``make`` for :func:`generate` from the passages alone (no requests); ``cloze``: the masked-LM writer of the
    ``cloze`` kind, called once per :data:`CLOZE_CHUNK` passages."""

    def make(todo: list[Passage], done: Callable[[int, str | None, list[str]], None]) -> int:
        for a in range(0, len(todo), CLOZE_CHUNK):
            chunk = todo[a : a + CLOZE_CHUNK]
            plans = rewrite_clozes([offline_plan(p, n, kinds, seed) for p in chunk], cloze)
            for i, plan in enumerate(plans):
                qs = finish_queries(plan, n)
                done(a + i, "\n".join(qs), qs)
        return 0

    return make
