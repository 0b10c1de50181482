"""Corpus jobs on a Ray cluster: one model per actor, results in input order.

    p = Predictor.load(folder)                  # the driver's engine choice, made once (encoderkit.inference.policy)
    results = map_rows(texts, partial(Predictor.load, folder, backend=p.choice), Predictor.embed_raw, address="auto")
    for results in map_chunks(chunks, make, call, address="auto"): ...   # chunks: (rows, groups) pairs

:func:`map_chunks`, what ``--ray ADDRESS`` runs, streams chunks of rows to a pool of actors that each build their
model once. A chunk goes out in blocks of whole groups (the model calls of the single-process run), so every row is
batched as in one process: the same values, under dynamic INT8 too. At most :data:`IN_FLIGHT` chunks are out; a dead
actor is restarted and its block run again (:data:`RETRIES` times). Addresses: ``auto``, ``local``, ``HOST:PORT`` or
``ray://HOST:10001``; one that does not answer fails before any model runs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from encoderkit.config import arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.progress import progress

INSTALL = 'pip install "encoderkit[ray]"'
CONNECT_TIMEOUT = 5.0  # seconds to wait for a HOST:PORT to accept a connection


def ray_address_arg() -> Any:
    return arg(None, help="Run the model on a Ray cluster: auto (the cluster `ray start` joined here), local (start "
                          "Ray here), HOST:6379 or ray://HOST:10001; the same rows in the same order as without it "
                          "(values under dynamic INT8: docs/deploy.md).",
               speed=True)


def ray_actors_arg() -> Any:
    return arg(2, help="--ray: actors, each holding one copy of the model.", speed=True)


def ray_batch_arg() -> Any:
    return arg(256, help="--ray: rows per block sent to an actor, in whole model calls (a block is one or more of the "
                          "batches the single-process run makes, never part of one).", speed=True)


def check_ray_args(actors: int, batch: int) -> None:
    """The checks a stage's ``validate`` runs on its ``--ray-actors`` and ``--ray-batch``."""
    check(actors >= 1, "--ray-actors must be at least 1")
    check(batch >= 1, "--ray-batch must be at least 1")


def require_ray() -> Any:
    """The ``ray`` module, or an error that names the install command."""
    try:
        import ray
    except ImportError as e:
        raise EncoderkitError(f"--ray needs Ray, which is not installed ({e}); install it with: {INSTALL}") from e
    return ray


def preflight(address: str) -> None:
    """What a stage checks before it loads a model: Ray is installed, and a HOST:PORT (or ray://HOST:PORT) address
    answers within :data:`CONNECT_TIMEOUT` seconds."""
    ray = require_ray()
    if address == "local":
        return
    if address == "auto":
        if not ray.is_initialized():
            _find_auto(ray)
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise EncoderkitError(f"--ray {address}: expected auto, local, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        raise EncoderkitError(f"--ray {address}: nothing answers at {host}:{port} ({e}); start the cluster there "
                              "(`ray start --head`) or fix the address. Nothing was written") from e


