"""The benchmark's model shapes: registry entries, and the folder every engine (ours, `generate()`,
vLLM's dummy loader) runs from, read back through `transformers` as those engines read it."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlmbatch.bench.shapes import SHAPES, ShapeError, resolve_shape, write_model_folder


def test_aliases_and_unknown_or_unavailable_shapes():
    assert resolve_shape("3b") is SHAPES["qwen2_5_vl_3b"] and resolve_shape("7b") is SHAPES["qwen2_5_vl_7b"]
    with pytest.raises(ShapeError, match="unknown model shape 'qwen9'.*qwen2_5_vl_3b"):
        resolve_shape("qwen9")
    for name in ("qwen3_vl_8b", "qwen3_vl_30b_a3b"):  # their families exist now
        assert resolve_shape(name).family in ("qwen3_vl", "qwen3_vl_moe")


def test_a_shape_of_a_family_vlmbatch_lacks_is_refused(monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(SHAPES, "future", replace(SHAPES["qwen3_vl_8b"], name="future", family="qwen9_vl"))
    with pytest.raises(ShapeError, match="future: family not available"):
        resolve_shape("future")


def test_model_folder_round_trips_through_transformers_with_the_published_sizes(tmp_path):
    from transformers import AutoConfig, AutoProcessor

    from vlmbatch.families.registry import load_adapter

    shape = resolve_shape("qwen2_5_vl_3b")
    path = write_model_folder(shape, tmp_path)
    assert not list(path.glob("*.safetensors"))  # the tiny weights would not fit these sizes
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]  # vLLM refuses generate() without it
    for key, value in shape.text.items():
        assert getattr(config.text_config, key) == value, key
    for key, value in shape.vision.items():
        assert getattr(config.vision_config, key) == value, key
    assert config.tie_word_embeddings is True
    assert len(config.text_config.layer_types) == 36
    written = json.loads((path / "config.json").read_text())
    assert written["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert written["text_config"]["hidden_size"] == 2048 and written["vision_config"]["out_hidden_size"] == 2048
    # the pixel bounds travel in both files other readers take them from
    assert json.loads((path / "preprocessor_config.json").read_text())["size"]["longest_edge"] == 28 * 28 * 16384
    assert AutoProcessor.from_pretrained(path).image_processor.size["longest_edge"] == 28 * 28 * 16384
    # a 448x448 image keeps its real 256 tokens (the tiny checkpoint's bounds would shrink it to 64)
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) == 2 + 256


@pytest.mark.parametrize(("name", "tokens"), [("qwen3_vl_8b", 196), ("qwen3_vl_30b_a3b", 196)])
def test_qwen3_folders_keep_the_published_sizes_and_image_tokens(tmp_path, name, tokens):
    from transformers import AutoConfig

    from vlmbatch.families.registry import load_adapter

    shape = resolve_shape(name)
    path = write_model_folder(shape, tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [shape.architecture] and config.vision_config.deepstack_visual_indexes == [8, 16, 24]
    assert config.text_config.num_hidden_layers == shape.text["num_hidden_layers"]
    if name.endswith("a3b"):
        assert json.loads((path / "config.json").read_text())["text_config"]["num_experts"] == 128  # what vLLM 0.26 reads
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) == 2 + tokens



def test_qwen3_folders_keep_the_published_video_bounds_so_a_720p_clip_keeps_most_of_its_size(tmp_path):
    """The clip bounds (frames x height x width) of Qwen3-VL's video_preprocessor_config.json:
    16 frames of 720p become 640x1152 under the per-frame cap (qwen-vl-utils, which our
    adapter asks of transformers that has it): 8 temporal pairs of 40x72 patches, 5,760
    tokens (V1, `bench.video_v1`); the tiny builder's bounds would shrink them to 64 tokens."""
    import numpy as np

    from vlmbatch.families.registry import load_adapter
    from vlmbatch.media.types import VideoFrames

    path = write_model_folder(resolve_shape("qwen3_vl_8b"), tmp_path)
    assert json.loads((path / "video_preprocessor_config.json").read_text())["size"] == {
        "longest_edge": 25165824, "shortest_edge": 4096}
    adapter = load_adapter(str(path))
    times = [i * 4.0 for i in range(16)]
    clip = VideoFrames(np.zeros((16, 720, 1280, 3), np.uint8), times, 16 / 60, 30.0, 60.0, list(range(0, 1920, 120)))
    video = adapter.prepare(adapter.video_placeholder, [], [clip]).media[0]
    capped = getattr(adapter.processor.video_processor, "cap_pixels_per_frame", False) is not False
    assert video.tensors["video_grid_thw"].tolist() == [[8, 40, 72] if capped else [8, 44, 80]]
    assert video.num_tokens == (5760 if capped else 7040)

