"""The model shapes the benchmarks run, from published config values, and the folders they run from.

Nothing is downloaded: a shape's folder is its family's tiny checkpoint (tokenizer,
processor, special-token ids) with `config.json` rewritten to the published sizes and
`"architectures"` set, and the image processor's pixel bounds widened so a 448x448 image
keeps its real token count. Weights are random: built in memory (`random_hf_model`),
written only where another process must load them (`save_random_checkpoint`), or not at
all (vLLM's `load_format="dummy"`).

Adding a shape is one `ModelShape` entry; a shape whose family vlmbatch does not have yet
is listed already and refused with "family not available" until it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """One benchmarked size of one family (values from the model's published config.json)."""

    name: str
    family: str  # vlmbatch family (the tiny builder's arch and the adapter's model_type)
    architecture: str  # config.json "architectures": without it vLLM treats the model as a pooling model
    text: dict[str, Any] = field(default_factory=dict)  # text_config values
    vision: dict[str, Any] = field(default_factory=dict)  # vision_config values
    top: dict[str, Any] = field(default_factory=dict)  # top-level config values
    image_processor: dict[str, Any] = field(default_factory=dict)  # image processor values (`size` bounds, patch...)
    video_processor: dict[str, Any] = field(default_factory=dict)  # video processor values (InternVL: frame size)
    processor: dict[str, Any] = field(default_factory=dict)  # processor values (InternVL: tokens a tile; SmolVLM: `image_seq_len`)
    text_json_extra: dict[str, Any] = field(default_factory=dict)  # written into config.json's text_config for older readers
    source: str = ""


_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
_QWEN25_TEXT = dict(max_position_embeddings=128000, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
# Qwen2.5-VL's published pixel bounds: a 448x448 image keeps its size (256 tokens).
_QWEN25_IMAGE = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}}

_QWEN3_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                     temporal_patch_size=2, deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304)
_QWEN3_TEXT = dict(head_dim=128, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=262144,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                    "mrope_interleaved": True})
# Qwen3-VL's processor: patch 16, merge 2, mean/std 0.5; a 448x448 image is 196 tokens.
_QWEN3_IMAGE = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Qwen3-VL's video_preprocessor_config.json: the pixel bounds are of a whole clip (frames x height x width),
# so 16 frames of a 720p clip keep most of their size (V1, `bench.video_v1`), not the tiny builder's 65536.
_QWEN3_VIDEO = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "merge_size": 2,
                "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}

