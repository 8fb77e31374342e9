"""`vlmbatch worker`: one worker process per GPU, restarted when it dies.

Each child gets the configuration `vlmbatch worker` built from its flags and variables on
its command line (`ProcessConfigs`). It is pinned to its GPU with `CUDA_VISIBLE_DEVICES`
before it starts (CUDA reads it once, at initialisation), and given its own share of this
process's cores (`VLMBATCH_WORKER_CPUS`: 8 each for two GPUs on 16 cores), both in its
environment; the share sizes its preprocessing pool and, unless the worker configuration
says not to pin (`VLMBATCH_PIN_WORKER_CPUS=0`), is all it runs on. Children run in their
own session so a terminal's Ctrl+C reaches only the supervisor, which forwards every
SIGTERM/SIGINT/SIGQUIT exactly once: that keeps Celery's "first Ctrl+C warm, second cold"
meaning intact. A child that dies (OOM, `kill -9`, a poison row) is restarted after a
short back-off; its shard comes back to the queue through the visibility timeout.

Children never outlive the supervisor, whatever kills it (`kill -9` included): each one
sets the parent-death signal on itself and watches its parent (`vlmbatch.lifeline`, given
this process's id on its command line), and their preprocessing pools watch them in turn.
A shard a dying child held is delivered again, as after any crash.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from vlmbatch.workers.process import ProcessConfigs

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# Back-off for a process that keeps dying: gentle, because a poison row costs a few
# deaths by design (see poison.py), but bounded, for a model that cannot load at all.
MIN_RESTART_DELAY = 1.0
MAX_RESTART_DELAY = 30.0
BACKOFF_FACTOR = 1.5
# A child that lived this long is healthy again: its next crash restarts without back-off.
HEALTHY_AFTER = 60.0


def gpu_slots(gpus: str | None) -> list[str]:
    """`all` (or nothing) → every visible GPU, `0,1` → those, `cpu` or no GPU at all → `["cpu"]`."""
    if gpus not in (None, "", "all"):
        slots = [g.strip() for g in gpus.split(",") if g.strip()]
        if len(set(slots)) != len(slots):  # one process per slot: a repeated one would go unsupervised
            raise ValueError(f"--gpus lists a slot twice: {gpus!r}")
        return slots
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()] or ["cpu"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] or ["cpu"]


def thread_siblings(core: int) -> str:
    """The hardware threads sharing `core`'s physical core, as Linux lists them ("0,8")."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return str(core)


def cpu_shares(slots: list[str], cores: set[int] | None = None,
               siblings: Callable[[int], str] = thread_siblings) -> dict[str, list[int]]:
    """Each slot's own cores: this process's (`cores`, default its affinity) cut into
    near-equal runs of physical cores, one per slot, hyperthreads of one core kept together
    (two engines on sibling threads would still compete). Empty when there is one slot or
    fewer than two cores per slot: the processes then share every core."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else cores)
    physical: dict[str, list[int]] = {}
    for core in ordered:
        physical.setdefault(siblings(core), []).append(core)
    groups = list(physical.values())
    if len(slots) < 2 or len(ordered) < 2 * len(slots) or len(groups) < len(slots):
        return {}
    size, extra = divmod(len(groups), len(slots))
    shares, start = {}, 0
    for i, slot in enumerate(slots):
        end = start + size + (1 if i < extra else 0)
        shares[slot] = sorted(core for group in groups[start:end] for core in group)
        start = end
    return shares


def pinned_env(slot: str, cpus: list[int] | None = None, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """This process's environment, with CUDA showing the child only its own GPU and, given
    `cpus`, `VLMBATCH_WORKER_CPUS` naming its share of the cores (`WorkerConfig.worker_cpus`);
    `storage_options` (possibly credentials) go as `VLMBATCH_STORAGE_OPTIONS`."""
    env = dict(os.environ)
    if slot != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = slot
    if cpus:
        env["VLMBATCH_WORKER_CPUS"] = ",".join(map(str, cpus))
    if storage_options:
        env["VLMBATCH_STORAGE_OPTIONS"] = json.dumps(storage_options)
    return env


@dataclass
class Child:
    slot: str
    process: subprocess.Popen[bytes]
    started: float
    delay: float = MIN_RESTART_DELAY


class Supervisor:
    """Keeps one worker process per slot alive until a shutdown signal arrives."""

    def __init__(self, model: str, broker_url: str, slots: list[str], configs: ProcessConfigs, dry_run: bool = False):
        self.model = model
        self.broker_url = broker_url
        self.slots = slots
        self.configs = configs
        self.dry_run = dry_run
        self.children: dict[str, Child] = {}
        self.stopping = False
        self.cpus = cpu_shares(slots)

    def metrics_port(self, slot: str) -> int | None:
        """The Prometheus port of `slot`'s process: `--metrics-port` plus the slot's index."""
        base = self.configs.worker.metrics_port
        return None if base is None else base + self.slots.index(slot)

    def command(self, slot: str) -> list[str]:
        cmd = [sys.executable, "-m", "vlmbatch.workers.process", "--model", self.model]
        cmd += ["--broker", self.broker_url, "--slot", slot, "--supervisor-pid", str(os.getpid())]
        cmd += self.configs.to_args(self.metrics_port(slot))
        return cmd + (["--dry-run"] if self.dry_run else [])

    def spawn(self, slot: str, delay: float = MIN_RESTART_DELAY) -> None:
        env = pinned_env(slot, self.cpus.get(slot), self.configs.worker.storage_options)
        process = subprocess.Popen(self.command(slot), env=env, start_new_session=True)
        self.children[slot] = Child(slot, process, time.monotonic(), delay)
        log.info("worker process %d started on slot %s", process.pid, slot)

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True
        for child in self.children.values():
            if child.process.poll() is None:
                child.process.send_signal(signum)

    def run(self) -> int:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self.forward)
        for slot in self.slots:
            self.spawn(slot)
        restarts: dict[str, tuple[float, float]] = {}  # slot -> (when to restart, next back-off)
        while self.children or (restarts and not self.stopping):
            now = time.monotonic()
            for slot, child in list(self.children.items()):
                code = child.process.poll()
                if code is None:
                    continue
                del self.children[slot]
                if not self.stopping:
                    healthy = now - child.started > HEALTHY_AFTER
                    delay = MIN_RESTART_DELAY if healthy else child.delay
                    log.warning("worker process %d (slot %s) exited with %s; restarting in %.0f s",
                                child.process.pid, slot, code, delay)
                    restarts[slot] = (now + delay, min(delay * BACKOFF_FACTOR, MAX_RESTART_DELAY))
            for slot, (when, next_delay) in list(restarts.items()):
                if now >= when and not self.stopping:
                    del restarts[slot]
                    self.spawn(slot, next_delay)
            time.sleep(0.2)
        return 0
