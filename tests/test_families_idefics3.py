"""Idefics3 and SmolVLM on the CPU in fp32: the paged engine's greedy tokens equal `transformers'`.

Mixed requests (text only, up to three images of odd sizes and aspect ratios, so each is
split into a different grid of tiles plus its global image; a timestamped video on
SmolVLM; exact repeats) through a small KV cache and token budget, so batching, chunked
prefill (also through an image's tiles), preemption and prefix- and encoder-cache hits
all happen; the engine's counters prove they did. The default run takes a few prompts per
model type; the 50-prompt sweep is `slow`.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import assert_greedy_matches_transformers, build_requests, make_image, make_video
from family_harness import ask, load_family, make_media_folder, media_parts, run_job, served_client

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.registry import load_adapter

# Wide, tall and small images (upscaled to a longest edge of 96 px): 1x3, 3x1, 2x3, 3x2 and 3x3 tile grids.
ODD_WIDTHS, ODD_HEIGHTS = (23, 37, 97, 131, 200), (29, 61, 150)
ARCHS = ["idefics3", "smolvlm"]


@pytest.fixture(scope="module", params=ARCHS)
def idefics3(request, tiny_model_dir):
    return load_family(request.param, tiny_model_dir)


def _check_mixed_requests(arch, adapter, hf_model, count: int, seed: int) -> None:
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=40, block_size=8,
                                               max_num_seqs=4, max_num_batched_tokens=96, min_admission_batch=1))
    requests = build_requests(adapter, arch, count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared = assert_greedy_matches_transformers(engine, adapter, hf_model, requests)
    tiles = {len(item.tensors["pixel_values"]) for prompt, _ in prepared.values() for item in prompt.media}
    assert len(tiles) >= 3, tiles  # images split into different grids
    assert any(videos for *_, videos, _ in requests) == (arch == "smolvlm")


def test_mixed_requests_match_transformers(idefics3):
    _check_mixed_requests(*idefics3, count=10, seed=3)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(idefics3):
    _check_mixed_requests(*idefics3, count=50, seed=4)


# ---- the adapters: tiles, the dry-run count, placeholders, media each family refuses --------


@pytest.fixture(scope="module")
def adapters(tiny_model_dir):
    return {arch: load_adapter(str(tiny_model_dir(arch))) for arch in ARCHS}


def _prompt(arch: str, media: str) -> str:
    return ("<|im_start|>" if arch == "smolvlm" else "") + f"User:{media}<end_of_utterance>\nAssistant:"


@pytest.mark.parametrize("arch", ARCHS)
def test_each_image_is_its_tiles_and_the_dry_run_counts_them(adapters, arch):
    """One item per image holding its tiles (rows x cols + the global image), together exactly
    the processor's pixels; `check` counts what `prepare` builds for odd sizes, without pixels."""
    adapter = adapters[arch]
    prompt = _prompt(arch, "<image>Compare<image>and<image>")
    for sizes in ([(200, 29), (23, 61), (97, 97)], [(32, 32), (131, 150), (37, 200)]):
        images = [make_image(i, size) for i, size in enumerate(sizes)]
        prepared = adapter.prepare(prompt, images)
        assert adapter.check(prompt, images) == prepared.num_tokens
        whole = adapter.processor(text=[prompt], images=images, return_tensors="pt")
        assert prepared.prompt_token_ids == whole["input_ids"][0].tolist()
        assert torch.equal(adapter.hf_media_inputs(prepared.media)["pixel_values"], whole["pixel_values"])
        seq_len = adapter.processor.image_seq_len
        assert [m.num_tokens for m in prepared.media] == [len(m.tensors["pixel_values"]) * seq_len for m in prepared.media]
        assert sum(m.num_tokens for m in prepared.media) == prepared.prompt_token_ids.count(adapter.image_token_id)
    wide, tall = (adapter.prepare(_prompt(arch, "<image>"), [make_image(0, size)]).media[0] for size in ((200, 29), (29, 200)))
    assert len(wide.tensors["pixel_values"]) == len(tall.tensors["pixel_values"]) == 4  # 1x3 and 3x1 tiles + global
    assert not adapter.accepts_encoded_images  # tiling needs the pixels: jobs decode JPEGs on the CPU