def _find_auto(ray: Any) -> None:
    """``auto`` finds no cluster: say so now rather than after the model is loaded (Ray's own lookup, which
    reads RAY_ADDRESS and what `ray start` left in /tmp/ray; skipped where that private API has moved)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:
        return
    try:
        canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError as e:
        raise EncoderkitError(f"--ray auto: no Ray cluster found on this machine ({e}); start one with "
                              "`ray start --head`, give its HOST:6379, or pass --ray local. Nothing was written") from e


@contextlib.contextmanager
def connected(address: str) -> Iterator[Any]:
    """``ray`` connected to ``address`` for the block (a connection made here is closed after it)."""
    preflight(address)
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=address, logging_level=logging.WARNING,
                 include_dashboard=False if address == "local" else None)
    except ConnectionError as e:
        raise EncoderkitError(f"--ray {address}: could not connect ({e}); start a cluster with `ray start --head` "
                              "or pass --ray local. Nothing was written") from e
    try:
        yield ray
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class RayJob:
    """A stage's ``--ray`` settings: where, how many actors, rows per block, CPUs (and model threads) per actor."""

    address: str
    actors: int = 2
    batch: int = 256
    threads: int = 1

    @classmethod
    def of(cls, cfg: Any) -> RayJob | None:
        """From a stage config's ``ray``, ``ray_actors``, ``ray_batch`` (and ``threads`` if it has one); None
        without ``--ray``. Runs :func:`preflight`, so call it before the stage loads its model."""
        if not cfg.ray:
            return None
        preflight(cfg.ray)
        return cls(cfg.ray, cfg.ray_actors, cfg.ray_batch, getattr(cfg, "threads", None) or 1)

    def map_chunks(self, chunks: Iterable[tuple[Sequence[Any], Sequence[Sequence[int]] | None]],
                   make: Callable[[], Any], call: Callable[[Any, list[Any]], Sequence[Any]]) -> Iterator[list[Any]]:
        """:func:`map_chunks` with these settings."""
        return map_chunks(chunks, make, call, address=self.address, actors=self.actors, batch=self.batch,
                          cpus=self.threads)

    def map(self, rows: Sequence[Any], make: Callable[[], Any], call: Callable[[Any, list[Any]], Sequence[Any]],
            desc: str = "ray", bar: Any = None, groups: Sequence[Sequence[int]] | None = None) -> list[Any]:
        """:func:`map_rows` with these settings."""
        return map_rows(rows, make, call, address=self.address, actors=self.actors, batch=self.batch, groups=groups,
                        cpus=self.threads, desc=desc, bar=bar)


class _Worker:
    """One per actor: the model, built once, run on blocks of groups; one ``call`` per group."""

    def __init__(self, make: Callable[[], Any], call: Callable[[Any, list[Any]], Sequence[Any]]) -> None:
        self.call, self.model, self.error = call, None, None
        try:
            self.model = make()
        except EncoderkitError as e:  # raised by the first batch: an actor that fails to start reaches the driver
            self.error = e            # as text only, a batch's exception as itself

    def run(self, blob: bytes) -> bytes:
        """A block: pickled lists of rows (one per group) in, pickled lists of results out."""
        if self.error is not None:
            raise self.error
        outs = []
        for rows in pickle.loads(blob):
            out = list(self.call(self.model, rows))
            if len(out) != len(rows):
                raise RuntimeError(f"{self.call!r} gave {len(out)} results for {len(rows)} rows")
            outs.append(out)
        return pickle.dumps(outs)


def pack(groups: Sequence[Sequence[int]], batch: int) -> list[list[Sequence[int]]]:
    """Consecutive ``groups`` packed into blocks of at most ``batch`` rows (a group is never split: a larger one
    is a block of its own)."""
    blocks: list[list[Sequence[int]]] = []
    size = 0
    for g in groups:
        if not blocks or size + len(g) > batch:
            blocks.append([])
            size = 0
        blocks[-1].append(g)
        size += len(g)
    return blocks


IN_FLIGHT = 3  # map_chunks: chunks the driver has sent ahead of the one whose results it is waiting for, at most
RETRIES = 4  # map_chunks: restarts of an actor whose process died, and reruns of the batch it held


