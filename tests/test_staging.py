"""An output folder written whole or not at all (dpq.staging): what a run writes appears in place
only on commit; a discard (a failed or cancelled run) leaves the folder given exactly as it was."""

from __future__ import annotations

import os
import signal
from pathlib import Path

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


def test_a_rerun_keeps_what_is_not_the_models(tmp_path):
    """Issue 31, item 2: a rerun into a model folder that holds the user's own file: the model is
    replaced (an earlier model's weights the new one does not have go), the user's file stays, as
    auto-round keeps it."""
    out = tmp_path / "out"
    _write(out, {"m-w4g128/config.json": b"old", "m-w4g128/model-00001-of-00002.safetensors": b"old",
                 "m-w4g128/model.safetensors.index.json": b"old", "m-w4g128/inner_notes.txt": b"mine",
                 "m-w4g128/extra/readme.md": b"mine too"})
    staging = Staging(out)
    _write(staging.dir, {"m-w4g128/config.json": b"new", "m-w4g128/model.safetensors": b"new"})
    staging.commit()
    assert tree_bytes(out) == {"m-w4g128/config.json": b"new", "m-w4g128/model.safetensors": b"new",
                               "m-w4g128/inner_notes.txt": b"mine", "m-w4g128/extra/readme.md": b"mine too"}
    assert sorted(p.name for p in staging.dropped) == ["model-00001-of-00002.safetensors",
                                                       "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_symlinks_are_followed_never_replaced(tmp_path):
    """--output_dir a symlink to a folder elsewhere, and a model file in it a symlink: the new
    content lands at their targets and both links stay links."""
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    _write(elsewhere, {"m/config.json": b"old", "real_tok.json": b"old"})
    out.symlink_to(elsewhere)
    (elsewhere / "m" / "tokenizer.json").symlink_to(elsewhere / "real_tok.json")
    staging = Staging(out)
    assert staging.dir.parent == tmp_path  # beside the link's target, whose parent is the same here
    _write(staging.dir, {"m/config.json": b"new", "m/tokenizer.json": b"new tok"})
    staging.commit()
    assert out.is_symlink() and (elsewhere / "m" / "tokenizer.json").is_symlink()
    assert (elsewhere / "real_tok.json").read_bytes() == b"new tok"
    assert (out / "m" / "config.json").read_bytes() == b"new"
    assert staging.path_in_place(staging.dir / "m") == str(out / "m")


def _abandoned_staging(parent, name: str, files: dict[str, bytes]):
    """A staging folder as a killed run leaves it: its lock file (dpq.staging.OWNER, named here so that
    the test runs against code without it too), held by nobody, and what it wrote."""
    folder = parent / name
    _write(folder, {".dpq-owner": b"", **files})
    return folder


def test_leftovers_of_killed_runs_are_named_or_removed(tmp_path):
    """Issue 31, item 9: a killed run's staging folder stays beside the output; a later run names it
    (it holds a partial model), removes one that holds nothing but its lock file, and leaves a live
    run's folder alone."""
    out = tmp_path / "out"
    live = Staging(out)  # another run into the same folder, still writing
    partial = _abandoned_staging(tmp_path, ".out.dpq-partial-aaaa", {"m/model-00001.safetensors": b"partial"})
    empty = _abandoned_staging(tmp_path, ".out.dpq-partial-bbbb", {})
    other = _abandoned_staging(tmp_path, ".other.dpq-partial-cccc", {})  # another output's: not ours to judge
    later = Staging(out)
    assert later.leftovers == [partial] and later.removed == [empty] and not empty.exists()
    assert partial.exists() and other.exists() and live.dir.exists() and live.dir not in later.leftovers
    later.discard()
    live.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([partial.name, other.name])
    from dpq.staging import OWNER

    assert OWNER == ".dpq-owner"  # the name _abandoned_staging writes


def test_a_commit_that_fails_midway_puts_the_folder_back(tmp_path, monkeypatch):
    """Issue 42's sweep, H1: a commit that failed after part of the new model was moved in (a full disk, an
    I/O error) left the new config beside a truncated shard and the earlier model renamed to hidden files,
    while the run said the folder was as it was. Every step is undone now (Note [a commit is all or nothing])."""
    import errno

    from dpq import staging as staging_mod

    out = tmp_path / "out"
    _write(out, {"m/config.json": b"old", "m/model.safetensors": b"old weights", "notes.txt": b"mine"})
    before = tree_bytes(out)
    staging = Staging(out)
    _write(staging.dir, {"m/config.json": b"new", "m/model.safetensors": b"new weights", "m/tokenizer.json": b"t"})
    real_move, moved = staging_mod._move, []

    def failing(src, dst):
        if moved:  # the second move fails, as a disk filling up would
            raise OSError(errno.EIO, "Input/output error")
        moved.append(dst)
        real_move(src, dst)

    monkeypatch.setattr(staging_mod, "_move", failing)
    with pytest.raises(OSError, match="Input/output error"):
        staging.commit()
    monkeypatch.setattr(staging_mod, "_move", real_move)
    assert moved and tree_bytes(out) == before  # the new config moved in, then taken back out
    staging.discard()
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_copy_to_another_file_system_never_leaves_a_partial_file(tmp_path, monkeypatch):
    """A move across file systems (a symlink's target elsewhere) copies to a temporary name and renames it:
    a copy that fails leaves the target as it was, and no temporary file."""
    import errno
    import shutil

    from dpq import staging as staging_mod

    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    real_replace = os.replace

    def cross_device(a, b):
        if Path(a) == src:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(a, b)

    def full(a, b, **k):
        Path(b).write_bytes(b"ne")  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging_mod.os, "replace", cross_device)
    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(OSError, match="No space left"):
        staging_mod._move(src, dst)
    assert dst.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["dst.bin", "src.bin"]


def test_a_mount_point_stages_inside_itself(tmp_path, monkeypatch):
    """Issue 42's sweep, H1: --output_dir a mount point (a container's volume) was staged in its parent, on
    another file system, so the commit copied across file systems. Staged inside it now (a rename away)."""
    from dpq import staging as staging_mod

    out = tmp_path / "vol"
    out.mkdir()
    real_device = staging_mod._device
    monkeypatch.setattr(staging_mod, "_device", lambda p: 99 if Path(p) == out else real_device(p))
    assert staging_mod.staging_place(out) == out
    staging = Staging(out)
    assert staging.dir.parent == out
    _write(staging.dir, {"m/config.json": b"new"})
    staging.commit()
    assert tree_bytes(out) == {"m/config.json": b"new"}
    assert staging_mod.staging_place(tmp_path / "not-yet") == tmp_path  # a folder still to make: beside it
