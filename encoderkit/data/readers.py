"""Corpus readers: turn files, folders, globs, HF datasets and the built-in corpus into documents.

:func:`iter_documents` streams :class:`Document` objects, so nothing holds a whole corpus in memory. A source is a
file (format by extension after an optional ``.gz``: JSONL, CSV, TSV without quoting, as GLUE files need, Parquet;
any other extension is plain UTF-8 text split by ``doc_split``), an archive, a folder, a glob (all in sorted
order), ``hf:NAME[:CONFIG][:SPLIT]`` or ``builtin:stdlib``. Errors name the file, the line and what to do.
"""

from __future__ import annotations

import csv
import glob
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.data.builtin_corpus import BUILTIN_CORPORA
from encoderkit.data.document import Document
from encoderkit.data.files import (
    MEMBER_SEP,
    Opener,
    decoded_lines,
    first_bad_utf8_offset,
    folder_files,
    is_archive,
    iter_archive,
    source_bytes,
)
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_input, csv_rows, json_line
from encoderkit.io import records as record_lines
from encoderkit.progress import note

DOC_SPLITS = ("file", "blank_line", "line")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
HF_PREFIX = "hf:"
BUILTIN_PREFIX = "builtin:"
_GLOB_CHARS = "*?["

SkipCallback = Callable[[str, str], None]
"""Called as ``on_skip(source, reason)`` for each file left out (``skip_bad_encoding=True``)."""


@dataclass
class ReadStats:
    """Counts filled in while :func:`iter_documents` runs (pass one in as ``stats=``)."""

    documents: int = 0
    files: int = 0
    skipped_files: int = 0
    text_bytes: int = 0
    skipped_links: int = 0  # links that leave a corpus folder, left out (no --follow-links)
    blank_lines: int = 0  # blank lines of JSONL / table files, skipped


# -- resolving sources ---------------------------------------------------------------------------
def resolve_sources(sources: str | Path | Iterable[str | Path], follow_links: bool = False,
                    stats: ReadStats | None = None, quiet: bool = False) -> list[str]:
    """Expand folders and globs into a deterministic list of files (plus ``hf:``/``builtin:`` specs).

    A folder means what is inside it: links that leave it are left out (counted in ``stats.skipped_links`` and,
    unless ``quiet``, reported on stderr) unless ``follow_links``. Raises :class:`EncoderkitError` for a missing path,
    a glob that matches nothing, an empty folder or an empty list of sources.
    """
    links: list[Path] = []
    if isinstance(sources, (str, Path)):
        sources = [sources]
    items = [str(s) for s in sources]
    if not items:
        raise EncoderkitError("no corpus given; pass one or more files, folders, globs, hf:NAME or builtin:stdlib")
    out: list[str] = []
    for item in items:
        if item.startswith(HF_PREFIX):
            out.append(item)
        elif item.startswith(BUILTIN_PREFIX):
            name = item[len(BUILTIN_PREFIX):]
            if name not in BUILTIN_CORPORA:
                raise EncoderkitError(f"unknown built-in corpus {item!r}; available: "
                                      + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_CORPORA))
            out.append(item)
        elif any(c in item for c in _GLOB_CHARS) and not Path(item).exists():
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise EncoderkitError(f"corpus glob {item!r} matches no file; check the pattern (quote it so "
                                      "the shell does not expand it) and the current folder")
            for m in matches:
                out.extend(_expand_path(Path(m), follow_links, links) if Path(m).is_dir() else [m])
        else:
            p = Path(item)
            if not p.exists():
                raise EncoderkitError(f"corpus path {item} does not exist; check the spelling or pass a folder/glob")
            if p.is_dir():
                files = _expand_path(p, follow_links, links)
                if not files:
                    raise EncoderkitError(f"corpus folder {item} holds no (non-hidden) file")
                out.extend(files)
            else:
                check_input(item, "corpus file")
                out.append(item)
    if links:
        if stats is not None:
            stats.skipped_links = len(links)
        if not quiet:
                note(f"skipped {len(links)} link(s) that leave their corpus folder (e.g. {links[0]}); pass "
                 "--follow-links to read them")
    return out


def _expand_path(folder: Path, follow_links: bool = False, links: list[Path] | None = None) -> list[str]:
    """Every non-hidden file under ``folder``, sorted by relative path (hidden folders skipped too); links that
    leave it are added to ``links`` instead, unless ``follow_links``."""
    files, left = folder_files(folder, follow_links)
    if links is not None:
        links.extend(left)
    return [str(p) for p in files]


