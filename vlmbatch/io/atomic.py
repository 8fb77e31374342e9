"""Crash-safe commits: a reader sees no file or a whole one, never half of one.

Every commit writes a temp file first. For a local destination it lives in `staging`
(outside the folders readers glob, on the same filesystem), is fsync'd, then moved into
place and the folder fsync'd. For an object-storage destination it lives in the local
temp folder, never in the bucket (so no staging object can match a results glob), and is
uploaded in one piece: a store shows an object only once its upload has completed.

Two kinds of commit:
- `atomic_file` replaces what is there (`os.replace`; an unconditional put).
- `write_new` creates the file only if it does not exist yet, and says whether this writer
  won: `os.link`, which fails on an existing name (also on NFS); on S3 a conditional put
  (`If-None-Match: *`, see `Storage.put_new`). Two writers racing for one name: exactly one
  wins and the loser's file is dropped, so the name never changes content once committed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from vlmbatch.io.storage import Location, ObjectPath


def fsync_dir(directory: Path) -> None:
    """Persist a rename: without it a power loss can forget the new directory entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _staged(final: Location, staging: Location | None) -> Iterator[tuple[BinaryIO, Path]]:
    """A temp file for `final`, removed when the block ends however it ends.

    Its name is `<final name>.tmp-<random>`: it never ends in `.parquet`.
    """
    if isinstance(final, Path):
        folder = staging if isinstance(staging, Path) else final.parent
        folder.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = folder / f"{final.name}.tmp-{uuid.uuid4().hex}"
    else:
        fd, name = tempfile.mkstemp(prefix=f"{final.name}.tmp-")
        os.close(fd)
        temp = Path(name)
    try:
        with open(temp, "wb") as handle:
            yield handle, temp
    finally:
        temp.unlink(missing_ok=True)


def _flush(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


@contextmanager
def atomic_file(final: Location, staging: Location | None = None) -> Iterator[BinaryIO]:
    """Yield a temp file that replaces `final` when the block ends cleanly (on error the
    temp file is removed and `final` is untouched). `staging` is used for local files."""
    with _staged(final, staging) as (handle, temp):
        yield handle
        _flush(handle)
        if isinstance(final, ObjectPath):
            final.storage.put(temp, final.path)
            return
        os.replace(temp, final)
    fsync_dir(final.parent)


def write_new(final: Location, write: Callable[[BinaryIO], None], staging: Location | None = None) -> bool:
    """Commit what `write` writes as `final` unless `final` exists; True if this call
    committed it, False if another writer had (this writer's file is dropped)."""
    with _staged(final, staging) as (handle, temp):
        write(handle)
        _flush(handle)
        if isinstance(final, ObjectPath):
            return final.storage.put_new(temp, final.path)
        try:
            os.link(temp, final)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: look, then move (not race-free)
            if final.exists():
                return False
            os.replace(temp, final)
    fsync_dir(final.parent)
    return True
