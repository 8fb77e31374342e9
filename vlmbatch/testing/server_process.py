"""Start `vlmbatch serve` as a child process on a free local port and wait until it answers.

Used by `vlmbatch bench serve` and the server tests, which both need a real server
process (its own event loop, its own memory) rather than an app inside the caller.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--model", path, ...]) as server:` → `server.url` answers `/health`."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None, startup_timeout_s: float = 180.0):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._args = serve_args
        self._env = {**os.environ, **(env or {})}
        self._startup_timeout_s = startup_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="vlmbatch-serve-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> "ServerProcess":
        command = [
            sys.executable, "-c", "from vlmbatch.cli.main import main; main()",
            "serve", *self._args, "--host", HOST, "--port", str(self.port),
        ]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=self._env)
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vlmbatch serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"vlmbatch serve did not answer within {self._startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