# LLaVA-NeXT (llava-v1.6-mistral-7b-hf): CLIP-L/336 (CLS dropped, layer -2), five 1x2..3x1 grids
# of 336 px tiles; a 448x448 image is a 2x2 grid plus the base view, 2,928 tokens.
_LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# LLaVA-OneVision (llava-onevision-qwen2-7b-ov-hf): SigLIP-so400m/384 without its last layer,
# every 1..6 x 1..6 grid of 384 px tiles, anyres_max_9; a 448x448 image is 3,699 tokens.
_ONEVISION_PINPOINTS = [[384 * rows, 384 * cols] for rows in range(1, 7) for cols in range(1, 7)]
# InternVL3-8B-hf: InternViT-300M-448px-V2.5 (CLS token, layer scale, LayerNorm, q/k/v biases),
# 0.5 pixel shuffle (256 tokens a 448 px tile), Qwen2.5-7B; the image processor's own
# ImageNet mean/std and 448 px tiles, up to 12 of them plus the thumbnail. Its rope_scaling
# (dynamic, factor 2) only acts past max_position_embeddings (32768): the default rope here.
_INTERNVL3_8B = dict(
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              vocab_size=151674, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              architectures=["Qwen2ForCausalLM"]),  # vLLM builds the inner language model from it
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=[448, 448],
                patch_size=[14, 14], attention_bias=True, norm_type="layer_norm", use_qk_norm=False, layer_norm_eps=1e-6,
                layer_scale_init_value=0.1, use_mean_pooling=True),
    top={"tie_word_embeddings": False, "image_seq_length": 256, "downsample_ratio": 0.5},
    image_processor={"size": {"height": 448, "width": 448}, "max_patches": 12, "min_patches": 1,
                     "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]},
    video_processor={"size": {"height": 448, "width": 448}, "image_mean": [0.485, 0.456, 0.406],
                     "image_std": [0.229, 0.224, 0.225]},
    processor={"image_seq_length": 256},
)
# SmolVLM2-2.2B: SigLIP-SO400M on 384 px tiles (27 x 27 patches of 14 px), a 3x3 pixel
# shuffle (81 tokens a tile), SmolLM2-1.7B with its context stretched to 16k (RoPE base
# 273768). The published processor upscales images to a longest edge of 1536 px and splits
# them into 384 px tiles (448x448: 4x4 tiles + the global image, 1,377 tokens, which no
# 288-token prompt holds); W1 here bounds the longest edge to one tile, so a 448x448 image is
# the global tile alone (84 tokens with its markers) on every engine.
_SMOLVLM_IMAGE = {"size": {"longest_edge": 384}, "max_image_size": {"longest_edge": 384}}
# vLLM 0.26 sizes each image's pixel tensors by the image processor's
# `get_number_of_image_patches`, which in transformers 5.17-5.24 says 0 for an image that is
# not split (the processor itself returns its one tile): on the one-tile shape vLLM's engine
# dies at its first step (BENCHMARKS.md, session 7). The tiled shape is what it can run.
_SMOLVLM_IMAGE_TILED = {"size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}}
_SMOLVLM2_2B = dict(
    text=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
              num_key_value_heads=32, head_dim=64, vocab_size=49280, max_position_embeddings=16384,
              rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 273768.0},
              tie_word_embeddings=False),
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                patch_size=14, image_size=384),
    top={"scale_factor": 3, "tie_word_embeddings": False}, processor={"image_seq_len": 81},
)
# Gemma 3: five sliding-window layers (window 1024, local RoPE base 1e4) per global one
# (base 1e6, linear scaling 8); `layer_types` is this pattern, repeated to the depth.
_GEMMA3_TEXT = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, vocab_size=262208, rms_norm_eps=1e-6,
                    max_position_embeddings=131072, final_logit_softcapping=None, attn_logit_softcapping=None,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
_GEMMA3_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
                      patch_size=14, vision_use_head=False)

SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("tiny", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
               source="the tiny test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("tiny_qwen3_vl", "qwen3_vl", "Qwen3VLForConditionalGeneration",
               source="the tiny Qwen3-VL test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("tiny_qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
               source="the tiny Qwen3-VL-MoE test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("tiny_llava_next", "llava_next", "LlavaNextForConditionalGeneration",
               source="the tiny LLaVA-NeXT test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("tiny_llava_onevision", "llava_onevision", "LlavaOnevisionForConditionalGeneration",
               source="the tiny LLaVA-OneVision test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("qwen2_5_vl_3b", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
               text=dict(_QWEN25_TEXT, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
               vision=dict(_QWEN25_VISION, out_hidden_size=2048), top={"tie_word_embeddings": True},
               image_processor=_QWEN25_IMAGE, source="Qwen/Qwen2.5-VL-3B-Instruct config.json"),
    ModelShape("qwen2_5_vl_7b", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
               text=dict(_QWEN25_TEXT, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
               vision=dict(_QWEN25_VISION, out_hidden_size=3584), top={"tie_word_embeddings": False},
               image_processor=_QWEN25_IMAGE, source="Qwen/Qwen2.5-VL-7B-Instruct config.json"),
    ModelShape("qwen2_5_vl_72b", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
               text=dict(_QWEN25_TEXT, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False),
               vision=dict(_QWEN25_VISION, out_hidden_size=8192), top={"tie_word_embeddings": False},
               image_processor=_QWEN25_IMAGE,
               source="Qwen/Qwen2.5-VL-72B-Instruct config.json (146 GB in bf16: run it with --quantization fp8 --load-format dummy)"),
    ModelShape("qwen3_vl_8b", "qwen3_vl", "Qwen3VLForConditionalGeneration",
               text=dict(_QWEN3_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8),
               vision=dict(_QWEN3_VISION, out_hidden_size=4096), top={"tie_word_embeddings": False},
               image_processor=_QWEN3_IMAGE, video_processor=_QWEN3_VIDEO,
               source="Qwen/Qwen3-VL-8B-Instruct config.json (../shared/FACTS.md)"),
    ModelShape("qwen3_vl_30b_a3b", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
               text=dict(_QWEN3_TEXT, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[]),
               vision=dict(_QWEN3_VISION, out_hidden_size=2048), top={"tie_word_embeddings": False},
               image_processor=_QWEN3_IMAGE, video_processor=_QWEN3_VIDEO,
               text_json_extra={"num_experts": 128},  # transformers 5.24 writes num_local_experts; 5.17 (vLLM's) reads this
               source="Qwen/Qwen3-VL-30B-A3B-Instruct config.json (../shared/FACTS.md)"),
    ModelShape("llava_next_7b", "llava_next", "LlavaNextForConditionalGeneration",
               text=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, vocab_size=32064),
               vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=336, patch_size=14, projection_dim=768),
               top={"image_grid_pinpoints": _LLAVA_NEXT_PINPOINTS, "tie_word_embeddings": False},
               image_processor={"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                                "image_grid_pinpoints": _LLAVA_NEXT_PINPOINTS},
               source="llava-hf/llava-v1.6-mistral-7b-hf config.json"),
    ModelShape("llava_onevision_7b", "llava_onevision", "LlavaOnevisionForConditionalGeneration",
               text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, vocab_size=152128),
               vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                           image_size=384, patch_size=14),
               top={"image_grid_pinpoints": _ONEVISION_PINPOINTS, "tie_word_embeddings": False},
               image_processor={"size": {"height": 384, "width": 384}, "image_grid_pinpoints": _ONEVISION_PINPOINTS},
               video_processor={"size": {"height": 384, "width": 384}},  # frames of one tile (vLLM profiles a video)
               processor={"num_image_tokens": 729},  # (384 / 14) ** 2 patches per tile
               source="llava-hf/llava-onevision-qwen2-7b-ov-hf config.json"),
    ModelShape("tiny_internvl", "internvl", "InternVLForConditionalGeneration",
               source="the tiny InternVL3 test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("internvl3_8b", "internvl", "InternVLForConditionalGeneration", **_INTERNVL3_8B,
               source="OpenGVLab/InternVL3-8B-hf config.json and processor"),
    ModelShape("tiny_smolvlm", "smolvlm", "SmolVLMForConditionalGeneration",
               source="the tiny SmolVLM test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("smolvlm2_2b", "smolvlm", "SmolVLMForConditionalGeneration", **_SMOLVLM2_2B, image_processor=_SMOLVLM_IMAGE,
               source="HuggingFaceTB/SmolVLM2-2.2B-Instruct config.json (SmolVLM paper: SigLIP-SO400M + SmolLM2-1.7B, "
                      "RoPE base 273k, 16k context); W1's image bound above"),
    ModelShape("smolvlm2_2b_tiled", "smolvlm", "SmolVLMForConditionalGeneration", **_SMOLVLM2_2B,
               image_processor=_SMOLVLM_IMAGE_TILED,
               source="as smolvlm2_2b, with the published image processor's 1536 px longest edge: 4x4 tiles + the global "
                      "image per W1 image (the vLLM-comparable SmolVLM2 shape)"),
    ModelShape("tiny_gemma3", "gemma3", "Gemma3ForConditionalGeneration",
               source="the tiny Gemma 3 test checkpoint's own sizes (CPU smoke runs)"),
    ModelShape("gemma3_12b", "gemma3", "Gemma3ForConditionalGeneration",
               text=dict(_GEMMA3_TEXT, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                         num_key_value_heads=8),
               vision=_GEMMA3_VISION, top={"mm_tokens_per_image": 256, "tie_word_embeddings": True},
               image_processor={"size": {"height": 896, "width": 896}}, processor={"image_seq_length": 256},
               source="google/gemma-3-12b-it config.json: 896x896 images pooled to 256 tokens"),
)}
ALIASES = {"3b": "qwen2_5_vl_3b", "7b": "qwen2_5_vl_7b", "72b": "qwen2_5_vl_72b"}


