"""Corpus readers: every format on slices of the real data, folders/globs/gz/hf:, and each bad input."""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from encoderkit.data.builtin_corpus import stdlib_files
from encoderkit.data.readers import (
    Document,
    ReadStats,
    estimate_bytes,
    first_bad_utf8_offset,
    iter_documents,
    parse_hf_spec,
    resolve_sources,
)
from encoderkit.errors import EncoderkitError


def _head_lines(src: Path, n: int) -> list[str]:
    with open(src, encoding="utf-8", newline="") as f:
        return list(itertools.islice(f, n))


# -- plain formats on real data ------------------------------------------------------------------
def test_sst2_tsv_rows_become_documents(shared_data, tmp_path):
    lines = _head_lines(shared_data / "glue_sst2" / "dev.tsv", 41)
    path = tmp_path / "sst2.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    docs = list(iter_documents([str(path)], text_column="sentence"))
    assert [d.text for d in docs] == [line.split("\t")[0].strip() for line in lines[1:]]
    assert [d.line for d in docs] == list(range(2, 42))
    assert all(d.source == str(path) for d in docs)


def test_rte_tsv_with_unbalanced_quotes_is_split_on_tabs(shared_data, tmp_path):
    lines = _head_lines(shared_data / "glue_rte" / "train.tsv", 2491)
    quoted = [line for line in lines[1:] if any(cell.startswith('"') for cell in line.split("\t")[1:3])]
    odd = [line for line in lines[1:] if line.split("\t")[1].count('"') % 2 == 1]
    keep = [lines[0]] + quoted[:6] + odd[:6]
    path = tmp_path / "rte.tsv"
    path.write_text("".join(keep), encoding="utf-8")
    for column, idx in (("sentence1", 1), ("sentence2", 2)):
        docs = list(iter_documents(str(path), text_column=column))
        expected = [line.split("\t")[idx].strip() for line in keep[1:]]
        assert [d.text for d in docs] == expected
        assert [d.line for d in docs] == list(range(2, len(keep) + 1))
    # what CSV quoting would have done to the same rows: quotes eaten, so the texts differ
    as_csv = [row[1].strip() for row in csv.reader(keep[1:], delimiter="\t")]
    assert as_csv != [line.split("\t")[1].strip() for line in keep[1:]]


def test_gutenberg_gz_three_doc_splits(shared_data):
    src = shared_data / "mlm_corpus_gutenberg" / "gitenberg" / "11-0.txt.gz"
    raw = gzip.decompress(src.read_bytes()).decode("utf-8").lstrip("\ufeff").replace("\r\n", "\n")
    whole = list(iter_documents(str(src)))
    assert len(whole) == 1 and whole[0].text == raw.strip() and "\r" not in whole[0].text
    paras = list(iter_documents(str(src), doc_split="blank_line"))
    expected = [p.strip() for p in re.split(r"\n[ \t]*\n", raw) if p.strip()]
    assert [p.text for p in paras] == [re.sub(r"[ \t]+\n", "\n", p) for p in expected]
    lines = list(iter_documents(str(src), doc_split="line"))
    assert [d.text for d in lines] == [x.strip() for x in raw.split("\n") if x.strip()]
    assert raw.split("\n")[lines[10].line - 1].strip() == lines[10].text  # line numbers are right
    assert estimate_bytes([str(src)]) == len(gzip.decompress(src.read_bytes()))


