"""Typed stage configs: one dataclass per stage, each field declared with :func:`arg` and its help text.

The CLI's flags and the config files' keys (YAML, TOML) come from the same fields, so they cannot drift apart.
``arg(speed=True)`` marks a setting that changes only speed: ``result_dict()`` leaves it out, so a cache or
resume check never trips on it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import tomllib
import yaml

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_text_file, write_text_atomic


def arg(
    default: Any = MISSING,
    *,
    help: str,
    choices: tuple[Any, ...] | None = None,
    speed: bool = False,
    required: bool = False,
) -> Any:
    """A documented config field. Lists and dicts get a fresh copy of ``default`` per instance."""
    meta = {"help": help, "choices": choices, "speed": speed, "required": required}
    if required:
        default = None
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def check(ok: bool, message: str) -> None:
    """Raise :class:`EncoderkitError` with ``message`` unless ``ok``."""
    if not ok:
        raise EncoderkitError(message)


def check_spellings(data: dict[str, Any], source: str = "config") -> None:
    """Refuse a mapping that sets one key twice, as ``seq-len`` and as ``seq_len`` (``-`` reads as ``_``)."""
    given: dict[str, str] = {}  # field name -> the key that set it, as written
    for key in data:
        name = key.replace("-", "_")
        if name in given:
            raise EncoderkitError(f"{source}: {given[name]!r} and {key!r} both set {name!r}; keep one of them")
        given[name] = key


@dataclass
class StageConfig:
    """Base of every stage config. Subclasses add fields with :func:`arg` and may override ``validate``.

    A config is read-only once built and checked: a stage that needs another value derives it (a
    local variable, a task's options object, ``dataclasses.replace`` for a new config) instead of
    writing it back, so the config a run records is the one it was given."""

    # a setting whose value narrows which of the others apply, e.g. {"to": {"static": ("teacher", "train", ...)}}:
    # `--to static --help` lists only those fields' flags (the CLI reads it; parsing still accepts every flag)
    FLAG_VIEWS: ClassVar[dict[str, dict[str, tuple[str, ...]]]] = {}

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get("required") and getattr(self, f.name) in (None, "", []):
                raise EncoderkitError(f"{type(self).__name__}: '{_flag(f.name)}' is required ({f.metadata['help']})")
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise EncoderkitError(
                    f"{type(self).__name__}: {f.name}={value!r} is not one of {', '.join(map(str, choices))}"
                )
        self.validate()
        object.__setattr__(self, "_parsed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_parsed"):
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name}: a stage config is read-only once parsed; derive the value instead "
                "(a local, the task's options, or dataclasses.replace(config, ...) for a new config)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__}.{name}: a stage config is read-only")

    def validate(self) -> None:
        """Check cross-field rules; raise :class:`EncoderkitError` with a useful message."""

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    def result_dict(self) -> dict[str, Any]:
        """The settings that change results (speed-only settings left out)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self) if not f.metadata.get("speed")}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> StageConfig:
        check_spellings(data, source)
        known = {f.name: f for f in fields(cls)}
        unknown = [k for k in data if k.replace("-", "_") not in known]
        if unknown:
            raise EncoderkitError(
                f"{source}: unknown key(s) {', '.join(sorted(unknown))} for {cls.__name__}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in data.items():
            name = key.replace("-", "_")
            kwargs[name] = coerce(value, hints[name], f"{source}: {name}")
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> StageConfig:
        """Load a YAML (.yaml/.yml) or TOML (.toml) file; ``overrides`` win over the file's keys."""
        data = load_mapping(path)
        data.update(overrides or {})
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> None:
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


def named_folders(specs: list[str], what: str) -> dict[str, Path]:
    """``--<what> DIR`` / ``--<what> name=DIR`` values -> {name: folder}; a bare DIR is named after its folder."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = Path(spec).name or what, spec
        if not name or name in out:
            raise EncoderkitError(f"--{what} {spec!r}: {what} names must be unique and non-empty (use name=DIR)")
        out[name] = Path(folder)
    return out


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML or TOML file that holds one mapping of keys to values."""
    p = Path(path)
    text = read_text_file(p, "config file")  # missing, a folder, unreadable or not UTF-8: said as such
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise EncoderkitError(f"config file {p}: use .yaml, .yml, .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise EncoderkitError(f"config file {p} is not valid: {e}") from e
    except yaml.YAMLError as e:
        raise EncoderkitError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise EncoderkitError(f"config file {p} must hold a mapping of keys to values")
    return data


def coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a value read from a file or a flag to the field's declared type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(value, inner[0], where)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [coerce(v, args[0] if args else str, where) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise EncoderkitError(f"{where}: expected a mapping, got {value!r}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if hint in (int, float, str):
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return hint(value)
    except (TypeError, ValueError) as e:
        raise EncoderkitError(f"{where}: expected {hint.__name__}, got {value!r}") from e
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value