class ShapeError(ValueError):
    """An unknown shape, or one whose family vlmbatch does not have yet."""


def resolve_shape(name: str) -> ModelShape:
    """The registry entry for `name` (or an alias), ready to build; `ShapeError` otherwise."""
    shape = SHAPES.get(ALIASES.get(name, name))
    if shape is None:
        known = ", ".join([*SHAPES, *ALIASES])
        raise ShapeError(f"unknown model shape {name!r}; choose one of {known}")
    missing = family_missing(shape.family)
    if missing:
        raise ShapeError(f"{shape.name}: family not available ({missing})")
    return shape


def family_missing(family: str) -> str | None:
    """Why `family` cannot be benchmarked yet (no such family registered: every registered
    one has a tiny checkpoint to take the tokenizer and processor from), or None."""
    from vlmbatch.families.registry import FAMILIES

    if family not in FAMILIES:
        return f"vlmbatch has no {family} family"
    return None


def write_model_folder(shape: ModelShape, root: Path) -> Path:
    """`root/<shape>`: config.json of the shape's sizes with `"architectures"`, the tiny
    checkpoint's tokenizer, chat template and processor (pixel bounds of the shape), no
    weights. Loads with `AutoConfig`/`AutoProcessor`, `from_config`, and vLLM's dummy loader."""
    from transformers import AutoConfig, AutoProcessor

    from vlmbatch.testing.tiny import make_tiny_model

    path = make_tiny_model(root / shape.name, shape.family)
    for weights in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        weights.unlink()  # the tiny weights do not fit the new sizes
    config = AutoConfig.from_pretrained(path)
    for target, values in ((config.text_config, shape.text), (config.vision_config, shape.vision), (config, shape.top)):
        for key, value in values.items():
            setattr(target, key, value)
    text = config.text_config
    if shape.text and getattr(text, "layer_types", None) is not None:  # derived at init: follow the new depth
        pattern = shape.text.get("layer_types", ["full_attention"])  # a shape's own: repeated to the depth
        text.layer_types = [pattern[i % len(pattern)] for i in range(text.num_hidden_layers)]
    config.architectures = [shape.architecture]
    config.save_pretrained(path)
    if shape.text_json_extra:
        written = json.loads((path / "config.json").read_text())
        written["text_config"].update(shape.text_json_extra)
        (path / "config.json").write_text(json.dumps(written, indent=2))
    if shape.image_processor or shape.video_processor or shape.processor:
        processor = AutoProcessor.from_pretrained(path)
        parts = ((processor.image_processor, shape.image_processor), (processor, shape.processor),
                 (getattr(processor, "video_processor", None), shape.video_processor))
        for target, values in parts:
            for key, value in values.items():
                setattr(target, key, value)
        processor.save_pretrained(path)
        processor.image_processor.save_pretrained(path)  # preprocessor_config.json, which other readers take
        if shape.video_processor:
            processor.video_processor.save_pretrained(path)  # video_preprocessor_config.json
    return path


def random_hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The `transformers` model of the folder at `path` with random weights, built on `device` (SDPA attention)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def save_random_checkpoint(shape: ModelShape, root: Path) -> Path:
    """`write_model_folder` plus random bf16 weights on disk, for commands that load the model
    in other processes (`serve`, workers, jobs); written once under `root` and reused."""
    path = root / shape.name
    done = path / ".complete"
    if not done.exists():
        write_model_folder(shape, root)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        random_hf_model(path, torch.bfloat16, device).save_pretrained(path)
        done.touch()
    return path