def test_scifact_csv_from_zip_with_multiline_quoted_fields(shared_data, tmp_path):
    with zipfile.ZipFile(shared_data / "scifact" / "scifact_hf_export.zip") as z:
        z.extract("corpus_train.csv", tmp_path)
        z.extract("claims_validation.csv", tmp_path)
    corpus = tmp_path / "corpus_train.csv"
    with open(corpus, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    titles = list(iter_documents(str(corpus), text_column="title"))
    assert [d.text for d in titles] == [r["title"].strip() for r in rows if r["title"].strip()]
    abstracts = list(iter_documents(str(corpus), text_column="abstract"))
    assert [d.text for d in abstracts] == [r["abstract"].strip() for r in rows]
    assert len(abstracts) == 5183
    assert any("\n" in d.text for d in abstracts)  # quoted fields spanning lines stay whole
    assert all(a.line < b.line for a, b in itertools.pairwise(abstracts))
    assert abstracts[-1].line > len(rows) + 1  # physical line numbers, not row numbers
    with open(tmp_path / "claims_validation.csv", encoding="utf-8", newline="") as f:
        claim_rows = list(csv.DictReader(f))
    claims = list(iter_documents(str(tmp_path / "claims_validation.csv"), text_column="claim"))
    assert [d.text for d in claims] == [r["claim"].strip() for r in claim_rows]


def test_jsonl_and_jsonl_gz_from_real_lines(shared_data, tmp_path):
    lines = _head_lines(shared_data / "glue_sst2" / "dev.tsv", 21)[1:]
    records = [{"sentence": line.split("\t")[0], "label": int(line.split("\t")[1])} for line in lines]
    body = "\n".join(json.dumps(r) for r in records[:10]) + "\n\n" + "\n".join(json.dumps(r) for r in records[10:])
    plain = tmp_path / "sst.jsonl"
    plain.write_text(body, encoding="utf-8")
    zipped = tmp_path / "sst.jsonl.gz"
    zipped.write_bytes(gzip.compress(body.encode("utf-8")))
    for path in (plain, zipped):
        docs = list(iter_documents(str(path), text_field="sentence"))
        assert [d.text for d in docs] == [r["sentence"].strip() for r in records]
        assert docs[10].line == 12  # the blank line is counted
    array = tmp_path / "sst.json"
    array.write_text(json.dumps(records), encoding="utf-8")
    assert ([d.text for d in iter_documents(str(array), text_field="sentence")]
            == [r["sentence"].strip() for r in records])


def test_crlf_and_bom_are_removed(tmp_path):
    path = tmp_path / "win.txt"
    path.write_bytes("\ufeffFirst line\r\n\r\nSecond para\r\nstill second\r\n".encode("utf-8"))
    docs = list(iter_documents(str(path), doc_split="blank_line"))
    assert [d.text for d in docs] == ["First line", "Second para\nstill second"]
    assert [d.line for d in docs] == [1, 3]


def test_unknown_extension_is_plain_text(tmp_path):
    path = tmp_path / "notes.rst"
    path.write_text("A heading\n=========\n\nBody text.\n", encoding="utf-8")
    assert [d.text for d in iter_documents(str(path), doc_split="blank_line")] == ["A heading\n=========", "Body text."]


def test_headerless_tsv_by_column_number(shared_data):
    src = shared_data / "scifact" / "topics.beir-v1.0.0-scifact.test.tsv.gz"
    rows = gzip.decompress(src.read_bytes()).decode("utf-8").strip("\n").split("\n")
    docs = list(iter_documents(str(src), text_column="1"))
    assert [d.text for d in docs] == [r.split("\t")[1].strip() for r in rows]
    assert docs[0].line == 1


def test_zip_members_by_extension_sorted(shared_data, tmp_path):
    src = shared_data / "scifact" / "scifact_hf_export.zip"
    archive = tmp_path / "claims.zip"
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(archive, "w") as out:
        for name in ("claims_validation.csv", "claims_test.csv"):  # written unsorted on purpose
            out.writestr(name, z.read(name))
        out.writestr("__MACOSX/._claims_test.csv", b"\x00\x05junk")
        out.writestr("notes.txt", "A plain note.\n")
    with zipfile.ZipFile(src) as z:
        expected = [r["claim"].strip() for name in ("claims_test.csv", "claims_validation.csv")
                    for r in csv.DictReader(io.StringIO(z.read(name).decode("utf-8")))]
    docs = list(iter_documents(str(archive), text_column="claim", doc_split="line"))
    assert [d.text for d in docs] == expected + ["A plain note."]
    assert docs[0].source == f"{archive}::claims_test.csv" and docs[0].line == 2
    assert docs[-1].source == f"{archive}::notes.txt"
    with pytest.raises(EncoderkitError, match=r"claims\.zip::claims_test\.csv:1: no column 'title'"):
        list(iter_documents(str(archive), text_column="title"))
    with zipfile.ZipFile(archive) as z:
        assert estimate_bytes(str(archive)) == sum(i.file_size for i in z.infolist())


def test_tar_gz_of_peps_one_document_per_member(shared_data):
    src = shared_data / "domain_corpus_python_peps" / "peps.tar.gz"
    listed = (shared_data / "domain_corpus_python_peps" / "SHA256SUMS.peps").read_text().split("\n")
    names = [line.split()[1] for line in listed if line.strip()]
    stats = ReadStats()
    docs = list(iter_documents(str(src), stats=stats))
    assert [d.source.split("::peps/")[1] for d in docs] == names  # archive order, one per member
    assert stats.files == len(names) == 703
    with tarfile.open(src) as tar:
        raw = tar.extractfile("peps/pep-0008.rst").read().decode("utf-8")  # type: ignore[union-attr]
    pep8 = next(d for d in docs if d.source.endswith("pep-0008.rst"))
    assert pep8.text == raw.replace("\r\n", "\n").strip()


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["one doc", "", "two doc"], "n": [1, 2, 3]}), path)
    docs = list(iter_documents(str(path), text_column="body"))
    assert [(d.text, d.line) for d in docs] == [("one doc", 1), ("two doc", 3)]
    with pytest.raises(EncoderkitError, match="no column 'text'.*body, n"):
        list(iter_documents(str(path)))


