"""Atomic output: nothing half-written ever appears under a final name.

Folders are written as a temporary sibling renamed into place when the stage finishes (:func:`output_dir`),
files as a temporary sibling renamed with ``os.replace``. What a model folder holds is
:mod:`encoderkit.models.card`'s business; this module only writes outputs safely.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.progress import note


def cache_dir(name: str) -> Path:
    """``$ENCODERKIT_CACHE/name`` (default ``~/.cache/encoderkit/name``): prepared corpora, ONNX
    exports, corpus embeddings, a rerank teacher's scores."""
    return Path(os.environ.get("ENCODERKIT_CACHE", Path.home() / ".cache" / "encoderkit")) / name


def cached_array(kind: str, key: str, rows: int, compute: Callable[[], Any], what: str) -> Any:
    """``compute()``, a numpy array of ``rows`` rows, cached as ``cache_dir(kind)/key.npy`` (no pickle).
    A cache that cannot be written costs time later, not this run: a note names ``what`` was not kept."""
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
    """Refuse ``folder`` when its parent cannot be written, so a long run fails before its first step rather
    than when it saves. Probes by creating a folder in the nearest existing ancestor (``os.access`` says yes
    to root on a read-only folder)."""
    folder = Path(folder).absolute()
    base = folder.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise EncoderkitError(f"{flag} {folder} cannot be created: {base} is a file, not a folder; "
                              f"choose another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".encoderkit-write-check-", dir=base))
    except OSError as e:
        raise EncoderkitError(f"{flag} {folder} cannot be written: creating a folder in {base} failed "
                              f"({e.strerror or e}); choose another {flag} or fix its permissions") from e


_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def write_failure(e: BaseException, where: Path | None = None) -> str | None:
    """Why ``e`` is a failed write (disk full, quota, read-only or unwritable folder), or None. An OSError counts
    when it is a disk-full kind or names a file under ``where``; safetensors and ``torch.save`` raise their own
    errors for a full disk."""
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
    """Like :func:`output_dir`, but the folder being written, ``.<name>.partial``, outlives a failure (kept unless
    empty; the error ends with ``retry``) so that hours of work are kept. ``resume`` continues it (or the finished
    ``out``); without it a stale one is removed first."""
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
    Not ``tempfile``'s 0700 / 0600: the caller asks for 0777 / 0666 under the umask, as for any normal new one.
    Temporaries that a killed run (a pid that is gone) left under these names are removed first."""
    sweep_stale(path)
    for _ in range(100):
        candidate = path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            create(candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


_STALE_KINDS = ("tmp", "old")  # what _new_sibling and replace_dir name ``.<name>.<kind>-<pid>-...``


def sweep_stale(path: str | Path) -> int:
    """Remove the temporaries beside ``path`` (``.<name>.tmp-<pid>-*``, ``.<name>.old-<pid>-*``) whose process is
    gone: what a run killed with SIGKILL left. A live process's (a concurrent writer's) are kept. Returns how many."""
    path = Path(path)
    removed = 0
    try:
        entries = list(path.parent.iterdir()) if path.parent.is_dir() else []
    except OSError:
        return 0
    for entry in entries:
        rest = entry.name.removeprefix(f".{path.name}.")
        if rest == entry.name:
            continue
        kind, _, tail = rest.partition("-")
        pid = tail.split("-", 1)[0]
        if kind not in _STALE_KINDS or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed += 1
    if removed:
        note(f"removed {removed} temporary file(s) beside {path} left by a run that was killed")
    return removed


def normalize_modes(folder: Path) -> None:
    """Give everything below ``folder`` the permissions of a normal new folder / file there (``folder``'s own
    mode), whatever mode the library that wrote it chose (safetensors writes 0600)."""
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


def portable_path(path: str | Path, folder: str | Path) -> str:
    """``path`` as a file written in ``folder`` records it: relative to ``folder`` (``../teacher``), so that the
    folder can be copied or moved together with what it names and holds no absolute path. A source that is not a
    file path (``hf:...``, ``builtin:...``) is kept as it is. :func:`recorded_path` reads it back."""
    s = str(path)
    if not s or _is_scheme(s):
        return s
    return os.path.relpath(os.path.realpath(s), os.path.realpath(folder))


def recorded_path(value: str | Path, folder: str | Path) -> Path:
    """A path a file in ``folder`` recorded (:func:`portable_path`), resolved against ``folder``; an absolute one
    (written before paths were recorded relative) as it is."""
    p = Path(value)
    return p if p.is_absolute() or _is_scheme(str(value)) else Path(folder) / p


def portable(value: Any, folder: str | Path) -> Any:
    """``value`` (a config, a list, a mapping) with every absolute path in it made relative to ``folder``
    (:func:`portable_path`); other values, relative paths as the user typed them included, unchanged."""
    if isinstance(value, str):
        return portable_path(value, folder) if _is_abs_path(value) else value
    if isinstance(value, Path):
        return portable_path(value, folder) if value.is_absolute() else str(value)
    if isinstance(value, (list, tuple)):
        return [portable(v, folder) for v in value]
    if isinstance(value, dict):
        return {k: portable(v, folder) for k, v in value.items()}
    return value


def _is_scheme(s: str) -> bool:
    head, sep, _ = s.partition(":")
    return bool(sep) and head.isalpha() and len(head) > 1  # hf:org/name, builtin:stdlib (not C:\ on Windows)


def _is_abs_path(s: str) -> bool:
    """An absolute path of this machine: absolute, one line, and its parent folder exists (not a URL's path)."""
    return os.path.isabs(s) and "\n" not in s and len(s) < 4096 and Path(s.split("#")[0]).parent.is_dir()


def relocate_paths(folder: Path, old: Path, new: Path) -> int:
    """Rewrite paths under ``old`` to ``new`` in the JSON files below ``folder`` (for stages that build
    sub-folders inside a temporary output folder); returns how many files changed."""
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
    """Write ``path`` through a temporary sibling and a rename, with a normal new file's permissions; a failed
    write is an EncoderkitError naming ``path``."""
    path = Path(path)
    try:
        with _sibling_file(path, binary=True) as (f, _):
            f.write(data)
    except OSError as e:
        reason = write_failure(e, path.parent)
        if reason is None:
            raise
        raise EncoderkitError(f"could not write {path} ({reason}); free disk space (or fix permissions) "
                              "and rerun") from e


@contextlib.contextmanager
def open_text_atomic(path: Path) -> Iterator[Any]:
    """A UTF-8 text file to write ``path`` piece by piece (outputs too large to build in memory): renamed onto
    ``path`` when the block ends, removed when it raises; a failed write is an EncoderkitError naming ``path``."""
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
        tmp.append(_new_sibling(path, "tmp",
                                lambda p: fds.append(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))))
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
        return json.loads(p.read_bytes().decode("utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as e:
        raise EncoderkitError(f"{p} is not UTF-8 (byte offset {e.start}); {fix}") from e
    except json.JSONDecodeError as e:
        raise EncoderkitError(f"{p} is not valid JSON ({e}); {fix}") from e


def json_line(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a dict; ``where`` ("file:line") names it in the error."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise EncoderkitError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                              "JSONL needs one JSON object per line") from e
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
            return (f"field {path or 'value'!r} has a lone surrogate (U+{ord(value[e.start]):04X}) "
                    f"at character {e.start}")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _lone_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


# -- inputs: one way to open a file a user names, and one line reader ----------------------------------
def input_problem(path: str | Path, e: OSError) -> str:
    """What happened when ``path`` could not be opened, in words (permission, missing, folder, ...)."""
    if isinstance(e, PermissionError):
        return "permission denied; fix its permissions (e.g. chmod u+r) or run as a user who may read it"
    if isinstance(e, FileNotFoundError):
        return "it does not exist; check the spelling and the current folder"
    if isinstance(e, IsADirectoryError):
        return "it is a folder, not a file; give a file"
    return f"{e.strerror or e}; check the file and the disk"


def check_input(path: str | Path, flag: str = "--input") -> Path:
    """``path`` if it is a regular file this process may read, else an EncoderkitError saying what it is instead
    (missing, a broken link, a folder, a device such as /dev/null, a pipe, unreadable). A pipe is refused without
    being opened (opening one blocks until something writes to it)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        if p.is_symlink():
            raise EncoderkitError(f"{flag} {p} is a link to {os.readlink(p)}, which does not exist; "
                                  "give a file") from None
        raise EncoderkitError(f"{flag} {p} does not exist; check the spelling and the current folder") from None
    except OSError as e:
        raise EncoderkitError(f"{flag} {p} cannot be read: {input_problem(p, e)}") from e
    if stat.S_ISDIR(st.st_mode):
        raise EncoderkitError(f"{flag} {p} is a folder, not a file; give a file inside it")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a pipe" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file")
        raise EncoderkitError(f"{flag} {p} is {kind}, not a regular file; give a file (save the data to one first)")
    try:
        open(p, "rb").close()  # only asks whether it may be read
    except OSError as e:
        raise EncoderkitError(f"{flag} {p} cannot be read: {input_problem(p, e)}") from e
    return p


def lines_of(stream: Any, name: str, keep_ends: bool = False, fix: str = "convert it to UTF-8 (e.g. iconv -f latin1 "
             "-t utf-8)", offset_kind: str = "byte offset",
             on_bad: Callable[[int, int], None] | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of a binary ``stream`` (named ``name`` in errors). Only ``\\n`` ends a
    line (with ``\\r\\n``, the ``\\r`` is part of the ending): a U+2028, U+2029, form feed, U+0085 or a lone ``\\r``
    inside a record is text, not a line break, as JSON and CSV read it. The ending is removed unless ``keep_ends``; a
    leading UTF-8 BOM (Excel's "CSV UTF-8") is dropped. A byte that is not UTF-8 is an error naming the line and
    the byte offset, and ``fix``; with ``on_bad`` it is ``on_bad(line number, byte offset)`` and the line is left
    out (a reader that skips and counts such lines)."""
    offset = 0
    for number, raw in enumerate(stream, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if on_bad is None:
                raise EncoderkitError(f"{name}:{number}: not UTF-8 ({offset_kind} {offset + e.start}); {fix}") from None
            on_bad(number, offset + e.start)
            offset += len(raw)
            continue
        offset += len(raw)
        if number == 1 and line.startswith("\ufeff"):
            line = line[1:]
        if not keep_ends and line.endswith("\n"):
            line = line[:-2] if line.endswith("\r\n") else line[:-1]
        yield number, line


def read_lines(path: str | Path, flag: str = "--input", keep_ends: bool = False,
               on_bad: Callable[[int, int], None] | None = None) -> Iterator[tuple[int, str]]:
    """:func:`lines_of` of the file ``path`` (checked by :func:`check_input` when the first line is asked for)."""
    p = check_input(path, flag)
    try:
        with open(p, "rb") as f:
            yield from lines_of(f, str(p), keep_ends, on_bad=on_bad)
    except OSError as e:
        raise EncoderkitError(f"{flag} {p} could not be read: {input_problem(p, e)}") from e


@dataclass
class BlankLines:
    """The blank lines a record reader skipped (how many, and the first's number): the one rule for blank lines
    in a file of one record per line is to skip, count and report them; each result carries its record's line."""

    count: int = 0
    first: int | None = None


def records(lines: Iterable[tuple[int, str]], name: str, blank: BlankLines | None = None) -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``lines`` (one record each), with their numbers; blank (whitespace-only) lines are
    counted in ``blank`` and reported once on stderr at the end."""
    blank = blank if blank is not None else BlankLines()
    for number, line in lines:
        if line.strip():
            yield number, line
            continue
        blank.count += 1
        blank.first = blank.first or number
    report_blank(name, blank)


def report_blank(name: str, blank: BlankLines) -> None:
    """The one stderr line that says how many blank lines a reader of ``name`` skipped (nothing when none)."""
    if blank.count:
        note(f"{name}: skipped {blank.count} blank line(s) (the first is line {blank.first}); results name each "
             "record's line")


def read_text_file(path: str | Path, flag: str = "--input") -> str:
    """The whole text of the file ``path`` (a config, a template, a JSON document), through the one line reader: what
    it is instead of a readable file is said (:func:`check_input`), a leading BOM is dropped, and a byte that is not
    UTF-8 is an error naming ``file:line`` and the byte offset."""
    return "".join(line for _, line in read_lines(path, flag, keep_ends=True))


def read_jsonl(path: str | Path, flag: str = "--input", blank: BlankLines | None = None,
               lines: Iterable[tuple[int, str]] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each record of the JSONL file ``path`` (or of its ``lines``, e.g. gunzipped or
    with bad lines skipped): the one line reader's lines, blank ones skipped and counted (:func:`records`), each a
    JSON object (:func:`json_line`: any valid JSON, a raw U+2028 included; anything else names ``file:line``)."""
    for number, line in records(read_lines(path, flag) if lines is None else lines, str(path), blank):
        yield number, json_line(line, f"{path}:{number}")


def csv_rows(lines: Iterable[tuple[int, str]], name: str, delimiter: str = ",",
             quoted: bool = True) -> Iterator[tuple[int, list[str]]]:
    """``(the line a row starts on, its cells)`` of CSV / TSV ``lines`` (the one line reader's, read with
    ``keep_ends=True``): ``quoted``, the csv module (a quoted cell may hold a line break); else a plain split on
    ``delimiter`` with no quoting (GLUE's TSV files hold unbalanced quotes). A blank row is ``[]``. A quoting error
    names ``name:line``."""
    at = [0]  # the line the csv reader last took

    def text() -> Iterator[str]:
        for number, line in lines:
            at[0] = number
            yield line

    if not quoted:
        for number, line in lines:
            cells = line.rstrip("\r\n").split(delimiter)
            yield number, [] if not "".join(cells).strip() else cells
        return
    reader = csv.reader(text(), delimiter=delimiter)
    start = 1
    try:
        for cells in reader:
            yield start, [] if not "".join(cells).strip() else cells
            start = at[0] + 1
    except csv.Error as e:
        raise EncoderkitError(f"{name}:{at[0]}: CSV error ({e}); fix the quoting (a cell over 128 KiB: split it or "
                              "convert the file to JSONL)") from e


def csv_records(lines: Iterable[tuple[int, str]], name: str, delimiter: str = ",", quoted: bool = True,
                blank: BlankLines | None = None) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, {column: cell})`` of each row of CSV / TSV ``lines`` after the header row (:func:`csv_rows`; column
    names stripped, a BOM already dropped by the line reader): blank rows skipped and counted (reported once), a row
    with another number of cells than the header an error naming ``name:line``; a file with no header row too."""
    blank = blank if blank is not None else BlankLines()
    rows = csv_rows(lines, name, delimiter, quoted)
    first = next(rows, None)
    if first is None:
        raise EncoderkitError(f"{name} is empty; expected a header line and rows")
    header = [h.strip() for h in first[1]]
    for number, cells in rows:
        if not cells:
            blank.count += 1
            blank.first = blank.first or number
            continue
        if len(cells) != len(header):
            how = "quote a cell that holds the delimiter" if quoted else "TSV fields are split on tabs, no quoting"
            raise EncoderkitError(f"{name}:{number}: {len(cells)} fields but the header has {len(header)} "
                                  f"({', '.join(header)}); fix the row ({how})")
        yield number, dict(zip(header, cells, strict=True))
    report_blank(name, blank)


def read_csv(path: str | Path, flag: str = "--input", delimiter: str = ",",
             quoted: bool = True) -> Iterator[tuple[int, dict[str, str]]]:
    """:func:`csv_records` of the file ``path`` through the one line reader."""
    return csv_records(read_lines(path, flag, keep_ends=True), str(path), delimiter, quoted)


def check_output_file(out: str | Path, overwrite: bool, flag: str = "--output",
                      inputs: Iterable[str | Path | None] = ()) -> Path:
    """The one check of an output file before any work: not one of the run's ``inputs`` (even with --overwrite),
    not a folder, not an existing file unless ``overwrite``, and in a folder that can be written."""
    out = Path(out)
    refuse_input_as_output(out, inputs, flag)
    if out.is_dir():
        raise EncoderkitError(f"{flag} {out} is a folder; give a file name (e.g. {out / 'out.jsonl'})")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise EncoderkitError(f"{flag} {out} exists; pass --overwrite to replace it, or choose another {flag}")
    check_writable(out, flag)
    return out


def refuse_input_as_output(out: str | Path, inputs: Iterable[str | Path | None], flag: str = "--out",
                           folder: bool = False) -> None:
    """An EncoderkitError when ``out`` is one of ``inputs`` (the same file, through links too), for a ``folder``
    output (replaced whole) a folder holding one, for a file output an existing file inside an input folder (a model's
    ``config.json``, an index's manifest): writing it would destroy what the run reads, whatever --overwrite says."""
    o = Path(out).absolute()
    ro = Path(os.path.realpath(o))
    for given in inputs:
        if not given or str(given).startswith(("hf:", "builtin:")):
            continue
        i = Path(given).absolute()
        if not os.path.lexists(i):
            continue
        ri = Path(os.path.realpath(i))
        same = ri == ro or (o.exists() and _same_file(o, i))
        holds = folder and ro.is_dir() and ro in ri.parents
        part = not folder and os.path.lexists(o) and ri.is_dir() and ri in ro.parents
        if same or holds or part:
            what = "is" if same else "holds" if holds else "is a file of"
            raise EncoderkitError(f"{flag} {out} {what} the input {given}; writing it would destroy the input. "
                                  f"Choose another {flag}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
