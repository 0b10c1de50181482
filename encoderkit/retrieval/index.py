"""``encoderkit index``: build or update a local semantic-search index (layout: :mod:`.store`; sources and passages:
:mod:`.corpus`; precisions: :mod:`.codes`).

An update re-embeds only new or changed documents and keeps the build's int8 calibration and engine (the manifest's
``engine``, :mod:`encoderkit.inference.policy`), so that kept codes stay valid and ``search`` embeds its queries on
the same graph; another model, dims, passage policy or backend needs ``--rebuild``. The corpus streams through a
block of :data:`BLOCK_TEXTS` passages at a time, ``--ray`` or not, and the files are byte for byte those of a
whole-corpus run, except that a build fits its int8 calibration on its first :data:`CALIBRATION_ROWS` vectors.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.engines import CALIBRATION_TEXTS
from encoderkit.inference.policy import AUTO_HELP, RECORD_KEY, recorded, resolve
from encoderkit.inference.predictor import (
    BACKENDS,
    Predictor,
    as_one_call,
    engine_batches,
    finish_embeddings,
    text_lengths,
)
from encoderkit.io import portable_path
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.models.names import resolve_model
from encoderkit.progress import note, progress
from encoderkit.ray_jobs import RayJob, check_ray_args, ray_actors_arg, ray_address_arg, ray_batch_arg
from encoderkit.retrieval import ann, first_stage, milvus, sparse
from encoderkit.retrieval.calibrate import calibrate
from encoderkit.retrieval.codes import binary_codes, int8_calibration, int8_codes
from encoderkit.retrieval.corpus import Skipped, SourceDoc, iter_corpus, passage_spans
from encoderkit.retrieval.store import (
    STORES,
    Generation,
    GenerationWriter,
    PassageLines,
    current_folder,
    open_generation,
)
from encoderkit.tasks import get_task

EMBED_CHUNK = 256  # texts per Predictor call (it batches inside)
BLOCK_TEXTS = 16 * EMBED_CHUNK  # new passages per block the driver embeds and writes (one --ray chunk)
BLOCK_ROWS = 4096  # passages per block of an update (kept ones too), and rows per read of the old generation
CALIBRATION_ROWS = 100_000  # a build's int8 calibration: the ranges of its first this many passages (all, below)


def embed_blocks(p: Predictor, blocks: Iterable[list[str]], ray: RayJob | None = None,
                 on_rows: Callable[[int], Any] | None = None) -> Iterator[np.ndarray]:
    """Pooled, un-normalised embeddings (n, H) float32 of each list of ``blocks``, in order, a block read when the
    one before it is handed back: :data:`EMBED_CHUNK` texts per Predictor call (it length-sorts and batches
    inside), or on ``ray``'s actors (one Predictor of the same folder and settings each) those same engine calls,
    each shipped whole, ``ray_jobs.IN_FLIGHT`` blocks out at a time. ``on_rows(n)``: after each block."""
    empty = np.zeros((0, 0), np.float32)
    if ray is None:
        for texts in blocks:
            parts = [p.embed_raw(texts[i : i + EMBED_CHUNK]) for i in range(0, len(texts), EMBED_CHUNK)]
            if on_rows is not None:
                on_rows(len(texts))
            yield np.concatenate(parts) if parts else empty
        return
    load = partial(Predictor.load, p.folder, backend=p.choice, threads=ray.threads, max_batch=p.max_batch)
    plans = ((texts, engine_batches(p, text_lengths(p, texts), EMBED_CHUNK)) for texts in blocks)  # tokenised as sent
    for vecs in ray.map_chunks(plans, load, partial(as_one_call, Predictor.embed_raw)):
        if on_rows is not None:
            on_rows(len(vecs))
        yield np.stack(vecs) if vecs else empty


def embed_texts(p: Predictor, texts: list[str], desc: str = "embed", ray: RayJob | None = None) -> np.ndarray:
    """Pooled, un-normalised embeddings (N, H) float32 of ``texts`` (:func:`embed_blocks`), with a progress bar."""
    blocks = (texts[i : i + BLOCK_TEXTS] for i in range(0, len(texts), BLOCK_TEXTS))
    with progress(total=len(texts), desc=desc, unit="text") as bar:
        out = [v for v in embed_blocks(p, blocks, ray, bar.update) if len(v)]
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


@dataclass
class IndexConfig(StageConfig):
    """Settings of ``encoderkit index``."""

    model: str = arg(help="Embed model folder (a sentence-transformers or encoderkit embed folder), or a sparse "
                          "(SPLADE, finetune --task sparse) folder: an inverted index of its vocabulary weights.",
                     required=True)
    corpus: list[str] = arg(help="Text files, folders, JSONL/CSV with an id field, a BEIR folder or the SciFact zip.",
                            required=True)
    out: str = arg(help="Index folder; an existing index there is updated.", required=True)
    id_field: str = arg("id", help="JSONL/CSV field with each document's stable id ('id' also accepts '_id').")
    text_field: str = arg("text", help="JSONL/CSV field with the text.")
    title_field: str = arg("title", help="JSONL/CSV field with an optional title (prepended to the text).")
    dims: int = arg(0, help="Keep the first DIMS dimensions (Matryoshka); 0 = the model's own.")
    float16: bool = arg(False, help="Also store float16 vectors (exact float search and float rescoring; 2 bytes/dim).")
    passage_tokens: int = arg(0, help="Passage length in tokens; 0 = the model's maximum length less its 2 special "
                                      "tokens; -1 = do not split (a long document is truncated by the model).")
    overlap: int = arg(32, help="Tokens shared by consecutive passages of one document.")
    ann_threshold: int = arg(ann.ANN_THRESHOLD, help="Past this many passages the binary first stage is an "
                                                     "approximate faiss IVF index (sqrt(N) cells, "
                                                     f"{ann.PROBE_SHARE:.0%} of them scanned per query); exact "
                                                     "Hamming search (faiss IndexBinaryFlat) below.")
    follow_links: bool = arg(False, help="Also read files that symbolic links inside a corpus folder point to "
                                         "outside it (by default such links are skipped and counted).")
    rebuild: bool = arg(False, help="Re-embed everything (another model, dims or passage policy; recalibrate int8).")
    calibrate: bool = arg(False, help="Also report, per precision x dims, top-10 overlap with exact float search, "
                                      "bytes/doc and latency, and recommend the smallest setting (no labels needed).")
    calibrate_queries: str | None = arg(None, help="JSONL of {'query'} lines for --calibrate (default: the first "
                                                   "sentences of sampled passages).")
    min_overlap: float = arg(0.9, help="--calibrate recommends the smallest setting whose mean top-10 overlap is at "
                                       "least this.")
    store: str = arg("local", help="Where vectors are searched: the local index, or also a Milvus server.",
                     choices=STORES)
    uri: str | None = arg(None, help="Milvus URI for --store milvus (http://host:19530, or a file.db for milvus-lite).")
    collection: str = arg("encoderkit", help="Milvus collection name.")
    backend: str = arg("auto", help="Predictor backend for embedding; an update embeds on the build's (auto takes it, "
                                    "another is refused without --rebuild); " + AUTO_HELP,
                       choices=BACKENDS, speed=True)
    threads: int | None = arg(None, help="onnxruntime threads.", speed=True)
    batch_size: int = arg(32, help="Texts per model call.", speed=True)
    ray: str | None = ray_address_arg()
    ray_actors: int = ray_actors_arg()
    ray_batch: int = ray_batch_arg()
    first_stage_model: str | None = arg(None, help="A static embedding folder (distill --to static from --model) as "
                                        "the first stage: its codes pick the candidates, --model's int8 codes rescore "
                                        "them (docs/search.md, Tiers).")
    full_codes: str = arg("lazy", choices=first_stage.FULL_CODES, help="With --first-stage-model: when --model embeds "
                          "the passages for rescoring: lazy (the first time a passage is a candidate; kept in the "
                          "index) or eager (all of them now).")

    def validate(self) -> None:
        check_ray_args(self.ray_actors, self.ray_batch)
        check(self.dims >= 0, "--dims must be 0 (the model's) or positive")
        check(self.overlap >= 0, "--overlap must be >= 0")
        check(self.passage_tokens <= 0 or self.overlap < self.passage_tokens,
              "--overlap must be below --passage-tokens")
        check(self.store != "milvus" or bool(self.uri), "--store milvus needs --uri (http://host:19530 or file.db)")
        check(0 < self.min_overlap <= 1, "--min-overlap must be in (0, 1]")


@dataclass
class IndexResult:
    out: Path
    stats: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        out = {"index": str(self.out), **self.stats}
        if self.calibration:
            out["calibration"] = self.calibration
        return out


def run(asked: IndexConfig) -> IndexResult:
    """Build or update the index ``asked.out`` from ``asked.corpus`` (see the module docstring)."""
    cfg = replace(asked, model=str(resolve_model(asked.model)))  # 'minilm' as in every stage
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise EncoderkitError(f"--out {cfg.out} is a file, not an index folder; choose another --out (a new folder "
                              "or an index to update)")
    if sparse.is_sparse_model(cfg.model):  # a SPLADE model: an inverted index of its vocabulary weights
        return IndexResult(Path(cfg.out), sparse.build(cfg))
    if cfg.first_stage_model or (not cfg.rebuild and first_stage.is_tiered(Path(cfg.out))):  # a static first stage
        return IndexResult(Path(cfg.out), first_stage.build(cfg, embed_texts))
    t0 = time.perf_counter()
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before any model is loaded
    skipped = Skipped(keep=5, note=note)
    docs = iter_corpus(cfg.corpus, cfg.id_field, cfg.text_field, cfg.title_field, skipped, cfg.follow_links)
    docs = itertools.chain([next(docs)], docs)  # a missing or empty corpus fails now, before the model is loaded
    root = Path(cfg.out)
    old = None
    if current_folder(root) is not None:
        old = open_generation(root, lazy_passages=True)  # its texts stay on disk: kept lines are copied from there
    elif root.exists() and any(x for x in root.iterdir() if not x.name.startswith(".")):
        raise EncoderkitError(f"--out {root} is a non-empty folder that is not an index; choose another --out")
    try:
        return _embed_into(cfg, root, old, docs, skipped, ray, t0)
    finally:
        if old is not None:
            old.passages.close()


def _embed_into(cfg: IndexConfig, root: Path, old: Generation | None, docs: Iterator[SourceDoc], skipped: Skipped,
                ray: RayJob, t0: float) -> IndexResult:
    """Load the model on the engine the index's vectors come from, check an update against ``old``, and stream."""
    updating = old is not None and not cfg.rebuild
    calibration = None
    if not updating and cfg.backend == "openvino-int8":  # a build's static INT8 calibrates on the corpus's head
        head = list(itertools.islice(docs, CALIBRATION_TEXTS))
        docs, calibration = itertools.chain(head, docs), [d.text for d in head]
    # an update embeds on the build's engine (auto takes it; another backend is refused: its vectors would not be the
    # ones the index holds)
    choice = resolve(cfg.model, cfg.backend, recorded(old.manifest) if updating else None, calibration=calibration,
                     update=f"index {root}")
    p = Predictor.load(cfg.model, backend=choice, threads=cfg.threads, max_batch=cfg.batch_size)
    if get_task(p.task).endpoint != "embed":  # the index holds sentence vectors: /v1/embed's call
        raise EncoderkitError(f"--model {cfg.model} is a {p.task!r} model; indexing needs an embed model")
    fingerprint = model_fingerprint(cfg.model)
    size = {0: p.max_length - 2, -1: 0}.get(cfg.passage_tokens, cfg.passage_tokens)
    # the engine (with openvino-int8's calibration): search's queries and later updates load that graph
    manifest = {"model": {"folder": portable_path(cfg.model, root), "fingerprint": fingerprint,
                          "max_length": p.max_length},
                RECORD_KEY: p.choice.to_dict(), "passages": {"tokens": size, "overlap": cfg.overlap},
                "normalized": True}
    if updating:
        om = old.manifest
        if om["model"]["fingerprint"] != fingerprint:
            raise EncoderkitError(f"index {root} was built with the model at {om['model']['folder']} (fingerprint "
                                  f"{om['model']['fingerprint']}), not {cfg.model} ({fingerprint}); pass --rebuild "
                                  "to re-embed")
        for key, want in (("passages", manifest["passages"]), ("dims", cfg.dims or om["dims"])):
            if om.get(key) != want:
                raise EncoderkitError(f"index {root} has {key}={om.get(key)}, this run asks {want}; pass --rebuild "
                                      "to re-embed")
        if (cfg.float16 or cfg.store == "milvus") and not om.get("float16"):
            raise EncoderkitError(f"index {root} holds no float16 vectors (needed by --float16 and --store milvus); "
                                  "pass --rebuild to re-embed")
    return _stream_generation(cfg, p, docs, skipped, old, manifest, ray, t0)


