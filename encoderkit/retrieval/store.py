"""The on-disk index: generations behind an atomically swapped pointer.

    DIR/CURRENT              the name of the live generation ("gen-000003"), replaced atomically
    DIR/gen-000003/
        manifest.json        model fingerprint, dims, precisions, passage policy, sizes and sha256 of every file
        passages.jsonl       one line per passage: {"id", "doc_id", "hash", "text"} (row i = vector i)
        binary.npy           (N, ceil(dims/8)) uint8, packed sign bits (loaded into RAM)
        int8.npy             (N, dims) int8, with int8_calibration.npy (2, dims) float32
        float16.npy          (N, dims) float16 (optional, --float16)
        binary.usearch       HNSW over the binary codes (only past --hnsw-threshold passages)

An update writes a complete new generation into a temporary folder, renames it into place and then
replaces ``CURRENT`` (``os.replace``: atomic); only then are older generations removed. A crash at
any point leaves ``CURRENT`` naming a complete generation, and the next write clears the leftovers.
Each generation holds only live rows, so an identical re-run writes files of the same size.
Opening checks every file's size and sha256 against the manifest (a corrupt or partly written file
is reported by name).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.errors import EncoderkitError
from encoderkit.io import write_json_atomic, write_text_atomic

FORMAT = "encoderkit-index/1"
STORES = ("local", "milvus")  # where the dense stage searches: this folder, or also a Milvus server
ARRAYS = ("binary", "int8", "int8_calibration", "float16")


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


def open_generation(root: str | Path, verify: bool = True, mmap: bool = True) -> Generation:
    """Load the live generation of index ``root``; every damage is an :class:`EncoderkitError`
    that names the file. ``verify``: check sha256 too (sizes are always checked)."""
    root = Path(root)
    folder = current_folder(root)
    if folder is None:
        what = "does not exist" if not root.exists() else "has no CURRENT file (not an index, or its first build was interrupted)"
        raise EncoderkitError(f"index {root} {what}; build it with `encoderkit index --out {root}`")
    if not (folder / "manifest.json").is_file():
        raise EncoderkitError(f"index {root}: CURRENT names {folder.name}, which has no manifest.json; the index is "
                              "damaged: rebuild it")
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EncoderkitError(f"{folder / 'manifest.json'}: not valid JSON ({e}); the index is damaged: rebuild it") from e
    if manifest.get("format") != FORMAT:
        raise EncoderkitError(f"{folder / 'manifest.json'}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise EncoderkitError(f"index {root}: {path} is missing; the index is damaged: rebuild it")
        if path.stat().st_size != meta["bytes"]:
            raise EncoderkitError(f"index {root}: {path} has {path.stat().st_size} bytes, the manifest says {meta['bytes']} "
                                  "(partly written or changed); rebuild the index")
        if verify and _sha256(path) != meta["sha256"]:
            raise EncoderkitError(f"index {root}: {path} does not match its sha256 in the manifest (corrupt); rebuild the index")
    passages = [json.loads(line) for line in (folder / "passages.jsonl").read_text(encoding="utf-8").splitlines() if line]
    arrays = {}
    for name in ARRAYS:
        if f"{name}.npy" in manifest["files"]:
            arrays[name] = np.load(folder / f"{name}.npy", mmap_mode="r" if mmap and name != "binary" else None,
                                   allow_pickle=False)
            if name != "int8_calibration" and arrays[name].shape[0] != len(passages):
                raise EncoderkitError(f"index {root}: {name}.npy has {arrays[name].shape[0]} rows for {len(passages)} passages")
    return Generation(manifest, passages, arrays, folder)


def write_generation(root: str | Path, gen: Generation, extra_files: dict[str, Any] | None = None,
                     before_swap: Any = None) -> Path:
    """Write ``gen`` as the next generation of ``root`` and make it live (see the module docstring).
    ``extra_files``: name -> callable(path) writing another file into the generation (e.g. an HNSW
    index). ``before_swap(folder)`` runs after everything is written, before ``CURRENT`` moves (a
    failure there leaves the previous generation live)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(".gen-*.tmp"):  # an interrupted earlier write
        shutil.rmtree(leftover, ignore_errors=True)
    live = current_folder(root)
    number = int(live.name.split("-")[1]) + 1 if live is not None else 1
    name = f"gen-{number:06d}"
    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    try:
        with open(tmp / "passages.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in gen.passages)
        for key, arr in gen.arrays.items():
            with open(tmp / f"{key}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        for fname, writer in (extra_files or {}).items():
            writer(tmp / fname)
        files = {}
        for p in sorted(tmp.iterdir()):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        write_json_atomic(tmp / "manifest.json", {**gen.manifest, "format": FORMAT, "count": len(gen.passages),
                                                  "files": files})
        if before_swap is not None:
            before_swap(tmp)
        os.replace(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(root / "CURRENT", name + "\n")
    for old in root.glob("gen-*"):
        if old.name != name:
            with contextlib.suppress(OSError):
                shutil.rmtree(old)
    return root / name


