"""Qwen3-VL, dense and mixture-of-experts, on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

Fifty mixed requests (text only, up to three images of odd sizes and aspect ratios, a
timestamped video, exact repeats) through a small KV cache and token budget, so batching,
chunked prefill (also through DeepStack's media rows), preemption and prefix- and
encoder-cache hits all happen; the engine's counters prove they did.
"""

from __future__ import annotations

import pytest
from engine_harness import assert_greedy_matches_transformers, build_requests, make_video, qwen_prompt
from family_harness import ask, load_family, make_media_folder, media_parts, run_job, served_client

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import PagedEngine

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3(request, tiny_model_dir):
    return load_family(request.param, tiny_model_dir)[1:]


def test_fifty_mixed_requests_match_transformers(qwen3):
    adapter, hf_model = qwen3
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=96, block_size=4,
                                               max_num_seqs=6, max_num_batched_tokens=48, min_admission_batch=1))
    requests = build_requests(adapter, "qwen3_vl", 50, seed=3, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    assert_greedy_matches_transformers(engine, adapter, hf_model, requests)
    assert {len(images) for _, _, images, _, _ in requests} == {0, 1, 2, 3}
    assert any(videos for *_, videos, _ in requests)


def test_video_frames_carry_their_real_timestamps(qwen3):
    """Each temporal pair of frames is preceded by its timestamp (the pair's mean), in the
    prompt the processor writes, from the frames' own presentation times."""
    adapter, _ = qwen3
    video = make_video(1, frames=4)  # frames at 0, 0.5, 1.0, 1.5 s
    text = adapter.tokenizer.decode(adapter.prepare(qwen_prompt("What happens?", 0, True), videos=[video]).prompt_token_ids)
    assert "<0.2 seconds>" in text and "<1.2 seconds>" in text
    uneven = make_video(1, frames=4)
    uneven.timestamps = [0.0, 0.1, 3.0, 5.0]  # a variable-frame-rate clip
    text = adapter.tokenizer.decode(adapter.prepare(qwen_prompt("What happens?", 0, True), videos=[uneven]).prompt_token_ids)
    assert "<0.1 seconds>" in text and "<4.0 seconds>" in text


# ---- everywhere the other families work: jobs, the dry run, serve -------------------------

VIDEO_PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    return make_media_folder(tmp_path_factory.mktemp("qwen3-media"))


# The MoE model's job is `slow`: its rows take qwen3_vl's path (processor, media, job) to a
# decoder whose tokens the parity test checks and that test_serve_answers_images_and_videos runs.
@pytest.mark.parametrize("arch", ["qwen3_vl", pytest.param("qwen3_vl_moe", marks=pytest.mark.slow)])
def test_a_job_with_images_videos_and_a_bad_row_completes(arch, tiny_model_dir, media_folder, tmp_path):
    rows = [
        {"id": "image", "prompt": IMAGE_PROMPT, "image": str(media_folder / "odd.png")},
        {"id": "video", "prompt": VIDEO_PROMPT, "video": str(media_folder / "h264_mp4.mp4")},
        {"id": "video-2-frames", "prompt": VIDEO_PROMPT, "video": str(media_folder / "h264_mp4.mp4"),
         "media_io_kwargs": {"video": {"num_frames": 2}}},
        {"id": "chat", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": str(media_folder / "h264_mp4.mp4")}},
            {"type": "text", "text": "What happens?"}]}]},
        {"id": "corrupt", "prompt": IMAGE_PROMPT, "image": str(media_folder / "corrupt.png")},
    ]
    by_id = run_job(rows, str(tiny_model_dir(arch)), tmp_path, "media_decode_error")
    assert by_id["corrupt"]["error_type"] == "media_decode_error"
    for key in ("image", "video", "video-2-frames", "chat"):
        assert by_id[key]["error_type"] is None and by_id[key]["num_generated_tokens"] == 4, by_id[key]
    assert by_id["video"]["num_input_tokens"] > by_id["video-2-frames"]["num_input_tokens"] > by_id["image"]["num_input_tokens"] - 10


def test_serve_answers_images_and_videos(tiny_model_dir, media_folder):
    model = str(tiny_model_dir("qwen3_vl_moe"))
    image, video = media_parts(media_folder)
    with served_client(model, media_folder) as client:
        for parts in ([image], [video], [image, video]):
            reply = ask(client, model, *parts)
            assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 20
