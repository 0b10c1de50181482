"""The on-disk index: generations behind an atomically swapped pointer.

    DIR/CURRENT              the name of the live generation ("gen-000003"), replaced atomically
    DIR/gen-000003/
        manifest.json        model fingerprint, engine (backend, calibration, reason: inference/policy.py), dims,
                             precisions, passage policy, sizes and sha256 of every file
        passages.jsonl       one line per passage: {"id", "doc_id", "hash", "text"} (row i = vector i)
        binary.npy           (N, ceil(dims/8)) uint8, packed sign bits (loaded into RAM)
        int8.npy             (N, dims) int8, with int8_calibration.npy (2, dims) float32
        float16.npy          (N, dims) float16 (optional, --float16)
        static_*.npy         a tiered index's static first stage (binary, int8 + calibration): first_stage.py,
                             whose full-encoder codes lie in DIR/full-codes/, outside the generations
        binary.ivf           faiss binary IVF over the binary codes (only past --ann-threshold passages)

An update writes a complete new generation into a temporary folder, renames it into place and then
replaces ``CURRENT`` (``os.replace``: atomic); only then are older generations removed. A crash at
any point leaves ``CURRENT`` naming a complete generation, and the next write clears the leftovers.
Each generation holds only live rows, so an identical re-run writes files of the same size.
Opening checks every file's size and sha256 against the manifest (a corrupt or partly written file
is reported by name).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.io import write_json_atomic, write_text_atomic

FORMAT = "encoderkit-index/1"
STORES = ("local", "milvus")  # where the dense stage searches: this folder, or also a Milvus server
# the static first stage of a tiered index (encoderkit.retrieval.first_stage): the static model's codes
ARRAYS = ("binary", "int8", "int8_calibration", "float16", "static_binary", "static_int8", "static_int8_calibration")


@dataclass
class Generation:
    """One generation's contents in memory (arrays may be memory-mapped)."""

    manifest: dict[str, Any]
    passages: list[dict[str, str]]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    folder: Path | None = None

    @property
    def dims(self) -> int:
        return int(self.manifest["dims"])


