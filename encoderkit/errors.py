"""The one error type users see. The CLI prints its message and exits with status 2."""

from __future__ import annotations


class EncoderkitError(Exception):
    """A problem with the user's input or environment, with a message that says what to do.

    Messages name the file (and line or record where it applies), what was expected and what
    to do about it. The CLI prints them without a traceback.
    """
