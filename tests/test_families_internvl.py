"""InternVL3 (Qwen2 decoder) and InternVL3.5 (Qwen3 decoder) on the CPU in fp32: the paged
engine's greedy tokens equal `transformers`'.

Mixed requests (text only, up to three images whose aspect ratios give 1 to 6 tiles plus
the thumbnail, a video of one tile per frame, exact repeats) through a small KV cache and
token budget, so batching, chunked prefill, preemption and prefix- and encoder-cache hits
all happen; the engine's counters prove they did. The prompts and pixels we build are the
processor's own, and a row's `mm_processor_kwargs` changes the tiling as it would there.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_harness import (assert_greedy_matches_transformers, build_requests, hf_greedy, internvl_prompt, make_image,
                            make_video, run_to_completion)
from family_harness import ask, make_media_folder, media_parts, run_job, served_client

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.internvl.tiny import TOKENS_PER_TILE, make_tiny_checkpoint
from vlmbatch.families.prompt import collate
from vlmbatch.families.registry import load_adapter

# Aspect ratios from 1:7 to 7:1: tile grids 1x1 .. 6x1 (the thumbnail is added past one tile).
ODD_WIDTHS, ODD_HEIGHTS = (29, 61, 97, 150, 200), (29, 37, 56, 131, 200)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def internvl(request, tiny_model_dir, tmp_path_factory):
    """(adapter, transformers model) of the tiny InternVL3 (qwen2) or InternVL3.5 (qwen3) checkpoint."""
    torch.set_num_threads(1)
    if request.param == "qwen2":
        path = str(tiny_model_dir("internvl"))  # what make-tiny-model --arch internvl writes
    else:
        path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-internvl3_5"), language_model="qwen3"))
    adapter = load_adapter(path)
    assert adapter.config.text_config.model_type == request.param
    return adapter, load_hf_model(path, torch.float32, torch.device("cpu"))


def _engine(adapter, num_kv_blocks: int) -> PagedEngine:
    return PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, block_size=4,
                                             max_num_seqs=6, max_num_batched_tokens=48, min_admission_batch=1))


def _assert_matches_transformers(internvl, count: int, seed: int, num_kv_blocks: int) -> None:
    adapter, hf_model = internvl
    engine = _engine(adapter, num_kv_blocks)
    requests = build_requests(adapter, "internvl", count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared = assert_greedy_matches_transformers(engine, adapter, hf_model, requests)
    assert any(videos for *_, videos, _ in requests) and max(len(images) for _, _, images, _, _ in requests) >= 2
    tiles = {item.tensors["pixel_values"].shape[0] for prompt, _ in prepared.values() for item in prompt.media}
    assert len(tiles) >= 3  # the images' aspect ratios gave several tilings


def test_mixed_requests_match_transformers(internvl):
    _assert_matches_transformers(internvl, count=10, seed=7, num_kv_blocks=56)


def test_a_tower_ours_does_not_rebuild_keeps_transformers_and_matches(tiny_model_dir, tmp_path):
    """InternViT-6B's layout (RMSNorm, q/k norms over the whole width): our tower's `rebuilds`
    refuses it, so the engine keeps `transformers`' tower, and its tokens still equal
    transformers'. (The checkpoint lacks the norms' weights: both load them as initialised.)"""
    path = shutil.copytree(tiny_model_dir("internvl"), tmp_path / "internvl-6b-layout")
    config = json.loads((path / "config.json").read_text())
    config["vision_config"].update(norm_type="rms_norm", use_qk_norm=True)
    (path / "config.json").write_text(json.dumps(config))
    adapter = load_adapter(str(path))
    hf_model = load_hf_model(str(path), torch.float32, torch.device("cpu"))
    engine = _engine(adapter, num_kv_blocks=56)
    assert engine.model.tower is None and engine.model.hf.model.vision_tower is not None
    requests = build_requests(adapter, "internvl", 4, seed=11, max_images=2, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    assert_greedy_matches_transformers(engine, adapter, hf_model, requests)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(internvl):
    _assert_matches_transformers(internvl, count=50, seed=3, num_kv_blocks=64)


def test_prompts_and_pixels_are_the_processors(internvl):
    """Token ids and the collated tiles equal the processor's for images and a video interleaved;
    each item holds its own tiles and fills its own context tokens."""
    adapter, _ = internvl
    images = [make_image(1, (150, 61)), make_image(2, (29, 200)), make_image(3, (40, 40))]
    video = make_video(4, frames=3)
    prompt = "<|im_start|>user\n<IMG_CONTEXT>\n<video>\n<IMG_CONTEXT><IMG_CONTEXT>Compare.<|im_end|>\n<|im_start|>assistant\n"
    prepared = adapter.prepare(prompt, images, [video])
    reference = adapter.processor(text=[prompt], images=images, videos=[video.frames], return_tensors="pt")
    assert prepared.prompt_token_ids == reference["input_ids"][0].tolist()
    assert torch.equal(collate(prepared.media)["pixel_values"], reference["pixel_values"])
    # 150x61: 2x1 tiles + thumbnail; the video: one tile a frame; 29x200: 1x6 + thumbnail; 40x40: one tile
    assert [item.tensors["pixel_values"].shape[0] for item in prepared.media] == [3, 3, 7, 1]
    assert [item.num_tokens for item in prepared.media] == [n * TOKENS_PER_TILE for n in (3, 3, 7, 1)]
    text = adapter.tokenizer.decode(prepared.prompt_token_ids)
    assert "Frame1: <img>" in text and "Frame3: <img>" in text
    assert adapter.check(prompt.replace("<video>\n", ""), images) == adapter.prepare(prompt.replace("<video>\n", ""), images).num_tokens


def test_max_patches_per_row_changes_the_tiling(internvl):
    adapter, hf_model = internvl
    image = make_image(7, (200, 37))  # 5x1 tiles + thumbnail by default
    prompt = internvl_prompt("Describe the image.", 1, False)
    default = adapter.prepare(prompt, [image], max_tokens=6)
    capped = adapter.prepare(prompt, [image], max_tokens=6, processor_kwargs={"max_patches": 2})
    whole = adapter.prepare(prompt, [image], max_tokens=6, processor_kwargs={"crop_to_patches": False})
    assert [p.media[0].tensors["pixel_values"].shape[0] for p in (default, capped, whole)] == [6, 3, 1]
    assert len({p.media[0].content_hash for p in (default, capped, whole)}) == 3  # no cache entry is shared
    assert adapter.check(prompt, [image], processor_kwargs={"max_patches": 2}) == capped.num_tokens
    engine = _engine(adapter, 64)
    for index, prepared in enumerate((default, capped, whole)):
        engine.add_request(str(index), prepared, SamplingParams(max_tokens=6, temperature=0))
    outputs = run_to_completion(engine)
    for index, prepared in enumerate((default, capped, whole)):
        assert outputs[str(index)].outputs[0].token_ids == hf_greedy(hf_model, adapter, prepared, 6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_dynamic_patch": 4}, "unknown mm_processor_kwargs key 'max_dynamic_patch'"),
    ({"max_patches": 0}, "must be a positive int"),
    ({"max_patches": "4"}, "must be a positive int"),
    ({"crop_to_patches": 1}, "must be a bool"),
])
def test_bad_processor_options_are_row_errors(internvl, kwargs, message):
    adapter, _ = internvl
    prompt = internvl_prompt("Describe.", 1, False)
    for call in (adapter.prepare, adapter.check):
        with pytest.raises(RowError, match=message) as info:
            call(prompt, [make_image(1, (64, 64))], processor_kwargs=kwargs)
        assert info.value.error_type == ErrorType.INVALID_ROW and info.value.param == "mm_processor_kwargs"


def test_chat_template_places_images_and_videos(internvl):
    adapter, _ = internvl
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                             {"type": "video_url", "video_url": {"url": "b.mp4"}},
                                             {"type": "text", "text": "What is this?"}]}]
    assert adapter.apply_chat_template(messages) == (
        "<|im_start|>user\n<IMG_CONTEXT>\n<video>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n")


# ---- everywhere the other families work: LLM, jobs, the dry run, serve ---------------------


def test_llm_takes_processor_options_per_prompt(tiny_model_dir):
    from vlmbatch import LLM

    llm = LLM(str(tiny_model_dir("internvl")), engine="paged", device="cpu", dtype="float32")
    image = make_image(3, (200, 61))
    prompt = internvl_prompt("Describe.", 1, False)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    tiled, whole = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}},
                                 {"prompt": prompt, "multi_modal_data": {"image": image},
                                  "mm_processor_kwargs": {"crop_to_patches": False}}], greedy, use_tqdm=False)
    assert tiled.num_input_tokens - whole.num_input_tokens == 3 * TOKENS_PER_TILE  # 3x1 tiles + thumbnail vs one
    with pytest.raises(RowError, match="unknown mm_processor_kwargs key 'tiles'"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}, "mm_processor_kwargs": {"tiles": 1}}, greedy)


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    return make_media_folder(tmp_path_factory.mktemp("internvl-media"))


IMAGE_PROMPT = "<|im_start|>user\n<IMG_CONTEXT>\nDescribe it.<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PROMPT = "<|im_start|>user\n<video>\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_a_job_with_tiling_options_videos_and_bad_rows_completes(tiny_model_dir, media_folder, tmp_path):
    odd = str(media_folder / "odd.png")
    rows = [
        {"id": "image", "prompt": IMAGE_PROMPT, "image": odd},
        {"id": "one-tile", "prompt": IMAGE_PROMPT, "image": odd, "mm_processor_kwargs": {"max_patches": 1}},
        {"id": "video", "prompt": VIDEO_PROMPT, "video": str(media_folder / "h264_mp4.mp4"),
         "media_io_kwargs": {"video": {"num_frames": 4}}},
        {"id": "chat", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": odd}}, {"type": "text", "text": "What is it?"}]}]},
        {"id": "bad-option", "prompt": IMAGE_PROMPT, "image": odd, "mm_processor_kwargs": {"tiles": 3}},
        {"id": "corrupt", "prompt": IMAGE_PROMPT, "image": str(media_folder / "corrupt.png")},
    ]
    by_id = run_job(rows, str(tiny_model_dir("internvl")), tmp_path, "media_decode_error")
    assert by_id["corrupt"]["error_type"] == "media_decode_error"
    assert by_id["bad-option"]["error_type"] == "invalid_row" and "tiles" in by_id["bad-option"]["error"]
    for key in ("image", "one-tile", "video", "chat"):
        assert by_id[key]["error_type"] is None and by_id[key]["num_generated_tokens"] == 4, by_id[key]
    # 97x61: 3x2 tiles + thumbnail by default, one tile when capped
    assert by_id["image"]["num_input_tokens"] - by_id["one-tile"]["num_input_tokens"] == 6 * TOKENS_PER_TILE
    assert by_id["video"]["num_input_tokens"] > 4 * TOKENS_PER_TILE


@pytest.mark.slow
def test_serve_answers_images_and_videos_with_tiling_options(tiny_model_dir, media_folder):
    import openai

    model = str(tiny_model_dir("internvl"))
    image, video = media_parts(media_folder)
    with served_client(model, media_folder) as client:
        both = ask(client, model, image, video)
        assert both.choices[0].finish_reason in ("stop", "length")
        tiled = ask(client, model, image)
        one_tile = ask(client, model, image, extra_body={"mm_processor_kwargs": {"max_patches": 1}})
        assert both.usage.prompt_tokens - tiled.usage.prompt_tokens >= 4 * TOKENS_PER_TILE  # a tile a frame
        assert tiled.usage.prompt_tokens - one_tile.usage.prompt_tokens == 6 * TOKENS_PER_TILE
        with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs"):
            ask(client, model, image, extra_body={"mm_processor_kwargs": {"max_dynamic_patch": 1}})


def test_the_8b_bench_folder_keeps_the_published_sizes_and_tokens(tmp_path):
    """`bench engine --model-shape internvl3_8b` runs from this folder (ours, generate(), vLLM's dummy loader)."""
    import json

    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    from vlmbatch.bench.shapes import resolve_shape, write_model_folder

    path = write_model_folder(resolve_shape("internvl3_8b"), tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["InternVLForConditionalGeneration"] and config.text_config.model_type == "qwen2"
    assert config.text_config.architectures == ["Qwen2ForCausalLM"]
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers, config.vision_config.num_hidden_layers) == (3584, 28, 24)
    processor = AutoProcessor.from_pretrained(path)
    assert processor.image_seq_length == config.image_seq_length == 256
    assert json.loads((path / "video_preprocessor_config.json").read_text())["size"] == {"height": 448, "width": 448}
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) == 2 + 256  # one tile, no thumbnail
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (896, 448))]) == 2 + 3 * 256  # 2x1 + thumbnail


