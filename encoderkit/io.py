"""Atomic output: nothing half-written ever appears under a final name.

Every stage writes a new directory. :func:`output_dir` hands out a temporary sibling folder and
renames it into place only when the stage finished; on an exception the temporary folder is
removed and any previous output is left as it was. Single files are written to a temporary
name in the same folder and renamed (``os.replace`` is atomic on POSIX).

What a model folder holds, its ``encoderkit.json`` card included, is :mod:`encoderkit.models`'
business (:mod:`encoderkit.models.card`); this module only writes outputs safely.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError


def cache_dir(name: str) -> Path:
    """``$ENCODERKIT_CACHE/name`` (default ``~/.cache/encoderkit/name``): prepared corpora, ONNX
    exports, corpus embeddings, a rerank teacher's scores."""
    return Path(os.environ.get("ENCODERKIT_CACHE", Path.home() / ".cache" / "encoderkit")) / name


def cached_array(kind: str, key: str, rows: int, compute: Callable[[], Any], what: str) -> Any:
    """``compute()``, a numpy array of ``rows`` rows, kept in ``cache_dir(kind)/key.npy``: returned from there
    when present with that many rows, else computed and written atomically. Plain ``.npy``, read without
    pickle. A cache that cannot be written costs time later, not this run: a note names ``what`` was not kept."""
    import numpy as np

    path = cache_dir(kind) / f"{key}.npy"
    if path.is_file():
        with contextlib.suppress(OSError, ValueError):
            cached = np.load(path, allow_pickle=False)
            if cached.shape[0] == rows:
                return cached
    out = compute()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, out, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        from encoderkit.progress import note

        note(f"could not cache {what} in {path.parent} ({e.strerror or e}); continuing without the cache")
    return out


