"""Output folders and files get a normal file's permissions (the umask applies, as for any new file), and
``export`` copies its files instead of hard-linking them to the source folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.io import output_dir, write_json_atomic, write_text_atomic
from tests.test_write_failures import _pretrain_args, one_thread, store  # noqa: F401  (fixtures)


@pytest.fixture
def umask():
    """Set a umask for the test; the previous one is restored after."""
    before = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(before)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask,folder,file", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640), (0o002, 0o775, 0o664)])
def test_atomic_outputs_respect_the_umask(tmp_path, umask, mask, folder, file):
    umask(mask)
    with output_dir(tmp_path / "out") as tmp:
        write_json_atomic(tmp / "a.json", {"x": 1})
        (tmp / "plain.txt").write_text("written the ordinary way")
    write_text_atomic(tmp_path / "single.txt", "x")
    out = tmp_path / "out"
    assert _mode(out) == folder
    assert _mode(out / "a.json") == _mode(out / "plain.txt") == _mode(tmp_path / "single.txt") == file


def test_a_pretrained_model_folder_and_its_checkpoints_are_0755_and_0644(store, tmp_path, umask, one_thread):  # noqa: F811
    from encoderkit.cli import main

    umask(0o022)
    assert main(_pretrain_args(store, tmp_path / "model")) == 0
    paths = [p for root in (tmp_path / "model", tmp_path / "model-run") for p in [root, *root.rglob("*")]]
    assert {oct(_mode(p)) for p in paths if p.is_dir()} == {"0o755"}
    files = {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in paths if p.is_file()}
    assert set(files.values()) == {"0o644"}, files
    assert "model/encoderkit.json" in files and "model-run/checkpoints/step-0000006/state.json" in files


def test_export_copies_files_so_editing_one_folder_leaves_the_other(tmp_path_factory, tiny_tokenizer_dir, tmp_path,
                                                                    umask):
    from encoderkit.inference.export import ExportConfig, run

    umask(0o022)
    src = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "classify")
    out = tmp_path / "onnx"
    run(ExportConfig(model=str(src), out=str(out), quantize="none"))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).stat().st_ino != (src / name).stat().st_ino and (out / name).stat().st_nlink == 1
        assert _mode(out / name) == 0o644
    before = (src / "config.json").read_bytes()
    with open(out / "config.json", "r+b") as f:  # an in-place edit, as an editor or a script would make
        f.seek(0)
        f.write(b"{   ")
    assert (src / "config.json").read_bytes() == before