def test_rows_take_tiling_options_and_keep_jpegs_on_the_cpu_path(tiny_model_dir, tmp_path):
    """A row's `mm_processor_kwargs` reach the processor (and the dry run's count); a bad one
    is that row's `invalid_row`. The engine's GPU decoder runs the image processor alone,
    which does not tile: InternVL rows decode on the CPU even where the engine decodes other
    families' JPEGs."""
    import io

    from vlmbatch.config import MediaConfig
    from vlmbatch.io.readers import ColumnMap
    from vlmbatch.job.prepare import media_loader_for, prepare_row

    adapter = load_adapter(str(tiny_model_dir("internvl")))
    assert not adapter.accepts_encoded_images
    buffer = io.BytesIO()
    make_image(2, (150, 61)).save(buffer, format="JPEG", quality=90)
    media = media_loader_for(tmp_path / "data.jsonl", None, MediaConfig())

    def row(options=None, **kwargs):
        raw = {"prompt": IMAGE_PROMPT, "image": buffer.getvalue(), "mm_processor_kwargs": options}
        return prepare_row(0, raw, ColumnMap(), SamplingParams(max_tokens=4), adapter, media, **kwargs)

    tiled, one_tile = row(defer_jpegs=True), row('{"max_patches": 1}', defer_jpegs=True)  # a JSON string column too
    assert tiled.error is None and [i.encoded for i in tiled.prepared.media] == [None]
    assert [r.prepared.media[0].tensors["pixel_values"].shape[0] for r in (tiled, one_tile)] == [3, 1]  # 2x1 + thumbnail
    assert row({"max_patches": 1}, check_only=True).error is None
    for bad in ({"tiles": 2}, {"max_patches": -1}, "[1]"):
        for kwargs in ({}, {"check_only": True}):
            error = row(bad, **kwargs).error
            assert error is not None and error.error_type == ErrorType.INVALID_ROW and error.param == "mm_processor_kwargs"
