"""LLaVA-NeXT and LLaVA-OneVision on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

Mixed requests (text only, up to three images of odd sizes and aspect ratios so the tile
grid, the unpadding and OneVision's `anyres_max_9` downsampling all vary, OneVision's
multi-image rule, a video for OneVision, exact repeats) through a small KV cache and token
budget, so batching, chunked prefill, preemption and prefix- and encoder-cache hits all
happen; the engine's counters prove they did. The default run takes a few requests, the
50-request sweep is `slow`.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import assert_greedy_matches_transformers, build_requests, make_image, make_video, onevision_prompt
from family_harness import ask, load_family, make_media_folder, media_parts, run_job, served_client

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.registry import load_adapter

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)
ARCHS = ["llava_next", "llava_onevision"]


@pytest.fixture(scope="module", params=ARCHS)
def llava(request, tiny_model_dir):
    return load_family(request.param, tiny_model_dir)


def _check_against_transformers(llava, count: int, seed: int) -> None:
    arch, adapter, hf_model = llava
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
                                               max_num_seqs=6, max_num_batched_tokens=64, min_admission_batch=1))
    requests = build_requests(adapter, arch, count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared = assert_greedy_matches_transformers(engine, adapter, hf_model, requests)
    tile_counts = {len(item.tensors["pixel_values"]) for p, _ in prepared.values() for item in p.media if item.kind == "image"}
    assert len(tile_counts) >= 3, tile_counts  # several tile grids (OneVision: and base-only images)
    items = [item for p, _ in prepared.values() for item in p.media]
    if arch == "llava_onevision":  # a video, and a 150x131 image alone: a 4x4 grid downsampled (anyres_max_9)
        assert any(item.kind == "video" for item in items)
        assert any(item.tensors.get("image_sizes", torch.zeros(1)).tolist() == [[150, 131]]
                   and len(item.tensors["pixel_values"]) == 17 for item in items)


def test_mixed_requests_match_transformers(llava):
    _check_against_transformers(llava, 12, seed={"llava_next": 0, "llava_onevision": 1}[llava[0]])  # seeds with varied grids


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(llava):
    _check_against_transformers(llava, 50, seed={"llava_next": 3, "llava_onevision": 0}[llava[0]])


# ---- the adapters' own rules ----------------------------------------------------------------


@pytest.fixture(scope="module")
def onevision(tiny_model_dir):
    return load_adapter(str(tiny_model_dir("llava_onevision")))


def test_onevision_tiles_a_lone_image_and_shrinks_multi_image_prompts(onevision):
    """A lone image is tiled (a 150x131 image: 4x4 tiles, its grid downsampled to the
    `anyres_max_9` budget); each image of a multi-image prompt is its base view plus one
    newline. The dry run's count, from sizes alone, equals the processor's."""
    large, small = make_image(1, (131, 150)), make_image(2, (97, 61))
    alone = onevision.prepare(onevision_prompt("What?", 1, False), [large])
    [item] = alone.media
    assert len(item.tensors["pixel_values"]) == 17 and item.num_tokens == 160 < 16 + 16 * 16 + 16
    pair = onevision.prepare(onevision_prompt("What?", 2, False), [large, small])
    assert [(len(i.tensors["pixel_values"]), i.num_tokens) for i in pair.media] == [(1, 17), (1, 17)]
    assert pair.media[0].content_hash != item.content_hash  # base-only embeddings are cached apart
    for prompt, images in ((alone, [large]), (pair, [large, small])):
        assert onevision.check(prompt.prompt, images) == prompt.num_tokens


def test_onevision_samples_32_frames_uniformly():
    """The sampling contract under OneVision's convention: 32 frames spread over a long clip
    (first and last included), every frame of a clip with fewer, none repeated."""
    from vlmbatch.families.llava_onevision.adapter import LLAVA_ONEVISION_FRAMES
    from vlmbatch.media.video.options import VideoOptions
    from vlmbatch.media.video.sampling import plan_frames

    long = plan_frames([i / 30 for i in range(1800)], VideoOptions(), LLAVA_ONEVISION_FRAMES)
    assert len(long.indices) == 32 and (long.indices[0], long.indices[-1]) == (0, 1799)
    assert plan_frames([i / 8 for i in range(24)], VideoOptions(), LLAVA_ONEVISION_FRAMES).indices == list(range(24))
    assert len(plan_frames([i / 30 for i in range(1800)], VideoOptions(num_frames=8), LLAVA_ONEVISION_FRAMES).indices) == 8


def test_a_video_on_llava_next_is_a_row_error(tiny_model_dir):
    adapter = load_adapter(str(tiny_model_dir("llava_next")))
    with pytest.raises(RowError) as info:
        adapter.prepare("[INST] <video>\nWhat happens? [/INST]", videos=[make_video(1)])
    assert info.value.error_type == ErrorType.UNSUPPORTED_MEDIA
    assert not adapter.accepts_encoded_images  # JPEGs are decoded on the CPU (see adapter.py)


# ---- everywhere the other families work: jobs, the dry run, serve -------------------------

IMAGE_PROMPTS = {
    "llava_next": "[INST] <image>\nDescribe it. [/INST]",
    "llava_onevision": "<|im_start|>user <image>\nDescribe it.<|im_end|>\n<|im_start|>assistant\n",
}
VIDEO_PROMPTS = {
    "llava_next": "[INST] <video>\nWhat happens? [/INST]",
    "llava_onevision": "<|im_start|>user <video>\nWhat happens?<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    folder = make_media_folder(tmp_path_factory.mktemp("llava-media"))  # odd.png is 97x61
    make_image(9, (131, 150)).save(folder / "large.png")  # OneVision: a 4x4 grid, downsampled
    return folder


@pytest.mark.slow  # ~40 s each: subprocesses
@pytest.mark.parametrize("arch", ARCHS)
def test_a_job_with_images_videos_and_bad_rows_completes(arch, tiny_model_dir, media_folder, tmp_path):
    """Images (one, two), a chat row, a corrupt image; a video is a row like any other on
    OneVision and an `unsupported_media` row error on NeXT; the dry run finds the bad rows."""
    two = IMAGE_PROMPTS[arch].replace("<image>", "<image><image>")
    rows = [
        {"id": "image", "prompt": IMAGE_PROMPTS[arch], "image": str(media_folder / "large.png")},
        {"id": "two-images", "prompt": two, "images": [str(media_folder / "large.png"), str(media_folder / "odd.png")]},
        {"id": "video", "prompt": VIDEO_PROMPTS[arch], "video": str(media_folder / "h264_mp4.mp4")},
        {"id": "chat", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(media_folder / "odd.png")}},
            {"type": "text", "text": "What is it?"}]}]},
        {"id": "corrupt", "prompt": IMAGE_PROMPTS[arch], "image": str(media_folder / "corrupt.png")},
    ]
    by_id = run_job(rows, str(tiny_model_dir(arch)), tmp_path, dry_run_error="media_decode_error")
    assert by_id["corrupt"]["error_type"] == "media_decode_error"
    ok = ["image", "two-images", "chat"] + (["video"] if arch == "llava_onevision" else [])
    for key in ok:
        assert by_id[key]["error_type"] is None and by_id[key]["num_generated_tokens"] == 4, by_id[key]
    if arch == "llava_next":
        assert by_id["video"]["error_type"] == "unsupported_media"
    else:  # a lone image is tiled (the larger, the more tokens); two images are 17 base-view tokens each
        counts = [by_id[key]["num_input_tokens"] for key in ("two-images", "chat", "image")]
        assert counts == sorted(counts) and counts[0] < 17 * 2 + 20, counts
        assert by_id["video"]["num_input_tokens"] >= 24 * 4 + 1  # all 24 frames of the 3 s clip, 2x2 pooled, a newline


@pytest.mark.slow  # ~30 s: a server per family
def test_serve_answers_images_and_videos(tiny_model_dir, media_folder):
    """OneVision answers images, videos and both; NeXT answers images and refuses a video
    with a 400 naming `unsupported_media`."""
    import openai

    image, video = media_parts(media_folder)
    for arch in ARCHS:
        model = str(tiny_model_dir(arch))
        with served_client(model, media_folder) as client:
            for parts in ([image], [image, image]) + (([video], [image, video]) if arch == "llava_onevision" else ()):
                reply = ask(client, model, *parts)
                assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 20
            if arch == "llava_next":
                with pytest.raises(openai.BadRequestError) as info:
                    ask(client, model, video)
                assert info.value.code == "unsupported_media"
