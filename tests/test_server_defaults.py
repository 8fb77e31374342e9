"""`vlmbatch serve` with no safety flags: private and metadata addresses and local files are
refused, no key is needed; and a model without a chat template needs `--chat-template`."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import MediaServer, media, png_bytes  # noqa: F401  (media: a fixture)
from vlmbatch.testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def template_less(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the tiny checkpoint without its chat template, and that template as a file."""
    root = tmp_path_factory.mktemp("no-template")
    model = root / "model"
    shutil.copytree(tiny_qwen, model)
    template = root / "template.jinja"
    shutil.move(model / "chat_template.jinja", template)
    return model, template


@pytest.fixture(scope="module")
def server(template_less: tuple[Path, Path]):
    model, template = template_less
    with ServerProcess(["--model", str(model), "--chat-template", str(template), "--log-level", "warning"]) as process:
        yield process


def test_a_model_without_a_chat_template_does_not_start(template_less: tuple[Path, Path]) -> None:
    model, _ = template_less
    attempt = ServerProcess(["--model", str(model)])
    with pytest.raises(RuntimeError, match="exited with 2") as refused:
        attempt.start()
    assert "no chat template" in str(refused.value) and "--chat-template" in str(refused.value)


def test_the_template_file_makes_it_chat_without_a_key(server: ServerProcess, template_less: tuple[Path, Path]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=str(template_less[0]), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3", "192.168.0.1", "0.0.0.0", "[fd00:ec2::254]"],
)
def test_private_loopback_and_metadata_urls_are_refused(server: ServerProcess, media: MediaServer, host: str) -> None:
    before = len(media.requests)
    url = media.url("/files/red.png").replace("127.0.0.1", host)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("media_forbidden", "messages[0].content[0].image_url")
    assert len(media.requests) == before  # refused before connecting


def test_file_urls_are_off_without_an_allowed_folder(server: ServerProcess, tmp_path: Path) -> None:
    image = tmp_path / "local.png"
    image.write_bytes(png_bytes())
    for url in (image.as_uri(), str(image)):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] in ("media_forbidden", "invalid_row")


def test_s3_media_urls_are_off_without_allowed_buckets(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "s3://bucket/cat.png"}}]}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("media_forbidden", "messages[0].content[0].image_url")
    assert "--allowed-media-buckets" in error["message"]
