"""The private-address guard runs again on every redirect hop.

The server keeps the guard on but exempts 127.0.0.1/32 (`--allowed-media-networks`), which
makes the local media server a legitimate first hop; a redirect from it to any other
loopback, private or metadata address must be refused before connecting (`media_forbidden`,
not a connection error or a timeout).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server_harness import MediaServer, media  # noqa: F401  (media: a fixture)
from vlmbatch.testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_qwen: Path):
    args = ["--model", str(tiny_qwen), "--allowed-media-networks", "127.0.0.1/32", "--log-level", "warning"]
    with ServerProcess(args) as process:
        yield process


def _ask(server: ServerProcess, url: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_an_exempt_network_is_fetched(server: ServerProcess, media: MediaServer) -> None:
    assert _ask(server, media.url("/files/red.png")).status_code == 200


@pytest.mark.parametrize(
    "target", ["http://127.0.0.2:{port}/files/red.png", "http://[::1]:{port}/files/red.png", "http://169.254.169.254/latest/meta-data/"]
)
def test_a_redirect_to_a_private_address_is_refused(server: ServerProcess, media: MediaServer, target: str) -> None:
    url = media.url("/redirect?to=" + target.format(port=media.port))
    response = _ask(server, url)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("media_forbidden", "messages[0].content[0].image_url"), error
    assert "private or reserved" in error["message"]
