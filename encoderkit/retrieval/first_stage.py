"""A static embedding model as the first stage of the tiered index, the full encoder rescoring its candidates.

    encoderkit index --model runs/minilm --first-stage-model runs/static --corpus docs/ --out idx   # --full-codes lazy
    encoderkit search --index idx --query "..."       # static candidates, rescored by the full encoder's int8 codes

Every passage is stored as the static model's binary and int8 codes (the candidate stage). The full encoder's int8
codes, which rescore the candidates, live outside the generations in ``DIR/full-codes/`` (:class:`FullCodes`), keyed
by passage id and document hash: made for every passage at index time (``--full-codes eager``) or, by default
(``lazy``), the first time a passage is a candidate, and kept; so the full encoder's time goes to the passages that
queries reach. An update keeps the full codes of unchanged passages; ``--rebuild`` starts them again.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import RECORD_KEY, recorded, resolve
from encoderkit.inference.predictor import Predictor, finish_embeddings
from encoderkit.io import portable_path, recorded_path, write_bytes_atomic, write_json_atomic
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.progress import note
from encoderkit.retrieval import ann
from encoderkit.retrieval.codes import binary_codes, hamming, int8_calibration, int8_codes, int8_dequantize, top_k
from encoderkit.retrieval.corpus import passage_spans, read_corpus
from encoderkit.retrieval.store import Generation, current_folder, open_generation, write_generation
from encoderkit.tasks import get_task

KEY = "first_stage"  # the manifest entry of a tiered index
CODES_DIR = "full-codes"
FULL_CODES = ("lazy", "eager")
CALIBRATION_SAMPLE = 256  # passages the full encoder embeds at a lazy build, for its int8 ranges
# Candidates per result the full encoder rescores when the settings leave it at 0 (bench/search_tiers.py,
# docs/search.md "Tiers"): 10 rather than 4 for its larger candidate recall
MULTIPLIER = 10
STATIC_CHUNK = 4096  # texts per static embedding call


def is_tiered(root: str | Path) -> bool:
    """Whether ``root`` holds an index with a static first stage."""
    folder = current_folder(Path(root))
    if folder is None or not (folder / "manifest.json").is_file():
        return False
    try:
        return KEY in json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # open_generation names the damage


def passage_key(passage: dict[str, str]) -> str:
    """What a passage's full codes are kept under: its id and its document's text hash."""
    return f"{passage['id']}\t{passage['hash']}"


def open_static(folder: str | Path, flag: str = "--first-stage-model", threads: int | None = None) -> Predictor:
    """The static embedding folder ``folder`` as a Predictor; anything else is refused, naming ``flag``."""
    if not Path(folder).is_dir():
        raise EncoderkitError(f"{flag} {folder} is not a folder; pass a static embedding folder (encoderkit distill "
                              "--to static --teacher YOUR_EMBED_MODEL)")
    info = ModelFolder.open(folder, tokenizer=False)
    if info.static_weights is None:
        raise EncoderkitError(f"{flag} {folder} is not a static embedding model (a {info.task!r} model); make one "
                              "with encoderkit distill --to static --teacher YOUR_EMBED_MODEL --train CORPUS")
    return Predictor.load(folder, threads=threads, max_batch=256)


class FullCodes:
    """The full encoder's int8 codes of the passages of a tiered index: ``DIR/full-codes/meta.json`` (fingerprint,
    dims, calibration) and ``part-*.npz`` files (``keys`` (M,) str, ``codes`` (M, D) int8), each written whole and
    renamed; a search adds a part for the codes it made, a build merges the live ones into one."""

    def __init__(self, folder: Path, fingerprint: str, dims: int, calibration: np.ndarray) -> None:
        self.folder, self.fingerprint, self.dims, self.calibration = folder, fingerprint, dims, calibration
        self.row: dict[str, int] = {}  # key -> row of self.codes
        self.codes = np.zeros((0, dims), np.int8)
        self.lock = threading.Lock()
        self._writable = True

    @classmethod
    def open(cls, root: Path, fingerprint: str, dims: int) -> FullCodes | None:
        """The codes kept under index ``root`` for this model and dims; None when there are none (or they are of
        another model or dims: a build then starts them again)."""
        folder = root / CODES_DIR
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if meta.get("fingerprint") != fingerprint or meta.get("dims") != dims:
            return None
        out = cls(folder, fingerprint, dims, np.asarray(meta["calibration"], dtype=np.float32))
        keys, parts = [], []
        for part in sorted(folder.glob("part-*.npz")):
            try:
                with np.load(part, allow_pickle=False) as z:
                    k, c = [str(x) for x in z["keys"]], np.asarray(z["codes"], dtype=np.int8)
            except (OSError, ValueError, KeyError) as e:  # a cache: its codes are made again when needed
                note(f"{part}: unreadable ({e}); ignored, its passages' codes are made again when they are candidates")
                continue
            if c.shape != (len(k), dims):
                note(f"{part}: codes of shape {c.shape} for {len(k)} keys at {dims} dims; ignored")
                continue
            keys += k
            parts.append(c)
        out.codes = np.concatenate(parts) if parts else out.codes
        out.row = {k: i for i, k in enumerate(keys)}
        return out

    def add(self, keys: Sequence[str], vectors: np.ndarray, persist: bool = True) -> None:
        """Keep the codes of unit ``vectors`` (M, D) under ``keys``; ``persist`` writes them as a new part."""
        codes = int8_codes(vectors, self.calibration)
        with self.lock:
            base = len(self.codes)
            self.codes = np.concatenate([self.codes, codes])
            self.row.update({k: base + i for i, k in enumerate(keys)})
        if persist and self._writable and len(keys):
            try:
                self._write_part(list(keys), codes)
            except OSError as e:  # a read-only index: the codes live as long as this process
                self._writable = False
                note(f"{self.folder}: cannot keep the full encoder's codes ({e}); they are made again in the next "
                     "process")

    def _write_part(self, keys: list[str], codes: np.ndarray, name: str | None = None) -> None:
        buf = io.BytesIO()
        np.savez(buf, keys=np.asarray(keys, dtype=str), codes=codes)
        write_bytes_atomic(self.folder / (name or f"part-{time.time_ns():020d}-{os.getpid()}.npz"), buf.getvalue())

    def vectors(self, keys: Sequence[str]) -> np.ndarray:
        """Dequantized vectors (M, D) float32 of ``keys`` (every key must be kept)."""
        with self.lock:
            return int8_dequantize(self.codes[[self.row[k] for k in keys]], self.calibration)

    def save(self, live: Sequence[str]) -> None:
        """Write the codes of the ``live`` keys as one part and the meta, removing the other parts (a build)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        old = set(self.folder.glob("part-*.npz"))
        kept = [k for k in dict.fromkeys(live) if k in self.row]
        write_json_atomic(self.folder / "meta.json", {"fingerprint": self.fingerprint, "dims": self.dims,
                                                      "calibration": self.calibration.tolist()})
        name = f"part-{time.time_ns():020d}-{os.getpid()}.npz"
        self._write_part(kept, self.codes[[self.row[k] for k in kept]] if kept else np.zeros((0, self.dims), np.int8),
                         name)
        for part in old - {self.folder / name}:
            part.unlink(missing_ok=True)
        self.codes = self.codes[[self.row[k] for k in kept]] if kept else np.zeros((0, self.dims), np.int8)
        self.row = {k: i for i, k in enumerate(kept)}


