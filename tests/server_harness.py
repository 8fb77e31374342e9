"""Helpers for the server tests: a real local HTTP server for media, and small media files.

The media server is a plain `http.server` on 127.0.0.1 in a thread of the test process; the
vlmbatch server under test is a separate process (`vlmbatch.testing.server_process`) that fetches
from it over real sockets.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from PIL import Image


def png_bytes(width: int = 64, height: int = 48, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(payload: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` but whose pixel data is garbage: decoding
    it fails, so refusing it as too large proves the size was checked before decoding."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"not zlib data") + chunk(b"IEND", b"")


class MediaServer:
    """Routes: /files/NAME (from `root`), /missing (404), /text (200, not an image),
    /slow?s=SECONDS (answers late), /redirect?to=URL (302), /big?bytes=N (N zero bytes)."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[str] = []
        handler = self._handler()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> "MediaServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/octet-stream", **headers: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                server.requests.append(self.path)
                if url.path.startswith("/files/"):
                    path = server.root / url.path.removeprefix("/files/")
                    if path.is_file():
                        return self._send(200, path.read_bytes(), "image/png" if path.suffix == ".png" else "video/mp4")
                    return self._send(404, b"no such file", "text/plain")
                if url.path == "/text":
                    return self._send(200, b"<html>certainly not an image</html>", "text/html")
                if url.path == "/slow":
                    time.sleep(float(query.get("s", "5")))
                    return self._send(200, png_bytes(), "image/png")
                if url.path == "/redirect":
                    return self._send(302, b"", "text/plain", Location=query["to"])
                if url.path == "/big":
                    return self._send(200, bytes(int(query["bytes"])), "image/png")
                return self._send(404, b"not found", "text/plain")

        return Handler


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory):
    """A media server with one image, /files/red.png (import this fixture into a test module)."""
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(png_bytes())
    with MediaServer(root) as server:
        yield server
