"""``encoderkit index``: build or update a local semantic-search index (see :mod:`.store` for the
layout, :mod:`.corpus` for sources and passages, :mod:`.codes` for the precisions).

    encoderkit index --model runs/minilm --corpus docs/ --out idx              # build
    encoderkit index --model runs/minilm --corpus docs/ --out idx              # again: update
    encoderkit index --model runs/minilm --corpus docs/ --out idx --calibrate  # + the label-free report

Every passage is stored as packed binary codes (the first stage, kept in RAM) and int8 codes with
their calibration (rescoring), optionally float16 (``--float16``), at ``--dims`` (Matryoshka: the
first dims, renormalised). Embeddings are L2-normalised, so scores are cosines.

Updates: a document whose id and text hash are unchanged keeps its codes (it is not re-embedded);
a changed one is re-embedded; one no longer in the corpus is removed from every file. The int8
calibration of the first build is kept by updates (so unchanged codes stay valid); ``--rebuild``
re-embeds everything and recalibrates. Another model, other dims or another passage policy than
the index was built with is refused unless ``--rebuild``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from encoderkit.config import Renamed, StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import (
    BACKENDS,
    Predictor,
    as_one_call,
    engine_batches,
    finish_embeddings,
    text_lengths,
)
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.progress import note, progress
from encoderkit.ray_jobs import RayJob, check_ray_args, ray_actors_arg, ray_address_arg, ray_batch_arg
from encoderkit.retrieval import ann
from encoderkit.retrieval.codes import int8_calibration, stored_codes
from encoderkit.retrieval.corpus import SourceDoc, passage_spans, read_corpus
from encoderkit.retrieval.store import STORES, Generation, current_folder, open_generation, write_generation
from encoderkit.tasks import get_task

EMBED_CHUNK = 256  # texts per Predictor call (it batches inside)


def embed_texts(p: Predictor, texts: list[str], desc: str = "embed", ray: RayJob | None = None) -> np.ndarray:
    """Pooled, un-normalised embeddings (N, H) float32 of ``texts``, with a progress bar (on ``ray``'s actors when
    given: one Predictor of the same folder and settings each)."""
    if ray is not None and texts:  # the engine calls of the loop below, each shipped whole, a chunk at a time
        load = partial(Predictor.load, p.folder, backend=p.backend, threads=ray.threads, max_batch=p.max_batch)
        parts = ((part, engine_batches(p, text_lengths(p, part)))  # tokenised as sent: ray_jobs.IN_FLIGHT chunks out
                 for part in (texts[i : i + EMBED_CHUNK] for i in range(0, len(texts), EMBED_CHUNK)))
        out = []
        with progress(total=len(texts), desc=desc, unit="text") as bar:
            for vecs in ray.map_chunks(parts, load, partial(as_one_call, Predictor.embed_raw)):
                out.append(np.stack(vecs))
                bar.update(len(vecs))
        return np.concatenate(out)
    chunks = [p.embed_raw(texts[i : i + EMBED_CHUNK]) for i in progress(range(0, len(texts), EMBED_CHUNK),
                                                                      total=-(-len(texts) // EMBED_CHUNK), desc=desc, unit="chunk")]
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)


@dataclass
class IndexConfig(StageConfig):
    """Settings of ``encoderkit index``."""

    # old spellings, until the next release: --runtime X is --backend X, --backend local|milvus is --store
    renamed: ClassVar[dict[str, Renamed]] = {"runtime": Renamed("backend"), "backend": Renamed("store", values=STORES)}

    model: str = arg(help="Embed model folder (a sentence-transformers or encoderkit embed folder).", required=True)
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
    ann_threshold: int = arg(ann.ANN_THRESHOLD, help="Past this many passages the binary first stage is an approximate faiss "
                                                     f"IVF index (sqrt(N) cells, {ann.PROBE_SHARE:.0%} of them scanned per "
                                                     "query); exact Hamming search (faiss IndexBinaryFlat) below.")
    rebuild: bool = arg(False, help="Re-embed everything (another model, dims or passage policy; recalibrate int8).")
    calibrate: bool = arg(False, help="Also report, per precision x dims, top-10 overlap with exact float search, "
                                      "bytes/doc and latency, and recommend the smallest setting (no labels needed).")
    calibrate_queries: str | None = arg(None, help="JSONL of {'query'} lines for --calibrate (default: the first "
                                                   "sentences of sampled passages).")
    min_overlap: float = arg(0.9, help="--calibrate recommends the smallest setting whose mean top-10 overlap is at least this.")
    store: str = arg("local", help="Where vectors are searched: the local index, or also a Milvus server.",
                     choices=STORES)
    uri: str | None = arg(None, help="Milvus URI for --store milvus (http://host:19530, or a file.db for milvus-lite).")
    collection: str = arg("encoderkit", help="Milvus collection name.")
    backend: str = arg("auto", help="Predictor backend for embedding (auto: the fastest, ONNX INT8 for embed models).",
                       choices=BACKENDS, speed=True)
    threads: int | None = arg(None, help="onnxruntime threads.", speed=True)
    batch_size: int = arg(32, help="Texts per model call.", speed=True)
    ray: str | None = ray_address_arg()
    ray_actors: int = ray_actors_arg()
    ray_batch: int = ray_batch_arg()

    def validate(self) -> None:
        check_ray_args(self.ray_actors, self.ray_batch)
        check(self.dims >= 0, "--dims must be 0 (the model's) or positive")
        check(self.overlap >= 0, "--overlap must be >= 0")
        check(self.passage_tokens <= 0 or self.overlap < self.passage_tokens, "--overlap must be below --passage-tokens")
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


def run(cfg: IndexConfig) -> IndexResult:
    """Build or update the index ``cfg.out`` from ``cfg.corpus`` (see the module docstring)."""
    t0 = time.perf_counter()
    ray = RayJob.of(cfg)  # Ray missing or an address that does not answer fails now, before any model is loaded
    read = read_corpus(cfg.corpus, cfg.id_field, cfg.text_field, cfg.title_field)
    for s in read.skipped[:5]:
        note(f"skipped {s}")
    if len(read.skipped) > 5:
        note(f"... and {len(read.skipped) - 5} more skipped")
    p = Predictor.load(cfg.model, backend=cfg.backend, threads=cfg.threads, max_batch=cfg.batch_size)
    if get_task(p.task).endpoint != "embed":  # the index holds sentence vectors: /v1/embed's call
        raise EncoderkitError(f"--model {cfg.model} is a {p.task!r} model; indexing needs an embed model")
    fingerprint = model_fingerprint(cfg.model)
    size = {0: p.max_length - 2, -1: 0}.get(cfg.passage_tokens, cfg.passage_tokens)
    root = Path(cfg.out)
    old = None
    if current_folder(root) is not None:
        old = open_generation(root)
    elif root.exists() and any(x for x in root.iterdir() if not x.name.startswith(".")):
        raise EncoderkitError(f"--out {root} is a non-empty folder that is not an index; choose another --out")
    # 'runtime' too, for one release: the release before the rename reads that key
    manifest = {"model": {"folder": str(Path(cfg.model).resolve()), "fingerprint": fingerprint, "backend": p.backend,
                          "runtime": p.backend, "max_length": p.max_length},
                "passages": {"tokens": size, "overlap": cfg.overlap}, "normalized": True}
    if old is not None and not cfg.rebuild:
        om = old.manifest
        if om["model"]["fingerprint"] != fingerprint:
            raise EncoderkitError(f"index {root} was built with the model at {om['model']['folder']} (fingerprint "
                                  f"{om['model']['fingerprint']}), not {cfg.model} ({fingerprint}); pass --rebuild to re-embed")
        for key, want in (("passages", manifest["passages"]), ("dims", cfg.dims or om["dims"])):
            if om.get(key) != want:
                raise EncoderkitError(f"index {root} has {key}={om.get(key)}, this run asks {want}; pass --rebuild to re-embed")
        if (cfg.float16 or cfg.store == "milvus") and not om.get("float16"):
            raise EncoderkitError(f"index {root} holds no float16 vectors (needed by --float16 and --store milvus); "
                                  "pass --rebuild to re-embed")
    reuse = {} if old is None or cfg.rebuild else _rows_by_doc(old)

    passages: list[dict[str, str]] = []
    source_rows: list[int] = []  # row in the old generation, or -1 for a new passage
    new_texts: list[str] = []
    counts = {"documents": len(read.docs), "unchanged": 0, "added": 0, "changed": 0}
    for d in read.docs:
        h = d.hash
        prev = reuse.get(d.id)
        if prev is not None and prev[0] == h:
            counts["unchanged"] += 1
            for row in prev[1]:
                passages.append(old.passages[row])
                source_rows.append(row)
            continue
        counts["changed" if prev is not None else "added"] += 1
        for j, (a, b) in enumerate(_spans(p, d, size, cfg.overlap)):
            passages.append({"id": f"{d.id}#{j}", "doc_id": d.id, "hash": h, "text": d.text[a:b]})
            source_rows.append(-1)
            new_texts.append(d.text[a:b])
    live = {d.id for d in read.docs}
    counts["deleted"] = sum(1 for doc_id in reuse if doc_id not in live) if old is not None and not cfg.rebuild else 0
    raw = embed_texts(p, new_texts, "embed", ray) if new_texts else np.zeros((0, 0), np.float32)
    full = raw.shape[1] if raw.size else int(old.manifest["model_dims"])
    dims = cfg.dims or (old.dims if old is not None and not cfg.rebuild else full)
    if dims > full:
        raise EncoderkitError(f"--dims {dims} is more than the model's {full} dimensions")
    vecs = finish_embeddings(raw, dims, True) if raw.size else np.zeros((0, dims), np.float32)
    calibration = (np.asarray(old.arrays["int8_calibration"]) if old is not None and not cfg.rebuild
                   else int8_calibration(vecs))
    keep_float = cfg.float16 or cfg.store == "milvus" or bool(old is not None and not cfg.rebuild and old.manifest["float16"])
    arrays = _assemble(old, source_rows, vecs, calibration, keep_float)
    manifest.update({"dims": dims, "model_dims": full, "float16": keep_float,
                     "precisions": ["binary", "int8"] + (["float16"] if keep_float else [])})
    gen = Generation(manifest, passages, arrays)
    extra = {}
    if len(passages) > cfg.ann_threshold:
        extra["binary.ivf"] = lambda path: ann.save(ann.build_binary_ivf(arrays["binary"]), path)
    before_swap = None
    if cfg.store == "milvus":
        from encoderkit.retrieval.milvus import sync

        kept = {x["id"] for x in passages}
        removed = [r["id"] for r in (old.passages if old is not None else []) if r["id"] not in kept]
        changed_ids = [passages[i]["id"] for i, r in enumerate(source_rows) if r < 0]
        before_swap = lambda folder: sync(cfg.uri, cfg.collection, gen, changed_ids, removed, root)
    folder = write_generation(root, gen, extra, before_swap)
    counts.update({"passages": len(passages), "embedded_passages": len(new_texts), "skipped": len(read.skipped),
                   "skipped_examples": read.skipped[:5], "dims": dims, "generation": folder.name,
                   "bytes": {f: m["bytes"] for f, m in json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["files"].items()},
                   "seconds": round(time.perf_counter() - t0, 2)})
    result = IndexResult(root, counts)
    if cfg.calibrate:
        from encoderkit.retrieval.calibrate import calibrate

        full_vecs = finish_embeddings(raw, None, True) if len(new_texts) == len(passages) else \
            finish_embeddings(embed_texts(p, [x["text"] for x in passages], "embed all for --calibrate", ray), None, True)
        result.calibration = calibrate(p, full_vecs, passages, cfg.calibrate_queries, cfg.min_overlap, root)
    return result


def _spans(p: Predictor, d: SourceDoc, size: int, overlap: int) -> list[tuple[int, int]]:
    return passage_spans(p.tokenizer, d.text, size, overlap)


def _rows_by_doc(gen: Generation) -> dict[str, tuple[str, list[int]]]:
    out: dict[str, tuple[str, list[int]]] = {}
    for i, r in enumerate(gen.passages):
        out.setdefault(r["doc_id"], (r["hash"], []))[1].append(i)
    return out


def _assemble(old: Generation | None, source_rows: list[int], vecs: np.ndarray, calibration: np.ndarray,
              keep_float: bool) -> dict[str, np.ndarray]:
    """The new generation's arrays: old rows copied where reused, new rows coded from ``vecs``."""
    src = np.asarray(source_rows)
    new_at = np.flatnonzero(src < 0)
    old_at = np.flatnonzero(src >= 0)
    arrays = {}
    for key, fresh in stored_codes(vecs, calibration, keep_float).items():
        arr = np.empty((len(src), fresh.shape[1]), dtype=fresh.dtype)
        arr[new_at] = fresh
        if len(old_at):
            arr[old_at] = np.asarray(old.arrays[key])[src[old_at]]
        arrays[key] = arr
    arrays["int8_calibration"] = calibration.astype(np.float32)
    return arrays