def source_format(path: str) -> str:
    """``"jsonl"``, ``"csv"``, ``"tsv"``, ``"parquet"`` or ``"text"`` (any other extension)."""
    name = path.lower()
    name = name.removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for fmt in ("csv", "tsv", "parquet"):
        if name.endswith("." + fmt):
            return fmt
    return "text"


def estimate_bytes(sources: str | Path | Iterable[str | Path], follow_links: bool = False) -> int | None:
    """Total uncompressed bytes of the file sources (a ``.gz`` file's size is read from its trailer),
    for progress bars. ``None`` when a source (``hf:``, ``builtin:``) has no known size."""
    total = 0
    for src in resolve_sources(sources, follow_links, quiet=True):
        if src.startswith((HF_PREFIX, BUILTIN_PREFIX)):
            return None
        total += source_bytes(src)
    return total


# -- the entry point -------------------------------------------------------------------------------
def iter_documents(
    sources: str | Path | Iterable[str | Path],
    *,
    doc_split: str = "file",
    text_field: str = "text",
    text_column: str = "text",
    skip_bad_encoding: bool = False,
    on_skip: SkipCallback | None = None,
    stats: ReadStats | None = None,
    follow_links: bool = False,
) -> Iterator[Document]:
    """Stream the non-empty documents of ``sources`` in a deterministic order.

    Sources are resolved (and missing paths reported) when this is called, before the first
    document is read. ``doc_split`` applies to plain-text files only; a JSONL/CSV/TSV record or a
    dataset row is always one document. With ``skip_bad_encoding`` a file that is not UTF-8 is left
    out as a whole (reported through ``on_skip`` and counted in ``stats.skipped_files``) instead of
    stopping the run. If no document at all is found, the iterator raises :class:`EncoderkitError`.
    """
    if doc_split not in DOC_SPLITS:
        raise EncoderkitError(f"doc_split={doc_split!r} is not one of {', '.join(DOC_SPLITS)}")
    stats = stats if stats is not None else ReadStats()
    files = resolve_sources(sources, follow_links, stats)
    return _iter_resolved(files, doc_split, text_field, text_column, skip_bad_encoding, on_skip, stats)


def _iter_resolved(files: list[str], doc_split: str, text_field: str, text_column: str,
                   skip_bad_encoding: bool, on_skip: SkipCallback | None, stats: ReadStats) -> Iterator[Document]:
    for src in files:
        if src.startswith(HF_PREFIX):
            stats.files += 1
            docs: Iterable[Document] = read_hf(src, text_field)
        elif src.startswith(BUILTIN_PREFIX):
            stats.files += 1
            docs = BUILTIN_CORPORA[src[len(BUILTIN_PREFIX):]]()
        elif is_archive(src):
            docs = (doc for name, opener in iter_archive(src)
                    for doc in _read_file(f"{src}{MEMBER_SEP}{name}", doc_split, text_field, text_column,
                                          skip_bad_encoding, on_skip, stats, opener))
        else:
            docs = _read_file(src, doc_split, text_field, text_column, skip_bad_encoding, on_skip, stats)
        for doc in docs:
            stats.documents += 1
            stats.text_bytes += len(doc.text.encode("utf-8"))
            yield doc
    if stats.documents == 0:
        skipped = f" ({stats.skipped_files} file(s) skipped for bad encoding)" if stats.skipped_files else ""
        raise EncoderkitError(f"the corpus {', '.join(files[:5])}{' ...' if len(files) > 5 else ''} holds no "
                              f"non-empty document{skipped}; check --doc-split, --text-field/--text-column "
                              "and that the files are not empty")


def _read_file(path: str, doc_split: str, text_field: str, text_column: str, skip_bad_encoding: bool,
               on_skip: SkipCallback | None, stats: ReadStats, opener: Opener | None = None) -> Iterator[Document]:
    """The documents of one file (or archive member ``path`` = ``ARCHIVE::MEMBER`` opened by ``opener``)."""
    stats.files += 1
    fmt = source_format(path)
    if skip_bad_encoding and fmt != "parquet":
        bad = first_bad_utf8_offset(path, opener)
        if bad is not None:
            stats.skipped_files += 1
            if on_skip is not None:
                on_skip(path, f"not UTF-8 (first bad byte at offset {bad})")
            return
    if fmt == "jsonl":
        yield from read_jsonl(path, text_field, opener)
    elif fmt in ("csv", "tsv"):
        yield from read_table(path, text_column, "," if fmt == "csv" else "\t", opener)
    elif fmt == "parquet":
        yield from read_parquet(path, text_column, opener)
    else:
        yield from read_text(path, doc_split, opener)