class PassageLines:
    """A generation's passages.jsonl without its texts in memory: the offset of every line (8 bytes a passage); a
    passage is parsed when asked for (``lines[i]``), ``raw(start, n)`` gives lines as they are, iteration streams."""

    def __init__(self, path: Path) -> None:
        ends = array.array("q", [0])
        with open(path, "rb") as f:
            for line in f:
                ends.append(ends[-1] + len(line))
        self.path, self.offsets, self._f = path, np.frombuffer(ends, dtype=np.int64), None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, start: int, n: int = 1) -> bytes:
        """Lines ``start`` to ``start + n`` of the file, newlines included."""
        if self._f is None:
            self._f = open(self.path, "rb")  # noqa: SIM115 (kept open for the next read; closed by close())
        self._f.seek(int(self.offsets[start]))
        return self._f.read(int(self.offsets[start + n] - self.offsets[start]))

    def __getitem__(self, i: int) -> dict[str, str]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return json.loads(self.raw(i % len(self)))

    def __iter__(self) -> Iterator[dict[str, str]]:
        with open(self.path, "rb") as f:
            for line in f:
                yield json.loads(line)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def current_folder(root: Path) -> Path | None:
    """The live generation folder of index ``root``, None when ``root`` holds no index."""
    pointer = root / "CURRENT"
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not name.startswith("gen-") or "/" in name:
        raise EncoderkitError(f"{pointer}: names {name!r}, not a generation; the index is damaged: rebuild it")
    return root / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def open_generation(root: str | Path, verify: bool = True, mmap: bool = True,
                    lazy_passages: bool = False) -> Generation:
    """Load the live generation of index ``root``; every damage is an :class:`EncoderkitError`
    that names the file. ``verify``: check sha256 too (sizes are always checked). ``lazy_passages``: ``passages``
    is a :class:`PassageLines` (offsets in memory, a line read when asked for) instead of a list of them all."""
    root = Path(root)
    folder = current_folder(root)
    if folder is None:
        what = ("does not exist" if not root.exists() else
                "has no CURRENT file (not an index, or its first build was interrupted)")
        raise EncoderkitError(f"index {root} {what}; build it with `encoderkit index --out {root}`")
    if not (folder / "manifest.json").is_file():
        raise EncoderkitError(f"index {root}: CURRENT names {folder.name}, which has no manifest.json; the index is "
                              "damaged: rebuild it")
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EncoderkitError(f"{folder / 'manifest.json'}: not valid JSON ({e}); the index is damaged: "
                              "rebuild it") from e
    if manifest.get("format") != FORMAT:
        raise EncoderkitError(f"{folder / 'manifest.json'}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise EncoderkitError(f"index {root}: {path} is missing; the index is damaged: rebuild it")
        if path.stat().st_size != meta["bytes"]:
            raise EncoderkitError(f"index {root}: {path} has {path.stat().st_size} bytes, the manifest says "
                                  f"{meta['bytes']} (partly written or changed); rebuild the index")
        if verify and _sha256(path) != meta["sha256"]:
            raise EncoderkitError(f"index {root}: {path} does not match its sha256 in the manifest (corrupt); "
                                  "rebuild the index")
    passages: Any = (PassageLines(folder / "passages.jsonl") if lazy_passages else  # lines end in \n only: a text
                     [json.loads(line) for line in (folder / "passages.jsonl").read_text(encoding="utf-8").split("\n")
                      if line])  # may hold U+2028, which str.splitlines would split at
    arrays = {}
    for name in ARRAYS:
        if f"{name}.npy" in manifest["files"]:
            arrays[name] = np.load(folder / f"{name}.npy", mmap_mode="r" if mmap and name != "binary" else None,
                                   allow_pickle=False)
            if not name.endswith("calibration") and arrays[name].shape[0] != len(passages):
                raise EncoderkitError(f"index {root}: {name}.npy has {arrays[name].shape[0]} rows for "
                                      f"{len(passages)} passages")
    return Generation(manifest, passages, arrays, folder)


def write_generation(root: str | Path, gen: Generation, extra_files: dict[str, Any] | None = None,
                     before_swap: Any = None) -> Path:
    """Write ``gen`` as the next generation of ``root`` and make it live (see the module docstring).
    ``extra_files``: name -> callable(path) writing another file into the generation (e.g. an HNSW
    index). ``before_swap(folder)`` runs after everything is written, before ``CURRENT`` moves (a
    failure there leaves the previous generation live). :class:`GenerationWriter` writes one a block at a time."""
    with GenerationWriter(root) as w:
        w.add_passages(json.dumps(p, ensure_ascii=False) + "\n" for p in gen.passages)
        for key, arr in gen.arrays.items():
            w.save(key, arr)
        return w.commit(gen.manifest, extra_files, before_swap)


class NpyRows:
    """A ``.npy`` file of (N, D) rows written a block at a time, byte for byte what ``np.save`` writes of the whole
    array: its header is written with N = 0 and rewritten with the final N on :meth:`close` (numpy pads the header
    so that the first axis can grow to 21 digits without changing its length)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows, self.dtype, self.width, self._f = path, 0, None, 0, None

    def _header(self) -> bytes:
        f = io.BytesIO()
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                 "fortran_order": False, "shape": (self.rows, self.width)})
        return f.getvalue()

    def append(self, block: np.ndarray) -> None:
        """Rows (n, D) after those already written (the first block sets D and the dtype)."""
        block = np.asarray(block)
        if self._f is None:
            self.dtype, self.width = block.dtype, block.shape[1]
            self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close(), after the last block)
            self._f.write(self._header())
        if block.dtype != self.dtype or block.ndim != 2 or block.shape[1] != self.width:
            raise ValueError(f"{self.path.name}: a block {block.dtype}{block.shape} after "
                             f"{self.dtype}(N, {self.width})")
        self._f.write(np.ascontiguousarray(block).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        if self._f is None:
            return
        header = self._header()
        self._f.seek(0)
        if len(header) != self._f.write(header) or self._f.tell() != len(header):
            raise RuntimeError(f"{self.path.name}: the header grew with {self.rows} rows")  # numpy's padding forbids it
        self._f.close()
        self._f = None


class GenerationWriter:
    """The next generation of ``root``, written into its temporary folder a block of rows at a time, then made live
    by :meth:`commit` (the checks and the atomic swap of :func:`write_generation`, which is this on a whole
    :class:`Generation`). Used as a context manager: leaving it without a commit (an error, Ctrl-C) removes the
    temporary folder, and ``root`` too when this writer created it and it is empty.

        with GenerationWriter(root) as w:
            w.add_passages(lines); w.append("binary", codes); ...   # rows in order, every array as many as passages
            w.commit(manifest, extra_files, before_swap)
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._made_root = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".gen-*.tmp"):  # an interrupted earlier write
            shutil.rmtree(leftover, ignore_errors=True)
        live = current_folder(self.root)
        number = int(live.name.split("-")[1]) + 1 if live is not None else 1
        self.name = f"gen-{number:06d}"
        self.folder = self.root / f".{self.name}.tmp"
        self.folder.mkdir()
        self.count = 0  # passages written
        self._passages = open(self.folder / "passages.jsonl", "wb")  # noqa: SIM115 (closed by commit / abort)
        self._rows: dict[str, NpyRows] = {}
        self._whole: set[str] = set()

    def __enter__(self) -> GenerationWriter:  # noqa: PYI034 -- no Self on Python 3.10
        return self

    def __exit__(self, *exc: object) -> None:
        if self.folder.exists():  # not committed
            self.abort()

    def add_passages(self, lines: Any) -> None:
        """passages.jsonl lines (str or bytes, each ending in a newline), after those already written."""
        for line in lines:
            self._passages.write(line.encode("utf-8") if isinstance(line, str) else line)
            self.count += 1

    def add_raw_passages(self, data: bytes, n: int) -> None:
        """``n`` whole lines of another generation's passages.jsonl, as they are."""
        self._passages.write(data)
        self.count += n

    def append(self, key: str, block: np.ndarray) -> None:
        """Rows of array ``key`` (``key.npy``) after those already written."""
        if key not in self._rows:
            self._rows[key] = NpyRows(self.folder / f"{key}.npy")
        self._rows[key].append(block)

    def save(self, key: str, arr: np.ndarray) -> None:
        """A whole array (a calibration, or every row of ``key`` at once)."""
        with open(self.folder / f"{key}.npy", "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        self._whole.add(key)

    def commit(self, manifest: dict[str, Any], extra_files: dict[str, Any] | None = None,
               before_swap: Any = None) -> Path:
        """Close the files, write ``extra_files`` (name -> callable(path), which may read the arrays back), the
        manifest (sizes and sha256 of every file), run ``before_swap(folder)`` and make the generation live."""
        self._passages.close()
        for key, rows in self._rows.items():
            rows.close()
            if rows.rows != self.count:
                raise RuntimeError(f"{key}.npy has {rows.rows} rows for {self.count} passages")
        for fname, writer in (extra_files or {}).items():
            writer(self.folder / fname)
        files = {}
        for p in sorted(self.folder.iterdir()):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        write_json_atomic(self.folder / "manifest.json",
                          {**manifest, "format": FORMAT, "count": self.count, "files": files})
        if before_swap is not None:
            before_swap(self.folder)
        os.replace(self.folder, self.root / self.name)
        write_text_atomic(self.root / "CURRENT", self.name + "\n")
        for old in self.root.glob("gen-*"):
            if old.name != self.name:
                with contextlib.suppress(OSError):
                    shutil.rmtree(old)
        return self.root / self.name

    def abort(self) -> None:
        """Remove the temporary folder (and ``root``, when this writer made it and nothing else is in it)."""
        self._passages.close()
        for rows in self._rows.values():
            with contextlib.suppress(Exception):
                rows.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._made_root:
            with contextlib.suppress(OSError):
                self.root.rmdir()