def test_smolvlm2_folder_keeps_the_published_sizes_and_one_tile_per_w1_image(tmp_path):
    from transformers import AutoConfig, AutoProcessor

    from vlmbatch.families.registry import load_adapter

    shape = resolve_shape("smolvlm2_2b")
    path = write_model_folder(shape, tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["SmolVLMForConditionalGeneration"] and config.scale_factor == 3
    assert (config.vision_config.image_size, config.vision_config.patch_size, config.vision_config.num_hidden_layers) == (384, 14, 27)
    assert config.text_config.rope_parameters["rope_theta"] == 273768.0 and config.text_config.num_key_value_heads == 32
    processor = AutoProcessor.from_pretrained(path)
    assert processor.image_seq_len == 81 == (384 // 14) ** 2 // 3**2  # what the model's connector makes of one tile
    assert json.loads((path / "preprocessor_config.json").read_text())["max_image_size"] == {"longest_edge": 384}
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) == 3 + 81  # the global tile and its markers


def test_gemma3_12b_folder_keeps_its_layer_pattern_rope_and_image_tokens(tmp_path):
    """Five sliding layers per global one over 48 layers, per-type RoPE, and 256 tokens per
    image (`image_seq_length` travels in the processor config)."""
    from transformers import AutoConfig

    from vlmbatch.families.registry import load_adapter

    shape = resolve_shape("gemma3_12b")
    path = write_model_folder(shape, tmp_path)
    text = AutoConfig.from_pretrained(path).text_config
    assert text.num_hidden_layers == 48 and text.layer_types.count("full_attention") == 8
    assert text.layer_types[5] == "full_attention" and text.layer_types[:5] == ["sliding_attention"] * 5
    assert text.rope_parameters["full_attention"]["factor"] == 8.0 and text.sliding_window == 1024
    adapter = load_adapter(str(path))
    expanded = adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))])
    assert 256 + 2 < expanded <= 256 + 2 + 5  # begin/end of image, the newlines around it, BOS


@pytest.mark.parametrize(("name", "tokens"), [("llava_next_7b", 1 + 2928), ("llava_onevision_7b", 3699)])
def test_llava_folders_tile_a_448_image_as_the_published_models_do(tmp_path, name, tokens):
    """A 448x448 image is a 2x2 grid of tiles plus the base view (LLaVA-NeXT: BOS + 576 base
    + 48x48 + 48 newlines; OneVision: 729 + 54x54 + 54, under anyres_max_9's budget), so the
    W1 prompt is the image plus 32 words."""
    from transformers import AutoConfig

    from vlmbatch.bench.workloads import MIN_TEXT_TOKENS, build_workload
    from vlmbatch.families.registry import load_adapter

    shape = resolve_shape(name)
    path = write_model_folder(shape, tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [shape.architecture] and config.image_grid_pinpoints == shape.top["image_grid_pinpoints"]
    assert config.text_config.num_hidden_layers == shape.text["num_hidden_layers"]
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) == tokens
    assert build_workload("w1", adapter, 2, seed=1).prompt_tokens == tokens + MIN_TEXT_TOKENS


def test_the_model_shape_help_names_every_shape():
    """`--model-shape`'s help is written by hand (the CLI must not import torch to print it): it must not go stale."""
    from vlmbatch.cli.bench_options import model_shape_option

    help_text = model_shape_option().help
    assert [name for name in SHAPES if name not in help_text] == []


def test_smolvlm2_tiled_folder_splits_a_w1_image_as_the_published_processor_and_vllm_count_it(tmp_path):
    """The vLLM-comparable shape: 4x4 tiles of 384 px plus the global image per 448x448
    image, and transformers' patch count (what vLLM sizes pixel tensors by) agrees with it;
    on the one-tile shape that count is 0, which is why vLLM cannot run that one."""
    from transformers import AutoProcessor

    from vlmbatch.families.registry import load_adapter

    path = write_model_folder(resolve_shape("smolvlm2_2b_tiled"), tmp_path)
    image_processor = AutoProcessor.from_pretrained(path).image_processor
    assert image_processor.get_number_of_image_patches(448, 448, {})[0] == 17
    assert image_processor([Image.new("RGB", (448, 448))], return_tensors="pt")["pixel_values"].shape[1] == 17
    adapter = load_adapter(str(path))
    assert adapter.check(adapter.image_placeholder, [Image.new("RGB", (448, 448))]) > 17 * 81
    one_tile = write_model_folder(resolve_shape("smolvlm2_2b"), tmp_path / "one")
    assert AutoProcessor.from_pretrained(one_tile).image_processor.get_number_of_image_patches(448, 448, {})[0] == 0
