"""`encoderkit distill --to static`: a static embedding model (one vector per token) from an embed teacher.

The model2vec recipe on the user's corpus: the corpus's tokens (the tokenizer kept whole; unseen and special tokens
get a zero row), the teacher's embedding of each token alone, PCA to ``dims``, frequency weights (``sif``/``zipf``),
and optionally a fit of the table to the teacher's embeddings of corpus pieces (tokenlearn's idea). A text is the
normalised mean of its tokens' weighted vectors, which sentence-transformers and model2vec compute alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoderkit.config import check
from encoderkit.data.readers import ReadStats
from encoderkit.errors import EncoderkitError
from encoderkit.inference.predictor import Predictor
from encoderkit.io import output_dir
from encoderkit.models.card import write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import STATIC, default_pooling
from encoderkit.models.static import write_static_folder
from encoderkit.progress import note, progress
from encoderkit.tasks import TASKS, get_task
from encoderkit.tasks.common import resolve_model
from encoderkit.tasks.embed.embedder import Embedder
from encoderkit.tasks.embed.texts import source_documents, training_texts

SIF_A = 1e-3
DEFAULT_DIMS = 256  # --dims 0: this, or the teacher's width if it is narrower
FIT_LR = 1e-2  # Adam on the token table when --lr is 0
WEIGHTINGS = ("sif", "zipf", "none")
DOCS_PER_CALL = 512  # documents tokenised per tokenizer call while counting


@dataclass
class StaticResult:
    out: Path
    vocab: int  # tokens of the tokenizer
    kept: int  # tokens seen in the corpus (rows of the table)
    dims: int
    documents: int
    corpus_tokens: int
    seconds: float
    skipped_links: int = 0  # links that leave a --train folder, left out (no --follow-links)

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "kept_tokens": self.kept, "tokenizer_vocab": self.vocab, "dims": self.dims,
                "documents": self.documents, "corpus_tokens": self.corpus_tokens, "seconds": round(self.seconds, 1),
                "skipped_links": self.skipped_links}


def count_tokens(tokenizer: Any, sources: str, follow_links: bool = False,
                 stats: ReadStats | None = None) -> tuple[np.ndarray, int]:
    """(counts (V,) int64 of each token id over the documents of ``sources`` (comma-separated corpora, as
    ``--train`` reads them: links that leave a folder left out unless ``follow_links``, counted in
    ``stats.skipped_links``), number of documents). Special tokens are not added, so not counted."""
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    n_docs = 0
    for spec in [s.strip() for s in sources.split(",") if s.strip()]:
        batch: list[str] = []
        own = ReadStats()
        for text in source_documents(spec, follow_links, own):
            batch.append(text)
            if len(batch) == DOCS_PER_CALL:
                counts += _bincount(tokenizer, batch, len(counts))
                n_docs, batch = n_docs + len(batch), []
        if batch:
            counts += _bincount(tokenizer, batch, len(counts))
            n_docs += len(batch)
        if stats is not None:
            stats.skipped_links += own.skipped_links
    return counts, n_docs


def _bincount(tokenizer: Any, texts: list[str], size: int) -> np.ndarray:
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    flat = np.fromiter((i for row in ids for i in row), dtype=np.int64)
    return np.bincount(flat, minlength=size)[:size]


def kept_tokens(tokenizer: Any, counts: np.ndarray) -> np.ndarray:
    """Ids (K,) of the tokens the table holds: those seen in the corpus, less the special ones ([UNK], [CLS]...)."""
    special = set(tokenizer.all_special_ids)
    return np.asarray([i for i in np.flatnonzero(counts) if int(i) not in special], dtype=np.int64)


def token_vectors(teacher: Any, ids: np.ndarray, batch: int = 256) -> np.ndarray:
    """The teacher's pooled, un-normalised embedding (K, H) of each token alone: ``[CLS] token [SEP]``
    (whatever the tokenizer puts around one token). ``teacher``: a loaded embed Predictor."""
    prefix, suffix = special_affixes(teacher.tokenizer)
    rows = [{"input_ids": np.asarray(prefix + [int(i)] + suffix, dtype=np.int64)} for i in ids]
    if "token_type_ids" in teacher.tokenizer("a"):
        for row in rows:
            row["token_type_ids"] = np.zeros(len(row["input_ids"]), dtype=np.int64)
    return Embedder.of_runner(teacher).pooled_rows(rows, progress=True, max_batch=batch)


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (BERT: [CLS] / [SEP])."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    at = next((j for j in range(len(full) - len(plain) + 1) if full[j : j + len(plain)] == plain), 0)
    return full[:at], full[at + len(plain):]


def pca(vectors: np.ndarray, dims: int) -> np.ndarray:
    """(K, H) -> (K, min(dims, H, K)) float32: centred, projected on the leading right singular vectors."""
    centred = vectors - vectors.mean(0, keepdims=True)
    _, _, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)  # vt: (min(K, H), H)
    return (centred @ vt[: min(dims, len(vt))].T).astype(np.float32)


def truncate(vectors: np.ndarray, dims: int) -> np.ndarray:
    """(K, H) -> (K, min(dims, H, K)) float32: projected on the leading right singular vectors, not centred (a
    fitted table: the mean of its rows is part of what was fitted)."""
    _, _, vt = np.linalg.svd(vectors.astype(np.float64), full_matrices=False)
    return (vectors @ vt[: min(dims, len(vt))].T).astype(np.float32)


def frequency_weights(counts: np.ndarray, method: str) -> np.ndarray:
    """Weight (K,) of each kept token from its corpus count (K,): ``sif`` ``a / (a + p(token))`` with a =
    :data:`SIF_A`, ``zipf`` ``log(1 + rank)`` by corpus frequency (model2vec's), or ``none`` (1)."""
    if method == "sif":
        p = counts / max(counts.sum(), 1)
        return (SIF_A / (SIF_A + p)).astype(np.float32)
    if method == "zipf":
        rank = np.empty(len(counts), dtype=np.float64)
        rank[np.argsort(-counts, kind="stable")] = np.arange(1, len(counts) + 1)
        return np.log1p(rank).astype(np.float32)
    if method == "none":
        return np.ones(len(counts), dtype=np.float32)
    raise EncoderkitError(f"weighting {method!r} is not one of {', '.join(WEIGHTINGS)}")


def fit_table(table: np.ndarray, ids: list[np.ndarray], targets: np.ndarray, epochs: int, lr: float,
              batch_size: int, seed: int) -> np.ndarray:
    """Train ``table`` (K + 1, H) (row K: unseen tokens, kept zero) so that the mean of each text's rows ``ids[i]``
    (int64 row numbers) has the direction of ``targets[i]`` (N, H); returns the fitted table (K + 1, H)."""
    keep = [i for i, r in enumerate(ids) if len(r)]
    bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(table.copy()), freeze=False, mode="mean")
    opt = torch.optim.Adam(bag.parameters(), lr=lr)
    target = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.float32))
    rng = np.random.default_rng(seed)
    bar = progress(total=epochs * len(keep), desc="fit", unit="texts")
    for _ in range(epochs):
        order = rng.permutation(keep)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            flat = torch.from_numpy(np.concatenate([ids[i] for i in idx]))
            offsets = torch.from_numpy(np.cumsum([0] + [len(ids[i]) for i in idx[:-1]]))
            loss = (1 - torch.nn.functional.cosine_similarity(bag(flat, offsets), target[idx])).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                bag.weight[-1] = 0.0  # the unseen tokens' row stays zero
            bar.update(len(idx))
    bar.close()
    return bag.weight.detach().numpy().copy()


