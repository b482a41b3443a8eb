"""An output folder written whole or not at all, and nothing of the user's lost on the way.

A run writes into a fresh folder beside the one it was given (:class:`Staging`: ``.<name>.dpq-partial-<token>``
in the same parent, so the moves below are renames on one file system); only when the whole save
succeeded does :meth:`Staging.commit` move what it wrote into place, merged into what is there:

* an entry that is not there yet is renamed in (a folder that did not exist is renamed in whole);
* a folder the run wrote where a folder of that name already is (an earlier model's) is merged the
  same way, so what the run did not write stays, as auto-round keeps it (a user's notes beside the
  model); except an earlier model's weight files (:data:`WEIGHT_SUFFIXES`) in a folder the run wrote
  weights into: beside the new weights they would be stale shards of another model, so they go
  (:attr:`Staging.dropped` names them);
* a file of the same name is renamed aside first and removed once the new one is in.

Symlinks are followed, never replaced or unlinked: the folder given, or a folder or file in it, that
is a symlink receives the new content at its target.

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

__all__ = ["OWNER", "WEIGHT_SUFFIXES", "Staging"]

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
        beside = self.real.parent / f".{self.real.name}.dpq-partial-{self.token}"
        try:
            beside.mkdir(parents=True)
            self.dir = beside
        except PermissionError:  # e.g. --output_dir is a mount point the user owns, its parent is not
            self.dir = self.real / f".dpq-partial-{self.token}"
            self.dir.mkdir(parents=True)
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
        """Move what was written into place (module docstring)."""
        with cancel.uninterrupted():
            self._release()
            (self.dir / OWNER).unlink(missing_ok=True)
            if not self.real.exists():
                os.replace(self.dir, self.real)
            else:
                aside: list[Path] = []
                _merge(self.dir, self.real, f".dpq-old-{self.token}", aside, self.dropped)
                self.dir.rmdir()
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


def _merge(new: Path, old: Path, suffix: str, aside: list[Path], dropped: list[Path]) -> None:
    """Every entry of ``new`` into the folder ``old`` (module docstring); what it replaces is renamed
    aside (``.<name><suffix>``, listed in ``aside``) for the caller to remove once everything is in."""
    entries = sorted(new.iterdir())
    weights_here = any(_is_weights(e) for e in entries)
    for entry in entries:
        target = old / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir():
            _merge(entry, Path(os.path.realpath(target)), suffix, aside, dropped)
            entry.rmdir()
            continue
        target = Path(os.path.realpath(target))  # a symlink's target gets the new content
        if target.exists():
            aside.append(_set_aside(target, suffix))
        _move(entry, target)
    if weights_here:  # the new weights are here: an earlier model's others are stale
        written = {e.name for e in entries}
        for stale in sorted(p for p in old.iterdir() if p.name not in written and _is_weights(p)):
            aside.append(_set_aside(stale, suffix))
            dropped.append(stale)


def _is_weights(path: Path) -> bool:
    return path.is_file() and not path.is_symlink() and path.name.endswith(WEIGHT_SUFFIXES)


def _set_aside(path: Path, suffix: str) -> Path:
    moved = path.with_name(f".{path.name}{suffix}")
    os.replace(path, moved)
    return moved


def _move(src: Path, dst: Path) -> None:
    """A rename; a copy where ``dst`` is on another file system (a symlink's target elsewhere)."""
    try:
        os.replace(src, dst)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.move(str(src), str(dst))


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
