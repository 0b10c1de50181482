"""Built-in corpora that need no download: ``builtin:stdlib``.

``builtin:stdlib`` is the docstrings of the running interpreter's standard library: every module,
class and function docstring of the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, read
with :mod:`ast` (nothing is imported, so no module's import-time side effects run). One document
per module, its docstrings joined by blank lines. Files are visited in sorted order, so two runs
on the same Python give the same corpus; test suites, ``site-packages`` and the IDLE/turtle demos
are left out. It is English technical prose, a few MB: enough for a quickstart tokenizer and a
tiny MLM run.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from encoderkit.data.document import Document

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "idlelib",
              "turtledemo", "lib2to3", "ensurepip", "config-3", "pydoc_data"}
MIN_DOCSTRING_CHARS = 20


def stdlib_root() -> Path:
    """The folder holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, test and vendored folders left out."""
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("config-", "."))]
        rel = Path(folder).relative_to(root)
        files.extend((rel / n).as_posix() for n in names if n.endswith(".py"))
    return [root / f for f in sorted(files)]


def module_docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order (cleaned with
    ``inspect.cleandoc``; ones shorter than ``MIN_DOCSTRING_CHARS`` dropped). A file that does not
    parse with this interpreter yields nothing."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc.strip()) >= MIN_DOCSTRING_CHARS:
            docs.append(doc.strip())
    return docs


def stdlib_documents() -> Iterator[Document]:
    """One :class:`Document` per standard-library module that has docstrings (source ``builtin:stdlib/REL``)."""
    root = stdlib_root()
    for path in stdlib_files(root):
        docs = module_docstrings(path)
        if docs:
            yield Document("\n\n".join(docs), f"builtin:stdlib/{path.relative_to(root).as_posix()}", 1)


BUILTIN_CORPORA: dict[str, Callable[[], Iterator[Document]]] = {"stdlib": stdlib_documents}