def open_teacher(name: str) -> Any:
    """The teacher (a folder, or ``minilm``) as a torch fp32 embed Predictor; refuses a folder that is not a
    transformer embed model."""
    folder = resolve_model(name)
    try:
        info = ModelFolder.open(folder, tokenizer=False)
    except EncoderkitError as e:
        raise EncoderkitError(f"distill --to static: --teacher {folder}: {e}; the teacher is a sentence-embedding "
                              "model folder (e.g. minilm, or one made by finetune --task embed)") from e
    task = get_task(info.task) if info.task in TASKS else None
    if task is None or task.distill_kind != "embedding" or info.static_weights is not None:  # a sentence embedder
        what = "a static embedding model" if info.static_weights is not None else f"a {info.task!r} model"
        raise EncoderkitError(f"distill --to static: the teacher {folder} is {what}; it needs a sentence-embedding "
                              "model folder (task embed, e.g. MiniLM or one made by finetune --task embed)")
    return Predictor.load(folder, backend="torch-fp32", max_batch=256)


def readable(source: str, read: Any) -> Any:
    """``read()``, with a file of ``source`` that cannot be read (permissions, a device error) named."""
    try:
        return read()
    except OSError as e:
        raise EncoderkitError(f"--train {source}: cannot read {e.filename or source} ({e.strerror or e}); fix its "
                              "permissions or leave it out of --train") from e
    except EncoderkitError as e:  # the reader's own message names the file
        if not isinstance(e.__cause__, OSError):
            raise
        raise EncoderkitError(f"--train {source}: {e}; fix its permissions or leave it out of --train") from e


