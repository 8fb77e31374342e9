"""Adapters, the registry and chat parsing: every per-row problem becomes the right `RowError`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vlmbatch.chat import parse_chat_messages
from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.media.types import VideoFrames
from vlmbatch.families.prompt import collate
from vlmbatch.families.registry import load_adapter, model_family

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def _image(h: int = 64, w: int = 80, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _video(num_frames: int = 4, fps: float = 2.0) -> VideoFrames:
    frames = np.random.default_rng(1).integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)
    return VideoFrames(
        frames=frames,
        timestamps=[i / fps for i in range(num_frames)],
        sampled_fps=fps,
        source_fps=30.0,
        duration=num_frames / fps,
    )


@pytest.fixture(scope="module")
def qwen(tiny_qwen):
    return load_adapter(str(tiny_qwen))


@pytest.fixture(scope="module")
def llava(tiny_llava):
    return load_adapter(str(tiny_llava))


def _error(fn, *args, **kwargs) -> RowError:
    with pytest.raises(RowError) as info:
        fn(*args, **kwargs)
    return info.value


def test_registry_picks_the_family(qwen, llava, tiny_qwen2):
    assert qwen.family.name == "qwen2_5_vl" and qwen.supports_video
    assert llava.family.name == "llava" and not llava.supports_video
    assert model_family(str(tiny_qwen2)).name == "qwen2_vl"
    vocab = qwen.tokenizer.get_vocab()
    assert qwen.eos_token_ids == sorted({vocab["<|im_end|>"], vocab["<|endoftext|>"]})
    assert llava.eos_token_ids == [llava.tokenizer.convert_tokens_to_ids("</s>")]


def test_missing_and_unsupported_models_are_job_errors(tmp_path):
    with pytest.raises(JobError, match="model not found"):
        load_adapter(str(tmp_path / "nope"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(JobError, match="unsupported model type 'gpt2'"):
        load_adapter(str(tmp_path / "gpt2"))


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(qwen, llava, prompt):
    for adapter in (qwen, llava):
        assert _error(adapter.prepare, prompt).error_type == ErrorType.PROMPT_EMPTY


def test_placeholder_mismatch(qwen, llava):
    cases = [
        (qwen, f"{QWEN_IMAGE} describe", []),
        (qwen, f"{QWEN_IMAGE} describe", [_image(), _image(seed=1)]),
        (qwen, "<|image_pad|> a bare pad without its vision markers", [_image()]),
        (qwen, f"{QWEN_VIDEO} a video placeholder, no video", []),
        (llava, "USER: <image>\n<image>\nWhat? ASSISTANT:", [_image()]),
        (llava, "USER: What? ASSISTANT:", [_image()]),
    ]
    for adapter, prompt, images in cases:
        error = _error(adapter.prepare, prompt, images)
        assert error.error_type == ErrorType.PLACEHOLDER_MISMATCH, prompt
        assert error.param == "prompt"


def test_prompt_too_long_counts_media_tokens(qwen):
    prompt = f"{QWEN_IMAGE} describe"
    fits = qwen.prepare(prompt, [_image(224, 224)], max_tokens=1)
    image_tokens = fits.prompt_token_ids.count(qwen.image_token_id)
    assert image_tokens == 64  # (224 / 14 / 2) ** 2: the text alone would be far shorter
    room = qwen.max_model_len - fits.num_tokens
    assert qwen.prepare(prompt, [_image(224, 224)], max_tokens=room).num_tokens == fits.num_tokens
    error = _error(qwen.prepare, prompt, [_image(224, 224)], max_tokens=room + 1)
    assert error.error_type == ErrorType.PROMPT_TOO_LONG


def test_processor_options_the_family_does_not_take_are_row_errors(qwen):
    error = _error(qwen.prepare, f"{QWEN_IMAGE} a", [_image()], processor_kwargs={"max_patches": 2})
    assert error.error_type == ErrorType.INVALID_ROW and error.param == "mm_processor_kwargs" and "none" in str(error)


def test_video_on_llava_is_unsupported(llava):
    error = _error(llava.prepare, "USER: <video> what happens? ASSISTANT:", None, [_video()])
    assert error.error_type == ErrorType.UNSUPPORTED_MEDIA


def test_qwen_video_uses_the_real_sampling_rate(qwen):
    prepared = qwen.prepare(f"{QWEN_VIDEO} what happens?", videos=[_video(num_frames=4, fps=2.0)])
    (video,) = prepared.media
    assert video.kind == "video" and video.tensors["video_grid_thw"].tolist() == [[2, 4, 6]]  # 4 frames / temporal patch 2; 56x84 px / 14
    assert video.tensors["second_per_grid_ts"].tolist() == [1.0]  # 2 frames per grid step at 2 fps
    assert video.num_tokens == prepared.prompt_token_ids.count(qwen.video_token_id) == 2 * 4 * 6 // 4
    slower = qwen.prepare(f"{QWEN_VIDEO} what happens?", videos=[_video(num_frames=4, fps=0.5)])
    assert slower.media[0].tensors["second_per_grid_ts"].tolist() == [4.0]


def test_media_items_are_one_per_image_and_collate_to_the_processor_batch(qwen, llava):
    """Each item holds its own rows of the processor's batch; collating a prompt's items gives
    back exactly what the processor returned for the whole prompt."""
    one = qwen.prepare(f"{QWEN_IMAGE}a", [_image(56, 56)])
    images = [_image(112, 84, 1), _image(56, 112, 2)]
    two = qwen.prepare(f"{QWEN_IMAGE}{QWEN_IMAGE}b", images)
    assert set(one.media[0].tensors) == {"pixel_values", "image_grid_thw"}
    assert [item.num_tokens for item in two.media] == [int(i.tensors["image_grid_thw"].prod()) // 4 for i in two.media]
    assert sum(item.num_tokens for item in two.media) == two.prompt_token_ids.count(qwen.image_token_id)
    whole = qwen.processor(text=[f"{QWEN_IMAGE}{QWEN_IMAGE}b"], images=images, return_tensors="pt")
    collated = collate(two.media)
    assert torch.equal(collated["pixel_values"], whole["pixel_values"])
    assert torch.equal(collated["image_grid_thw"], whole["image_grid_thw"])
    assert two.media[0].content_hash != two.media[1].content_hash
    again = qwen.prepare(f"x{QWEN_IMAGE}", [_image(56, 56)])
    assert again.media[0].content_hash == one.media[0].content_hash  # same pixels, same hash
    lone = llava.prepare("USER: <image>\nhi ASSISTANT:", [_image()])
    assert lone.media[0].tensors["pixel_values"].shape == (1, 3, 56, 56) and lone.media[0].num_tokens == 16


def test_chat_template_renders_placeholders(qwen, llava):
    messages = [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "a.png"}},
            {"type": "text", "text": "What is this?"},
        ]},
    ]
    assert llava.apply_chat_template(messages) == "USER: <image>\nWhat is this? ASSISTANT:"
    assert f"<|im_start|>user\n{QWEN_IMAGE}What is this?<|im_end|>" in qwen.apply_chat_template(messages)
    parsed, _, _ = parse_chat_messages(messages)
    assert qwen.apply_chat_template(parsed) == qwen.apply_chat_template(messages)  # both forms accepted


def test_chat_template_override_and_missing_template(tiny_llava, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    custom = load_adapter(str(tiny_llava), chat_template=str(template))
    assert custom.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    inline = load_adapter(str(tiny_llava), chat_template="{{ messages[0]['content'] }}!")
    assert inline.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(JobError, match="chat template not found"):
        load_adapter(str(tiny_llava), chat_template=str(tmp_path / "missing.jinja"))
    bare = load_adapter(str(tiny_llava))
    bare.processor.chat_template = None
    error = _error(bare.apply_chat_template, [{"role": "user", "content": "hi"}])
    assert error.error_type == ErrorType.INVALID_ROW and "no chat template" in error.message


def test_parse_chat_messages_returns_refs_in_order():
    pil = _image()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
            {"type": "video_url", "video_url": {"url": "clip.mp4"}},
            {"type": "image_pil", "image_pil": pil},
            {"type": "text", "text": "Compare."},
        ]},
    ]
    parsed, images, videos = parse_chat_messages(messages)
    assert images == ["https://x/a.png", pil] and videos == ["clip.mp4"]
    assert parsed[1]["content"] == [{"type": "image"}, {"type": "video"}, {"type": "image"},
                                    {"type": "text", "text": "Compare."}]
    assert parse_chat_messages(parsed) == (parsed, [], [])


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hello", "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "a.png"}]}],
         "messages[0].content[1].image_url"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "video_url", "video_url": {}}]}],
         "messages[1].content[0].video_url"),
        ([{"role": "user", "content": [{"type": "image_pil", "image_pil": "not an image"}]}],
         "messages[0].content[0].image_pil"),
        ([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "a.wav"}}]}],
         "messages[0].content[0].type"),
    ],
)
def test_bad_chat_messages_name_the_bad_part(messages, param):
    error = _error(parse_chat_messages, messages)
    assert error.error_type == ErrorType.INVALID_ROW
    assert error.param == param


def test_check_counts_tokens_like_prepare_without_pixels(qwen, llava):
    sizes = [(56, 56), (64, 80), (300, 120), (500, 700)]
    for h, w in sizes:
        images = [_image(h, w), _image(w, h, 1)]
        prompt = f"{QWEN_IMAGE}and{QWEN_IMAGE} compare"
        assert qwen.check(prompt, images) == qwen.prepare(prompt, images).num_tokens
        llava_prompt = "USER: <image>\n<image>\ncompare ASSISTANT:"
        assert llava.check(llava_prompt, images) == llava.prepare(llava_prompt, images).num_tokens
    video_prompt = f"{QWEN_VIDEO} what happens?"
    assert qwen.check(video_prompt, videos=[_video()]) == qwen.prepare(video_prompt, videos=[_video()]).num_tokens
    count = qwen.check(f"{QWEN_IMAGE} a", [_image()])
    assert _error(qwen.check, f"{QWEN_IMAGE} a", [_image()], max_tokens=qwen.max_model_len - count + 1).error_type == (
        ErrorType.PROMPT_TOO_LONG
    )
    assert _error(qwen.check, "  ").error_type == ErrorType.PROMPT_EMPTY
    assert _error(llava.check, "<image>", []).error_type == ErrorType.PLACEHOLDER_MISMATCH
    assert _error(llava.check, "x", None, [_video()]).error_type == ErrorType.UNSUPPORTED_MEDIA
