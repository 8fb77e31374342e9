"""Crash-safe file replacement: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def fsync_dir(directory: Path) -> None:
    """Persist a rename: without it a power loss can forget the new directory entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(final: Path, staging: Path) -> Iterator[BinaryIO]:
    """Yield a temp file in `staging` that replaces `final` when the block ends cleanly.

    The temp name is `<final name>.tmp-<uuid>`: it never ends in `.parquet`, and
    `staging` should be a folder readers do not glob, on the same filesystem as
    `final` (so `os.replace` is atomic). On error the temp file is removed.
    """
    staging.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = staging / f"{final.name}.tmp-{uuid.uuid4().hex}"
    try:
        with open(temp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