def fit_pieces(cfg: Any) -> list[str]:
    """The corpus pieces the fit trains on; refused, saying what to do, when the corpus has none."""
    try:
        return readable(cfg.train, lambda: training_texts(cfg.train, cfg.fit_texts, seed=cfg.seed,
                                                          follow_links=cfg.follow_links))
    except EncoderkitError as e:
        if "no text of at least" not in str(e):
            raise
        raise EncoderkitError(f"{e}: the fit (--fit-texts {cfg.fit_texts}) needs corpus sentences to learn from; pass "
                              "--fit-texts 0 for a model from the token vectors alone, or a larger corpus") from e


def run_static(cfg: Any) -> StaticResult:
    """Distil ``cfg.teacher`` (an embed folder) into a static folder at ``cfg.out`` from the corpus ``cfg.train``;
    ``cfg``: a DistillConfig with ``to == "static"`` (``dims``, ``weighting``, ``overwrite``)."""
    start = time.perf_counter()
    check(cfg.dims >= 0, f"--dims must be at least 1 (0: {DEFAULT_DIMS} or the teacher's width), got {cfg.dims}")
    teacher = open_teacher(cfg.teacher)
    width = int(teacher.embed_raw(["a"]).shape[1])
    if cfg.dims > width:
        raise EncoderkitError(f"--dims {cfg.dims} is more than the teacher {teacher.folder}'s {width} dimensions; pass "
                              f"--dims {width} or fewer (the token vectors are the teacher's, cut by PCA)")
    dims = cfg.dims or min(DEFAULT_DIMS, width)
    tokenizer = teacher.tokenizer
    read = ReadStats()
    counts, n_docs = readable(cfg.train, lambda: count_tokens(tokenizer, cfg.train, cfg.follow_links, read))
    ids = kept_tokens(tokenizer, counts)
    if n_docs == 0 or len(ids) == 0:
        raise EncoderkitError(f"--train {cfg.train}: {n_docs} passages with {int(counts.sum())} tokens; a static "
                              "model needs a corpus of text to take its vocabulary from: pass the folder or file of "
                              "your passages")
    note(f"distill --to static: {n_docs} passages, {int(counts.sum())} tokens, {len(ids)} of {len(counts)} "
         f"vocabulary tokens seen; embedding each with {cfg.teacher}")
    mapping = np.full(len(counts), len(ids), dtype=np.int64)  # token id -> row; the last row: unseen tokens
    mapping[ids] = np.arange(len(ids))
    weights = np.zeros(len(counts), dtype=np.float32)
    weights[ids] = frequency_weights(counts[ids], cfg.weighting)
    texts = fit_pieces(cfg) if cfg.fit_texts else []  # read (and refused) before the teacher's passes
    vectors = token_vectors(teacher, ids)  # (K, H)
    if cfg.fit_texts:
        note(f"distill --to static: fitting the token vectors to {cfg.teacher}'s embeddings of {len(texts)} "
             "corpus pieces")
        targets = Embedder.of_runner(teacher).embed(texts, progress=True)  # (N, H) unit vectors
        rows = [mapping[np.asarray(r, dtype=np.int64)]
                for r in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
        weighted = np.concatenate([vectors * weights[ids][:, None], np.zeros((1, vectors.shape[1]), np.float32)])
        fitted = fit_table(weighted, rows, targets, max(1, round(cfg.epochs)), cfg.lr or FIT_LR, cfg.batch_size,
                           cfg.seed)[:-1]
        vectors = truncate(fitted, dims) / np.maximum(weights[ids], 1e-12)[:, None]  # stored unweighted
    else:
        vectors = pca(vectors, dims)  # (K, D)
    table = np.concatenate([vectors, np.zeros((1, vectors.shape[1]), dtype=np.float32)])
    # the teacher's folder name, not its path: the folder is copied between machines (its tokenizer is inside it)
    extra = {"tokenizer_name": teacher.folder.resolve().name, "apply_pca": int(vectors.shape[1]),
             "apply_zipf": cfg.weighting == "zipf", "sif_coefficient": SIF_A if cfg.weighting == "sif" else None}
    with output_dir(cfg.out, cfg.overwrite) as tmp:
        write_static_folder(tmp, tokenizer, table, mapping, weights, extra)
        seconds = time.perf_counter() - start
        write_card(tmp, "distill", teacher.folder, cfg.result_dict(),
                   {"kept_tokens": len(ids), "documents": n_docs, "corpus_tokens": int(counts.sum()),
                    "seconds": round(seconds, 1), "skipped_links": read.skipped_links},
                   task="embed", kind="static", pooling=default_pooling(STATIC), normalize=True)
    return StaticResult(Path(cfg.out), len(counts), len(ids), int(vectors.shape[1]), n_docs, int(counts.sum()), seconds,
                        read.skipped_links)
