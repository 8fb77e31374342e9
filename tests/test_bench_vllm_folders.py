"""The folders the vLLM peer runs from (`bench.shapes.write_model_folder`) hold what vLLM 0.26's
multimodal processors look up in them (`vllm/model_executor/models/<family>.py`: the processor
class, its token and size fields, tokens by their text, the image processor's patch count).

vLLM cannot run here, so each lookup is made through transformers as vLLM makes it; a missing
one otherwise shows only on the GPU, after minutes of start-up (Gemma 3: `KeyError: '\\n'`)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image

from vlmbatch.bench.shapes import resolve_shape, write_model_folder


@dataclass(frozen=True)
class VllmLookups:
    """What vLLM's processor of one family reads from a folder (attribute paths from the HF
    processor, or from the config after "config."), and its count of one image's embedded tokens."""

    processor_class: str  # `ctx.get_hf_processor(<class>)` refuses any other
    fields: tuple[str, ...]  # read as attributes: none may be missing or None
    tokens: tuple[str, ...]  # processor fields whose values must each be one token of the vocabulary
    texts: tuple[str, ...] = ()  # strings looked up by their text in `tokenizer.get_vocab()`
    image_tokens: Callable[[Any, int, int], int] | None = None  # vLLM's count for an image (processor, h, w)
    embed_token: str = "image_token"  # the processor field naming the embedded token


def _qwen_tokens(p: Any, height: int, width: int) -> int:
    """`qwen2_vl.py`: the image processor's patch grid over its merge size squared."""
    return p.image_processor.get_number_of_image_patches(height, width, {}) // p.image_processor.merge_size**2


_QWEN = dict(fields=("image_token", "video_token", "image_processor.merge_size", "image_processor.size",
                     "config.vision_config.spatial_merge_size", "config.vision_config.patch_size",
                     "config.vision_config.temporal_patch_size"),
             tokens=("image_token", "video_token"), image_tokens=_qwen_tokens)
LOOKUPS: dict[str, VllmLookups] = {
    "qwen2_5_vl_3b": VllmLookups("Qwen2_5_VLProcessor", **_QWEN),
    "qwen3_vl_8b": VllmLookups("Qwen3VLProcessor", **{**_QWEN, "fields": _QWEN["fields"] + (
        "image_token_id", "config.vision_start_token_id", "config.vision_end_token_id", "config.video_token_id",
        "video_processor.fps", "video_processor.min_frames", "video_processor.max_frames")}),
    "llava_next_7b": VllmLookups(
        "LlavaNextProcessor", ("image_token", "patch_size", "config.vision_feature_select_strategy",
                               "config.image_grid_pinpoints", "config.image_token_index"), ("image_token",)),
    "llava_onevision_7b": VllmLookups(
        "LlavaOnevisionProcessor", ("image_token", "video_token", "config.image_token_index", "config.video_token_index"),
        ("image_token", "video_token")),
    "internvl3_8b": VllmLookups(  # interns1.py serves the HF-format InternVLForConditionalGeneration
        "InternVLProcessor", ("image_token", "video_token", "start_image_token", "end_image_token", "image_token_id",
                              "image_seq_length", "image_processor.min_patches", "image_processor.max_patches",
                              "image_processor.crop_to_patches", "config.downsample_ratio", "config.projector_hidden_act"),
        ("image_token", "video_token", "start_image_token", "end_image_token"),
        image_tokens=lambda p, h, w: p.image_seq_length * p.image_processor.get_number_of_image_patches(h, w, {})),
    "smolvlm2_2b_tiled": VllmLookups(  # smolvlm.py, on idefics3.py
        "SmolVLMProcessor", ("image_token", "fake_image_token", "global_image_token", "image_seq_len",
                             "image_processor.max_image_size", "image_processor.size", "config.scale_factor"),
        ("image_token", "fake_image_token", "global_image_token"), texts=("<row_1_col_1>", "<row_4_col_4>"),
        image_tokens=lambda p, h, w: p.image_seq_len * p.image_processor.get_number_of_image_patches(h, w, {})[0]),
    "gemma3_12b": VllmLookups(
        "Gemma3Processor", ("boi_token", "full_image_sequence", "image_seq_length", "tokenizer.image_token",
                            "tokenizer.init_kwargs", "image_processor.do_pan_and_scan",
                            "image_processor.pan_and_scan_min_crop_size", "image_processor.pan_and_scan_max_num_crops",
                            "image_processor.pan_and_scan_min_ratio_to_activate", "config.image_token_index",
                            "config.mm_tokens_per_image", "config.vision_config.image_size"),
        ("boi_token", "tokenizer.image_token"), texts=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
        image_tokens=lambda p, h, w: p.image_seq_length, embed_token="tokenizer.image_token"),
}


