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
