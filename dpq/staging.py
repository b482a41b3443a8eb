"""An output folder written whole or not at all, and nothing of the user's lost on the way.

A run writes into a fresh folder beside the one it was given (:class:`Staging`: ``.<name>.dpq-partial-<token>``
in the same parent), or inside it where the folder is on another file system than its parent (a mount
point: a container's volume) or its parent cannot be written (:func:`staging_place`), so the moves below
are renames on one file system; only when the whole save succeeded does :meth:`Staging.commit` move what
it wrote into place, merged into what is there:

* an entry that is not there yet is renamed in (a folder that did not exist is renamed in whole);
* a folder the run wrote where a folder of that name already is (an earlier model's) is merged the
  same way, so what the run did not write stays, as auto-round keeps it (a user's notes beside the
  model); except an earlier model's weight files (:data:`WEIGHT_SUFFIXES`) in a folder the run wrote
  weights into: beside the new weights they would be stale shards of another model, so they go
  (:attr:`Staging.dropped` names them);
* a file of the same name is renamed aside first and removed once the new one is in.

Symlinks are followed, never replaced or unlinked: the folder given, or a folder or file in it, that
is a symlink receives the new content at its target (a target on another file system is copied to a
temporary name beside it, then renamed).

Note [a commit is all or nothing]
Every step of the commit is recorded as it is taken (an entry moved in, a file set aside); if any step
fails (a full disk while copying to a symlink's target, a file system error), the steps taken are undone
in reverse order (what was moved in goes back, what was set aside comes back) before the error is
raised, so "the folder given is exactly as it was" stays true of a failed commit too.

A failed or cancelled run removes the staging folder (:meth:`Staging.discard`; the cancel watcher
does it too, :func:`dpq.cancel.on_exit`), so the folder given is exactly as it was: a model saved
there before is bitwise untouched, and no folder looks like a complete model without being one. The
commit runs under :func:`dpq.cancel.uninterrupted`: a cancel before it refuses it, one during it
waits for its end.

A run killed outright (SIGKILL, a host gone) cannot remove its staging folder. Each staging folder
holds a lock on its :data:`OWNER` file for as long as its run lives (``flock``: the kernel lets go
of it when the process ends), so a later run into the same folder tells a leftover (nobody holds its
lock) from another live run's folder: it removes the leftovers that hold nothing but their lock file
and names the others (:attr:`Staging.leftovers`); another run's folder in use is not touched.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import uuid
from pathlib import Path

from dpq import cancel

try:
    import fcntl
except ImportError:  # not POSIX: no lock, so no leftover is ever removed (each is only named)
    fcntl = None

__all__ = ["OWNER", "WEIGHT_SUFFIXES", "Staging", "staging_place"]

OWNER = ".dpq-owner"  # inside a staging folder: locked by its run while it lives
# An earlier model's files that a new model's weights make stale when left beside them (its index too)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class Staging:
    """``final``: the folder the caller asked for (its path as given: :meth:`path_in_place`). ``dir``:
    where the run writes instead (made here; beside ``final``'s real path, or inside it when that
    parent cannot be written). ``leftovers``: staging folders of killed runs into the same folder,
    each holding more than its lock file (named, not removed); ``removed``: those that held nothing
    else (removed here). ``dropped``: after :meth:`commit`, the earlier model's weight files it
    removed (module docstring)."""

    def __init__(self, final: str | os.PathLike) -> None:
        self.final = Path(final)
        self.real = Path(os.path.realpath(self.final))  # a symlink given is followed, never replaced
        self.token = uuid.uuid4().hex[:12]
        self.leftovers, self.removed = _sweep(self.real)
        self.dropped: list[Path] = []
        place = staging_place(self.real)
        inside = self.real / f".dpq-partial-{self.token}"
        self.dir = place / f".{self.real.name}.dpq-partial-{self.token}" if place == self.real.parent else inside
        try:
            self.dir.mkdir(parents=True)
        except OSError:  # the parent refuses (not this user's, a read-only mount): inside, where it can
            if self.dir == inside or not self.real.is_dir():
                raise
            self.dir = inside
            self.dir.mkdir()
        self._owner = _hold(self.dir / OWNER)
        self._unregister = cancel.on_exit(self.discard)

    def path_in_place(self, path: str | os.PathLike) -> str:
        """Where ``path`` (under :attr:`dir`) is once committed; other paths unchanged."""
        p = Path(path)
        try:
            return str(self.final / p.relative_to(self.dir))
        except ValueError:
            return str(path)

    def commit(self) -> None:
        """Move what was written into place (module docstring); all or nothing (Note [a commit is all or
        nothing]): on a failure the folder given is put back as it was and the error raised."""
        with cancel.uninterrupted():
            self._release()
            (self.dir / OWNER).unlink(missing_ok=True)
            if not self.real.exists():
                os.replace(self.dir, self.real)
            else:
                aside: list[Path] = []
                undo: list[tuple[str, Path, Path]] = []
                try:
                    _merge(self.dir, self.real, f".dpq-old-{self.token}", aside, self.dropped, undo)
                except BaseException:
                    _undo(undo)
                    self.dropped.clear()
                    raise
                for old in aside:
                    _remove(old)
        self._unregister()

    def discard(self) -> None:
        """Remove what was written (best effort); the folder given stays as it was."""
        self._release()
        _remove(self.dir)
        self._unregister()

    def _release(self) -> None:
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None


def _merge(new: Path, old: Path, suffix: str, aside: list[Path], dropped: list[Path],
           undo: list[tuple[str, Path, Path]]) -> None:
    """Every entry of ``new`` into the folder ``old`` (module docstring); what it replaces is renamed
    aside (``.<name><suffix>``, listed in ``aside``) for the caller to remove once everything is in.
    Each step taken is appended to ``undo`` (Note [a commit is all or nothing])."""
    entries = sorted(new.iterdir())
    weights_here = any(_is_weights(e) for e in entries)
    for entry in entries:
        target = old / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir():
            _merge(entry, Path(os.path.realpath(target)), suffix, aside, dropped, undo)
            continue
        target = Path(os.path.realpath(target))  # a symlink's target gets the new content
        if target.exists():
            aside.append(_set_aside(target, suffix))
            undo.append(("aside", target, aside[-1]))
        _move(entry, target)
        undo.append(("moved", entry, target))
    if weights_here:  # the new weights are here: an earlier model's others are stale
        written = {e.name for e in entries}
        for stale in sorted(p for p in old.iterdir() if p.name not in written and _is_weights(p)):
            aside.append(_set_aside(stale, suffix))
            undo.append(("aside", stale, aside[-1]))
            dropped.append(stale)
    new.rmdir()  # (its entries are in place; a failure before leaves it for the discard)


def _undo(steps: list[tuple[str, Path, Path]]) -> None:
    """The commit's steps undone, last first: what was moved in goes back to the staging folder, what was
    set aside comes back (best effort: each step is tried whatever the others did)."""
    for kind, first, second in reversed(steps):
        with contextlib.suppress(OSError):
            if kind == "moved":
                first.parent.mkdir(parents=True, exist_ok=True)
                _move(second, first)
            else:
                os.replace(second, first)


def _is_weights(path: Path) -> bool:
    return path.is_file() and not path.is_symlink() and path.name.endswith(WEIGHT_SUFFIXES)


def _set_aside(path: Path, suffix: str) -> Path:
    moved = path.with_name(f".{path.name}{suffix}")
    os.replace(path, moved)
    return moved


def _move(src: Path, dst: Path) -> None:
    """A rename; where ``dst`` is on another file system (a symlink's target elsewhere), a copy to a
    temporary name beside ``dst`` then a rename, so ``dst`` is never a partial file."""
    try:
        os.replace(src, dst)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        partial = dst.with_name(f".{dst.name}.dpq-copy-{uuid.uuid4().hex[:8]}")
        try:
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, partial, symlinks=True)
            else:
                shutil.copy2(src, partial, follow_symlinks=False)
            os.replace(partial, dst)
        except BaseException:
            _remove(partial)
            raise
        _remove(src)


def staging_place(real: Path) -> Path:
    """Where the staging folder for the output folder ``real`` (a real path) goes: beside it, in its
    parent, so that moving in is a rename; inside it where it exists on another file system than its
    parent (a mount point) or where the parent cannot be written."""
    parent = real.parent
    if real.is_dir() and _device(real) != _device(parent):
        return real
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if real.is_dir() and not _writable(probe):
        return real
    return parent


def _device(path: Path) -> int:
    return os.stat(path).st_dev


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def _hold(path: Path) -> int | None:
    """Create ``path`` and hold an exclusive lock on it for this run (None: no locks here)."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _abandoned(folder: Path) -> bool:
    """Whether ``folder``'s run is gone: it has a lock file and nobody holds the lock."""
    if fcntl is None:
        return False
    try:
        fd = os.open(folder / OWNER, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # no lock file: not one of ours to judge (or its run is just starting)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held: a live run writes there
    finally:
        os.close(fd)


def _sweep(real: Path) -> tuple[list[Path], list[Path]]:
    """(leftovers named, leftovers removed): staging folders of runs into ``real`` that are gone
    (module docstring). One that holds only its lock file is removed; the others are named."""
    pattern = [real.parent / f".{glob.escape(real.name)}.dpq-partial-*", real / ".dpq-partial-*"]
    found = sorted(Path(p) for g in pattern for p in glob.glob(str(g)))
    named, removed = [], []
    for folder in found:
        if folder.is_symlink() or not folder.is_dir() or not _abandoned(folder):
            continue
        if [p.name for p in folder.iterdir()] == [OWNER]:
            (folder / OWNER).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()
                removed.append(folder)
                continue
        named.append(folder)
    return named, removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
