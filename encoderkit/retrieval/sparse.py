"""Learned sparse (SPLADE) indexes: ``encoderkit index --model SPARSE_FOLDER`` and their search stage.

    encoderkit finetune --task sparse --model minilm --train scifact.zip#train --out splade
    encoderkit index --model splade --corpus scifact.zip#test --out sidx         # an inverted index
    encoderkit search --index sidx --query "what causes fever?"                  # dot products
    encoderkit search --index didx --fuse-with sidx --query "..."                # dense + sparse, reciprocal rank

A sparse index is a generation of :mod:`.store` (``passages.jsonl``, the manifest with every file's size and
sha256, the atomic ``CURRENT`` swap) whose vectors are one scipy CSR matrix, passages x vocabulary
(``sparse.npz``: float32 weights, int32 token ids; an inverted index read by rows), with ``"kind":
"sparse"`` in the manifest. Passages are cut as for a dense index (``--passage-tokens``, ``--overlap``);
an update keeps the rows of unchanged documents and encodes only new or changed ones; another model or
passage policy is refused unless ``--rebuild``. Search: the query's SPLADE vector, the dot product with
every row (a sparse-dense product), the best rows; BM25 fusion, other indexes (``--fuse-with``) and
reranking then work as on a dense index. ``--first-stage`` / ``--rescore`` do not apply (one exact stage).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.inference.policy import RECORD_KEY, recorded, resolve
from encoderkit.inference.predictor import Predictor
from encoderkit.io import portable_path
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.progress import note, progress
from encoderkit.retrieval.codes import top_k
from encoderkit.retrieval.corpus import passage_spans, read_corpus
from encoderkit.retrieval.store import Generation, current_folder, open_generation, write_generation
from encoderkit.tasks import TASKS, get_task

KIND = "sparse"
MATRIX = "sparse.npz"
ENDPOINT = "embed_sparse"  # the route of a task whose vectors this index holds
CHUNK = 256  # passages encoded per Predictor call


def is_sparse_model(model: str | Path) -> bool:
    """Whether ``model`` is a folder whose task makes sparse vectors (served on ``/v1/embed_sparse``)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return False
    folder = ModelFolder.open(path, weights=False, tokenizer=False)
    return folder.task in TASKS and get_task(folder.task).endpoint == ENDPOINT


def is_sparse_index(gen: Generation) -> bool:
    return gen.manifest.get("kind") == KIND


def _load_matrix(gen: Generation) -> Any:
    from scipy import sparse

    assert gen.folder is not None
    try:
        return sparse.load_npz(gen.folder / MATRIX).tocsr()
    except Exception as e:  # a file the manifest check let through that scipy cannot read
        raise EncoderkitError(f"{gen.folder / MATRIX} cannot be read as a sparse matrix ({e}); rebuild the "
                              "index") from e


