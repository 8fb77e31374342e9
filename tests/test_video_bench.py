"""`vlmbatch bench video` end to end on a tiny clip: every backend timed on the same frames."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmbatch.testing.videos import ffmpeg_available

pytestmark = pytest.mark.skipif(not ffmpeg_available(), reason="needs the ffmpeg command line")


def test_bench_video_command_writes_figures(tmp_path: Path):
    from vlmbatch.cli.commands import app

    out = tmp_path / "video.json"
    result = CliRunner().invoke(
        app,
        ["bench", "video", "--backends", "opencv,pyav,torchcodec", "--frames", "4", "--threads", "1", "--seconds", "2",
         "--size", "160x120", "--clip-dir", str(tmp_path / "clips"), "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    rows = figures["results"]
    assert {r["backend"] for r in rows} == {"ffmpeg-cli", "opencv", "pyav", "torchcodec"}
    assert {r["clip"] for r in rows} == {"default_gop", "keyframe_1s"}
    assert all(r["frame_indices_match"] and r["frames_per_s"] > 0 and r["cpu_seconds"] > 0 for r in rows)
    for clip in ("default_gop", "keyframe_1s"):
        backends = [r for r in rows if r["clip"] == clip and r["backend"] != "ffmpeg-cli"]
        assert min(r["slowdown_vs_best"] for r in backends) == pytest.approx(1.0)
    assert "video decoding" in result.output


def test_unknown_backend_is_refused(tmp_path: Path):
    from vlmbatch.cli.commands import app

    result = CliRunner().invoke(app, ["bench", "video", "--backends", "gstreamer", "--clip-dir", str(tmp_path)])
    assert result.exit_code != 0 and "gstreamer" in result.output