def map_chunks(chunks: Iterable[tuple[Sequence[Any], Sequence[Sequence[int]] | None]], make: Callable[[], Any],
               call: Callable[[Any, list[Any]], Sequence[Any]], *, address: str, actors: int = 2, batch: int = 256,
               cpus: float = 1, in_flight: int = IN_FLIGHT,
               on_block: Callable[[int], Any] | None = None) -> Iterator[list[Any]]:
    """:func:`map_rows` over a stream: for each ``(rows, groups)`` of ``chunks``, in order, the list of
    ``call(model, ...)`` results of its rows in their order (``groups`` as in :func:`map_rows`, indices into that
    chunk's rows; None: runs of ``batch`` rows). ``actors`` Ray actors build their model once for the whole stream;
    each chunk goes out as blocks of whole groups (about ``batch`` rows), and the driver reads a chunk ahead only
    while fewer than ``in_flight`` chunks are out, so it holds at most ``in_flight`` chunks of rows (plus the one
    whose results the caller is writing), whatever the length of the stream. An actor whose process dies is
    restarted and its block run again (:data:`RETRIES` times). Progress is the caller's (one list per chunk;
    ``on_block(rows)`` as each block's results arrive)."""
    with connected(address) as ray:
        from ray.util import ActorPool

        worker = ray.remote(num_cpus=cpus, max_restarts=RETRIES, max_task_retries=RETRIES)(_Worker)
        pool = ActorPool([worker.remote(make, call) for _ in range(actors)])
        pending: collections.deque[tuple[int, list[list[list[int]]]]] = collections.deque()

        def collect() -> list[Any]:
            n, blocks = pending.popleft()
            out: list[Any] = [None] * n
            for block in blocks:
                try:
                    results = pickle.loads(pool.get_next())
                except Exception as e:
                    user = _user_error(e) or _actor_lost(e)
                    if user is None:
                        raise
                    raise user from e
                for g, ys in zip(block, results, strict=True):
                    for i, y in zip(g, ys, strict=True):
                        out[i] = y
                if on_block is not None:
                    on_block(sum(len(g) for g in block))
            return out

        for rows, groups in chunks:
            if groups is None:
                groups = [range(a, min(a + batch, len(rows))) for a in range(0, len(rows), batch)]
            groups = [[int(i) for i in g] for g in groups if len(g)]
            if sorted(i for g in groups for i in g) != list(range(len(rows))):
                raise ValueError(f"map_chunks: groups must hold each of the {len(rows)} rows once (of a chunk)")
            blocks = pack(groups, batch)
            for block in blocks:  # submitted in order, handed back in order (ActorPool.get_next)
                pool.submit(lambda a, blob: a.run.remote(blob), pickle.dumps([[rows[i] for i in g] for g in block]))
            pending.append((len(rows), blocks))
            while len(pending) >= in_flight:
                yield collect()
        while pending:
            yield collect()


def map_rows(rows: Sequence[Any], make: Callable[[], Any], call: Callable[[Any, list[Any]], Sequence[Any]], *,
             address: str, actors: int = 2, batch: int = 256, groups: Sequence[Sequence[int]] | None = None,
             cpus: float = 1, desc: str = "ray", bar: Any = None) -> list[Any]:
    """``call(model, [rows[i] for i in group])`` for every group on ``actors`` Ray actors, each with its own
    ``model = make()``; one result per row, in input order (see the module docstring): :func:`map_chunks` on one
    chunk. ``groups``: row indices, each row in one group, each group one call (the engine batches the
    single-process run makes); default: consecutive runs of ``batch`` rows. ``make`` and ``call`` must be
    importable functions (or partials of them): they travel to the workers by reference. ``bar``: the stage's own
    progress bar to advance, by blocks (one of ``desc`` is made, and closed, otherwise)."""
    if not rows:
        return []
    own = bar is None
    bar = progress(total=len(rows), desc=desc, unit="row") if own else bar
    try:
        return next(iter(map_chunks([(rows, groups)], make, call, address=address, actors=actors, batch=batch,
                                    cpus=cpus, on_block=bar.update)))
    finally:
        if own:
            bar.close()


def _actor_lost(e: BaseException) -> EncoderkitError | None:
    """A message for an actor that died past its restarts (Ray's ActorDiedError / ActorUnavailableError, or a
    worker process that crashed), or None for anything else."""
    name = type(e).__name__
    if name not in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError",
                    "LocalRayletDiedError", "NodeDiedError", "OutOfMemoryError"):
        return None
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return EncoderkitError(f"a Ray worker died {RETRIES} times in a row and was given up ({name}: {first}); nothing "
                           "was written. Check the Ray cluster's memory and logs (ray status; a killed worker is "
                           "usually out of memory: lower --ray-batch or --ray-actors) and rerun")


def _user_error(e: BaseException) -> EncoderkitError | None:
    """The :class:`EncoderkitError` a worker raised (a wrong model folder, say), out of Ray's wrappers."""
    seen: set[int] = set()
    todo: list[Any] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        # RayTaskError(EncoderkitError) is one too, with Ray's text: take the original
        inner = getattr(x, "cause", None)
        if isinstance(inner, EncoderkitError):
            return inner
        if isinstance(x, EncoderkitError):
            return x
        todo += [x.__cause__, x.__context__, getattr(x, "cause", None)]
    return None
