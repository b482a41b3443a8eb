"""An output folder written whole or not at all.

A run writes into a fresh folder beside the one it was given (:class:`Staging`: ``.<name>.dpq-partial-<token>``
in the same parent, so the moves below are renames on one file system); only when the whole save
succeeded does :meth:`Staging.commit` move what it wrote into place, entry by entry: a new entry is
renamed in; an entry of the same name already there (an earlier model's folder) is renamed aside
first and removed once the new one is in. A folder that did not exist is renamed into place
whole. A failed or cancelled run removes the staging folder (:meth:`Staging.discard`; the cancel
watcher does it too, :func:`dpq.cancel.on_exit`), so the folder given is exactly as it was: a
model saved there before is bitwise untouched, and no folder looks like a complete model without
being one. The commit runs under :func:`dpq.cancel.uninterrupted`: a cancel before it refuses it,
one during it waits for its end.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from dpq import cancel

__all__ = ["Staging"]


class Staging:
    """``final``: the folder the caller asked for. ``dir``: where the run writes instead (made
    here; beside ``final``, or inside it when its parent cannot be written)."""

    def __init__(self, final: str | os.PathLike) -> None:
        self.final = Path(final)
        self.token = uuid.uuid4().hex[:12]
        beside = self.final.parent / f".{self.final.name}.dpq-partial-{self.token}"
        try:
            beside.mkdir(parents=True)
            self.dir = beside
        except PermissionError:  # e.g. --output_dir is a mount point the user owns, its parent is not
            self.dir = self.final / f".dpq-partial-{self.token}"
            self.dir.mkdir(parents=True)
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
            if not self.final.exists():
                os.replace(self.dir, self.final)
            else:
                aside = []
                for entry in sorted(self.dir.iterdir()):
                    target = self.final / entry.name
                    if target.exists() or target.is_symlink():
                        old = self.final / f".{entry.name}.dpq-old-{self.token}"
                        os.replace(target, old)
                        aside.append(old)
                    os.replace(entry, target)
                self.dir.rmdir()
                for old in aside:
                    _remove(old)
        self._unregister()

    def discard(self) -> None:
        """Remove what was written (best effort); the folder given stays as it was."""
        _remove(self.dir)
        self._unregister()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
