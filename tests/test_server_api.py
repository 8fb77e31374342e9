"""`vlmbatch serve` end to end: a real server process with a tiny checkpoint, driven through
the official `openai` client, curl and raw HTTP, with media served by a local HTTP server.

The server here allows private URLs (the media server is on 127.0.0.1) but only the host
name `localhost`, reads file:// URLs only inside one folder, and has small media caps, so
every safety rule that needs a flag is exercised; `test_server_defaults.py` checks the
defaults.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from server_harness import MediaServer, data_url, png_bytes, png_header_only
from vlmbatch.families.registry import load_adapter
from vlmbatch.testing.server_process import ServerProcess
from vlmbatch.testing.videos import ffmpeg_available, make_video

KEY = "sk-test-key"
MAX_MEDIA_BYTES = 300_000
MAX_IMAGE_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(png_bytes(64, 48, (220, 20, 20)))
    (root / "blue.png").write_bytes(png_bytes(40, 56, (20, 20, 220)))
    (root / "bomb.png").write_bytes(png_header_only(5000, 5000))
    if ffmpeg_available():
        make_video(root, "h264_mp4", width=64, height=48, fps=8, seconds=2)
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "green.png").write_bytes(png_bytes(32, 32, (20, 200, 20)))
    (root / "secret.png").write_bytes(png_bytes(16, 16))
    (allowed / "link.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def media(media_root: Path):
    with MediaServer(media_root) as server:
        yield server


@pytest.fixture(scope="module")
def server(tiny_qwen: Path, media_root: Path):
    args = [
        "--model", str(tiny_qwen), "--api-key", KEY,
        "--allow-private-media-urls", "--allowed-media-domains", "localhost",
        "--allowed-local-media-path", str(media_root / "allowed"),
        "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
        "--max-media-bytes", str(MAX_MEDIA_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
        "--media-io-kwargs", '{"video": {"num_frames": 4}}',
        "--log-level", "warning",
    ]
    env = {"VLMBATCH_IMAGE_FETCH_TIMEOUT": "1", "VLMBATCH_VIDEO_FETCH_TIMEOUT": "2"}
    with ServerProcess(args, env=env) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def adapter(tiny_qwen: Path):
    return load_adapter(str(tiny_qwen))


def _post(server: ServerProcess, body: dict | bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={**headers, "Content-Type": "application/json"}, timeout=120)
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---- text, usage, sampling ------------------------------------------------------------


def test_system_and_multi_turn_chat_reports_real_token_counts(client: openai.OpenAI, adapter, tiny_qwen: Path) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ]
    reply = client.chat.completions.create(model=str(tiny_qwen), messages=messages, max_tokens=6, temperature=0)
    expected_prompt = adapter.prepare(adapter.apply_chat_template(messages)).num_tokens
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == str(tiny_qwen)
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens == expected_prompt
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 6
    assert 1 <= reply.usage.completion_tokens <= 6
    assert reply.usage.total_tokens == expected_prompt + reply.usage.completion_tokens
    newer = client.chat.completions.create(messages=messages, max_completion_tokens=3, temperature=0, model=str(tiny_qwen))
    assert newer.usage.completion_tokens <= 3 and choice.message.content.startswith(newer.choices[0].message.content)


def test_n_choices_and_seeded_sampling_are_reproducible(client: openai.OpenAI, tiny_qwen: Path) -> None:
    ask = dict(model=str(tiny_qwen), messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=1.0, seed=1234)
    first = client.chat.completions.create(n=2, **ask)
    again = client.chat.completions.create(n=2, **ask)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 2 * 8  # counted over both choices
    assert 2 <= first.usage.completion_tokens <= 16
    streamed: dict[int, str] = {0: "", 1: ""}
    finishes: list[int] = []
    for chunk in client.chat.completions.create(n=2, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.index)
    assert [streamed[0], streamed[1]] == [c.message.content for c in first.choices]
    assert sorted(finishes) == [0, 1]


def test_n_choices_with_logprobs_in_openai_shape_streamed_or_not(client: openai.OpenAI, adapter, tiny_qwen: Path) -> None:
    ask = dict(model=str(tiny_qwen), messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6,
               temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=3, presence_penalty=0.5,
               extra_body={"ignore_eos": True, "repetition_penalty": 1.1})
    whole = client.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content != whole.choices[1].message.content  # seed, seed + 1
    special = set(adapter.tokenizer.all_special_tokens)  # not in the text (skip_special_tokens)
    for choice in whole.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        text_bytes = b"".join(bytes(e.bytes) for e in content if e.token not in special)
        assert text_bytes.decode("utf-8", errors="replace") == choice.message.content
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index].extend(choice.logprobs.content)
    for choice in whole.choices:
        got = streamed[choice.index]
        assert [e.token for e in got] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)
    greedy = client.chat.completions.create(**{**ask, "temperature": 0})
    assert greedy.choices[0].message.content == greedy.choices[1].message.content  # temperature 0: identical samples
    plain = client.chat.completions.create(**{k: v for k, v in ask.items() if k not in ("logprobs", "top_logprobs")})
    assert all(c.logprobs is None for c in plain.choices)


def test_stop_string_cuts_the_text_in_both_modes(client: openai.OpenAI, tiny_qwen: Path) -> None:
    ask = dict(model=str(tiny_qwen), messages=[{"role": "user", "content": "Count for me"}], temperature=0, max_tokens=16)
    full = client.chat.completions.create(**ask).choices[0].message.content
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip() and full.find(full[i : i + 2]) == i)
    cut = client.chat.completions.create(stop=[stop], **ask).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stop=stop, stream=True, **ask) if c.choices)
    assert streamed == cut.message.content


def test_tools_with_tool_choice_none_answer_as_without_tools(client: openai.OpenAI, tiny_qwen: Path) -> None:
    """Tool calling is not served (a request with tools and any other tool_choice is a 400,
    `test_client_mistakes`); with tool_choice "none" the request is answered as text, the
    tools not rendered into the prompt."""
    ask = dict(model=str(tiny_qwen), messages=[{"role": "user", "content": "Weather?"}], temperature=0, max_tokens=6)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    plain = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(tools=tools, tool_choice="none", **ask).choices[0].message.content == plain


def test_streaming_equals_non_streaming_with_one_finish_chunk(client: openai.OpenAI, tiny_qwen: Path) -> None:
    ask = dict(
        model=str(tiny_qwen), temperature=0, max_tokens=12,
        messages=_user(_image(data_url(png_bytes(48, 48, (10, 120, 200))))),
    )
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert text == whole.choices[0].message.content
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing_through_curl(server: ServerProcess) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True})
    out = subprocess.run(
        ["curl", "-sS", "-N", f"{server.url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert sum(p["choices"][0]["finish_reason"] is not None for p in payloads) == 1
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


def test_text_only_through_curl(server: ServerProcess, tiny_qwen: Path) -> None:
    body = json.dumps({"model": str(tiny_qwen), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    out = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"{server.url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    payload, status = out.rsplit("\n", 1)
    assert status == "200"
    assert json.loads(payload)["usage"]["completion_tokens"] <= 3


# ---- routes and auth ------------------------------------------------------------------


def test_models_health_and_version(client: openai.OpenAI, server: ServerProcess, tiny_qwen: Path) -> None:
    from importlib.metadata import version

    assert [m.id for m in client.models.list()] == [str(tiny_qwen)]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/version").json() == {"version": version("vlmbatch")}


def test_every_v1_route_needs_the_key(server: ServerProcess, tiny_qwen: Path) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    out = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"{server.url}/v1/chat/completions", "-H", "Content-Type: application/json",
         "-d", json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    payload, status = out.rsplit("\n", 1)
    assert status == "401" and json.loads(payload)["error"]["type"] == "invalid_request_error"
    for path in ("/v1/models", "/v1/no-such-route", "/v1"):
        _error(httpx.get(f"{server.url}{path}"), 401)
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# ---- client mistakes are 4xx, never 500 -------------------------------------------------


def test_malformed_json_through_curl(server: ServerProcess) -> None:
    out = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"{server.url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", '{"messages": [}'],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    payload, status = out.rsplit("\n", 1)
    assert status == "400" and "not valid JSON" in json.loads(payload)["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://localhost/x.png"}]}]},
         400, "messages[0].content[0].image_url", "invalid_row"),
        ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]},
         400, "messages[0].content[0].type", "invalid_row"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, 400, "messages", "prompt_too_long"),
        ({"messages": []}, 400, "messages", "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature", "invalid_request"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_row"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
        ({"messages": [{"role": "user", "content": "hi"}], "media_io_kwargs": {"video": {"backend": "pyav"}}},
         400, "media_io_kwargs.video", "invalid_row"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_request"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"not-a-token": 1}}, 400, None, "invalid_row"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias", "invalid_row"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 3}, 400, None, "invalid_row"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
         400, "tools", "invalid_request"),
    ],
    ids=["image_url-string", "unknown-part", "too-long", "no-messages", "bad-temperature", "bad-role", "unknown-model", "request-picks-decoder",
         "top_logprobs-alone", "too-many-top_logprobs", "bad-logit_bias", "logit_bias-outside-vocabulary", "min_tokens-over-max",
         "tools"],
)
def test_client_mistakes(server: ServerProcess, body: dict, status: int, param: str, code: str) -> None:
    error = _error(_post(server, body), status)
    assert (error["param"], error["code"]) == (param, code)


def test_too_many_images_is_refused_before_any_download(server: ServerProcess, media: MediaServer) -> None:
    before = len(media.requests)
    urls = [media.url(f"/files/red.png?i={i}", host="localhost") for i in range(3)]
    error = _error(_post(server, {"messages": _user(*map(_image, urls))}), 400)
    assert error["code"] == "too_many_media" and "at most 2" in error["message"]
    assert len(media.requests) == before


def test_the_openai_client_sees_a_bad_request(client: openai.OpenAI, tiny_qwen: Path) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=str(tiny_qwen), messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "nope"}]}]
        )
    assert bad.value.body["param"] == "messages[0].content[0].image_url"


# ---- media that works -------------------------------------------------------------------


def test_one_image_by_http_data_and_file_urls(client: openai.OpenAI, media: MediaServer, media_root: Path, tiny_qwen: Path) -> None:
    text_only = client.chat.completions.create(model=str(tiny_qwen), messages=_user(), max_tokens=2, temperature=0)
    for url in (
        media.url("/files/red.png", host="localhost"),
        data_url((media_root / "red.png").read_bytes()),
        (media_root / "allowed" / "green.png").as_uri(),
    ):
        reply = client.chat.completions.create(model=str(tiny_qwen), messages=_user(_image(url)), max_tokens=2, temperature=0)
        # the image's patches are in the prompt: a 64x48 or 32x32 image adds several tokens
        assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 2, url[:40]


def test_two_images_in_one_message_and_across_turns(client: openai.OpenAI, media: MediaServer, media_root: Path, tiny_qwen: Path) -> None:
    red, blue = media.url("/files/red.png", host="localhost"), data_url((media_root / "blue.png").read_bytes())
    one = client.chat.completions.create(model=str(tiny_qwen), messages=_user(_image(red)), max_tokens=2, temperature=0)
    both = client.chat.completions.create(model=str(tiny_qwen), messages=_user(_image(red), _image(blue)), max_tokens=2, temperature=0)
    turns = [
        {"role": "user", "content": [_image(red), {"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [_image(blue), {"type": "text", "text": "second"}]},
    ]
    across = client.chat.completions.create(model=str(tiny_qwen), messages=turns, max_tokens=2, temperature=0)
    assert both.usage.prompt_tokens > one.usage.prompt_tokens
    assert across.usage.prompt_tokens > one.usage.prompt_tokens


@pytest.mark.skipif(not ffmpeg_available(), reason="needs ffmpeg to make the test video")
def test_video_with_per_request_frame_count(client: openai.OpenAI, media: MediaServer, tiny_qwen: Path) -> None:
    video = {"type": "video_url", "video_url": {"url": media.url("/files/h264_mp4.mp4", host="localhost")}}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}]
    default = client.chat.completions.create(model=str(tiny_qwen), messages=messages, max_tokens=2, temperature=0)
    fewer = client.chat.completions.create(
        model=str(tiny_qwen), messages=messages, max_tokens=2, temperature=0,
        extra_body={"media_io_kwargs": {"video": {"num_frames": 2}}},
    )
    assert default.usage.prompt_tokens > fewer.usage.prompt_tokens > 20


# ---- media that fails: 4xx naming the part, and the next request still works -------------


def test_media_failures_name_their_part(server: ServerProcess, media: MediaServer) -> None:
    ok = media.url("/files/red.png", host="localhost")
    cases = {
        "/missing": "media_not_found",
        "/text": "media_decode_error",
        "/slow?s=4": "media_timeout",
        f"/big?bytes={MAX_MEDIA_BYTES + 1000}": "media_too_large",
        "/files/bomb.png": "media_too_large",
    }
    for path, code in cases.items():
        started = time.monotonic()
        body = {"messages": _user(_image(ok), _image(media.url(path, host="localhost"))), "max_tokens": 2}
        error = _error(_post(server, body), 400)
        assert (error["code"], error["param"]) == (code, "messages[0].content[1].image_url"), (path, error)
        assert time.monotonic() - started < 4, "the 1 s image fetch timeout was not applied"
        assert _post(server, {"messages": _user(_image(ok)), "max_tokens": 2}).status_code == 200


def test_hosts_outside_the_domain_list_are_refused_on_every_redirect_hop(server: ServerProcess, media: MediaServer) -> None:
    red_by_ip = media.url("/files/red.png")  # 127.0.0.1: not in --allowed-media-domains localhost
    ok_by_name = media.url("/files/red.png", host="localhost")
    for url in (red_by_ip, media.url(f"/redirect?to={red_by_ip}", host="localhost")):
        before = len(media.requests)
        error = _error(_post(server, {"messages": _user(_image(url)), "max_tokens": 2}), 400)
        assert (error["code"], error["param"]) == ("media_forbidden", "messages[0].content[0].image_url")
        assert "/files/red.png" not in media.requests[before:]  # refused before connecting
    redirected = media.url(f"/redirect?to={ok_by_name}", host="localhost")
    assert _post(server, {"messages": _user(_image(redirected)), "max_tokens": 2}).status_code == 200


def test_file_urls_cannot_leave_the_allowed_folder(server: ServerProcess, media_root: Path) -> None:
    allowed = media_root / "allowed"
    attempts = {
        f"file://{allowed}/../secret.png": "media_forbidden",
        (allowed / "link.png").as_uri(): "media_forbidden",  # a symlink pointing outside
        f"file://{allowed}/absent.png": "media_not_found",
        str(allowed / "green.png"): "invalid_row",  # a bare path is not a URL
    }
    for url, code in attempts.items():
        error = _error(_post(server, {"messages": _user(_image(url)), "max_tokens": 2}), 400)
        assert (error["code"], error["param"]) == (code, "messages[0].content[0].image_url"), url


# ---- disconnects --------------------------------------------------------------------------


def _cpu_seconds(server: ServerProcess) -> float:
    times = psutil.Process(server.process.pid).cpu_times()
    return times.user + times.system


def test_a_client_that_disconnects_stops_its_generation(server: ServerProcess) -> None:
    """B (2,000 tokens) is cut off while A (200 tokens) holds the engine. Had B gone on
    generating, the server would spend about ten times A's CPU time after A; aborted, only
    the tiny request C runs. CPU time, not wall time, so a busy machine does not matter."""
    health = f"{server.url}/health"
    story = [{"role": "user", "content": "Write a long story"}]
    a_status: list[int] = []
    cpu_before_a = _cpu_seconds(server)
    a = threading.Thread(
        target=lambda: a_status.append(_post(server, {"messages": story, "max_tokens": 200, "temperature": 0}).status_code)
    )
    a.start()
    while httpx.get(health).json()["requests_in_flight"] == 0 and a.is_alive():
        time.sleep(0.01)
    b_body = {"messages": story, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=b_body, headers=headers, timeout=60) as b:
        assert b.status_code == 200
        next(b.iter_lines())  # the role chunk: B has been handed to the engine
    assert a.is_alive(), "A finished before B was cut off; the test needs A to hold the engine"
    a.join(300)
    assert a_status == [200]
    cpu_after_a = _cpu_seconds(server)
    assert _post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    while httpx.get(health).json()["requests_in_flight"]:
        time.sleep(0.05)
    cpu_spent_after_a = _cpu_seconds(server) - cpu_after_a
    assert cpu_spent_after_a < 0.5 * (cpu_after_a - cpu_before_a), (cpu_spent_after_a, cpu_after_a - cpu_before_a)


@pytest.mark.skipif(not ffmpeg_available(), reason="needs ffmpeg to make the test video")
def test_video_failures_name_their_part(server: ServerProcess, media: MediaServer, media_root: Path) -> None:
    attempts = {
        (media_root / "h264_mp4.mp4").as_uri(): "media_forbidden",  # outside the allowed folder
        media.url("/missing", host="localhost"): "media_not_found",
        media.url("/files/h264_mp4.mp4"): "media_forbidden",  # 127.0.0.1 is not an allowed domain
    }
    for url, code in attempts.items():
        video = {"type": "video_url", "video_url": {"url": url}}
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, video]}], "max_tokens": 2}
        error = _error(_post(server, body), 400)
        assert (error["code"], error["param"]) == (code, "messages[0].content[1].video_url"), url


# ---- metrics -------------------------------------------------------------------------


def _scrape(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    """/metrics over HTTP, parsed by prometheus-client's own parser: (name, labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{server.url}/metrics", timeout=10)  # no key: outside /v1
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_during_and_after_requests(client: openai.OpenAI, server: ServerProcess, tiny_qwen: Path) -> None:
    def value(metrics: dict, name: str, **labels: str) -> float:
        return metrics.get((name, frozenset(labels.items())), 0.0)

    before = _scrape(server)
    stream = client.chat.completions.create(
        model=str(tiny_qwen), temperature=0, max_tokens=400, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "count"}], extra_body={"ignore_eos": True},
    )
    chunks = [next(stream)]
    during = _scrape(server)  # the request is still generating: 400 tokens take a while
    chunks.extend(stream)
    refused = _post(server, {"messages": [{"role": "user", "content": "hi"}]}, key="wrong")
    assert refused.status_code == 401
    after = _scrape(server)

    assert value(during, "vlmbatch_server_requests_running") == 1
    assert value(during, "vlmbatch_server_requests_waiting") == 0
    assert 0 < value(during, "vlmbatch_server_kv_cache_usage_ratio") <= 1
    assert value(after, "vlmbatch_server_kv_cache_usage_ratio") < value(during, "vlmbatch_server_kv_cache_usage_ratio")
    usage = chunks[-1].usage
    assert usage.completion_tokens == 400
    grew = {name: value(after, name) - value(before, name) for name in (
        "vlmbatch_server_prompt_tokens_total", "vlmbatch_server_generation_tokens_total",
        "vlmbatch_server_request_latency_seconds_count", "vlmbatch_server_time_to_first_token_seconds_count",
        "vlmbatch_server_inter_token_latency_seconds_count")}
    assert grew == {"vlmbatch_server_prompt_tokens_total": usage.prompt_tokens,
                    "vlmbatch_server_generation_tokens_total": 400,
                    "vlmbatch_server_request_latency_seconds_count": 1,
                    "vlmbatch_server_time_to_first_token_seconds_count": 1,
                    "vlmbatch_server_inter_token_latency_seconds_count": 399}  # fmt: skip
    path = "/v1/chat/completions"
    assert value(after, "vlmbatch_server_requests_total", path=path, status="200") - value(
        before, "vlmbatch_server_requests_total", path=path, status="200") == 1
    assert value(after, "vlmbatch_server_requests_total", path=path, status="401") - value(
        before, "vlmbatch_server_requests_total", path=path, status="401") == 1
    # The engine and media work run in threads of the server's one process: nothing to orphan.
    assert psutil.Process(server.process.pid).children(recursive=True) == []
