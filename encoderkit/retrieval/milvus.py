"""Scale-out: the index's passage ids and float vectors in Milvus, through pymilvus.

``encoderkit index --store milvus --uri URI`` writes the local index as usual (texts, codes,
float16 vectors, BM25 source) and, before the new generation goes live, upserts the new and
changed passages into the collection and deletes the removed ones (same ids: ``DOC#j``); if
Milvus fails, the error says so and the local index stays as it was. ``encoderkit search
--store milvus`` runs the dense stage in Milvus (float vectors, inner product = cosine on unit
vectors, a FLAT index: exact) and the same BM25 fusion and rerank stages on top, locally.

The same code talks to a Milvus server (``http://host:19530``) and to milvus-lite, the embedded
in-process Milvus used by the tests (``URI`` = a ``file.db`` path). milvus-lite has no binary
vectors (BINARY_VECTOR needs a server), so only float vectors go to Milvus; the binary first stage
stays in the embedded index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.store import Generation

BATCH = 1000
TIMEOUT_S = 10
_clients: dict[str, Any] = {}


def client(uri: str):
    """A connected MilvusClient for ``uri`` (one per URI and process); a clear error if it does not answer."""
    if uri in _clients:
        return _clients[uri]
    try:
        from pymilvus import MilvusClient
    except ImportError as e:
        raise EncoderkitError("--store milvus needs pymilvus (and milvus-lite for a file.db): pip install "
                              "'encoderkit[search]'") from e
    try:
        c = MilvusClient(uri, timeout=TIMEOUT_S)
    except Exception as e:  # pymilvus raises MilvusException, grpc errors or OSError depending on the failure
        raise EncoderkitError(f"Milvus at {uri} did not answer ({type(e).__name__}: {str(e)[:200]}); check --uri and "
                              "that the server is running") from e
    _clients[uri] = c
    return c


def _create(c, name: str, dims: int) -> None:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False)
    schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=1024)
    schema.add_field("doc_id", DataType.VARCHAR, max_length=1024)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dims)
    params = c.prepare_index_params()
    params.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
    c.create_collection(name, schema=schema, index_params=params)


def _count(c, name: str) -> int:
    return int(c.query(name, filter="", output_fields=["count(*)"])[0]["count(*)"])


def _upsert(c, name: str, gen: Generation, rows: list[int]) -> None:
    vecs = gen.arrays["float16"]
    for start in range(0, len(rows), BATCH):
        part = rows[start : start + BATCH]
        data = np.asarray(vecs[part], dtype=np.float32)
        c.upsert(name, [{"id": gen.passages[r]["id"], "doc_id": gen.passages[r]["doc_id"], "vector": data[j].tolist()}
                        for j, r in enumerate(part)])


def sync(uri: str, name: str, gen: Generation, changed: list[str], removed: list[str], root: Path) -> None:
    """Bring collection ``name`` in line with ``gen`` (see the module docstring)."""
    try:
        c = client(uri)
        row_of = {p["id"]: i for i, p in enumerate(gen.passages)}
        fresh = not c.has_collection(name)
        if fresh:
            _create(c, name, gen.dims)
        if removed and not fresh:
            for start in range(0, len(removed), BATCH):
                c.delete(name, ids=removed[start : start + BATCH])
        _upsert(c, name, gen, sorted(range(len(gen.passages))) if fresh else [row_of[i] for i in changed])
        c.flush(name)
        if _count(c, name) != len(gen.passages):  # the collection was not this index's: rewrite it whole
            c.drop_collection(name)
            _create(c, name, gen.dims)
            _upsert(c, name, gen, list(range(len(gen.passages))))
            c.flush(name)
    except EncoderkitError as e:
        raise EncoderkitError(f"{e}; the local index {root} is unchanged") from e
    except Exception as e:
        raise EncoderkitError(f"Milvus at {uri} failed while writing collection {name!r} ({type(e).__name__}: "
                              f"{str(e)[:200]}); the local index {root} is unchanged") from e


def check_collection(uri: str, name: str, gen: Generation) -> None:
    c = client(uri)
    if not c.has_collection(name):
        raise EncoderkitError(f"Milvus at {uri} has no collection {name!r}; run `encoderkit index --store milvus "
                              f"--uri {uri}`")
    n = _count(c, name)
    if n != len(gen.passages):
        raise EncoderkitError(f"Milvus collection {name!r} holds {n} vectors, the local index {len(gen.passages)}; "
                              "re-run `encoderkit index --store milvus` to bring it in line")


def search(uri: str, name: str, q: np.ndarray, fetch: int) -> tuple[list[list[str]], list[list[float]]]:
    """Passage ids and inner products (Q lists, best first) of the ``fetch`` nearest vectors."""
    try:
        res = client(uri).search(name, data=np.asarray(q, dtype=np.float32).tolist(), limit=fetch,
                                 search_params={"metric_type": "IP"}, output_fields=["id"])
    except Exception as e:
        raise EncoderkitError(f"Milvus search at {uri} failed ({type(e).__name__}: {str(e)[:200]})") from e
    return [[h["id"] for h in row] for row in res], [[float(h["distance"]) for h in row] for row in res]