# -- the formats ---------------------------------------------------------------------------------
def read_text(path: str, doc_split: str = "file", opener: Opener | None = None) -> Iterator[Document]:
    """Documents of a plain-text file: the whole file, each blank-line-separated block, or each line."""
    if doc_split == "file":
        parts, first = [], None
        for number, line in decoded_lines(path, opener=opener):
            if first is None and line.strip():
                first = number
            parts.append(line)
        text = "\n".join(parts).strip()
        if text:
            yield Document(text, path, first or 1)
    elif doc_split == "line":
        for number, line in decoded_lines(path, opener=opener):
            if line.strip():
                yield Document(line.strip(), path, number)
    else:
        block: list[str] = []
        start = 0
        for number, line in decoded_lines(path, opener=opener):
            if line.strip():
                if not block:
                    start = number
                block.append(line.rstrip())
            elif block:
                yield Document("\n".join(block).strip(), path, start)
                block = []
        if block:
            yield Document("\n".join(block).strip(), path, start)


def read_jsonl(path: str, text_field: str = "text", opener: Opener | None = None) -> Iterator[Document]:
    """One document per JSON object (one per line; a ``.json`` file starting with ``[`` is an array)."""
    lines = decoded_lines(path, opener=opener)
    first = next(lines, None)
    if first is None:
        return
    if path.lower().removesuffix(".gz").endswith(".json") and first[1].lstrip().startswith("["):
        text = "\n".join([first[1]] + [line for _, line in lines])
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise EncoderkitError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file") from e
        if not isinstance(records, list):
            raise EncoderkitError(f"{path}: a .json file must hold one array of objects or one object per line")
        for i, rec in enumerate(records, start=1):
            text_value = _field(rec, text_field, f"{path}: record {i}")
            if text_value:
                yield Document(text_value, path, i)
        return
    for number, line in record_lines(_chain([first], lines), path):
        rec = json_line(line, f"{path}:{number}")
        text_value = _field(rec, text_field, f"{path}:{number}")
        if text_value:
            yield Document(text_value, path, number)


def _chain(head: list[Any], tail: Iterator[Any]) -> Iterator[Any]:
    yield from head
    yield from tail


def _field(rec: Any, name: str, where: str) -> str:
    """The stripped string ``rec[name]``; a missing field or a non-string value is an error."""
    if not isinstance(rec, dict):
        raise EncoderkitError(f"{where}: expected a JSON object with a {name!r} field, got {type(rec).__name__}")
    if name not in rec:
        keys = ", ".join(sorted(map(str, rec))[:20]) or "none"
        raise EncoderkitError(f"{where}: no field {name!r} (fields found: {keys}); pass --text-field NAME")
    value = rec[name]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise EncoderkitError(f"{where}: field {name!r} holds a {type(value).__name__}, expected text")
    return value.strip()


def read_table(path: str, text_column: str = "text", delimiter: str = ",",
               opener: Opener | None = None) -> Iterator[Document]:
    """Rows of a CSV (``csv`` module, quotes honoured) or TSV (plain tab split, no quoting) file with a
    header row; the text is the column named ``text_column``."""
    rows = csv_rows(decoded_lines(path, keep_ends=True, opener=opener), path, delimiter, quoted=delimiter != "\t")
    head = next(rows, None)
    if head is None:
        return
    col, has_header = _column_index(head[1], text_column, path)
    for number, cells in rows if has_header else _chain([head], rows):
        if not cells:
            continue
        if len(cells) <= col:
            sep = "tab-separated field(s)" if delimiter == "\t" else "field(s)"
            raise EncoderkitError(f"{path}:{number}: {len(cells)} {sep}, but column {text_column!r} is field "
                                  f"{col + 1}; fix the row")
        if cells[col].strip():
            yield Document(cells[col].strip(), path, number)


def _column_index(columns: list[str], name: str, path: str) -> tuple[int, bool]:
    """``(index, has_header)``: the position of column ``name`` in the header row, or, when ``name``
    is a number, that 0-based column of a file without a header row."""
    if name.isdigit():
        return int(name), False
    cleaned = [c.strip() for c in columns]
    if name in cleaned:
        return cleaned.index(name), True
    raise EncoderkitError(f"{path}:1: no column {name!r} in the header (columns found: "
                          f"{', '.join(cleaned)}); pass --text-column NAME (or a 0-based number for a "
                          "file without a header row)")