def encode(p: Predictor, texts: list[str], desc: str = "encode") -> Any:
    """SPLADE vectors (N, V) CSR of ``texts`` by the Predictor's task, ``CHUNK`` at a time, with a progress bar."""
    from scipy import sparse

    task = get_task(p.task)
    starts = progress(range(0, len(texts), CHUNK), total=-(-len(texts) // CHUNK), desc=desc, unit="chunk")
    parts = [task.vectors(p, texts[a : a + CHUNK]) for a in starts]
    vocab = int(p.info.config.get("vocab_size") or len(p.tokenizer))
    return sparse.vstack(parts).tocsr() if parts else sparse.csr_matrix((0, vocab), dtype=np.float32)


def build(cfg: Any) -> dict[str, Any]:
    """Build or update the sparse index ``cfg.out`` (an :class:`~encoderkit.retrieval.index.IndexConfig`) from
    ``cfg.corpus`` with the sparse model ``cfg.model``; the index's stats."""
    t0 = time.perf_counter()
    for flag, on in (("--first-stage-model", cfg.first_stage_model), ("--store milvus", cfg.store == "milvus"),
                     ("--float16", cfg.float16), ("--dims", cfg.dims), ("--calibrate", cfg.calibrate),
                     ("--ray", cfg.ray)):
        if on:
            raise EncoderkitError(f"{flag} is a dense-index setting; a sparse model ({cfg.model}) writes an inverted "
                                  "index of its vocabulary weights: drop the flag")
    read = read_corpus(cfg.corpus, cfg.id_field, cfg.text_field, cfg.title_field, cfg.follow_links)
    for s in read.skipped[:5]:
        note(f"skipped {s}")
    root = Path(cfg.out)
    old = None
    if current_folder(root) is not None:
        old = open_generation(root)
    elif root.exists() and any(x for x in root.iterdir() if not x.name.startswith(".")):
        raise EncoderkitError(f"--out {root} is a non-empty folder that is not an index; choose another --out")
    # an update encodes on the build's engine: the vectors it keeps came from it
    choice = resolve(cfg.model, cfg.backend, recorded(old.manifest) if old is not None and not cfg.rebuild else None,
                     update=f"index {root}")
    p = Predictor.load(cfg.model, backend=choice, threads=cfg.threads, max_batch=cfg.batch_size)
    vocab = int(p.info.config.get("vocab_size") or len(p.tokenizer))
    fingerprint = model_fingerprint(cfg.model)
    size = {0: p.max_length - 2, -1: 0}.get(cfg.passage_tokens, cfg.passage_tokens)
    manifest = {"kind": KIND, "model": {"folder": portable_path(cfg.model, root), "fingerprint": fingerprint,
                                        "max_length": p.max_length}, RECORD_KEY: p.choice.to_dict(),
                "passages": {"tokens": size, "overlap": cfg.overlap}, "normalized": False,
                "dims": vocab, "model_dims": vocab, "float16": False, "precisions": [KIND]}
    if old is not None and not cfg.rebuild:
        om = old.manifest
        if not is_sparse_index(old) or om["model"]["fingerprint"] != fingerprint:
            raise EncoderkitError(f"index {root} was built with the model at {om['model']['folder']} (fingerprint "
                                  f"{om['model']['fingerprint']}), not {cfg.model} ({fingerprint}); pass --rebuild "
                                  "to re-encode")
        if om.get("passages") != manifest["passages"]:
            raise EncoderkitError(f"index {root} has passages={om.get('passages')}, this run asks "
                                  f"{manifest['passages']}; pass --rebuild to re-encode")
    reuse: dict[str, tuple[str, list[int]]] = {}
    if old is not None and not cfg.rebuild and is_sparse_index(old):
        for i, r in enumerate(old.passages):
            reuse.setdefault(r["doc_id"], (r["hash"], []))[1].append(i)
    passages: list[dict[str, str]] = []
    source_rows: list[int] = []  # row of the old generation, or -1: a passage to encode
    new_texts: list[str] = []
    counts = {"documents": len(read.docs), "unchanged": 0, "added": 0, "changed": 0}
    for d in read.docs:
        prev = reuse.get(d.id)
        if prev is not None and prev[0] == d.hash:
            counts["unchanged"] += 1
            passages.extend(old.passages[r] for r in prev[1])
            source_rows.extend(prev[1])
            continue
        counts["changed" if prev is not None else "added"] += 1
        for j, (a, b) in enumerate(passage_spans(p.tokenizer, d.text, size, cfg.overlap)):
            passages.append({"id": f"{d.id}#{j}", "doc_id": d.id, "hash": d.hash, "text": d.text[a:b]})
            source_rows.append(-1)
            new_texts.append(d.text[a:b])
    live = {d.id for d in read.docs}
    counts["deleted"] = sum(1 for doc_id in reuse if doc_id not in live)
    fresh = encode(p, new_texts)
    matrix = _assemble(_load_matrix(old) if reuse else None, source_rows, fresh, vocab)
    gen = Generation({**manifest, "nnz": int(matrix.nnz)}, passages, {})
    folder = write_generation(root, gen, {MATRIX: lambda path: _save_npz(path, matrix)})
    row_nnz = np.diff(matrix.indptr)
    counts.update({"kind": KIND, "passages": len(passages), "embedded_passages": len(new_texts),
                   "skipped": len(read.skipped), "skipped_examples": read.skipped[:5], "vocabulary": vocab,
                   "mean_terms_per_passage": round(float(row_nnz.mean()), 1) if len(row_nnz) else 0.0,
                   "generation": folder.name, "bytes": {MATRIX: (folder / MATRIX).stat().st_size},
                   "seconds": round(time.perf_counter() - t0, 2)})
    return counts


def _save_npz(path: Path, matrix: Any) -> None:
    """The CSR matrix as ``.npz`` (float32 weights, int32 ids), uncompressed: it is read by memory, not scanned."""
    from scipy import sparse

    with open(path, "wb") as f:  # a file object: scipy would add '.npz' to a name without it
        sparse.save_npz(f, matrix, compressed=False)


def _assemble(old: Any, source_rows: list[int], fresh: Any, vocab: int) -> Any:
    """Rows of the new generation, in order: an old row where kept (``source_rows[i] >= 0``), else the next fresh
    one."""
    from scipy import sparse

    src = np.asarray(source_rows, dtype=np.int64)
    if not len(src):
        return sparse.csr_matrix((0, vocab), dtype=np.float32)
    pick = np.empty(len(src), dtype=np.int64)  # row of vstack([old, fresh])
    n_old = 0 if old is None else old.shape[0]
    pick[src >= 0] = src[src >= 0]
    pick[src < 0] = n_old + np.arange(int((src < 0).sum()))
    stacked = fresh if old is None else sparse.vstack([old, fresh]).tocsr()
    out = stacked[pick].tocsr()
    out.indices = out.indices.astype(np.int32)
    out.data = out.data.astype(np.float32)
    return out


class SparseStage:
    """A sparse index's one search stage: the query model's SPLADE vectors and exact dot products with the
    passage rows. ``Searcher`` uses it in place of its dense stage."""

    def __init__(self, matrix: Any, predictor: Predictor | None) -> None:
        self.matrix, self.predictor = matrix, predictor
        self._t = matrix.T.tocsr()  # (V, N): a query's few terms pick their rows (the inverted lists)

    @classmethod
    def open(cls, gen: Generation, predictor: Predictor | None) -> SparseStage | None:
        """The stage of a sparse generation (None for a dense one); ``predictor`` embeds queries."""
        if not is_sparse_index(gen):
            return None
        if predictor is not None and get_task(predictor.task).endpoint != ENDPOINT:
            raise EncoderkitError(f"{predictor.folder} is a {predictor.task!r} model; a sparse index's queries need "
                                  "its sparse model")
        m = _load_matrix(gen)
        if m.shape[0] != len(gen.passages):
            raise EncoderkitError(f"{gen.folder / MATRIX}: {m.shape[0]} rows for {len(gen.passages)} passages; "
                                  "rebuild the index")
        return cls(m, predictor)

    def embed(self, queries: list[str]) -> np.ndarray:
        """Query vectors (Q, V) float32 (dense rows: a batch of queries is small)."""
        if self.predictor is None:
            raise EncoderkitError("this searcher has no query model; pass QueryVectors to search_vectors")
        return encode(self.predictor, list(queries), desc="").toarray()

    def search(self, q: np.ndarray, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        """Passage rows (Q, <=fetch) and their dot products, best first; rows sharing no term score -inf (no hit)."""
        from scipy import sparse

        qs = sparse.csr_matrix(np.asarray(q, dtype=np.float32))
        scores = (qs @ self._t).toarray()  # (Q, N)
        rows = top_k(scores, fetch)
        picked = np.take_along_axis(scores, rows, 1).astype(np.float32)
        picked[picked <= 0] = -np.inf
        return rows, picked


def same_corpus(a: Generation, b: Generation, root_a: Path, root_b: Path) -> None:
    """Refuse to fuse two indexes whose documents differ (a fused hit is shown from the first index's passages)."""
    da, db = {r["doc_id"] for r in a.passages}, {r["doc_id"] for r in b.passages}
    if da != db:
        extra = sorted(db - da)[:1] or sorted(da - db)[:1]
        raise EncoderkitError(f"--fuse-with {root_b}: it holds {len(db)} documents, index {root_a} {len(da)} (e.g. "
                              f"{extra[0]!r} is in only one); fusion needs two indexes of the same corpus")
