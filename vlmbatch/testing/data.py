"""Small images and example datasets for tests, the demo and benchmarks.

Everything is deterministic (same arguments → same bytes) and fast: datasets reuse a
handful of encoded images instead of encoding one per row.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

DISTINCT_IMAGES = 8  # datasets cycle through this many different pictures
DEFAULT_QUESTION = "Describe the image in one sentence."
CATEGORIES = ("cat", "dog", "bird")
HF_IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
IMAGE_MODES = ("path", "bytes", "hf_struct", "data_url")
BAD_ROW_KINDS = ("corrupt", "truncated", "missing", "invalid_json")
EXIF_ORIENTATION_TAG = 0x0112


def make_image(width: int = 64, height: int = 48, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A noisy gradient (noise keeps encoders from shrinking it to nothing; seed changes the colours)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 256, size=3)
    pixels = np.stack([(xs * 255 // max(width - 1, 1) + base[0]) % 256, (ys * 255 // max(height - 1, 1) + base[1]) % 256,
                       np.full_like(xs, base[2])], axis=-1)  # fmt: skip
    pixels = (pixels + rng.integers(0, 32, size=pixels.shape)) % 256
    return Image.fromarray(pixels.astype(np.uint8), "RGB").convert(mode)


def encode_image(image: Image.Image, fmt: str = "PNG", **save_options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_options)
    return buffer.getvalue()


def image_bytes(width: int = 64, height: int = 48, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    return encode_image(make_image(width, height, seed, mode), fmt)


def exif_rotated_jpeg(width: int = 64, height: int = 32, orientation: int = 6, seed: int = 0) -> bytes:
    """A JPEG stored width x height whose EXIF says to display it rotated (6: 90° clockwise)."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = orientation
    return encode_image(make_image(width, height, seed), "JPEG", exif=exif.tobytes())