def build(cfg: Any, embed: Callable[[Predictor, list[str], str], np.ndarray]) -> dict[str, Any]:
    """``encoderkit index`` with ``cfg.first_stage_model`` (an IndexConfig): build or update the tiered index
    ``cfg.out`` (module docstring); ``embed(predictor, texts, desc)`` -> pooled (N, H) float32. Returns the stats."""
    t0 = time.perf_counter()
    if not cfg.first_stage_model:
        raise EncoderkitError(f"index {cfg.out} has a static first stage; pass --first-stage-model (the same static "
                              "folder) to update it, or --rebuild for an index without one")
    for bad, why in ((cfg.store != "local", "--store milvus"), (cfg.calibrate, "--calibrate"), (cfg.ray, "--ray")):
        if bad:
            raise EncoderkitError(f"{why} is not available with --first-stage-model; drop one of them")
    read = read_corpus(cfg.corpus, cfg.id_field, cfg.text_field, cfg.title_field, cfg.follow_links)
    for s in read.skipped[:5]:
        note(f"skipped {s}")
    root = Path(cfg.out)
    old = open_generation(root) if current_folder(root) is not None else None
    if old is None and root.exists() and any(x for x in root.iterdir() if not x.name.startswith(".")):
        raise EncoderkitError(f"--out {root} is a non-empty folder that is not an index; choose another --out")
    # an update embeds on the build's engine: the full codes it keeps came from it
    choice = resolve(cfg.model, cfg.backend, recorded(old.manifest) if old is not None and not cfg.rebuild else None,
                     update=f"index {root}")
    full = Predictor.load(cfg.model, backend=choice, threads=cfg.threads, max_batch=cfg.batch_size)
    if get_task(full.task).endpoint != "embed" or full.info.static_weights is not None:
        what = "a static embedding model" if full.info.static_weights is not None else f"a {full.task!r} model"
        raise EncoderkitError(f"--model {cfg.model} is {what}; with --first-stage-model it is the full encoder that "
                              "rescores the candidates: pass the transformer embed model the static one was distilled "
                              "from")
    static = open_static(cfg.first_stage_model, threads=cfg.threads)
    fingerprint = model_fingerprint(cfg.model)
    size = {0: full.max_length - 2, -1: 0}.get(cfg.passage_tokens, cfg.passage_tokens)
    passages_policy = {"tokens": size, "overlap": cfg.overlap}
    if old is not None and not cfg.rebuild:
        om = old.manifest
        if om["model"]["fingerprint"] != fingerprint:
            raise EncoderkitError(f"index {root} was built with the model at {om['model']['folder']} (fingerprint "
                                  f"{om['model']['fingerprint']}), not {cfg.model} ({fingerprint}); pass --rebuild "
                                  "to re-embed")
        if om.get("passages") != passages_policy or (cfg.dims and om.get("dims") != cfg.dims):
            raise EncoderkitError(f"index {root} has passages={om.get('passages')} dims={om.get('dims')}, this run "
                                  f"asks {passages_policy} dims={cfg.dims or 'the model'}'s; pass --rebuild to "
                                  "re-embed")
        if KEY not in om:
            raise EncoderkitError(f"index {root} has no static first stage; pass --rebuild to add one")

    passages = [{"id": f"{d.id}#{j}", "doc_id": d.id, "hash": d.hash, "text": d.text[a:b]}
                for d in read.docs for j, (a, b) in enumerate(passage_spans(full.tokenizer, d.text, size, cfg.overlap))]
    texts = [p["text"] for p in passages]
    svec = np.concatenate([static.embed(texts[i : i + STATIC_CHUNK], normalize=True)
                           for i in range(0, len(texts), STATIC_CHUNK)])
    s_cal = int8_calibration(svec)
    arrays = {"static_binary": binary_codes(svec), "static_int8": int8_codes(svec, s_cal),
              "static_int8_calibration": s_cal}

    keys = [passage_key(p) for p in passages]
    probe = full.embed_raw(texts[:1])
    model_dims = probe.shape[1]
    dims = cfg.dims or (old.dims if old is not None and not cfg.rebuild else model_dims)
    if dims > model_dims:
        raise EncoderkitError(f"--dims {dims} is more than the model's {model_dims} dimensions")
    codes = None if cfg.rebuild else FullCodes.open(root, fingerprint, dims)
    todo = list(range(len(passages)))
    if codes is None:  # a first build: the calibration from the whole corpus (eager) or a seeded sample (lazy)
        rng = np.random.default_rng(0)
        sample = todo if cfg.full_codes == "eager" else sorted(rng.permutation(len(todo))[:CALIBRATION_SAMPLE].tolist())
        vecs = finish_embeddings(embed(full, [texts[i] for i in sample], "full encoder (calibration)"), dims, True)
        codes = FullCodes(root / CODES_DIR, fingerprint, dims, int8_calibration(vecs))
        codes.add([keys[i] for i in sample], vecs, persist=False)
    if cfg.full_codes == "eager":
        todo = [i for i in todo if keys[i] not in codes.row]
        if todo:
            vecs = finish_embeddings(embed(full, [texts[i] for i in todo], "full encoder"), dims, True)
            codes.add([keys[i] for i in todo], vecs, persist=False)
    kept_before = len(codes.row)
    manifest = {"model": {"folder": portable_path(cfg.model, root), "fingerprint": fingerprint,
                          "max_length": full.max_length}, RECORD_KEY: full.choice.to_dict(),
                "passages": passages_policy, "normalized": True, "dims": dims, "model_dims": model_dims,
                "float16": False, "precisions": ["static_binary", "static_int8", "full_int8"],
                KEY: {"folder": portable_path(cfg.first_stage_model, root),
                      "fingerprint": model_fingerprint(cfg.first_stage_model),
                      "dims": int(svec.shape[1]), "full_codes": cfg.full_codes}}
    folder = write_generation(root, Generation(manifest, passages, arrays), before_swap=lambda _: codes.save(keys))
    files = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["files"]
    return {"documents": len(read.docs), "passages": len(passages), "skipped": len(read.skipped),
            "skipped_examples": read.skipped[:5], "dims": dims, "first_stage_dims": int(svec.shape[1]),
            "full_codes": cfg.full_codes, "full_codes_kept": len(codes.row),
            "full_codes_stale": kept_before - len(codes.row),
            "generation": folder.name, "bytes": {f: m["bytes"] for f, m in files.items()},
            "seconds": round(time.perf_counter() - t0, 2)}