@pytest.mark.parametrize("arch", ARCHS)
def test_placeholders_and_unsupported_media_are_row_errors(adapters, arch):
    adapter = adapters[arch]
    with pytest.raises(RowError) as info:
        adapter.prepare(_prompt(arch, "<image><image>"), [make_image(0, (40, 40))])
    assert info.value.error_type == ErrorType.PLACEHOLDER_MISMATCH
    with pytest.raises(RowError) as info:
        adapter.prepare(_prompt(arch, "<image><video>" if arch == "smolvlm" else "<image>"),
                        [make_image(0, (40, 40))], [make_video(1)])
    assert info.value.error_type == ErrorType.UNSUPPORTED_MEDIA  # Idefics3: no video; SmolVLM: not with images
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                             {"type": "text", "text": "What is this?"}]}]
    assert adapter.apply_chat_template(messages) == _prompt(arch, "<image>What is this?")


def test_smolvlm_videos_are_timestamped_frames(adapters):
    """A video is one single-tile image per frame after its real timestamp, as the processor
    writes it; frames of a variable-frame-rate clip keep their own times."""
    adapter = adapters["smolvlm"]
    uneven = make_video(1, frames=4)
    uneven.timestamps, uneven.duration = [0.0, 1.0, 61.0, 125.0], 126.0
    prepared = adapter.prepare(_prompt("smolvlm", "<video>What happens?"), videos=[uneven])
    text = adapter.tokenizer.decode(prepared.prompt_token_ids)
    assert "series of four frames from a 0:02:06 [H:MM:SS] video" in text
    assert [text.count(f"Frame from {t}:") for t in ("00:00", "00:01", "01:01", "02:05")] == [1, 1, 1, 1]
    (video,) = prepared.media
    assert video.tensors["pixel_values"].shape == (4, 3, 32, 32) and video.num_tokens == 4 * adapter.processor.image_seq_len
    two = adapter.prepare(_prompt("smolvlm", "<video>and<video>"), videos=[make_video(2, frames=4), make_video(3, frames=2)])
    assert [len(m.tensors["pixel_values"]) for m in two.media] == [4, 2]  # each video's own frames, not the padding


# ---- everywhere the other families work: jobs, the dry run, serve -------------------------


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    folder = make_media_folder(tmp_path_factory.mktemp("idefics3-media"))
    make_image(2, (30, 140)).save(folder / "tall.jpg")
    return folder


# slow (both): past the adapter a job is the same for every family (Qwen's job tests run by
# default); this family's prompts, tiles, video and row errors are this file's default tests
# (parity, serve, test_placeholders_and_unsupported_media_are_row_errors).
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_a_job_with_images_a_video_and_bad_rows_completes(arch, tiny_model_dir, media_folder, tmp_path):
    video = str(media_folder / "h264_mp4.mp4")
    rows = [
        {"id": "image", "prompt": _prompt(arch, "<image>Describe it."), "image": str(media_folder / "odd.png")},
        {"id": "two-images", "prompt": _prompt(arch, "<image><image>Compare."),
         "images": [str(media_folder / "odd.png"), str(media_folder / "tall.jpg")]},
        {"id": "chat", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(media_folder / "tall.jpg")}},
            {"type": "text", "text": "What is it?"}]}]},
        {"id": "video", "prompt": _prompt(arch, "<video>What happens?"), "video": video,
         "media_io_kwargs": {"video": {"num_frames": 3}}},
        {"id": "corrupt", "prompt": _prompt(arch, "<image>Describe it."), "image": str(media_folder / "corrupt.png")},
    ]
    by_id = run_job(rows, str(tiny_model_dir(arch)), tmp_path, "media_decode_error")
    assert by_id["corrupt"]["error_type"] == "media_decode_error"
    assert by_id["video"]["error_type"] == (None if arch == "smolvlm" else "unsupported_media"), by_id["video"]
    for key in ("image", "two-images", "chat", *(["video"] if arch == "smolvlm" else [])):
        assert by_id[key]["error_type"] is None and by_id[key]["num_generated_tokens"] == 4, by_id[key]
    assert by_id["two-images"]["num_input_tokens"] > by_id["image"]["num_input_tokens"]


def test_serve_answers_images_and_a_video_and_refuses_both_at_once(tiny_model_dir, media_folder):
    import openai

    model = str(tiny_model_dir("smolvlm"))
    image, video = media_parts(media_folder)
    with served_client(model, media_folder) as client:
        for parts in ([image], [image, image], [video]):
            reply = ask(client, model, *parts)
            assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 20
        with pytest.raises(openai.BadRequestError) as bad:
            ask(client, model, image, video)
        assert bad.value.body["code"] == "unsupported_media"
