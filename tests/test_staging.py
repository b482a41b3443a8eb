"""An output folder written whole or not at all (dpq.staging): what a run writes appears in place
only on commit; a discard (a failed or cancelled run) leaves the folder given exactly as it was."""

from __future__ import annotations

import signal

import pytest

from dpq import cancel
from dpq.staging import Staging
from tests.test_cli import tree_bytes


def _write(root, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_a_new_folder_appears_whole_on_commit(tmp_path):
    staging = Staging(tmp_path / "out")
    assert staging.dir.parent == tmp_path and staging.dir.name.startswith(".out.dpq-partial-")
    _write(staging.dir, {"m-w4g128/config.json": b"{}", "m-w4g128/model.safetensors": b"w"})
    assert not (tmp_path / "out").exists()
    assert staging.path_in_place(staging.dir / "m-w4g128") == str(tmp_path / "out" / "m-w4g128")
    staging.commit()
    assert tree_bytes(tmp_path / "out") == {"m-w4g128/config.json": b"{}", "m-w4g128/model.safetensors": b"w"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_commit_replaces_an_earlier_model_and_leaves_the_rest(tmp_path):
    out = tmp_path / "out"
    _write(out, {"m-w4g128/config.json": b"old", "m-w4g128/model-shard-00001.safetensors": b"old",
                 "notes.txt": b"mine"})
    staging = Staging(out)
    _write(staging.dir, {"m-w4g128/config.json": b"new", "m-w4g128/model.safetensors": b"new"})
    staging.commit()
    assert tree_bytes(out) == {"m-w4g128/config.json": b"new", "m-w4g128/model.safetensors": b"new",
                               "notes.txt": b"mine"}  # no shard of the earlier model beside the new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in out.iterdir()) == [
        "m-w4g128", "notes.txt"]


def test_discard_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    _write(out, {"m-w4g128/config.json": b"good", "m-w4g128/model.safetensors": b"good"})
    before = tree_bytes(out)
    staging = Staging(out)
    _write(staging.dir, {"m-w4g128/model-shard-00001.safetensors": b"partial"})
    staging.discard()
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_cancel_before_the_commit_refuses_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _write(out, {"m/config.json": b"good"})
    staging = Staging(out)
    _write(staging.dir, {"m/config.json": b"new"})
    monkeypatch.setattr(cancel._state, "signum", signal.SIGTERM)
    with pytest.raises(cancel.Cancelled, match="SIGTERM"):
        staging.commit()
    staging.discard()
    assert tree_bytes(out) == {"m/config.json": b"good"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_unwritable_parent_stages_inside(tmp_path, monkeypatch):
    """--output_dir whose parent cannot be written (a mount point the user owns): staged inside it."""
    out = tmp_path / "out"
    out.mkdir()
    real_mkdir = type(out).mkdir

    def mkdir(self, *a, **k):
        if self.parent == tmp_path and self.name.startswith(".out.dpq-partial-"):
            raise PermissionError(13, "Permission denied")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(type(out), "mkdir", mkdir)
    staging = Staging(out)
    assert staging.dir.parent == out
    _write(staging.dir, {"m/config.json": b"new"})
    staging.commit()
    assert tree_bytes(out) == {"m/config.json": b"new"}
