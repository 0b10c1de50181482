"""Opening corpus files: archives (zip/tar members), gzip, and UTF-8 decoding with line numbers.

The byte-level half of :mod:`encoderkit.data.readers`: every reader gets its lines from :func:`decoded_lines`,
so a bad byte is reported the same way everywhere (file, line, byte offset, what to do).
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, input_problem, lines_of

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
MEMBER_SEP = "::"  # an archive member's source name: ARCHIVE::MEMBER
Opener = Callable[[], BinaryIO]


# -- archives --------------------------------------------------------------------------------------
def is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def _hidden(name: str) -> bool:
    return any(part.startswith(".") or part == "__MACOSX" for part in name.split("/") if part)


def iter_archive(path: str) -> Iterator[tuple[str, Opener]]:
    """``(member name, opener)`` for each regular, non-hidden file of a .zip (in sorted name order) or a
    .tar/.tar.gz/.tgz (in archive order, read in one pass; each member is held in memory while read)."""
    try:
        if path.lower().endswith(".zip"):
            with zipfile.ZipFile(path) as z:
                names = sorted(i.filename for i in z.infolist() if not i.is_dir() and not _hidden(i.filename))
                for name in names:
                    yield name, lambda n=name: z.open(n)  # type: ignore[misc]
            return
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile() and not _hidden(member.name):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    yield member.name, lambda d=data: io.BytesIO(d)  # type: ignore[misc]
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, gzip.BadGzipFile) as e:
        raise EncoderkitError(f"cannot read archive {path}: {e}; check that the file is complete") from e


def _archive_bytes(path: Path) -> int:
    if path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist())
    return _uncompressed_size(path)


# -- bytes to lines ------------------------------------------------------------------------------
def _open_binary(path: str, opener: Opener | None = None) -> BinaryIO:
    """``path`` (or the archive member ``opener`` opens) as a binary stream, gunzipped if it ends in .gz."""
    if opener is None:
        return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")  # type: ignore[return-value]
    raw = opener()
    return gzip.GzipFile(fileobj=raw, mode="rb") if path.lower().endswith(".gz") else raw  # type: ignore[return-value]


def decoded_lines(path: str, keep_ends: bool = False, opener: Opener | None = None) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for each line of a (possibly gzipped) UTF-8 file: :func:`encoderkit.io.lines_of`,
    the one line reader (only ``\\n`` / ``\\r\\n`` end a line, the ending removed unless ``keep_ends``, a leading BOM
    dropped). A byte that is not UTF-8 raises :class:`EncoderkitError` with its line and byte offset (in the
    uncompressed stream); a file that cannot be opened says why (missing, folder, device, permission)."""
    if opener is None:
        check_input(path, "corpus file")
    where = "uncompressed byte offset" if path.lower().endswith(".gz") else "byte offset"
    try:
        with _open_binary(path, opener) as f:
            yield from lines_of(f, path, keep_ends, fix=_ENCODING_FIX, offset_kind=where)
    except (OSError, EOFError, gzip.BadGzipFile, zipfile.BadZipFile, tarfile.TarError) as e:
        why = input_problem(path, e) if isinstance(e, OSError) and e.errno is not None else (
            f"{e}; check that the file is complete (a .gz file must be a gzip stream)")
        raise EncoderkitError(f"cannot read {path}: {why}") from e


_ENCODING_FIX = "convert it (e.g. iconv -f latin1 -t utf-8) or pass --skip-bad-encoding to leave such files out"


def first_bad_utf8_offset(path: str, opener: Opener | None = None) -> int | None:
    """Byte offset (uncompressed) of the first invalid UTF-8 byte of a file, or ``None`` if it is clean.
    Reads in 1 MiB chunks with an incremental decoder, so no line is held twice."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the stream handed to the decoder so far
    try:
        with _open_binary(path, opener) as f:
            while chunk := f.read(1 << 20):
                offset += len(chunk)
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:  # e.object = the decoder's pending bytes + the last chunk
        return offset - len(e.object) + e.start
    except (OSError, EOFError, gzip.BadGzipFile, zipfile.BadZipFile, tarfile.TarError) as e:
        raise EncoderkitError(f"cannot read {path}: {e}") from e
    return None


def _uncompressed_size(path: Path) -> int:
    size = path.stat().st_size
    if not path.name.lower().endswith((".gz", ".tgz")) or size < 18:
        return size
    with open(path, "rb") as f:  # ISIZE: the last 4 bytes, the uncompressed size mod 2**32 (an estimate)
        f.seek(-4, 2)
        isize = struct.unpack("<I", f.read(4))[0]
    return max(isize, size)


def source_bytes(path: str) -> int:
    """Uncompressed bytes of a file or an archive's members (for progress bars; a .gz size is an estimate)."""
    return _archive_bytes(Path(path)) if is_archive(path) else _uncompressed_size(Path(path))


# -- folders ---------------------------------------------------------------------------------------
def folder_files(folder: str | Path, follow_links: bool = False) -> tuple[list[Path], list[Path]]:
    """(every non-hidden file below ``folder``, sorted by relative path; the links left out). A corpus is what is
    inside its folder: a symbolic link whose target lies outside it (or is missing) is left out, unless
    ``follow_links``; a link to a folder is not entered unless ``follow_links`` (each real folder once)."""
    folder = Path(folder)
    root = Path(os.path.realpath(folder))
    kept: list[tuple[str, Path]] = []
    left: list[Path] = []
    seen: set[str] = set()
    for dirpath, dirs, files in os.walk(folder, followlinks=follow_links):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link cycle, or a folder reached twice through links
            dirs[:] = []
            continue
        seen.add(real)
        here = Path(dirpath)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and _keep_link(here / d, root, follow_links, left))
        for name in files:
            p = here / name
            if name.startswith(".") or not _keep_link(p, root, follow_links, left) or not p.is_file():
                continue
            kept.append((p.relative_to(folder).as_posix(), p))
    return [p for _, p in sorted(kept)], sorted(left)


def _keep_link(p: Path, root: Path, follow_links: bool, left: list[Path]) -> bool:
    """Whether ``p`` (a file or folder below ``root``) is read: anything that is not a link; a link whose target
    is inside ``root`` (a folder link only with ``follow_links``, as its files are already read there); any link
    that resolves with ``follow_links``. A link left out that leaves the folder (or dangles) is added to ``left``."""
    if not p.is_symlink():
        return True
    target = Path(os.path.realpath(p))
    inside = target == root or root in target.parents
    if not target.exists() or (not inside and not follow_links):
        left.append(p)
        return False
    return follow_links or not target.is_dir()
