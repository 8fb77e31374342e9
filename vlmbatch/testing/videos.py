"""Small test videos made with the `ffmpeg` command line.

Each kind reproduces one real-world case the decoders must agree on (codecs and
containers, variable frame rate, display-matrix rotation, damaged packets, files
with no picture at all). The content is FFmpeg's `testsrc2` pattern, whose moving
parts make a wrong frame visible as a large pixel difference.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

VIDEO_KINDS = (
    "h264_mp4",
    "hevc_mkv",
    "vp9_webm",
    "mpeg4_avi",
    "vfr_mp4",
    "rotated_mp4",
    "corrupt_mp4",
    "audio_only",
    "empty",
)
# Colour-tagged variants (not in the conformance set): BT.709 and full ("JPEG") range.
COLOUR_KINDS = ("bt709_mp4", "full_range_mp4")

# Codec arguments and file suffix per CPU-decodable kind; "-g" keeps keyframes
# one second apart so seeking backends are exercised.
_ENCODINGS = {
    "h264_mp4": (["-c:v", "libx264", "-pix_fmt", "yuv420p", "-bf", "2"], ".mp4"),
    "hevc_mkv": (["-c:v", "libx265", "-pix_fmt", "yuv420p", "-x265-params", "log-level=error"], ".mkv"),
    "vp9_webm": (["-c:v", "libvpx-vp9", "-pix_fmt", "yuv420p", "-deadline", "realtime", "-cpu-used", "8"], ".webm"),
    "mpeg4_avi": (["-c:v", "mpeg4", "-q:v", "3"], ".avi"),
    "bt709_mp4": (
        ["-vf", "scale=out_color_matrix=bt709", "-c:v", "libx264", "-pix_fmt", "yuv420p",
         "-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709"],
        ".mp4",
    ),
    "full_range_mp4": (["-c:v", "libx264", "-pix_fmt", "yuvj420p"], ".mp4"),
}


def ffmpeg_available() -> bool:
    return shutil.which("ffmpeg") is not None


def _ffmpeg(args: list[str]) -> None:
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def _testsrc(width: int, height: int, fps: float, seconds: float) -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate={fps}:duration={seconds}"]


def make_video(
    directory: str | Path,
    kind: str,
    *,
    width: int = 160,
    height: int = 120,
    fps: float = 15.0,
    seconds: float = 3.0,
    keyframe_interval: int | None = None,
) -> Path:
    """Write one test video of `kind` (`VIDEO_KINDS`, `COLOUR_KINDS`) into `directory`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gop = ["-g", str(keyframe_interval or max(1, round(fps)))]
    source = _testsrc(width, height, fps, seconds)
    if kind in _ENCODINGS:
        codec, suffix = _ENCODINGS[kind]
        path = directory / f"{kind}{suffix}"
        _ffmpeg([*source, *codec, *gop, str(path)])
    elif kind == "vfr_mp4":
        # The first second at `fps`, the rest at a third of it: uniform index
        # sampling and fps-based seeking both pick wrong frames on this file.
        path = directory / "vfr_mp4.mp4"
        n = round(fps)
        retime = f"setpts='if(lt(N,{n}),N/{fps},1+(N-{n})*3/{fps})/TB'"
        _ffmpeg([*source, "-vf", retime, "-fps_mode", "vfr", "-c:v", "libx264", "-pix_fmt", "yuv420p", *gop, str(path)])
    elif kind == "rotated_mp4":
        # A 90-degree display matrix on an unrotated stream (how phones record).
        plain = make_video(directory, "h264_mp4", width=width, height=height, fps=fps, seconds=seconds)
        path = directory / "rotated_mp4.mp4"
        if _supports_display_rotation():
            _ffmpeg(["-display_rotation", "90", "-i", str(plain), "-c", "copy", str(path)])
        else:
            _ffmpeg(["-i", str(plain), "-c", "copy", "-metadata:s:v:0", "rotate=90", str(path)])
    elif kind == "corrupt_mp4":
        path = directory / "corrupt_mp4.mp4"
        plain = make_video(directory, "h264_mp4", width=width, height=height, fps=fps, seconds=seconds)
        path.write_bytes(_damage_middle(plain.read_bytes()))
    elif kind == "audio_only":
        path = directory / "audio_only.m4a"
        _ffmpeg(["-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}", "-c:a", "aac", str(path)])
    elif kind == "empty":
        path = directory / "empty.mp4"
        path.write_bytes(b"")
    else:
        raise ValueError(f"unknown test video kind {kind!r}; expected one of {', '.join(VIDEO_KINDS)}")
    return path


def make_video_set(directory: str | Path, **kwargs: float) -> dict[str, Path]:
    """One file of every kind in `VIDEO_KINDS`, keyed by kind."""
    return {kind: make_video(directory, kind, **kwargs) for kind in VIDEO_KINDS}


def decode_every_frame(path: str | Path) -> list[np.ndarray | None]:
    """The reference for conformance: a plain sequential PyAV decode of every frame.

    Frames are in presentation order, rotated for display; a frame whose packet
    the decoder rejected is None. No seeking, no frame selection: whatever a
    backend returns for frame i must match entry i.
    """
    import av

    decoded: dict[int, np.ndarray] = {}
    pts_order: list[int] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            if packet.size > 0:
                pts_order.append(packet.pts if packet.pts is not None else packet.dts)
            try:
                for frame in packet.decode():
                    turns = (int(frame.rotation) // 90) % 4
                    decoded[frame.pts] = np.ascontiguousarray(np.rot90(frame.to_ndarray(format="rgb24"), turns))
            except av.InvalidDataError:
                continue
    return [decoded.get(pts) for pts in sorted(pts_order)]


def _supports_display_rotation() -> bool:
    """`-display_rotation` exists from FFmpeg 6; older ones take the `rotate` tag."""
    out = subprocess.run(["ffmpeg", "-hide_banner", "-h", "full"], capture_output=True, text=True).stdout
    return "-display_rotation" in out


def _damage_middle(data: bytes) -> bytes:
    """Overwrite a few short runs in the middle of the media data with junk bytes.

    The container index stays intact, so the file opens and every packet is
    found, but some packets decode with errors (concealed or dropped).
    """
    damaged = bytearray(data)
    start = len(data) // 2
    for offset in range(0, 4 * 997, 997):
        position = start + offset
        damaged[position : position + 24] = bytes((i * 37 + 11) % 256 for i in range(24))
    return bytes(damaged)