@pytest.mark.parametrize("name", LOOKUPS)
def test_vllm_finds_what_its_processor_looks_up_in_the_bench_folder(tmp_path, name):
    from transformers import AutoConfig, AutoProcessor

    from vlmbatch.families.registry import load_adapter

    lookups = LOOKUPS[name]
    path = write_model_folder(resolve_shape(name), tmp_path)
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == lookups.processor_class
    config = AutoConfig.from_pretrained(path)

    def read(dotted: str) -> Any:
        if dotted.startswith("config."):
            return operator.attrgetter(dotted.removeprefix("config."))(config)
        return operator.attrgetter(dotted)(processor)

    missing = [f for f in lookups.fields if read(f) is None]
    assert missing == []
    tokenizer, vocab = processor.tokenizer, processor.tokenizer.get_vocab()
    for text in [*(read(t) for t in lookups.tokens), *lookups.texts]:
        assert text in vocab, repr(text)  # vLLM's `vocab[...]`
        assert tokenizer.encode(text, add_special_tokens=False) == [vocab[text]], repr(text)  # and `encode(...)` is one token
    # one 448x448 image in the bench's prompt: the processor expands it to what vLLM counts for it
    adapter = load_adapter(str(path))
    ids = processor(text=[adapter.image_placeholder + " the"], images=[Image.new("RGB", (448, 448))])["input_ids"][0]
    embedded = list(ids).count(vocab[read(lookups.embed_token)])
    assert embedded > 0
    if lookups.image_tokens is not None:
        assert embedded == lookups.image_tokens(processor, 448, 448)


def test_the_vllm_child_starts_with_the_names_vllm_imports_from_transformers(tmp_path):
    """The child's PYTHONPATH leads with the peer's sitecustomize (after `--vllm-pythonpath`
    replaced ours), so a Python started with it, as vLLM's subprocesses are, can import what
    vLLM 0.26's pixtral.py imports from transformers 5, and the position ids are each patch's
    row x max_width + column, image after image."""
    import os
    import subprocess
    import sys

    from vlmbatch.bench.peers.vllm import VLLM_SITE, child_environment

    env = child_environment({"PYTHONPATH": "/nowhere", "HOME": str(tmp_path)}, [])
    assert env["PYTHONPATH"].split(os.pathsep) == [str(VLLM_SITE), "/nowhere"] and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_USE_DEEP_GEMM"] == "0" and child_environment({"VLLM_USE_DEEP_GEMM": "1"}, [])["VLLM_USE_DEEP_GEMM"] == "1"
    assert child_environment({"PYTHONPATH": "/ours"}, ["/tmp/site-vllm"])["PYTHONPATH"].split(os.pathsep) == [str(VLLM_SITE), "/tmp/site-vllm"]
    probe = ("import torch\n"
             "from transformers.models.pixtral.modeling_pixtral import PixtralRotaryEmbedding, position_ids_in_meshgrid\n"
             "ids = position_ids_in_meshgrid([torch.zeros(3, 2, 3), torch.zeros(3, 1, 2)], max_width=4)\n"
             "print(ids.tolist())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": os.pathsep.join([str(VLLM_SITE), *sys.path])},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0, 1, 2, 4, 5, 6, 0, 1]"
