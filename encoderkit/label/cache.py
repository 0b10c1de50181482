"""The answer cache and the ledger: one sqlite file beside the output.

Every answer (parsed or not) is committed the moment it arrives, keyed by a hash of (prompt, text,
model, sample, attempt), so a killed run resumes where it stopped and a rerun sends nothing. The
same rows are the ledger: requests, prompt and completion tokens and seconds per request.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

_SCHEMA = """CREATE TABLE IF NOT EXISTS answers (
  key TEXT PRIMARY KEY, model TEXT, answer TEXT, prompt_tokens INTEGER, completion_tokens INTEGER,
  seconds REAL, created REAL DEFAULT (julianday('now')))"""


def request_key(prompt: str, text: str, model: str, sample: int, attempt: int) -> str:
    raw = json.dumps([prompt, text, model, sample, attempt], ensure_ascii=False)
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


class AnswerCache:
    """sqlite cache of raw answers with their token counts and seconds (used from one thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), check_same_thread=False)  # callers hold a lock
        self.db.execute("PRAGMA synchronous=FULL")  # a committed answer survives a kill or a power cut
        self.db.execute(_SCHEMA)
        self.db.commit()

    def get(self, key: str) -> str | None:
        row = self.db.execute("SELECT answer FROM answers WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, model: str, answer: str, prompt_tokens: int, completion_tokens: int,
            seconds: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO answers(key, model, answer, prompt_tokens, completion_tokens, seconds) "
                        "VALUES (?,?,?,?,?,?)", (key, model, answer, prompt_tokens, completion_tokens, seconds))
        self.db.commit()

    def ledger(self) -> dict[str, Any]:
        """Totals over every request ever answered into this cache."""
        n, pt, ct, s = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0), "
            "COALESCE(SUM(seconds),0) FROM answers").fetchone()
        return {"requests": n, "prompt_tokens": pt, "completion_tokens": ct, "tokens": pt + ct, "seconds": round(s, 3)}

    def close(self) -> None:
        self.db.close()
