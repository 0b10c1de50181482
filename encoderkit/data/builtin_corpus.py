"""Built-in corpora that need no download: ``builtin:stdlib``.

``builtin:stdlib``: the docstrings of the running interpreter's standard library, one document per module, read
with :mod:`ast` (nothing is imported, so no import-time side effects run) in sorted file order, so the same Python
gives the same corpus: English technical prose, enough for a quickstart tokenizer and a tiny MLM run.
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
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


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


def named_docstrings(path: Path) -> list[tuple[str, str]]:
    """``(qualified name, docstring)`` of a source file's module (name ``""``), classes and functions,
    nested ones named ``Class.method``, in source order; docstrings cleaned with
    ``inspect.cleandoc``, ones shorter than ``MIN_DOCSTRING_CHARS`` dropped. A file that does not
    parse with this interpreter yields nothing."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
        return []
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, name: str) -> None:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc and len(doc.strip()) >= MIN_DOCSTRING_CHARS:
            found.append((getattr(node, "lineno", 0), name, doc.strip()))
        stack = list(ast.iter_child_nodes(node))
        while stack:  # definitions directly inside this one, also under if/try/with blocks
            child = stack.pop()
            if isinstance(child, _DEFS):
                visit(child, f"{name}.{child.name}" if name else child.name)
            elif not isinstance(child, ast.Lambda):
                stack.extend(ast.iter_child_nodes(child))

    visit(tree, "")
    found.sort(key=lambda t: t[0])
    return [(name, doc) for _, name, doc in found]


def module_docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order (see
    :func:`named_docstrings`)."""
    return [doc for _, doc in named_docstrings(path)]


def module_name(rel: str) -> str:
    """Dotted module name of a stdlib path relative to its root: ``email/mime/text.py`` ->
    ``email.mime.text``, ``json/__init__.py`` -> ``json``."""
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def stdlib_docstrings() -> Iterator[tuple[str, str, str]]:
    """``(module, qualified name, docstring)`` for every docstring of ``builtin:stdlib``, in the
    corpus's own order (modules sorted by path, docstrings in source order)."""
    root = stdlib_root()
    for path in stdlib_files(root):
        module = module_name(path.relative_to(root).as_posix())
        for name, doc in named_docstrings(path):
            yield module, name, doc


def stdlib_documents() -> Iterator[Document]:
    """One :class:`Document` per standard-library module that has docstrings (source ``builtin:stdlib/REL``)."""
    root = stdlib_root()
    for path in stdlib_files(root):
        docs = module_docstrings(path)
        if docs:
            yield Document("\n\n".join(docs), f"builtin:stdlib/{path.relative_to(root).as_posix()}", 1)


BUILTIN_CORPORA: dict[str, Callable[[], Iterator[Document]]] = {"stdlib": stdlib_documents}
