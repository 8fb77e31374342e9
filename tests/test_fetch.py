"""fetch_bytes against a real HTTP server on 127.0.0.1 (started here, one per module)."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.fetch import FetchPolicy, fetch_bytes, host_allowed, is_public_address

BODY = b"0123456789" * 100


class Handler(BaseHTTPRequestHandler):
    hits: Counter = Counter()

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def send_body(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlparse(self.path)
        query = parse_qs(url.query)
        Handler.hits[self.path] += 1
        if url.path == "/ok":
            self.send_body(200, BODY)
        elif url.path in ("/missing", "/gone", "/teapot"):
            self.send_body({"/missing": 404, "/gone": 410, "/teapot": 418}[url.path], b"no")
        elif url.path == "/flaky":  # fails until the n-th hit
            ok = Handler.hits[self.path] >= int(query["ok_on"][0])
            self.send_body(200 if ok else 503, BODY if ok else b"busy")
        elif url.path == "/slow":
            time.sleep(float(query["s"][0]))
            self.send_body(200, BODY)
        elif url.path == "/drip":  # headers at once, then one byte per 0.1 s
            self.send_body(200, headers={"Content-Length": "50"})
            for _ in range(50):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif url.path == "/big":
            self.send_body(200, b"x" * 5000)
        elif url.path == "/big-unsized":  # no Content-Length: the cap must hold while reading
            self.close_connection = True
            self.send_body(200, b"x" * 5000, headers={"Connection": "close"})
        elif url.path == "/redirect":
            self.send_body(302, headers={"Location": query["to"][0], "Content-Length": "0"})
        else:
            self.send_body(404)


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request, client_address) -> None:  # clients that gave up (timeouts) are expected
        pass


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetch_error(url: str, policy: FetchPolicy) -> RowError:
    with pytest.raises(RowError) as caught:
        fetch_bytes(url, policy)
    return caught.value


FAST = FetchPolicy(timeout=5, retries=0)


def test_ok_and_http_errors(server: str) -> None:
    assert fetch_bytes(f"{server}/ok", FAST) == BODY
    assert fetch_error(f"{server}/missing", FAST).error_type == ErrorType.MEDIA_NOT_FOUND
    assert fetch_error(f"{server}/gone", FAST).error_type == ErrorType.MEDIA_NOT_FOUND
    assert fetch_error(f"{server}/teapot", FAST).error_type == ErrorType.MEDIA_FETCH


def test_retries_5xx_but_never_4xx(server: str) -> None:
    assert fetch_bytes(f"{server}/flaky?ok_on=3&k=a", FetchPolicy(timeout=5, retries=2)) == BODY
    assert Handler.hits["/flaky?ok_on=3&k=a"] == 3
    error = fetch_error(f"{server}/flaky?ok_on=9&k=b", FetchPolicy(timeout=5, retries=1))
    assert error.error_type == ErrorType.MEDIA_FETCH and "503" in error.message
    assert Handler.hits["/flaky?ok_on=9&k=b"] == 2
    fetch_error(f"{server}/missing?k=c", FetchPolicy(timeout=5, retries=3))
    assert Handler.hits["/missing?k=c"] == 1


def test_unreachable_host_is_a_fetch_error() -> None:
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert fetch_error(f"http://127.0.0.1:{port}/x", FAST).error_type == ErrorType.MEDIA_FETCH


@pytest.mark.parametrize("path", ["/slow?s=3", "/drip"])
def test_timeout_bounds_the_whole_download(server: str, path: str) -> None:
    started = time.monotonic()
    error = fetch_error(f"{server}{path}", FetchPolicy(timeout=0.6, retries=2))
    assert error.error_type == ErrorType.MEDIA_TIMEOUT
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("path", ["/big", "/big-unsized"])
def test_size_cap(server: str, path: str) -> None:
    assert fetch_error(f"{server}{path}", FetchPolicy(timeout=5, max_bytes=1000)).error_type == ErrorType.MEDIA_TOO_LARGE
    assert len(fetch_bytes(f"{server}{path}", FetchPolicy(timeout=5, max_bytes=5000))) == 5000


def test_private_addresses_refused_when_asked(server: str) -> None:
    guarded = FetchPolicy(timeout=5, allow_private=False)
    for url in (f"{server}/ok", server.replace("127.0.0.1", "localhost") + "/ok"):
        error = fetch_error(url, guarded)
        assert error.error_type == ErrorType.MEDIA_FORBIDDEN and "private" in error.message
    assert fetch_error("ftp://example.com/a.png", FAST).error_type == ErrorType.MEDIA_FORBIDDEN
    assert fetch_error("file:///etc/passwd", FAST).error_type == ErrorType.MEDIA_FORBIDDEN


def test_every_redirect_hop_is_checked(server: str) -> None:
    # The test server itself is exempt (standing in for a public host); its redirects are not.
    guarded = FetchPolicy(timeout=5, retries=0, allow_private=False, allowed_networks=("127.0.0.1/32",))
    assert fetch_bytes(f"{server}/redirect?to=/ok", guarded) == BODY
    for target in ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.2/ok", "http://[::1]/ok", "http://10.1.2.3/"):
        error = fetch_error(f"{server}/redirect?to={target}", guarded)
        assert error.error_type == ErrorType.MEDIA_FORBIDDEN, target
    loop = fetch_error(f"{server}/redirect?to=/redirect?to=/redirect?to=/ok", FetchPolicy(timeout=5, max_redirects=1))
    assert loop.error_type == ErrorType.MEDIA_FETCH and "redirects" in loop.message


def test_domain_allow_list(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    assert fetch_bytes(f"http://localhost:{port}/ok", FetchPolicy(timeout=5, allowed_domains=("LOCALHOST.",))) == BODY
    error = fetch_error(f"{server}/ok", FetchPolicy(timeout=5, allowed_domains=("example.com",)))
    assert error.error_type == ErrorType.MEDIA_FORBIDDEN
    assert host_allowed("img.cdn.example.com", ("example.com",))
    assert not host_allowed("badexample.com", ("example.com",))
    assert not host_allowed("example.com.evil.net", ("example.com",))


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.0.0.1", False),
        ("172.16.5.4", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
        ("0.0.0.0", False), ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("fe80::1", False),
        ("fd00:ec2::254", False), ("::ffff:127.0.0.1", False), ("ff02::1", False),
    ],
)  # fmt: skip
def test_address_classes(address: str, public: bool) -> None:
    assert is_public_address(ipaddress.ip_address(address)) is public