def check_output_dir(out: str | Path, overwrite: bool) -> Path:
    """Refuse an existing non-empty output folder unless ``overwrite``, and one that could not be written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EncoderkitError(f"output {out} exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise EncoderkitError(f"output folder {out} already exists and is not empty; pass --overwrite to replace it")
    check_writable(out)
    return out


def check_writable(folder: str | Path, flag: str = "--out") -> None:
    """Refuse ``folder`` (to be created, or replaced through a sibling as :func:`output_dir` does) when its
    parent cannot be written: checked by creating and removing a probe folder in the nearest existing
    ancestor, so that a long run fails before its first step rather than when it saves. (``os.access`` would
    say yes to root on a read-only folder.)"""
    folder = Path(folder).absolute()
    base = folder.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise EncoderkitError(f"{flag} {folder} cannot be created: {base} is a file, not a folder; choose another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".encoderkit-write-check-", dir=base))
    except OSError as e:
        raise EncoderkitError(f"{flag} {folder} cannot be written: creating a folder in {base} failed "
                              f"({e.strerror or e}); choose another {flag} or fix its permissions") from e


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def write_failure(e: BaseException, where: Path | None = None) -> str | None:
    """Why ``e`` is a failed write (disk full, quota, read-only or unwritable folder), or None when it is
    something else. Safetensors raises its own ``SafetensorError`` and ``torch.save`` a ``RuntimeError`` for a
    full disk, not an OSError. An OSError counts when it is a disk-full kind or names a file under ``where``."""
    if isinstance(e, OSError):
        inside = where is not None and e.filename is not None and str(e.filename).startswith(str(where))
        if e.errno in _FULL or inside:
            return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        return None
    text = str(e)
    if type(e).__name__ == "SafetensorError" and "serializ" in text:
        return text.removeprefix("Error while serializing: ")
    if isinstance(e, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text):
        return f"torch could not write the file ({text.splitlines()[0][:200]})"
    return None


@contextlib.contextmanager
def output_dir(out: str | Path, overwrite: bool = False, retry: str = "rerun") -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` only if the block finishes without error.

    A failed write (see :func:`write_failure`) in the block becomes an :class:`EncoderkitError` that names
    ``out`` and ends with ``retry`` (what to do once there is space, e.g. "rerun with --resume"); the
    temporary folder is removed either way."""
    out = check_output_dir(out, overwrite)
    tmp: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_sibling(out, "tmp", lambda p: os.mkdir(p, 0o777))
        yield tmp
        normalize_modes(tmp)
        replace_dir(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = write_failure(e, tmp if tmp is not None else out.parent)  # not a read error of an input nearby
        if reason is None:
            raise
        raise EncoderkitError(f"could not write {out} ({reason}); nothing was written there. "
                              f"Free disk space (or fix permissions) and {retry}") from e


def partial_dir(out: str | Path) -> Path:
    """``.<name>.partial`` beside ``out``: where :func:`resumable_dir` writes until the work finishes."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def resumed_folder(out: str | Path) -> Path | None:
    """The folder ``resumable_dir(out, resume=True)`` continues: the unfinished partial one, else a
    finished ``out``, else None (nothing to continue)."""
    partial = partial_dir(out)
    return partial if partial.exists() else Path(out) if Path(out).is_dir() else None


@contextlib.contextmanager
def resumable_dir(out: str | Path, overwrite: bool, resume: bool, retry: str = "rerun with --resume") -> Iterator[Path]:
    """Like :func:`output_dir`, but the folder being written is ``.<name>.partial`` beside ``out`` and
    outlives a failure: work that takes hours keeps what it finished. ``resume`` continues in an existing
    one (or, when there is none, the finished ``out`` itself, which becomes the partial folder again);
    without it a stale one is removed first. It becomes ``out`` only if the block finishes; a failure
    leaves it (unless empty) and the error says so, ending with ``retry``."""
    from encoderkit.progress import note

    out, partial = Path(out), partial_dir(out)
    out = check_output_dir(out, overwrite or resume and not partial.exists())
    out.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(out.parent / f".{out.name}.lock", out):
        if resume and resumed_folder(out) == out:  # a finished run, continued: its folder is the work again
            note(f"--resume: continuing the finished {out} (steps that are the same are kept)")
            out.rename(partial)
        if partial.exists() and not resume:
            note(f"removing {partial}, the unfinished work of an earlier run (--resume continues it)")
            shutil.rmtree(partial)
        try:
            partial.mkdir(exist_ok=True)
            yield partial
            normalize_modes(partial)
            replace_dir(partial, out)
        except BaseException as e:
            if partial.is_dir() and not any(partial.iterdir()):
                partial.rmdir()
            reason = write_failure(e, partial)
            if reason is not None:
                raise EncoderkitError(f"could not write {out} ({reason}). Free disk space (or fix permissions) and "
                                      f"{retry}") from e
            if partial.is_dir() and isinstance(e, Exception):
                note(f"{out} was not written; what was finished is kept in {partial}: {retry}")
            raise


@contextlib.contextmanager
def _writer_lock(lock: Path, out: Path) -> Iterator[None]:
    """One writer of ``out`` at a time: ``lock`` holds the writer's pid; a lock whose process is gone (a
    killed run) is taken over."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise EncoderkitError(f"another process (pid {pid}) is writing {out}; wait for it, or stop it and "
                                      f"rerun with --resume (if it was not running, remove {lock})") from None
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    else:
        raise EncoderkitError(f"could not take {lock} to write {out}; remove it if no other process is writing there")
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_sibling(path: Path, kind: str, create) -> Path:
    """Create ``.<name>.<kind>-<pid>-<random>`` beside ``path`` with ``create(p)`` (exclusively), and return it.
    Unlike ``tempfile.mkdtemp`` / ``mkstemp`` (0700 / 0600, meant for private scratch files), the caller asks
    for 0777 / 0666 and the umask applies, so a folder or file renamed into place gets the permissions of any
    normal new one (0755 / 0644 under umask 022)."""
    for _ in range(100):
        candidate = path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            create(candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def normalize_modes(folder: Path) -> None:
    """Give everything below ``folder`` the permissions of a normal new folder / file here (``folder``'s own mode,
    made with 0777 under the umask: 0755 / 0644 under umask 022). Libraries differ (safetensors writes 0600,
    torch.save 0644), and an output folder's files should not."""
    folder = Path(folder)
    dir_mode = stat.S_IMODE(folder.stat().st_mode)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            want = dir_mode if stat.S_ISDIR(st.st_mode) else dir_mode & (0o777 if st.st_mode & 0o100 else 0o666)
            if stat.S_IMODE(st.st_mode) != want:
                os.chmod(p, want)


def relocate_paths(folder: Path, old: Path, new: Path) -> int:
    """Rewrite paths under ``old`` to ``new`` in the JSON files below ``folder`` (cards, store
    metadata), for stages that build sub-folders inside a temporary output folder. Returns how
    many files changed."""
    pairs = [(str(old.resolve()), str(new.resolve())), (str(old), str(new))]

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            for a, b in pairs:
                v = v.replace(a, b)
            return v
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return v

    changed = 0
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        fixed = fix(data)
        if fixed != data:
            write_text_atomic(path, json.dumps(fixed, indent=2) + "\n")
            changed += 1
    return changed


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``, replacing an old ``dst`` with no gap in which
    neither a complete old nor a complete new folder exists under a known name."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary sibling and a rename, with a normal new file's permissions (0644 under
    umask 022). A failed write is an EncoderkitError naming ``path``."""
    path = Path(path)
    try:
        with _sibling_file(path, binary=True) as (f, _):
            f.write(data)
    except OSError as e:
        reason = write_failure(e, path.parent)
        if reason is None:
            raise
        raise EncoderkitError(f"could not write {path} ({reason}); free disk space (or fix permissions) and rerun") from e


@contextlib.contextmanager
def open_text_atomic(path: Path) -> Iterator[Any]:
    """A text file (UTF-8) to write ``path`` piece by piece: a temporary sibling, renamed onto ``path`` when the
    block ends without an exception and removed when it raises, so a failure leaves no (and no half) ``path``.
    For outputs too large to build in memory first; a failed write is an EncoderkitError naming ``path``."""
    path = Path(path)
    tmp: list[Path] = []
    try:
        with _sibling_file(path, binary=False) as (f, tmp):
            yield f
    except OSError as e:
        reason = write_failure(e, tmp[0] if tmp else path.parent)  # not a read error of an input nearby
        if reason is None:
            raise
        raise EncoderkitError(f"could not write {path} ({reason}); nothing was written there. Free disk space (or "
                              "fix permissions) and rerun") from e


@contextlib.contextmanager
def _sibling_file(path: Path, binary: bool) -> Iterator[tuple[Any, list[Path]]]:
    """(the open temporary sibling of ``path``, [its path]): flushed, synced and renamed onto ``path`` when the
    block ends, removed when it raises (0644 under umask 022, as a normal new file)."""
    tmp: list[Path] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fds: list[int] = []
        tmp.append(_new_sibling(path, "tmp", lambda p: fds.append(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))))
        with os.fdopen(fds[0], "wb") if binary else os.fdopen(fds[0], "w", encoding="utf-8", newline="") as f:
            yield f, tmp
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp[0], path)
    except BaseException:
        if tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp[0])
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path, missing: str, fix: str = "remove or fix it") -> Any:
    """A JSON file; ``missing`` is the error message when it does not exist, ``fix`` says what to do
    when it is not valid JSON."""
    p = Path(path)
    if not p.is_file():
        raise EncoderkitError(missing)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise EncoderkitError(f"{p} is not valid JSON ({e}); {fix}") from e


def json_line(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a dict; ``where`` ("file:line") names it in the error."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise EncoderkitError(f"{where}: not a JSON object ({e.msg} at column {e.colno}); "
                              "JSONL needs one object per line") from e
    if not isinstance(rec, dict):
        raise EncoderkitError(f"{where}: not a JSON object (got {type(rec).__name__}); JSONL needs one object per line")
    if "\\u" in line:  # only a \uXXXX escape can make a lone surrogate, which no tokenizer takes
        bad = _lone_surrogate(rec)
        if bad:
            raise EncoderkitError(f"{where}: {bad}; texts must be valid Unicode (a \\ud800-\\udfff escape only as "
                                  "half of a pair)")
    return rec


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate ("field 'text' character 3"), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"field {path or 'value'!r} has a lone surrogate (U+{ord(value[e.start]):04X}) at character {e.start}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _lone_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None
