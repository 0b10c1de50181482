"""The docs' command blocks cannot rot (issue 53): every `encoderkit STAGE ...` command in README.md and docs/*.md is
parsed by the real CLI parser (the stage exists, every flag exists, every value is one its choices accept), every
`make` target exists, and a block that runs a stage is either run by a test or marked, just before it,
`<!-- not run: REASON -->`. The curl examples are run against a live server by tests/test_serve_clients.py."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from encoderkit.cli import STAGES, _find_stage, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")
SHELL = ("bash", "sh", "shell", "console", "")
PREFIXES = {"nice": 2, "timeout": 1, "time": 0, "env": 0}  # words (and how many arguments) before the command
# blocks run for real elsewhere (page, first line of the block) -> by what; the README has no room for a marker
RUN_BY_TESTS: dict[tuple[str, str], str] = {
    ("README.md", "make quickstart   # sets up .venv, then the whole life cycle on MiniLM and the stdlib's docstrings"):
        "CI runs `make test`; tests/test_quickstart.py runs the quickstart's stages on a tiny model",
}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    not_run: str | None  # the reason given in a `<!-- not run: REASON -->` line just before the block

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines, out, i = page.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        reason = NOT_RUN.search(before)
        out.append(Block(page.name, i + 1, m.group(1), "\n".join(lines[i + 1:j]), reason and reason.group(1)))
        i = j + 1
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block as argv lists: continuation lines joined, comments dropped, `a && b`, `a | b`
    and `a; b` split, environment assignments and `nice -n 5` / `timeout N` in front left out."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()  # a comment, not the # of scifact.zip#test
        if not line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue  # not a shell line (a RESULT line, output shown)
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", "|", ";"):
                out.append(_bare(cmd))
                cmd = []
            else:
                cmd.append(w)
    return [c for c in out if c]


def _bare(cmd: list[str]) -> list[str]:
    while cmd and re.match(r"^[A-Za-z_]\w*=", cmd[0]):
        cmd = cmd[1:]
    while cmd and cmd[0] in PREFIXES:
        n = PREFIXES[cmd[0]]
        cmd = cmd[1 + (n if cmd[0] != "nice" or (len(cmd) > 1 and cmd[1] == "-n") else 0):]
    return cmd


def kind(cmd: list[str]) -> str:
    """encoderkit (a stage), curl, make, pip, or other (python, cd, ...)."""
    head = cmd[0].rsplit("/", 1)[-1]
    if head == "encoderkit" or cmd[:3] == ["python", "-m", "encoderkit"]:
        return "encoderkit"
    return head if head in ("curl", "make", "pip") else "other"


def stage_commands() -> list[tuple[Block, list[str]]]:
    out = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang in SHELL:
                out += [(block, c) for c in commands(block.text) if kind(c) == "encoderkit"]
    return out


def test_the_docs_have_stage_commands_and_the_extractor_reads_them():
    found = stage_commands()
    assert len(found) >= 20, "the extractor found too few `encoderkit STAGE` commands; has the fence syntax changed?"
    assert commands("X=1 nice -n 5 encoderkit --threads 1 index --model m \\\n  --out o  # the index") == [
        ["encoderkit", "--threads", "1", "index", "--model", "m", "--out", "o"]]
    assert commands("encoderkit search --index i --dev s.zip#test && curl -d x host") == [
        ["encoderkit", "search", "--index", "i", "--dev", "s.zip#test"], ["curl", "-d", "x", "host"]]


@pytest.mark.parametrize(("block", "cmd"), stage_commands(), ids=lambda x: x.where() if isinstance(x, Block) else "")
def test_every_stage_command_in_the_docs_parses(block, cmd):
    """The stage exists, every flag exists and every value is accepted by its choices: a flag renamed or removed,
    or a choice dropped, fails here, naming the page and line."""
    args = cmd[3 if cmd[0] == "python" else 1:]
    # `--flag ...`: a value left out; a bare `...`: the flags of the line above
    argv = [("VALUE" if prev.startswith("--") else None) if a == "..." else a for prev, a in zip(["", *args], args)]
    argv = [a for a in argv if a is not None]
    if not argv or argv[0] in ("-h", "--help"):
        return
    words, end = _find_stage(argv)
    assert words is not None, f"{block.where()}: `{shlex.join(cmd)}`: no such stage (stages: {sorted(STAGES)})"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser(words).parse_args(argv[end:])
        except SystemExit:
            said = err.getvalue().strip().splitlines()[-1]
            pytest.fail(f"{block.where()}: `{shlex.join(cmd)}` does not parse: {said}")


def test_every_make_target_in_the_docs_exists():
    targets = set(re.findall(r"(?m)^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8")))
    for page in PAGES:
        for block in blocks(page):
            for cmd in commands(block.text) if block.lang in SHELL else []:
                if kind(cmd) == "make":
                    missing = [t for t in cmd[1:] if not t.startswith("-") and "=" not in t and t not in targets]
                    assert not missing, f"{block.where()}: make {' '.join(missing)}: no such target in the Makefile"


def test_a_block_that_runs_a_stage_is_run_by_a_test_or_says_why_not():
    unmarked = []
    for page in PAGES:
        for block in blocks(page):
            cmds = commands(block.text) if block.lang in SHELL else []
            runs = [c for c in cmds if kind(c) in ("encoderkit", "make", "pip")]
            first = block.text.strip().splitlines()[0] if block.text.strip() else ""
            if runs and not block.not_run and (block.page, first) not in RUN_BY_TESTS:
                unmarked.append(f"{block.where()}: {shlex.join(runs[0])}")
    assert not unmarked, ("these blocks run a stage but are neither run by a test nor marked "
                          "`<!-- not run: REASON -->` on the line before the block:\n" + "\n".join(unmarked))
