"""Every kind of video reference reaches the decoder as the same bytes, or fails as a row error."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.refs import MediaContext
from vlmbatch.media.video import load_video, parse_video_options
from vlmbatch.testing.videos import ffmpeg_available, make_video

pytestmark = pytest.mark.skipif(not ffmpeg_available(), reason="needs the ffmpeg command line to make test videos")

OPTIONS = parse_video_options({"backend": "opencv", "num_frames": 4})


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_video(tmp_path_factory.mktemp("sources"), "h264_mp4", seconds=2.0)


class _Handler(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/slow.mp4":
            time.sleep(3)  # the client has given up by now: nothing to answer
            return
        if self.path == "/missing.mp4":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server(clip: Path) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"payload": clip.read_bytes()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_all_reference_forms_give_the_same_frames(clip: Path, server: str):
    expected = load_video(str(clip), OPTIONS)
    data = clip.read_bytes()
    refs = [
        clip,
        f"file://{clip}",
        data,
        f"data:video/mp4;base64,{base64.b64encode(data).decode()}",
        {"bytes": data, "path": "clip.mp4"},
        {"bytes": None, "path": str(clip)},
        f"{server}/clip.mp4",
    ]
    for ref in refs:
        result = load_video(ref, OPTIONS)
        assert result.frame_indices == expected.frame_indices
        assert (result.frames == expected.frames).all()


def test_relative_paths_resolve_against_the_base_dir(clip: Path):
    result = load_video(clip.name, OPTIONS, MediaContext(base_dir=str(clip.parent)))
    assert result.num_frames == 4


def test_missing_file_is_not_found(tmp_path: Path):
    with pytest.raises(RowError) as caught:
        load_video(str(tmp_path / "nope.mp4"), OPTIONS)
    assert caught.value.error_type == ErrorType.MEDIA_NOT_FOUND


def test_local_paths_stay_inside_the_allowed_folder(clip: Path, tmp_path: Path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link.mp4").symlink_to(clip)
    ctx = MediaContext(base_dir=str(allowed), allowed_local_path=str(allowed))
    for ref in ["link.mp4", f"../{clip.name}", str(clip)]:
        with pytest.raises(RowError) as caught:
            load_video(ref, OPTIONS, ctx)
        assert caught.value.error_type == ErrorType.MEDIA_FORBIDDEN, ref
    (allowed / "inside.mp4").write_bytes(clip.read_bytes())
    assert load_video("inside.mp4", OPTIONS, ctx).num_frames == 4


def test_local_files_can_be_refused_altogether(clip: Path):
    ctx = MediaContext(allow_local_files=False)
    for ref in [str(clip), f"file://{clip}", {"bytes": None, "path": str(clip)}]:
        with pytest.raises(RowError) as caught:
            load_video(ref, OPTIONS, ctx)
        assert caught.value.error_type == ErrorType.MEDIA_FORBIDDEN
    assert load_video(clip.read_bytes(), OPTIONS, ctx).num_frames == 4  # inline bytes are not local files


def test_http_errors_and_the_video_fetch_timeout(server: str):
    from vlmbatch.config import MediaConfig
    from vlmbatch.media.loader import MediaLoader

    with pytest.raises(RowError) as caught:
        load_video(f"{server}/missing.mp4", OPTIONS)
    assert caught.value.error_type == ErrorType.MEDIA_NOT_FOUND
    loader = MediaLoader(MediaConfig.from_env({"VLMBATCH_VIDEO_FETCH_TIMEOUT": "0.5"}))
    started = time.monotonic()
    with pytest.raises(RowError) as caught:
        load_video(f"{server}/slow.mp4", OPTIONS, loader.video_context)
    assert caught.value.error_type == ErrorType.MEDIA_TIMEOUT
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize(
    "ref, error_type",
    [
        ("data:video/mp4,not-base64", ErrorType.MEDIA_DECODE),
        ("data:video/mp4;base64,@@@", ErrorType.MEDIA_DECODE),
        ({"path": None, "bytes": None}, ErrorType.INVALID_ROW),
        (12, ErrorType.INVALID_ROW),
        (b"", ErrorType.MEDIA_DECODE),
        ("ftp://example.com/clip.mp4", ErrorType.MEDIA_FORBIDDEN),
    ],
)
def test_malformed_references(ref, error_type):
    with pytest.raises(RowError) as caught:
        load_video(ref, OPTIONS)
    assert caught.value.error_type == error_type
