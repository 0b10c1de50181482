"""Packed sparse weights: the bytes that unstructured (magnitude) and 2:4 pruning save, in safetensors only.

A pruned folder stores its weights in ``model.sparse.safetensors`` (no ``model.safetensors``, so plain transformers
fails loudly instead of loading zeros or random weights) and says so in ``config.json``'s ``encoderkit_sparse``
(``{"file": ..., "method": ...}``). Each pruned matrix ``X`` (e.g. ``bert.encoder.layer.0.output.dense.weight``) is
stored as two tensors, every other tensor as it is:

- ``X.packed_values``: the kept entries, 1-D, in the matrix's own dtype, in row-major order;
- ``X.packed_index``: where they go, by the matrix's scheme:
  - ``2:4``: in each group of 4 consecutive entries of a row, the 2 kept positions (0-3, ascending), 2 bits each,
    4 per byte (the first position in the lowest bits); a group with fewer than 2 non-zeros keeps a zero;
  - ``bitmask``: one bit per entry (row-major, the first entry in the lowest bit of byte 0), 1 = kept;
  - ``delta``: the gaps between successive kept flat positions (the first one: its position), ``uint8`` when every
    gap is under 256, else ``int32``.

The file's safetensors metadata ``encoderkit_sparse`` (a JSON object) gives, per packed matrix, ``scheme``,
``shape`` (the dense shape), ``dtype`` and ``nnz`` (values stored). The writer picks, per matrix, the scheme with the
fewest bytes (2:4 where the pattern holds; a tie goes to 2:4, then bitmask) and keeps the matrix dense where no scheme
is smaller. Zeros with the sign bit set count as kept entries, so unpacking gives bit-identical dense tensors. The
reader checks every length, position and count against the metadata and refuses a damaged file naming the matrix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from encoderkit.errors import EncoderkitError

SPARSE_FILE = "model.sparse.safetensors"
SPARSE_KEY = "encoderkit_sparse"  # in config.json: the folder's weights are packed; in the file: the layout
VALUES, INDEX = ".packed_values", ".packed_index"
SCHEMES = ("2:4", "bitmask", "delta")
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
REMEDY = "re-create the folder with `encoderkit prune` (or copy it again); the file was damaged or edited"


# -- writing ---------------------------------------------------------------------------------
def _kept(w: torch.Tensor) -> torch.Tensor:
    """Entries that must be stored: every non-zero, and -0.0 (its sign bit is not a plain zero's)."""
    return (w != 0) | torch.signbit(w)


def _pack_24(w: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if w.dim() != 2 or w.shape[1] % 4 or bool((kept.view(-1, 4).sum(1) > 2).any()):
        return None
    groups = kept.view(-1, 4)
    order = (~groups).to(torch.int64) * 4 + torch.arange(4)  # kept positions first, then the lowest zeros
    pos = torch.sort(torch.argsort(order, dim=1)[:, :2], dim=1).values
    values = w.reshape(-1, 4).gather(1, pos).reshape(-1)
    codes = pos.reshape(-1).to(torch.uint8)
    codes = torch.cat([codes, torch.zeros((-len(codes)) % 4, dtype=torch.uint8)]).view(-1, 4)
    index = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
    return values, index


def _pack_bitmask(w: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = kept.reshape(-1)
    bits = np.packbits(flat.numpy().astype(np.uint8), bitorder="little")
    return w.reshape(-1)[flat], torch.from_numpy(bits)


def _pack_delta(w: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = kept.reshape(-1)
    pos = torch.nonzero(flat).reshape(-1)
    gaps = torch.diff(pos, prepend=torch.zeros(1, dtype=pos.dtype)) if len(pos) else pos
    if len(pos):
        gaps[0] = pos[0]
    index = gaps.to(torch.uint8) if len(gaps) == 0 or int(gaps.max()) < 256 else gaps.to(torch.int32)
    return w.reshape(-1)[flat], index


def pack(w: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor] | None:
    """``(meta, values, index)`` of ``w`` in the scheme with the fewest bytes, or None when dense is no larger."""
    if w.dtype not in _DTYPES.values() or w.dim() < 1:
        return None
    w = w.detach().contiguous().cpu()
    kept = _kept(w)
    dense = w.numel() * w.element_size()
    best: tuple[int, str, torch.Tensor, torch.Tensor] | None = None
    for scheme, fn in (("2:4", _pack_24), ("bitmask", _pack_bitmask), ("delta", _pack_delta)):
        packed = fn(w, kept)
        if packed is None:
            continue
        size = packed[0].numel() * packed[0].element_size() + packed[1].numel() * packed[1].element_size()
        if best is None or size < best[0]:
            best = (size, scheme, *packed)
    if best is None or best[0] >= dense:
        return None
    _, scheme, values, index = best
    meta = {"scheme": scheme, "shape": list(w.shape), "dtype": str(w.dtype).removeprefix("torch."),
            "nnz": int(values.numel())}
    return meta, values.contiguous(), index.contiguous()


def save_sparse(tensors: dict[str, torch.Tensor], names: list[str], path: Path) -> dict[str, Any]:
    """Write ``tensors`` to ``path`` with the matrices ``names`` packed (where packing saves bytes); returns what
    was saved: ``{packed, nonzero, packed_bytes, dense_bytes}`` of the packed matrices."""
    out: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for key, t in tensors.items():
        packed = pack(t) if key in names else None
        if packed is None:
            out[key] = t.contiguous()
            continue
        layout[key], out[key + VALUES], out[key + INDEX] = packed
    save_file(out, str(path), metadata={"format": "pt", SPARSE_KEY: json.dumps(layout, sort_keys=True)})
    return sparse_stats(path)


# -- reading ---------------------------------------------------------------------------------
def _layout(path: Path, meta: dict[str, str] | None) -> dict[str, Any]:
    raw = (meta or {}).get(SPARSE_KEY)
    if raw is None:
        raise EncoderkitError(f"{path}: its header has no {SPARSE_KEY} layout, so its packed weights cannot be "
                              f"unpacked; {REMEDY}")
    try:
        layout = json.loads(raw)
    except json.JSONDecodeError as e:
        raise EncoderkitError(f"{path}: the {SPARSE_KEY} layout in its header is not JSON ({e}); {REMEDY}") from e
    if not isinstance(layout, dict):
        raise EncoderkitError(f"{path}: the {SPARSE_KEY} layout in its header is not a JSON object; {REMEDY}")
    return layout


def sparse_stats(path: str | Path) -> dict[str, Any]:
    """From the header only: packed matrices, their non-zeros, packed and dense bytes, and bytes per non-zero."""
    path = Path(path)
    with safe_open(str(path), "pt") as f:
        layout = _layout(path, f.metadata())
        packed = dense = nnz = 0
        for name, m in layout.items():
            for part in (VALUES, INDEX):
                sl = f.get_slice(name + part)
                packed += int(np.prod(sl.get_shape())) * _itemsize(sl.get_dtype())
            dense += int(np.prod(m["shape"])) * _DTYPES[m["dtype"]].itemsize
            nnz += int(m["nnz"])
    return {"packed": len(layout), "nonzero": nnz, "packed_bytes": packed, "dense_bytes": dense,
            "bytes_per_nonzero": round(packed / nnz, 4) if nnz else None}


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}.get(dtype, 4)


def read_sparse(path: str | Path) -> dict[str, torch.Tensor]:
    """The dense tensors of a packed file, every packed matrix checked against its layout and unpacked exactly."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            layout = _layout(path, f.metadata())
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise EncoderkitError(f"{path} is damaged or truncated ({e}); {REMEDY}") from e
    packed = {k.rsplit(".packed_", 1)[0] for k in tensors if k.endswith((VALUES, INDEX))}
    if stray := sorted(packed - set(layout)):
        raise EncoderkitError(f"{path}: packed tensors of {stray[0]} have no entry in the {SPARSE_KEY} layout; "
                              f"{REMEDY}")
    out = {k: v for k, v in tensors.items() if not k.endswith((VALUES, INDEX))}
    for name, meta in layout.items():
        values, index = tensors.get(name + VALUES), tensors.get(name + INDEX)
        if values is None or index is None:
            raise EncoderkitError(f"{path}: the layout names {name}, but {name}{VALUES if values is None else INDEX} "
                                  f"is missing; {REMEDY}")
        out[name] = _unpack(path, name, meta, values, index)
    return out


def _unpack(path: Path, name: str, meta: Any, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    def bad(what: str) -> EncoderkitError:
        return EncoderkitError(f"{path}: packed weight {name}: {what}; {REMEDY}")

    if not isinstance(meta, dict) or meta.get("scheme") not in SCHEMES or meta.get("dtype") not in _DTYPES:
        raise bad(f"its layout entry {meta!r} names no known scheme ({', '.join(SCHEMES)}) and dtype")
    shape, nnz = meta.get("shape"), meta.get("nnz")
    if (not isinstance(shape, list) or not shape or not all(isinstance(s, int) and s > 0 for s in shape)
            or not isinstance(nnz, int) or nnz < 0):
        raise bad(f"its layout gives shape {shape!r} and nnz {nnz!r}")
    numel = int(np.prod(shape))
    if values.dtype != _DTYPES[meta["dtype"]] or values.dim() != 1 or values.numel() != nnz or nnz > numel:
        raise bad(f"{values.numel()} {values.dtype} values stored, the layout says {nnz} {meta['dtype']} of "
                  f"{numel} entries")
    scheme = meta["scheme"]
    if index.dim() != 1:
        raise bad("its index is not 1-D")
    if scheme == "2:4":
        if len(shape) != 2 or shape[1] % 4 or nnz != numel // 2 or index.dtype != torch.uint8 \
                or index.numel() != -(-nnz // 4):
            raise bad(f"2:4 needs a matrix with rows of 4k entries, numel/2 values and ceil(nnz/4) index bytes; "
                      f"got shape {shape}, {nnz} values, {index.numel()} {index.dtype} index entries")
        codes = torch.stack([(index >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[:nnz].to(torch.int64)
        pos = codes.view(-1, 2)
        if bool((pos[:, 0] >= pos[:, 1]).any()):
            raise bad("a group's two positions are not ascending")
        dense = torch.zeros(numel // 4, 4, dtype=values.dtype).scatter_(1, pos, values.view(-1, 2))
        return dense.view(shape)
    if scheme == "bitmask":
        if index.dtype != torch.uint8 or index.numel() != -(-numel // 8):
            raise bad(f"a bitmask of {numel} entries takes {-(-numel // 8)} bytes; {index.numel()} "
                      f"{index.dtype} stored")
        bits = np.unpackbits(index.numpy(), bitorder="little")
        if bits[numel:].any() or int(bits[:numel].sum()) != nnz:
            raise bad(f"its bitmask marks {int(bits.sum())} entries, the layout says {nnz}")
        flat = torch.zeros(numel, dtype=values.dtype)
        flat[torch.from_numpy(bits[:numel].astype(bool))] = values
        return flat.view(shape)
    if index.dtype not in (torch.uint8, torch.int32) or index.numel() != nnz:
        raise bad(f"delta needs {nnz} uint8/int32 gaps; {index.numel()} {index.dtype} stored")
    gaps = index.to(torch.int64)
    pos = torch.cumsum(gaps, 0)
    if nnz and (int(gaps[0]) < 0 or bool((gaps[1:] < 1).any()) or int(pos[-1]) >= numel):
        raise bad(f"its positions are not increasing within the {numel} entries")
    flat = torch.zeros(numel, dtype=values.dtype)
    flat[pos] = values
    return flat.view(shape)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, packed ones unpacked (:func:`read_sparse`) when the file is a packed one."""
    path = Path(path)
    if path.name == SPARSE_FILE:
        return read_sparse(path)
    return load_file(str(path))
