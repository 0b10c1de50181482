"""Opening corpus files: archives (zip/tar members), gzip, and UTF-8 decoding with line numbers.

The byte-level half of :mod:`encoderkit.data.readers`: every reader gets its lines from
:func:`decoded_lines`, so a bad byte is reported the same way everywhere (file, line, byte offset,
what to do), and :func:`first_bad_utf8_offset` lets ``--skip-bad-encoding`` check a file before
reading it.
"""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from encoderkit.errors import EncoderkitError

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
    """Yield ``(line_number, text)`` for each line of a (possibly gzipped) UTF-8 file, with the line
    ending (``\\n`` or ``\\r\\n``) removed unless ``keep_ends``, and a leading BOM dropped. A byte that is not UTF-8 raises
    :class:`EncoderkitError` with its line and byte offset (in the uncompressed stream)."""
    offset = 0
    try:
        with _open_binary(path, opener) as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _encoding_error(path, number, offset + e.start) from e
                offset += len(raw)
                if number == 1 and line.startswith("\ufeff"):
                    line = line[1:]
                yield number, line if keep_ends or not line.endswith("\n") else line.rstrip("\r\n")
    except (OSError, EOFError, gzip.BadGzipFile, zipfile.BadZipFile, tarfile.TarError) as e:
        raise EncoderkitError(f"cannot read {path}: {e}; check that the file is complete (a .gz file "
                              "must be a gzip stream)") from e


def _encoding_error(path: str, line: int, offset: int) -> EncoderkitError:
    where = "uncompressed byte offset" if path.lower().endswith(".gz") else "byte offset"
    return EncoderkitError(f"{path}:{line}: not UTF-8 ({where} {offset}); convert it (e.g. iconv -f latin1 -t utf-8) "
                           "or pass --skip-bad-encoding to leave such files out")


def first_bad_utf8_offset(path: str, opener: Opener | None = None) -> int | None:
    """Byte offset (uncompressed) of the first invalid UTF-8 byte of a file, or ``None`` if it is clean.
    Reads in 1 MiB chunks with an incremental decoder, so no line is held twice."""
    import codecs

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