def _spans(p: Predictor, d: SourceDoc, size: int, overlap: int) -> list[tuple[int, int]]:
    return passage_spans(p.tokenizer, d.text, size, overlap)


def _rows_by_doc(gen: Generation) -> dict[str, tuple[str, list[int]]]:
    out: dict[str, tuple[str, list[int]]] = {}
    for i, r in enumerate(gen.passages):
        out.setdefault(r["doc_id"], (r["hash"], []))[1].append(i)
    return out



# -- the stream: documents -> passages -> blocks -> vectors -> the generation's files -----------------------------

@dataclass
class _Block:
    """Passages in corpus order, as runs: ``["new", [passage dicts]]`` or ``["old", first row, rows]`` (kept
    passages of the old generation); ``texts``: the new passages' texts, what is embedded."""

    runs: list[list[Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rows: int = 0

    def add_new(self, passage: dict[str, str]) -> None:
        if not self.runs or self.runs[-1][0] != "new":
            self.runs.append(["new", []])
        self.runs[-1][1].append(passage)
        self.texts.append(passage["text"])
        self.rows += 1

    def add_old(self, row: int) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == "old" and last[1] + last[2] == row:
            last[2] += 1
        else:
            self.runs.append(["old", row, 1])
        self.rows += 1

    def full(self) -> bool:
        """A block ends after :data:`BLOCK_TEXTS` new passages, or past :data:`BLOCK_ROWS` passages where its new
        ones are whole Predictor calls: so the texts are embedded :data:`EMBED_CHUNK` at a time across blocks, the
        calls of a run that embeds them all in one list."""
        return len(self.texts) >= BLOCK_TEXTS or (self.rows >= BLOCK_ROWS and len(self.texts) % EMBED_CHUNK == 0)


def _plan(docs: Iterable[SourceDoc], p: Predictor, size: int, overlap: int, reuse: dict[str, tuple[str, list[int]]],
          counts: dict[str, int], kept: np.ndarray | None) -> Iterator[_Block]:
    """The blocks of the new generation: each document's passages, kept (same id and hash as in ``reuse``: its old
    rows, marked in ``kept``) or new (split and to be embedded); ``counts`` counted as the documents go by."""
    block = _Block()
    for d in docs:
        counts["documents"] += 1
        h = d.hash
        prev = reuse.get(d.id)
        if prev is not None and prev[0] == h:
            counts["unchanged"] += 1
            for row in prev[1]:
                block.add_old(row)
                kept[row] = True
                if block.full():
                    yield block
                    block = _Block()
            continue
        counts["changed" if prev is not None else "added"] += 1
        for j, (a, b) in enumerate(_spans(p, d, size, overlap)):
            block.add_new({"id": f"{d.id}#{j}", "doc_id": d.id, "hash": h, "text": d.text[a:b]})
            if block.full():
                yield block
                block = _Block()
    if block.rows:
        yield block


class _Codes:
    """Writes the arrays of a generation a block of rows at a time: binary and float16 codes at once; int8 codes
    once the calibration is known (an update's is the old one; a build fits it on its first
    :data:`CALIBRATION_ROWS` vectors, held until then, or on all of them when it has fewer: the whole-corpus
    calibration, as before streaming)."""

    def __init__(self, w: GenerationWriter, old: Generation | None, calibration: np.ndarray | None,
                 keep_float: bool) -> None:
        self.w, self.old, self.calibration, self.keep_float = w, old, calibration, keep_float
        self._held: list[np.ndarray] = []

    def new(self, vecs: np.ndarray) -> None:
        """Unit vectors (n, dims) of the next rows."""
        self.w.append("binary", binary_codes(vecs))
        if self.keep_float:
            self.w.append("float16", vecs.astype(np.float16))
        if self.calibration is not None:
            self.w.append("int8", int8_codes(vecs, self.calibration))
            return
        self._held.append(vecs)
        if sum(len(x) for x in self._held) >= CALIBRATION_ROWS:
            self._fit()

    def old_rows(self, start: int, n: int) -> None:
        """Rows ``start .. start + n`` of the old generation, as they are (its calibration is this one's)."""
        for key in ("binary", "int8") + (("float16",) if self.keep_float else ()):
            self.w.append(key, np.asarray(self.old.arrays[key][start : start + n]))

    def _fit(self) -> None:
        held = np.concatenate(self._held)
        self.calibration = int8_calibration(held[:CALIBRATION_ROWS])
        self.w.append("int8", int8_codes(held, self.calibration))
        self._held = []

    def finish(self) -> np.ndarray:
        """Write what is held and the calibration; the calibration."""
        if self.calibration is None:
            self._fit()
        self.w.save("int8_calibration", self.calibration.astype(np.float32))
        return self.calibration


def _write_block(w: GenerationWriter, codes: _Codes, block: _Block, vecs: np.ndarray | None,
                 old: Generation | None) -> None:
    """A block's passages.jsonl lines and array rows, in order (``vecs``: its new passages' unit vectors)."""
    j = 0
    for run in block.runs:
        if run[0] == "new":
            w.add_passages(json.dumps(x, ensure_ascii=False) + "\n" for x in run[1])
            codes.new(vecs[j : j + len(run[1])])
            j += len(run[1])
            continue
        for start in range(run[1], run[1] + run[2], BLOCK_ROWS):  # the old lines and rows, as they are
            n = min(BLOCK_ROWS, run[1] + run[2] - start)
            w.add_raw_passages(old.passages.raw(start, n), n)
            codes.old_rows(start, n)


def _stream_generation(cfg: IndexConfig, p: Predictor, docs: Iterable[SourceDoc], skipped: Skipped,
                       old: Generation | None, manifest: dict[str, Any], ray: RayJob | None, t0: float) -> IndexResult:
    """Read, split, embed and write the next generation a block at a time (:func:`_plan`, :func:`embed_blocks`,
    :func:`_write_block`), then make it live. Held in the driver: per passage of the old generation its row's
    offset, doc id and hash, and a kept flag; per document its id (to name a repeated one); with ``--store milvus``
    the ids of new passages; the blocks in flight (``ray_jobs.IN_FLIGHT`` with ``--ray``); the first
    :data:`CALIBRATION_ROWS` vectors of a build; with ``--calibrate``, every vector (its report searches them all)."""
    root = Path(cfg.out)
    updating = old is not None and not cfg.rebuild
    reuse = _rows_by_doc(old) if updating else {}
    kept = np.zeros(len(old.passages) if updating else 0, dtype=bool)
    counts: dict[str, Any] = {"documents": 0, "unchanged": 0, "added": 0, "changed": 0}
    keep_float = cfg.float16 or cfg.store == "milvus" or bool(updating and old.manifest["float16"])
    dims = cfg.dims or (old.dims if updating else 0)  # 0: the model's, known from the first vectors
    full = int(old.manifest["model_dims"]) if updating else 0
    new_ids: list[str] = []  # --store milvus: the passages to upsert
    raws: list[np.ndarray] = []  # --calibrate on a build: its report's vectors
    held: collections.deque[_Block] = collections.deque()  # blocks read and not yet written, in order
    embedded = 0

    def texts_of(blocks: Iterable[_Block]) -> Iterator[list[str]]:
        for b in blocks:
            held.append(b)
            yield b.texts

    with GenerationWriter(root) as w, progress(desc="embed", unit="text") as bar:
        codes = _Codes(w, old if updating else None, np.asarray(old.arrays["int8_calibration"]) if updating else None,
                       keep_float)
        blocks = _plan(docs, p, manifest["passages"]["tokens"], cfg.overlap, reuse, counts, kept)
        for raw in embed_blocks(p, texts_of(blocks), ray, bar.update):
            block = held.popleft()
            vecs = None
            if len(block.texts):
                full = raw.shape[1]
                dims = dims or full
                if dims > full:
                    raise EncoderkitError(f"--dims {dims} is more than the model's {full} dimensions")
                vecs = finish_embeddings(raw, dims, True)
                embedded += len(vecs)
                if cfg.calibrate:
                    raws.append(raw)
                if cfg.store == "milvus":
                    new_ids += [x["id"] for run in block.runs if run[0] == "new" for x in run[1]]
            _write_block(w, codes, block, vecs, old)
        codes.finish()
        if skipped.count > 5:
            note(f"... and {skipped.count - 5} more skipped")
        counts["deleted"] = len(reuse) - counts["unchanged"] - counts["changed"]
        manifest.update({"dims": dims, "model_dims": full, "float16": keep_float,
                         "precisions": ["binary", "int8"] + (["float16"] if keep_float else [])})
        extra = {}
        if w.count > cfg.ann_threshold:  # the IVF is trained on every binary code (what search loads into RAM anyway)
            extra["binary.ivf"] = lambda path: ann.save(ann.build_binary_ivf(np.load(w.folder / "binary.npy")), path)
        before_swap = None
        if cfg.store == "milvus":
            before_swap = partial(_sync_milvus, cfg, manifest, old, kept, new_ids, root)
        folder = w.commit(manifest, extra, before_swap)
    files = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["files"]
    counts.update({"passages": w.count, "embedded_passages": embedded, "skipped": skipped.count,
                   "skipped_examples": skipped.first[:5], "dims": dims, "generation": folder.name,
                   "bytes": {f: m["bytes"] for f, m in files.items()},
                   "seconds": round(time.perf_counter() - t0, 2)})
    result = IndexResult(root, counts)
    if cfg.calibrate:
        result.calibration = _calibration_report(cfg, p, raws, counts, ray)
    return result


def _sync_milvus(cfg: IndexConfig, manifest: dict[str, Any], old: Generation | None, kept: np.ndarray,
                 new_ids: list[str], root: Path, folder: Path) -> None:
    """``--store milvus``: upsert the new passages and delete the old ones no longer there, before the swap (the
    written generation read back: its ids streamed, its float16 vectors memory-mapped)."""
    fresh = set(new_ids)
    removed = [] if old is None else [r["id"] for i, r in enumerate(old.passages)
                                      if not (i < len(kept) and kept[i]) and r["id"] not in fresh]
    gen = Generation(manifest, PassageLines(folder / "passages.jsonl"),
                     {"float16": np.load(folder / "float16.npy", mmap_mode="r")})
    try:
        milvus.sync(cfg.uri, cfg.collection, gen, new_ids, removed, root)
    finally:
        gen.passages.close()


def _calibration_report(cfg: IndexConfig, p: Predictor, raws: list[np.ndarray], counts: dict[str, Any],
                        ray: RayJob | None) -> dict[str, Any]:
    """``--calibrate``: the report over every passage of the new generation, in memory (its exact float search is
    the reference): the vectors of this run when it embedded them all, else all passages embedded again."""
    root = Path(cfg.out)
    passages = open_generation(root).passages
    if counts["embedded_passages"] == counts["passages"]:
        full_vecs = finish_embeddings(np.concatenate(raws), None, True)
    else:
        full_vecs = finish_embeddings(embed_texts(p, [x["text"] for x in passages], "embed all for --calibrate", ray),
                                      None, True)
    return calibrate(p, full_vecs, passages, cfg.calibrate_queries, cfg.min_overlap, root)
