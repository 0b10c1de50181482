"""Progress on long work: a tqdm bar on a terminal, a plain line a minute in a log file.

tqdm hides itself when stderr is not a terminal, so a run under nohup, a scheduler or CI gets
``DESC 120/2104 (5.7%), loss=0.49, 1m02s elapsed, 35m left`` lines from :class:`LineProgress` instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm.auto import tqdm

LINE_EVERY = 60.0  # seconds between lines when stderr is not a terminal


class LineProgress:
    """The log-file twin of a tqdm bar (see the module docstring)."""

    def __init__(self, iterable: Iterable[Any] | None = None, total: float | None = None, desc: str = "",
                 unit: str = "it", initial: float = 0, every: float = LINE_EVERY, stream: Any = None) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self.start = initial
        self.every = every
        self.stream = stream or sys.stderr
        self.t0 = self.last = time.perf_counter()
        self.postfix = ""

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)

    def __enter__(self) -> LineProgress:  # noqa: PYI034 -- no Self on Python 3.10
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_postfix(self, refresh: bool = True, **kw: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kw.items())

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every or (self.total is not None and self.n >= self.total):
            self.last = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        done = (now or time.perf_counter()) - self.t0
        parts = [f"{self.desc} {_count(self.n)}" + (f"/{_count(self.total)}" if self.total else f" {self.unit}")]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.1f}%)"
        if self.postfix:
            parts.append(self.postfix)
        parts.append(f"{_clock(done)} elapsed")
        if self.total and self.n > self.start:
            parts.append(f"{_clock(done / (self.n - self.start) * max(self.total - self.n, 0))} left")
        return ", ".join(parts)

    def close(self) -> None:
        pass


def progress(iterable: Iterable[Any] | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
             initial: float = 0, leave: bool = True, **tqdm_kw: Any) -> Any:
    """A tqdm bar on a terminal, else a :class:`LineProgress`."""
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, dynamic_ncols=True,
                    **tqdm_kw)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial)


def note(message: str) -> None:
    """A message on stderr that does not tear a bar in progress."""
    if sys.stderr.isatty():
        tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)


def _count(n: float) -> str:
    return f"{n:,.0f}" if n >= 10_000 else f"{n:g}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"
