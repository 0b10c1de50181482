"""Tiered search over an index, as a Python API and ``encoderkit search``.

    s = Searcher.open("idx")                                    # the index's own model, on its recorded engine
    s.search(["what causes fever?"], SearchSettings(k=10, bm25=True))[0].hits

Stages, each switchable: a first stage over passages (``binary`` sign-bit codes by Hamming distance, ``int8`` or
``float``, or Milvus); rescoring of ``multiplier x depth`` candidates with the float query; passages collapsed to
documents (a document scores as its best passage); BM25 and other indexes of the corpus (``fuse_with``) fused by
reciprocal rank; a cross-encoder reordering the top documents. A sparse index (:mod:`.sparse`) has one exact stage
in place of the first two. Query vectors carry their model's fingerprint, and an index refuses another model's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import recorded, resolve
from encoderkit.inference.predictor import BACKENDS, Predictor
from encoderkit.io import check_output_file, json_line, read_lines, recorded_path, records, write_text_atomic
from encoderkit.metrics.ranking import rrf_scores
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.progress import note
from encoderkit.retrieval import ann
from encoderkit.retrieval.codes import binary_codes, hamming, int8_codes, int8_dequantize, top_k
from encoderkit.retrieval.first_stage import MULTIPLIER as TIER_MULTIPLIER
from encoderkit.retrieval.first_stage import StaticTier
from encoderkit.retrieval.milvus import check_collection
from encoderkit.retrieval.milvus import search as milvus_search
from encoderkit.retrieval.sparse import SparseStage, same_corpus
from encoderkit.retrieval.store import STORES, Generation, open_generation
from encoderkit.tasks import get_task

FIRST_STAGES = ("binary", "int8", "float")
RESCORES = ("int8", "float", "none")
SCAN_CHUNK = 65_536  # rows per matrix product in the int8/float first stages
# Candidates rescored per result when the settings leave it at 0 (docs/search.md, "Scale"). Past LARGE_INDEX passages
# the binary first stage rescores 20 x k: more codes share each Hamming distance as an index grows, and rescoring
# costs little next to the scan.
RESCORE_MULTIPLIER = 4
RESCORE_MULTIPLIER_LARGE = 20
LARGE_INDEX = 100_000


def default_multiplier(passages: int, first_stage: str = "binary") -> int:
    """The rescore multiplier used when none is given, from the index size (passages) and first stage."""
    return RESCORE_MULTIPLIER_LARGE if first_stage == "binary" and passages > LARGE_INDEX else RESCORE_MULTIPLIER


@dataclass
class SearchSettings:
    k: int = 10
    first_stage: str = "binary"
    rescore: str = "int8"
    rescore_multiplier: int = 0  # 0 = default_multiplier() of the index size and first stage
    bm25: bool = False
    rerank_top: int = 0  # 0 = no cross-encoder
    exact: bool = False  # exact Hamming search even past the ANN threshold
    rerank_fuse: bool = False  # fuse the cross-encoder's order with the order it reranked (reciprocal rank)

    def check(self, gen: Generation, has_reranker: bool) -> None:
        if self.first_stage not in FIRST_STAGES:
            raise EncoderkitError(f"first stage {self.first_stage!r} is not one of {', '.join(FIRST_STAGES)}")
        if self.rescore not in RESCORES:
            raise EncoderkitError(f"rescore {self.rescore!r} is not one of {', '.join(RESCORES)}")
        if "float" in (self.first_stage, self.rescore) and "float16" not in gen.arrays:
            raise EncoderkitError("float search or rescoring needs float16 vectors: rebuild the index with --float16")
        if self.k < 1 or self.rescore_multiplier < 0:
            raise EncoderkitError("k must be at least 1 and the rescore multiplier at least 0 (0: the default)")
        if self.rerank_top and not has_reranker:
            raise EncoderkitError("reranking needs a cross-encoder folder (--rerank DIR)")


@dataclass
class Hit:
    doc_id: str
    score: float
    text: str
    passage_id: str


@dataclass
class Result:
    hits: list[Hit]
    truncated: bool = False


@dataclass
class QueryVectors:
    """Unit query embeddings (Q, dims) and the fingerprint of the model that made them."""

    vectors: np.ndarray
    fingerprint: str
    truncated: list[bool] = field(default_factory=list)
    first: np.ndarray | None = None  # a tiered index: the static first stage's unit query vectors (Q, Ds)


class Searcher:
    """An open index, its query model and optional reranker / Milvus first stage."""

    def __init__(self, gen: Generation, root: Path, predictor: Predictor | None = None,
                 reranker: Predictor | None = None, milvus: tuple[str, str] | None = None) -> None:
        self.gen, self.root, self.predictor, self.reranker, self.milvus = gen, root, predictor, reranker, milvus
        self.fingerprint = gen.manifest["model"]["fingerprint"]
        self._bm25 = None
        ivf = gen.folder / "binary.ivf" if gen.folder else None
        self._ivf = ann.load(ivf) if ivf is not None and ivf.is_file() else None
        self._row_of = {r["id"]: i for i, r in enumerate(gen.passages)} if milvus else None
        self._flat = None  # the exact faiss binary index, built on first use
        self.tier = StaticTier.open(gen, root)  # a static first stage (first_stage.py), else None
        self.sparse = SparseStage.open(gen, predictor)  # a sparse (SPLADE) index's one stage (sparse.py), else None
        self.partners: list[Searcher] = []  # other indexes of the corpus fused by reciprocal rank (fuse_with)
        self._first_row: dict[str, int] | None = None

    def _binary_flat(self):
        """The exact faiss binary index over the codes (a copy of them), or None without faiss."""
        if self._flat is None and ann.available():
            self._flat = ann.build_binary_flat(np.asarray(self.gen.arrays["binary"]))
        return self._flat

    @classmethod
    def open(cls, root: str | Path, model: str | Path | None = None, backend: str = "auto",
             rerank: str | Path | None = None, threads: int | None = None, verify: bool = True,
             milvus: tuple[str, str] | None = None) -> Searcher:
        """Open index ``root``; queries are embedded by ``model`` (default: the folder the index was
        built with), which must be the same model (same fingerprint), on ``backend``: ``auto`` (and the build's
        own backend named again) is the engine the index recorded, with its openvino-int8 calibration; another
        is that backend (:func:`encoderkit.inference.policy.resolve`)."""
        root = Path(root)
        gen = open_generation(root, verify=verify)
        built = gen.manifest["model"]
        folder = Path(model) if model is not None else recorded_path(built["folder"], root)  # relative to root
        if not folder.is_dir():
            raise EncoderkitError(f"index {root}: its model folder {folder} is gone; pass the same model with --model")
        if model is not None and model_fingerprint(folder) != built["fingerprint"]:
            raise EncoderkitError(f"--model {folder} is not the model index {root} was built with ({built['folder']}, "
                                  f"fingerprint {built['fingerprint']}); its vectors would not be comparable")
        p = Predictor.load(folder, backend=resolve(folder, backend, recorded(gen.manifest)), threads=threads)
        r = Predictor.load(rerank, threads=threads) if rerank else None
        if r is not None and not get_task(r.task).scores_pairs:  # a cross-encoder: a pair's score from its logits
            raise EncoderkitError(f"--rerank {rerank} is a {r.task!r} model, not a cross-encoder")
        if milvus is not None:
            check_collection(milvus[0], milvus[1], gen)
        return cls(gen, root, p, r, milvus)

    # -- queries ----------------------------------------------------------------------------
    def embed(self, queries: Sequence[str]) -> QueryVectors:
        if self.predictor is None:
            raise EncoderkitError("this searcher has no query model; pass QueryVectors to search_vectors")
        p = self.predictor
        lengths = [len(ids) for ids in p.tokenizer(list(queries), truncation=False)["input_ids"]]
        vecs = (self.sparse.embed(list(queries)) if self.sparse is not None
                else p.embed(list(queries), dim=self.gen.dims, normalize=True))
        first = self.tier.embed(queries) if self.tier is not None else None
        return QueryVectors(vecs, self.fingerprint, [n > p.max_length for n in lengths], first)

    def search(self, queries: Sequence[str], settings: SearchSettings | None = None,
               reranker: Predictor | None = None) -> list[Result]:
        """``reranker``: the cross-encoder of ``rerank_top`` for this call (default: the one opened with the index)."""
        if isinstance(queries, str):
            queries = [queries]
        qv = self.embed(queries)
        return self.search_vectors(qv, settings, list(queries), reranker)

    def search_vectors(self, qv: QueryVectors, settings: SearchSettings | None = None,
                       texts: Sequence[str] | None = None, reranker: Predictor | None = None) -> list[Result]:
        """Search with precomputed query vectors (BM25 and rerank also need the query ``texts``)."""
        s = settings or SearchSettings()
        cross = reranker or self.reranker
        if self.tier is not None:  # the static first stage's settings, before the plain index's
            self.tier.check(s.first_stage, s.rescore)
        s.check(self.gen, cross is not None)
        if qv.fingerprint != self.fingerprint:
            raise EncoderkitError(f"these query vectors come from a model with fingerprint {qv.fingerprint}, the index "
                                  f"{self.root} from {self.fingerprint}; embed queries with the index's model")
        if qv.vectors.shape[1] != self.gen.dims:
            raise EncoderkitError(f"query vectors have {qv.vectors.shape[1]} dims, the index {self.gen.dims}")
        if (s.bm25 or s.rerank_top or self.partners) and texts is None:
            raise EncoderkitError("BM25, fusion with other indexes and reranking need the query texts")
        depth = max(s.k, s.rerank_top)
        mult = self.multiplier(s)
        rows, scores = (self.tier.dense(qv.first, qv.vectors, s.first_stage, s.rescore, depth * mult, self.predictor)
                        if self.tier is not None else self.sparse.search(qv.vectors, depth * mult)
                        if self.sparse is not None else self.dense(qv.vectors, s, depth * mult))
        partners = [[[h.doc_id for h in r.hits] for r in o.search(list(texts), SearchSettings(k=depth * mult))]
                    for o in self.partners] if self.partners else []
        out = []
        for i in range(len(qv.vectors)):
            ranked = self._collapse(rows[i], scores[i])
            # BM25 and the fused indexes: one reciprocal-rank fusion of every order (a hit keeps this index's passage)
            others = [self._collapse(*self.bm25(texts[i], depth * mult))] if s.bm25 else []
            others += [self._doc_rows(docs[i]) for docs in partners]
            if others:
                fused = rrf_scores([[d for d, _, _ in x] for x in (ranked, *others)])
                best = {d: r for x in (*reversed(others), ranked) for d, _, r in x}
                ranked = sorted(((d, fused[d], best[d]) for d in fused), key=lambda x: -x[1])
            ranked = ranked[:depth]
            if s.rerank_top:
                top = ranked[: s.rerank_top]
                logits = cross.score_pairs([texts[i]] * len(top), [self.gen.passages[r]["text"] for _, _, r in top])
                order = np.argsort(-logits, kind="stable")
                reranked = [(top[j][0], float(logits[j]), top[j][2]) for j in order]
                if s.rerank_fuse:
                    fused = rrf_scores([[d for d, _, _ in reranked], [d for d, _, _ in top]])
                    reranked = sorted(((d, fused[d], r) for d, _, r in reranked), key=lambda x: -x[1])
                ranked = reranked + ranked[s.rerank_top:]
            hits = [Hit(d, float(sc), self.gen.passages[r]["text"], self.gen.passages[r]["id"])
                    for d, sc, r in ranked[: s.k]]
            out.append(Result(hits, bool(qv.truncated[i]) if qv.truncated else False))
        return out

    def fuse_with(self, roots: Sequence[str | Path], threads: int | None = None) -> None:
        """Fuse the document order of each index in ``roots`` (dense or sparse, of the same corpus; each searched with
        its own model and default settings) with this one's by reciprocal rank, as BM25 is fused."""
        for root in roots:
            other = Searcher.open(root, threads=threads)
            same_corpus(self.gen, other.gen, self.root, Path(root))
            self.partners.append(other)

    def _doc_rows(self, doc_ids: Sequence[str]) -> list[tuple[str, float, int]]:
        """(doc id, 0, the document's first passage row here) per document of another index's order."""
        if self._first_row is None:
            self._first_row = {}
            for i, r in enumerate(self.gen.passages):
                self._first_row.setdefault(r["doc_id"], i)
        return [(d, 0.0, self._first_row[d]) for d in doc_ids if d in self._first_row]

    def approximate(self, s: SearchSettings) -> bool:
        """Whether settings ``s`` search this index with the approximate binary IVF."""
        return s.first_stage == "binary" and self._ivf is not None and not s.exact and self.milvus is None

    def multiplier(self, s: SearchSettings) -> int:
        if self.tier is not None:
            return s.rescore_multiplier or TIER_MULTIPLIER
        return s.rescore_multiplier or default_multiplier(len(self.gen.passages), s.first_stage)

    # -- stages -----------------------------------------------------------------------------
    def dense(self, q: np.ndarray, s: SearchSettings, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        """Passage rows (Q, <=fetch) and their scores, best first, after the first stage and rescoring."""
        a = self.gen.arrays
        if self.milvus is not None:
            ids, sc = milvus_search(self.milvus[0], self.milvus[1], q, fetch)
            rows, scores = np.full((len(q), fetch), -1, np.int64), np.full((len(q), fetch), -np.inf, np.float32)
            for i, (row, srow) in enumerate(zip(ids, sc, strict=True)):
                rows[i, : len(row)] = [self._row_of[x] for x in row]
                scores[i, : len(row)] = srow
            return rows, scores
        if s.first_stage == "binary":
            qb = binary_codes(q)
            if self.approximate(s):
                rows, dist = ann.search(self._ivf, qb, fetch)
            elif self._binary_flat() is not None:
                rows, dist = ann.search(self._flat, qb, min(fetch, len(a["binary"])))
            else:  # no faiss: numpy popcount, the same rows and order
                d = hamming(qb, a["binary"])
                rows = top_k(d, fetch, largest=False)
                dist = np.take_along_axis(d, rows, 1).astype(np.float32)
            first = -dist
        else:
            if s.first_stage == "int8":
                qq, codes = int8_codes(q, a["int8_calibration"]).astype(np.float32), a["int8"]
            else:
                qq, codes = q, a["float16"]
            sc = np.concatenate([qq @ np.asarray(codes[j : j + SCAN_CHUNK], dtype=np.float32).T
                                 for j in range(0, codes.shape[0], SCAN_CHUNK)], axis=1)
            rows = top_k(sc, fetch)
            first = np.take_along_axis(sc, rows, 1)
        if s.rescore == "none":
            return rows, first
        out_rows, out_scores = np.empty_like(rows), np.empty(rows.shape, dtype=np.float32)
        for i in range(len(q)):
            r = rows[i]
            valid = r >= 0
            vec = (int8_dequantize(np.asarray(a["int8"][r[valid]]), a["int8_calibration"]) if s.rescore == "int8"
                   else np.asarray(a["float16"][r[valid]], dtype=np.float32))
            sc = np.full(len(r), -np.inf, dtype=np.float32)
            sc[valid] = vec @ q[i]
            order = np.argsort(-sc, kind="stable")
            out_rows[i], out_scores[i] = r[order], sc[order]
        return out_rows, out_scores

    def bm25(self, query: str, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        import bm25s

        if self._bm25 is None:
            self._bm25 = bm25s.BM25()
            self._bm25.index(bm25s.tokenize([p["text"] for p in self.gen.passages], show_progress=False),
                             show_progress=False)
        tokens = bm25s.tokenize([query], show_progress=False)  # a query of stopwords scores 0 everywhere: no hits
        rows, scores = self._bm25.retrieve(tokens, k=min(fetch, len(self.gen.passages)), show_progress=False,
                                           n_threads=1)
        keep = scores[0] > 0
        return rows[0][keep], scores[0][keep]

    def _collapse(self, rows: np.ndarray, scores: np.ndarray) -> list[tuple[str, float, int]]:
        """Passage rows, best first -> (doc id, score, best row) per document, best first."""
        seen, out = set(), []
        for r, sc in zip(rows, scores, strict=True):
            if r < 0 or not np.isfinite(sc):
                continue
            d = self.gen.passages[r]["doc_id"]
            if d not in seen:
                seen.add(d)
                out.append((d, float(sc), int(r)))
        return out


# -- `encoderkit search` -----------------------------------------------------------------------
@dataclass
class SearchConfig(StageConfig):
    """Settings of ``encoderkit search``."""

    index: str = arg(help="Index folder written by `encoderkit index`.", required=True)
    query: str | None = arg(None, help="One query; the hits are printed.")
    queries: str | None = arg(None, help="JSONL of {'id', 'query'} lines (with --output).")
    output: str | None = arg(None, help="JSONL written for --queries: {'id', 'hits': [{doc_id, score, text}], "
                                        "'truncated'}.")
    overwrite: bool = arg(False, help="Replace an existing --output file.")
    k: int = arg(10, help="Documents per query.")
    first_stage: str = arg("binary", help="First stage over passages.", choices=FIRST_STAGES)
    rescore: str = arg("int8", help="Rescore the candidates with these vectors (none: keep the first stage's order).",
                       choices=RESCORES)
    rescore_multiplier: int = arg(0, help=f"Candidates rescored per result: multiplier x k (x the rerank depth); 0: "
                                          f"{RESCORE_MULTIPLIER}, or {RESCORE_MULTIPLIER_LARGE} after the binary first "
                                          f"stage of an index of more than {LARGE_INDEX:,} passages.")
    bm25: bool = arg(False, help="Fuse BM25 (bm25s) with the dense order by reciprocal rank.")
    rerank: str | None = arg(None, help="Cross-encoder folder: rerank the top --rerank-top documents.")
    rerank_top: int = arg(100, help="Documents the cross-encoder reorders (with --rerank).")
    rerank_fuse: bool = arg(False, help=(
        "With --rerank: fuse the cross-encoder's order of the top --rerank-top with the order it was given (the "
        "dense / BM25 stages) by reciprocal rank (k = 60) instead of keeping the cross-encoder's order alone; "
        "scores become fusion scores."))
    fuse_with: list[str] = arg([], help=(
        "Other index folders of the same corpus (e.g. a sparse index of a `finetune --task sparse` model next to a "
        "dense one) whose document order is fused with this index's by reciprocal rank (k = 60), as --bm25 is; "
        "each is searched with its own model."))
    model: str | None = arg(None, help="Query model (default: the one the index records; another model is refused).")
    store: str = arg("local", help="Dense search in the local index or in Milvus.", choices=STORES)
    uri: str | None = arg(None, help="Milvus URI for --store milvus.")
    collection: str = arg("encoderkit", help="Milvus collection name.")
    exact: bool = arg(False, help="Exact Hamming search even where the index has an approximate one.")
    backend: str = arg("auto", help="Predictor backend for queries; auto: the engine the index was built with (its "
                                    "manifest's record, openvino-int8's calibration included).",
                       choices=BACKENDS, speed=True)
    threads: int | None = arg(None, help="onnxruntime threads.", speed=True)

    def validate(self) -> None:
        check((self.query is None) != (self.queries is None), "give exactly one of --query and --queries")
        check(self.queries is None or self.output is not None, "--queries needs --output FILE.jsonl")
        check(self.k >= 1 and self.rescore_multiplier >= 0,
              "--k must be at least 1 and --rescore-multiplier at least 0")
        check(self.store != "milvus" or bool(self.uri), "--store milvus needs --uri")
        check(not self.rerank_fuse or bool(self.rerank), "--rerank-fuse needs --rerank DIR")

    def settings(self) -> SearchSettings:
        return SearchSettings(self.k, self.first_stage, self.rescore, self.rescore_multiplier, self.bm25,
                              self.rerank_top if self.rerank else 0, self.exact, self.rerank_fuse and bool(self.rerank))


@dataclass
class SearchRunResult:
    results: list[dict[str, Any]]
    output: str | None
    seconds: float

    def summary(self) -> Any:
        if self.output:
            return {"queries": len(self.results), "output": self.output, "seconds": round(self.seconds, 3),
                    "truncated_queries": sum(r["truncated"] for r in self.results)}
        return self.results[0]


def read_queries(path: Path) -> list[tuple[str, str]]:
    """(id, query) of each line of a JSONL file, read by the one line reader (only ``\\n`` ends a line, so a query
    may hold a raw U+2028); a line without an ``id`` is named by its line number; blank lines are skipped and
    reported."""
    out = []
    for n, line in records(read_lines(path, "--queries"), str(path)):
        rec = json_line(line, f"{path}:{n}")
        q = rec.get("query")
        if not isinstance(q, str) or not q.strip():
            raise EncoderkitError(f"{path}:{n}: needs a non-empty 'query' string")
        out.append((str(rec.get("id", n)), q))
    if not out:
        raise EncoderkitError(f"--queries {path} holds no query")
    return out


def run(cfg: SearchConfig) -> SearchRunResult:
    """Search an index (see the module docstring); one --query prints its hits, --queries writes JSONL."""
    milvus = (cfg.uri, cfg.collection) if cfg.store == "milvus" else None
    if cfg.output:  # before the index and model are opened: never the --queries file, an existing one only on asking
        check_output_file(cfg.output, cfg.overwrite, "--output", [cfg.queries, cfg.index, cfg.model])
    s = Searcher.open(cfg.index, cfg.model, cfg.backend, cfg.rerank, cfg.threads, milvus=milvus)
    if cfg.fuse_with:
        s.fuse_with(cfg.fuse_with, cfg.threads)
    items = [("query", cfg.query)] if cfg.query is not None else read_queries(Path(cfg.queries))
    t0 = time.perf_counter()
    results = s.search([q for _, q in items], cfg.settings())
    seconds = time.perf_counter() - t0
    rows = [{"id": qid, "hits": [asdict(h) for h in r.hits], "truncated": r.truncated}
            for (qid, _), r in zip(items, results, strict=True)]
    n_trunc = sum(r.truncated for r in results)
    if n_trunc:
        note(f"{n_trunc} quer{'y was' if n_trunc == 1 else 'ies were'} longer than the model's "
             f"{s.predictor.max_length} tokens and truncated (marked 'truncated' in the results)")
    if cfg.output:
        write_text_atomic(Path(cfg.output), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return SearchRunResult(rows, cfg.output, seconds)