# -- folders, globs, hf:, builtin -----------------------------------------------------------------
def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a").mkdir()
    (root / ".git").mkdir()
    (root / "b" / "z.txt").write_text("zed\n")
    (root / "a" / "y.txt").write_text("why\n")
    (root / "a" / ".hidden.txt").write_text("secret\n")
    (root / ".git" / "config").write_text("ignored\n")
    (root / "c.jsonl").write_text('{"text": "see"}\n')
    (root / "d.txt.gz").write_bytes(gzip.compress(b"dee\n"))
    return root


def test_folder_is_recursive_sorted_and_skips_hidden(tmp_path):
    root = _tree(tmp_path)
    files = resolve_sources([str(root)])
    assert files == [str(root / p) for p in ("a/y.txt", "b/z.txt", "c.jsonl", "d.txt.gz")]
    assert [d.text for d in iter_documents([str(root)])] == ["why", "zed", "see", "dee"]


def test_glob_expands_sorted_and_empty_glob_fails(tmp_path):
    root = _tree(tmp_path)
    docs = list(iter_documents([str(root / "**" / "*.txt")]))
    assert [d.text for d in docs] == ["why", "zed"]
    with pytest.raises(EncoderkitError, match=r"matches no file"):
        iter_documents([str(root / "*.nothing")])


def test_hf_local_files_and_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"body": "first row", "y": 1}\n{"body": "second row", "y": 0}\n', encoding="utf-8")
    docs = list(iter_documents([f"hf:{jsonl}"], text_field="body"))
    assert [(d.text, d.line) for d in docs] == [("first row", 1), ("second row", 2)]
    assert [d.text for d in iter_documents([f"hf:{jsonl}:train"], text_field="body")] == ["first row", "second row"]
    with pytest.raises(EncoderkitError, match="splits found: train"):
        list(iter_documents([f"hf:{jsonl}:test"], text_field="body"))
    with pytest.raises(EncoderkitError, match="no field 'text'.*body, y"):
        list(iter_documents([f"hf:{jsonl}"]))
    txt = tmp_path / "lines.txt"
    txt.write_text("alpha\nbeta\n", encoding="utf-8")
    assert [d.text for d in iter_documents([f"hf:{txt}"])] == ["alpha", "beta"]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["x y", "", "z"]}).save_to_disk(str(saved))
    assert [d.text for d in iter_documents([f"hf:{saved}"])] == ["x y", "z"]


def test_parse_hf_spec():
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:train") == ("wikitext", "wikitext-2-raw-v1", "train", False)
    assert parse_hf_spec("hf:org/name") == ("org/name", None, None, False)
    with pytest.raises(EncoderkitError, match="does not exist"):
        parse_hf_spec("hf:./missing.jsonl")


def test_builtin_stdlib_is_deterministic_and_skips_tests():
    first = list(itertools.islice(iter_documents(["builtin:stdlib"]), 6))
    again = list(itertools.islice(iter_documents(["builtin:stdlib"]), 6))
    assert first == again and len(first) == 6
    assert all(d.text.strip() and d.source.startswith("builtin:stdlib/") for d in first)
    assert [d.source for d in first] == sorted(d.source for d in first)
    assert not any("/test/" in f.as_posix() or "/idlelib/" in f.as_posix() for f in stdlib_files())


@pytest.mark.slow
def test_builtin_stdlib_whole_corpus_is_a_few_megabytes():
    stats = ReadStats()
    docs = list(iter_documents(["builtin:stdlib"], stats=stats))
    assert 200 < len(docs) == stats.documents
    assert 300_000 < stats.text_bytes < 8_000_000
    assert len({d.source for d in docs}) == len(docs)


