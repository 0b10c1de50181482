"""Training checkpoints: written atomically, kept K at a time, loaded only after checking that
they belong to this run.

``root`` holds ``step-NNNNNNN/`` (``model.safetensors``, ``optimizer.pt``, ``state.json``) and ``best/``. A folder is
filled under a temporary name and renamed into place, ``state.json`` last, so a ``step-*`` folder is always complete:
a crash or a full disk mid-write leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.io import normalize_modes, replace_dir, write_failure, write_json_atomic
from encoderkit.progress import note

WEIGHTS, OPTIMIZER, STATE = "model.safetensors", "optimizer.pt", "state.json"


class CheckpointStore:
    """The checkpoints of one run. Only the writer (rank 0) touches the disk."""

    def __init__(self, root: str | Path, keep_last: int = 2, is_writer: bool = True) -> None:
        self.root = Path(root)
        self.keep_last = max(1, keep_last)
        self.is_writer = is_writer

    # -- finding -------------------------------------------------------------------------
    def steps(self) -> list[Path]:
        """Complete step folders, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if (p / STATE).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_path(self) -> Path | None:
        p = self.root / "best"
        return p if (p / STATE).is_file() else None

    # -- writing -------------------------------------------------------------------------
    def save(self, step: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             state: dict[str, Any], is_best: bool = False) -> Path:
        """Write ``step-NNNNNNN`` (and ``best`` if ``is_best``); prune to the last ``keep_last``.
        Returns the final folder. A failed write (a full disk: an OSError, safetensors' SafetensorError or
        torch's RuntimeError) touches nothing that existed before, removes the temporary folders and is an
        EncoderkitError saying to rerun with --resume."""
        final = self.root / f"step-{step:07d}"
        if not self.is_writer:
            return final
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            write_weights(module, tmp / WEIGHTS)
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
            write_json_atomic(tmp / STATE, state)
            normalize_modes(tmp)  # safetensors writes 0600; a checkpoint is as readable as any new file
            replace_dir(tmp, final)
            if is_best:
                best_tmp = self.root / f".best.tmp-{os.getpid()}"
                shutil.rmtree(best_tmp, ignore_errors=True)
                shutil.copytree(final, best_tmp)
                replace_dir(best_tmp, self.root / "best")
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(self.root / f".best.tmp-{os.getpid()}", ignore_errors=True)
            cause = e.__cause__ if isinstance(e, EncoderkitError) and e.__cause__ is not None else e
            reason = write_failure(cause, self.root)
            if reason is None:
                raise
            previous = self.latest()
            then = (f"the previous checkpoint {previous} is intact. Free disk space (or fix permissions) and rerun "
                    "with --resume to continue from it") if previous else \
                ("no checkpoint was written yet. Free disk space (or fix permissions) and rerun")
            raise EncoderkitError(f"could not write checkpoint {final} ({reason}); {then}") from e
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".*.tmp-*"):
            with contextlib.suppress(OSError):
                if int(stale.name.rsplit("-", 1)[1]) != os.getpid():
                    shutil.rmtree(stale, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------
    def load(self, folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             identity: dict[str, Any]) -> dict[str, Any]:
        """Restore weights and optimizer from ``folder`` after checking that its recorded
        identity (settings that change results, config, data fingerprint, world size) equals
        ``identity``. Returns the saved state dict (``step``, ``best``...)."""
        state = read_state(folder)
        saved = state.get("identity", {})
        diffs = _differences(saved, identity)
        if diffs:
            shown = "; ".join(diffs[:6])
            raise EncoderkitError(
                f"cannot resume from {folder}: it was made by a different run ({shown}). "
                "Resume with the same config and data, or start a new run in another folder"
            )
        load_weights(module, folder / WEIGHTS)
        if optimizer is not None:
            try:
                optimizer.load_state_dict(torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True))
            except (OSError, RuntimeError, ValueError) as e:
                raise EncoderkitError(f"{folder / OPTIMIZER} could not be read ({e}); resume from an older "
                                      "checkpoint") from e
        return state


@contextlib.contextmanager
def run_dir_beside(out: Path, resume: bool) -> Any:
    """``.<out>.run``, where a stage writing ``out`` keeps its checkpoints: a stale one is removed unless
    ``resume``; one left with no checkpoint by a failure is removed (nothing to resume from); the stage
    removes it itself once ``out`` is written."""
    run_dir = out.parent / f".{out.name}.run"
    if run_dir.exists() and not resume:
        note(f"removing the checkpoints of an earlier, unfinished run in {run_dir} (--resume continues one)")
        shutil.rmtree(run_dir)
    try:
        yield run_dir
    except BaseException:
        if CheckpointStore(run_dir / "checkpoints").latest() is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing to resume from: leave no hidden folder behind
        raise


def read_state(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(folder) / STATE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EncoderkitError(f"{Path(folder) / STATE} is missing or not valid JSON ({e}); not a checkpoint "
                              "folder") from e


def write_weights(module: nn.Module, path: Path) -> None:
    """Safetensors file of ``module``'s parameters and buffers (tied tensors stored once)."""
    save_model(_unwrap(module), str(path))


def load_weights(module: nn.Module, path: Path) -> None:
    """Load a file written by :func:`write_weights` into ``module`` (strict: same keys)."""
    try:
        missing, unexpected = load_model(_unwrap(module), str(path), strict=False)
    except (OSError, RuntimeError) as e:
        raise EncoderkitError(f"{path}: weights do not fit this model ({e})") from e
    if missing or unexpected:
        raise EncoderkitError(
            f"{path}: weights do not fit this model (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]})"
        )


def _unwrap(module: nn.Module) -> nn.Module:
    module = getattr(module, "_orig_mod", module)
    return getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module


def _differences(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current)):
            out += _differences(saved.get(k), current.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        saved, current = list(saved), list(current)
    if json.dumps(saved, default=str, sort_keys=True) != json.dumps(current, default=str, sort_keys=True):
        return [f"{path}: checkpoint has {saved!r}, this run has {current!r}"]
    return []
