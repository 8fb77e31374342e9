"""Processes that never outlive the process that started them (Linux; a watch elsewhere).

Nothing runs in a process killed by SIGKILL (the OOM killer, an orchestrator, `kill -9`),
so it cannot stop its children: they must notice by themselves. Before this, a `kill -9`
of `vlmbatch worker` left its GPU processes and their preprocessing pools running as
orphans, holding GPUs and memory for minutes. Two mechanisms, because each has a gap:

- `PR_SET_PDEATHSIG` (`prctl`, through ctypes): the kernel signals the child the moment its
  parent dies. It is Linux-only, it fires when the parent *thread* that started the child
  ends (so only processes started from their parent's main thread use it), it is cleared
  in the children of a fork (each generation sets its own), and a parent that died before
  the call leaves nothing to fire: the caller checks `os.getppid()` against the parent it
  was given right after setting it.
- A watch thread, for the rest: `watch_parent` polls `os.getppid()` against the recorded
  parent (re-parenting to init or a subreaper means it died); `watch_pipe` waits for EOF on
  a pipe whose only write end the owner holds and never writes, which works for an owner
  that is not the parent (a pool's workers are forked by a fork server, not by the pool's
  owner). Either way the process ends with `os._exit`, skipping clean-up: whatever it was
  doing belongs to a process that is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The exit code of a process that found its parent (or owner) gone.
ORPHANED_EXIT_CODE = 70
WATCH_INTERVAL_S = 0.5


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies; False where
    the platform has no such thing (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return True


def _orphaned() -> None:
    os._exit(ORPHANED_EXIT_CODE)


def _watch(until_dead: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread that runs `until_dead` (it returns once the parent or owner is gone),
    then ends this process."""
    thread = threading.Thread(target=lambda: (until_dead(), _orphaned()), name=name, daemon=True)
    thread.start()
    return thread


def watch_parent(parent_pid: int, interval: float = WATCH_INTERVAL_S) -> threading.Thread:
    """A daemon thread that ends this process once its parent is no longer `parent_pid`."""

    def until_dead() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)

    return _watch(until_dead, "vlmbatch-parent-watch")


def watch_pipe(owner_alive: Connection) -> threading.Thread:
    """A daemon thread that ends this process when `owner_alive` reports EOF (or data):
    its owner holds the only write end and never writes, so that means the owner died."""
    return _watch(lambda: wait([owner_alive]), "vlmbatch-owner-watch")


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Never outlive `parent_pid`, the process that started this one: the parent-death
    signal, a check that the parent did not die before it was set, and a watch thread."""
    set_parent_death_signal(signum)
    if os.getppid() != parent_pid:
        _orphaned()
    watch_parent(parent_pid)