# -- bad inputs ----------------------------------------------------------------------------------------
def test_missing_path_is_named(tmp_path):
    with pytest.raises(EncoderkitError, match=r"nope\.txt does not exist"):
        iter_documents([str(tmp_path / "nope.txt")])  # raised at the call, before reading


def test_empty_corpus_fails(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\n\t\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(EncoderkitError, match="no non-empty document"):
        list(iter_documents([str(tmp_path / "blank.txt"), str(tmp_path / "empty.jsonl")]))


def test_non_utf8_names_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"hello\nwor" + "é".encode("latin-1") + b"ld\n")
    with pytest.raises(EncoderkitError, match=r"latin\.txt:2: not UTF-8 \(byte offset 9\).*--skip-bad-encoding"):
        list(iter_documents(str(path), doc_split="line"))


def test_real_latin1_gutenberg_file_offset_and_skip_count(shared_data, tmp_path):
    bad = shared_data / "mlm_corpus_gutenberg" / "nltk_gutenberg_selection" / "shakespeare-caesar.txt.gz"
    data = gzip.decompress(bad.read_bytes())
    with pytest.raises(UnicodeDecodeError) as info:
        data.decode("utf-8")
    offset = info.value.start
    assert first_bad_utf8_offset(str(bad)) == offset
    with pytest.raises(EncoderkitError, match=rf"uncompressed byte offset {offset}\)"):
        list(iter_documents(str(bad)))
    good = tmp_path / "good.txt"
    good.write_text("a clean document\n", encoding="utf-8")
    skipped: list[tuple[str, str]] = []
    stats = ReadStats()
    docs = list(iter_documents([str(bad), str(good)], skip_bad_encoding=True,
                               on_skip=lambda s, why: skipped.append((s, why)), stats=stats))
    assert [d.text for d in docs] == ["a clean document"]
    assert stats.skipped_files == 1 and skipped[0][0] == str(bad) and str(offset) in skipped[0][1]
    with pytest.raises(EncoderkitError, match=r"no non-empty document \(1 file\(s\) skipped"):
        list(iter_documents([str(bad)], skip_bad_encoding=True))


def test_jsonl_bad_line_and_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n', encoding="utf-8")
    with pytest.raises(EncoderkitError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_documents(str(path)))
    path.write_text('{"text": "ok"}\n\n{"body": "x", "id": 3}\n', encoding="utf-8")
    with pytest.raises(EncoderkitError, match=r"bad\.jsonl:3: no field 'text' \(fields found: body, id\)"):
        list(iter_documents(str(path)))
    path.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(EncoderkitError, match=r"bad\.jsonl:1: field 'text' holds a int"):
        list(iter_documents(str(path)))


def test_table_without_the_column_lists_columns(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text('id,body\n1,"hello, world"\n', encoding="utf-8")
    with pytest.raises(EncoderkitError, match=r"t\.csv:1: no column 'text'.*columns found: id, body"):
        list(iter_documents(str(csv_path)))
    assert [d.text for d in iter_documents(str(csv_path), text_column="body")] == ["hello, world"]
    headerless = tmp_path / "h.csv"
    headerless.write_text('1,"a, b"\n2,"multi\nline"\n3,c\n', encoding="utf-8")
    docs = list(iter_documents(str(headerless), text_column="1"))
    assert [(d.text, d.line) for d in docs] == [("a, b", 1), ("multi\nline", 2), ("c", 4)]
    tsv_path = tmp_path / "t.tsv"
    tsv_path.write_text("id\tbody\n1\tfine\n2\n", encoding="utf-8")
    with pytest.raises(EncoderkitError, match=r"t\.tsv:3: 1 tab-separated field"):
        list(iter_documents(str(tsv_path), text_column="body"))


def test_bad_doc_split_and_empty_source_list():
    with pytest.raises(EncoderkitError, match="doc_split"):
        iter_documents(["x"], doc_split="page")
    with pytest.raises(EncoderkitError, match="no corpus given"):
        iter_documents([])
    with pytest.raises(EncoderkitError, match="unknown built-in corpus"):
        iter_documents(["builtin:nothing"])


def test_document_is_a_small_value():
    d = Document("t", "s", 3)
    assert (d.text, d.source, d.line) == ("t", "s", 3)