class StaticTier:
    """A tiered index's search: static candidates, rescored by the full encoder's codes (made when missing)."""

    def __init__(self, gen: Generation, static: Predictor, codes: FullCodes) -> None:
        self.gen, self.static, self.codes = gen, static, codes
        self.keys = [passage_key(p) for p in gen.passages]
        self._flat = None
        self._codes: np.ndarray | None = None  # the static int8 codes + 128 as float32, made on first use

    @classmethod
    def open(cls, gen: Generation, root: Path, threads: int | None = None) -> StaticTier | None:
        """The first stage of ``gen`` (an index under ``root``), None for an index without one."""
        meta = gen.manifest.get(KEY)
        if meta is None:
            return None
        folder = recorded_path(meta["folder"], root)  # relative to the index folder
        if not folder.is_dir() or model_fingerprint(folder) != meta["fingerprint"]:
            what = "is gone" if not folder.is_dir() else "has changed since the index was built"
            raise EncoderkitError(f"index {root}: its first-stage model {folder} {what}; rebuild the index with "
                                  "--first-stage-model FOLDER --rebuild")
        codes = FullCodes.open(root, gen.manifest["model"]["fingerprint"], gen.dims)
        if codes is None:
            raise EncoderkitError(f"index {root}: {root / CODES_DIR} is missing or damaged; rebuild the index "
                                  "(--rebuild)")
        return cls(gen, open_static(folder, "the index's first stage", threads), codes)

    def embed(self, queries: Sequence[str]) -> np.ndarray:
        """Unit static query vectors (Q, Ds)."""
        return self.static.embed(list(queries), normalize=True)

    def check(self, first_stage: str, rescore: str) -> None:
        if first_stage not in ("binary", "int8") or rescore not in ("int8", "none"):
            raise EncoderkitError("an index with a static first stage searches --first-stage binary or int8 (the "
                                  "static codes) and rescores with --rescore int8 (the full encoder's codes) or none; "
                                  f"got --first-stage {first_stage} --rescore {rescore}")

    def candidates(self, q: np.ndarray, first_stage: str, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        """Passage rows (Q, <=fetch) and first-stage scores by the static codes, best first."""
        a = self.gen.arrays
        fetch = min(fetch, len(self.keys))
        if first_stage == "binary":
            qb = binary_codes(q)
            if ann.available():
                if self._flat is None:
                    self._flat = ann.build_binary_flat(np.asarray(a["static_binary"]))
                rows, dist = ann.search(self._flat, qb, fetch)
            else:
                d = hamming(qb, a["static_binary"])
                rows = top_k(d, fetch, largest=False)
                dist = np.take_along_axis(d, rows, 1).astype(np.float32)
            return rows, -dist
        # the float query against the dequantized codes (lo + (code + 128) * step): on SciFact the recall of float16
        # vectors at half the bytes, above the int8 query's (docs/results/inference-from-code.md)
        lo, hi = a["static_int8_calibration"]
        if self._codes is None:
            self._codes = np.asarray(a["static_int8"], dtype=np.float32) + 128.0
        sc = (q * ((hi - lo) / 255.0)) @ self._codes.T + (q @ lo)[:, None]
        rows = top_k(sc, fetch)
        return rows, np.take_along_axis(sc, rows, 1)

    def dense(self, q_static: np.ndarray, q_full: np.ndarray, first_stage: str, rescore: str, fetch: int,
              full: Predictor | None) -> tuple[np.ndarray, np.ndarray]:
        """Rows (Q, <=fetch) and scores, best first: static candidates, rescored by the full encoder's codes."""
        self.check(first_stage, rescore)
        if q_static is None:
            raise EncoderkitError("this index has a static first stage: embed the queries with Searcher.embed, which "
                                  "also gives their static vectors")
        rows, first = self.candidates(q_static, first_stage, fetch)
        if rescore == "none":
            return rows, first
        missing = list(dict.fromkeys(int(r) for r in rows.ravel() if r >= 0 and self.keys[r] not in self.codes.row))
        if missing:
            if full is None:
                raise EncoderkitError("rescoring candidates the full encoder has not embedded yet needs its model; "
                                      "open the index with Searcher.open")
            raw = full.embed_raw([self.gen.passages[r]["text"] for r in missing])
            self.codes.add([self.keys[r] for r in missing], finish_embeddings(raw, self.gen.dims, True))
        out_rows, out_scores = np.empty_like(rows), np.empty(rows.shape, dtype=np.float32)
        for i in range(len(rows)):
            r = rows[i]
            sc = np.full(len(r), -np.inf, dtype=np.float32)
            valid = r >= 0
            sc[valid] = self.codes.vectors([self.keys[x] for x in r[valid]]) @ q_full[i]
            order = np.argsort(-sc, kind="stable")
            out_rows[i], out_scores[i] = r[order], sc[order]
        return out_rows, out_scores