def read_parquet(path: str, text_column: str = "text", opener: Opener | None = None) -> Iterator[Document]:
    """Rows of a Parquet file (needs ``pyarrow``), read in record batches; ``line`` is the row number."""
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional: pyarrow comes with the hub extra (datasets)
    except ImportError as e:
        raise EncoderkitError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    pf = pq.ParquetFile(opener() if opener else path)
    names = pf.schema_arrow.names
    if text_column not in names:
        raise EncoderkitError(f"{path}: no column {text_column!r} (columns found: {', '.join(names)}); "
                              "pass --text-column NAME")
    row = 0
    for batch in pf.iter_batches(columns=[text_column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str) and value.strip():
                yield Document(value.strip(), path, row)


# -- Hugging Face datasets -------------------------------------------------------------------------
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
                   ".txt": "text", ".text": "text"}


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None, bool]:
    """Split ``hf:NAME[:CONFIG][:SPLIT]`` or ``hf:PATH[:SPLIT]`` into (name, config, split, is_local)."""
    body = spec[len(HF_PREFIX):]
    if not body:
        raise EncoderkitError(f"{spec!r}: give a dataset after hf:, e.g. hf:wikitext:wikitext-2-raw-v1:train")
    parts = body.split(":")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is an existing path is local
        candidate = ":".join(parts[:cut])
        if Path(candidate).exists():
            rest = parts[cut:]
            if len(rest) > 1:
                raise EncoderkitError(f"{spec!r}: a local dataset takes at most one :SPLIT after the path")
            return candidate, None, (rest[0] if rest else None), True
    if len(parts) > 3:
        raise EncoderkitError(f"{spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = (parts + [None, None])[:3]
    if name.startswith((".", "/", "~")) or name.endswith(tuple(_LOCAL_BUILDERS)):
        raise EncoderkitError(f"{spec!r}: local dataset path {name} does not exist")
    return name, config or None, split or None, False


def read_hf(spec: str, text_field: str = "text") -> Iterator[Document]:
    """Rows of a dataset loaded with the ``datasets`` library; ``line`` is the 1-based row number."""
    try:
        import datasets
    except ImportError as e:
        raise EncoderkitError(f"{spec}: hf: sources need the datasets library (pip install 'encoderkit[hub]')") from e
    name, config, split, local = parse_hf_spec(spec)
    try:
        if local and Path(name).is_dir() and _is_saved_dataset(Path(name)):
            ds: Any = datasets.load_from_disk(name)
        elif local and Path(name).is_file():
            suffix = Path(name.removesuffix(".gz")).suffix.lower()
            builder = _LOCAL_BUILDERS.get(suffix, "text")
            kw = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if suffix == ".tsv" else {}
            ds = datasets.load_dataset(builder, data_files={"train": name}, **kw)
        else:
            ds = datasets.load_dataset(name, config, streaming=not local)
    except EncoderkitError:
        raise
    except Exception as e:  # datasets raises many types: connection, missing config, bad file
        hint = ("the hub could not be reached or the name is wrong; download the data and pass a local path "
                "(hf:PATH or the files themselves)") if not local else "check the file's format"
        raise EncoderkitError(f"{spec}: could not load the dataset ({type(e).__name__}: {str(e)[:300]}); {hint}") from e
    if hasattr(ds, "keys"):  # a DatasetDict: pick the split
        splits = list(ds.keys())
        chosen = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
        if chosen not in splits:
            raise EncoderkitError(f"{spec}: choose a split with :SPLIT (splits found: {', '.join(splits)})")
        ds = ds[chosen]
    elif split is not None:
        raise EncoderkitError(f"{spec}: this dataset has a single split; drop :{split}")
    columns = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    if columns is not None and text_field not in columns:
        raise EncoderkitError(f"{spec}: no field {text_field!r} (fields found: {', '.join(columns)}); "
                              "pass --text-field NAME")
    for i, rec in enumerate(ds, start=1):
        value = _field(rec, text_field, f"{spec}: row {i}")
        if value:
            yield Document(value, spec, i)


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


__all__ = [
    "Document",
    "ReadStats",
    "decoded_lines",
    "estimate_bytes",
    "first_bad_utf8_offset",
    "iter_documents",
    "parse_hf_spec",
    "read_hf",
    "read_jsonl",
    "read_parquet",
    "read_table",
    "read_text",
    "resolve_sources",
    "source_format",
]
