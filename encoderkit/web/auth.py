"""The bearer-token check shared by ``serve`` and the browser pages (``audit review --web``, ``/search``)."""

from __future__ import annotations

import hmac


def token_ok(headers: dict[bytes, bytes], token: bytes) -> bool:
    """Whether ``headers`` (ASGI, lower-case names) carry ``Authorization: Bearer <token>``; constant-time compare."""
    scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