def corrupt_image_bytes(size: int = 512, seed: int = 0) -> bytes:
    """Random bytes that no image format recognises."""
    return b"NOTANIMAGE" + np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def truncated_image_bytes(fmt: str = "PNG", keep: float = 0.6) -> bytes:
    """A valid header followed by only part of the pixel data (opens lazily, fails to load)."""
    data = image_bytes(256, 256, seed=1, fmt=fmt)
    return data[: int(len(data) * keep)]


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def decompression_bomb_png(side: int = 12_000) -> bytes:
    """A real 1-bit side x side PNG of zeros: tens of KB on disk, side² pixels when decoded."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    compressed = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", compressed) + _png_chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _image_ref(mode: str, data: bytes, relative_path: str, fmt: str, in_json: bool) -> Any:
    """How one image appears in the `image` column for `mode` (JSON cannot hold raw bytes)."""
    if mode == "path":
        return relative_path
    if mode == "bytes":
        return data
    if mode == "hf_struct":
        return {"bytes": None if in_json else data, "path": relative_path}
    return data_url(data, "image/" + fmt.lower())


def _missing_ref(mode: str, relative_path: str) -> Any:
    if mode == "bytes":
        raise ValueError("a missing image cannot be expressed with image_mode='bytes'")
    return {"bytes": None, "path": relative_path} if mode == "hf_struct" else relative_path


def write_image_dataset(
    path: str | Path,
    n: int,
    fmt: str = "jsonl",
    image_mode: str = "path",
    bad_rows: Mapping[int, str] | None = None,
    prompt_style: str = "messages",
    image_size: tuple[int, int] = (64, 48),
    image_format: str = "PNG",
    question: str = DEFAULT_QUESTION,
) -> Path:
    """Write an n-row image dataset (and its image files) and return its path.

    Columns: `id`, `messages` (a user turn with the question; the image column
    supplies the picture) or `prompt` (the bare question), `image`, and the scalar
    passthrough columns `category` and `index`. `image_mode` picks how images are
    referenced: relative `path` (files written to `<stem>_images/` beside the dataset),
    raw `bytes` (Parquet only), `hf_struct` ({"bytes", "path"}; JSONL keeps only the
    path) or `data_url`. `bad_rows` maps row numbers to one of BAD_ROW_KINDS
    (`invalid_json` writes a broken JSONL line for that row).
    """
    path = Path(path)
    if fmt not in ("jsonl", "parquet") or image_mode not in IMAGE_MODES or prompt_style not in ("messages", "prompt"):
        raise ValueError(f"unsupported combination fmt={fmt!r} image_mode={image_mode!r} prompt_style={prompt_style!r}")
    if fmt == "jsonl" and image_mode == "bytes":
        raise ValueError("JSONL cannot hold raw bytes: use image_mode='path', 'hf_struct' or 'data_url'")
    bad_rows = dict(bad_rows or {})
    possible = set(BAD_ROW_KINDS) - ({"invalid_json"} if fmt == "parquet" else set())
    unknown = set(bad_rows.values()) - possible
    if unknown:
        raise ValueError(f"bad row kinds {sorted(unknown)} are not possible here; choose from {BAD_ROW_KINDS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    image_dir = path.parent / f"{path.stem}_images"
    if image_mode in ("path", "hf_struct"):
        image_dir.mkdir(exist_ok=True)
    suffix = image_format.lower().replace("jpeg", "jpg")
    encoded = [encode_image(make_image(*image_size, seed=s), image_format) for s in range(min(n, DISTINCT_IMAGES))]
    for seed, data in enumerate(encoded):
        if image_mode in ("path", "hf_struct"):
            (image_dir / f"img-{seed:02d}.{suffix}").write_bytes(data)

    rows: list[dict[str, Any]] = []
    for index in range(n):
        kind = bad_rows.get(index)
        if kind == "missing":
            image = _missing_ref(image_mode, f"{image_dir.name}/does-not-exist-{index:05d}.{suffix}")
        else:
            if kind in ("corrupt", "truncated"):
                data = corrupt_image_bytes(seed=index) if kind == "corrupt" else truncated_image_bytes(image_format)
                name = f"bad-{index:05d}.{suffix}"
                if image_mode in ("path", "hf_struct"):
                    (image_dir / name).write_bytes(data)
            else:
                data, name = encoded[index % DISTINCT_IMAGES], f"img-{index % DISTINCT_IMAGES:02d}.{suffix}"
            image = _image_ref(image_mode, data, f"{image_dir.name}/{name}", image_format, in_json=fmt == "jsonl")
        text = {"messages": [{"role": "user", "content": question}]} if prompt_style == "messages" else {"prompt": question}
        rows.append({"id": f"row-{index:05d}", **text, "image": image, "category": CATEGORIES[index % 3], "index": index})

    if fmt == "jsonl":
        lines = [
            b'{"id": "broken", "messages": [' if bad_rows.get(i) == "invalid_json" else json.dumps(row).encode()
            for i, row in enumerate(rows)
        ]
        path.write_bytes(b"".join(line + b"\n" for line in lines))
    else:
        pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema(image_mode, prompt_style)), path)
    return path


def _parquet_schema(image_mode: str, prompt_style: str) -> pa.Schema:
    image_type = {"path": pa.string(), "bytes": pa.binary(), "hf_struct": HF_IMAGE_TYPE, "data_url": pa.string()}
    message_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    text_field = pa.field("messages", message_type) if prompt_style == "messages" else pa.field("prompt", pa.string())
    return pa.schema([("id", pa.string()), text_field, ("image", image_type[image_mode]),
                      ("category", pa.string()), ("index", pa.int64())])  # fmt: skip


def write_openai_batch(path: str | Path, n: int, image_size: tuple[int, int] = (64, 48), max_tokens: int = 16) -> Path:
    """An OpenAI Batch request file: chat completions with a data: URL image each."""
    path = Path(path)
    urls = [data_url(image_bytes(*image_size, seed=s)) for s in range(min(n, DISTINCT_IMAGES))]
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(n):
            content = [{"type": "text", "text": DEFAULT_QUESTION},
                       {"type": "image_url", "image_url": {"url": urls[index % DISTINCT_IMAGES]}}]  # fmt: skip
            body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
            line = {"custom_id": f"request-{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            handle.write(json.dumps(line) + "\n")
    return path


def write_large_parquet(
    path: str | Path,
    n_rows: int,
    image_size: tuple[int, int] = (64, 64),
    chunk_rows: int = 10_000,
    prompt: str = DEFAULT_QUESTION,
) -> Path:
    """A big Parquet dataset with HF `Image` struct columns, written chunk by chunk (fast, flat memory).

    Made for the dry-run and planning benchmarks (e.g. 100k rows): rows cycle through
    DISTINCT_IMAGES encoded pictures; each chunk is one row group.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = pa.array([image_bytes(*image_size, seed=s) for s in range(DISTINCT_IMAGES)], pa.binary())
    names = pa.array([f"img-{s}.png" for s in range(DISTINCT_IMAGES)])
    categories = pa.array(CATEGORIES)
    schema = _parquet_schema("hf_struct", "prompt")
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, n_rows, chunk_rows):
            indices = np.arange(start, min(n_rows, start + chunk_rows))
            picks = pa.array(indices % DISTINCT_IMAGES)
            images = pa.StructArray.from_arrays([encoded.take(picks), names.take(picks)], fields=list(HF_IMAGE_TYPE))
            columns = {
                "id": pa.array([f"row-{i:07d}" for i in range(start, start + len(indices))]),
                "prompt": pa.array([prompt] * len(indices)),
                "image": images,
                "category": categories.take(pa.array(indices % len(CATEGORIES))),
                "index": pa.array(indices, pa.int64()),
            }
            writer.write_table(pa.table(columns, schema=schema))
    return path
