"""Our API gives exactly what a direct `transformers` `generate()` call gives (greedy, fp32, CPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmbatch.engine.llm import LLM
from vlmbatch.engine.sampling_params import SamplingParams

MAX_TOKENS = 6
ARCHS = ["qwen2_5_vl", "qwen2_vl", "llava", "qwen3_vl", "qwen3_vl_moe", "internvl", "idefics3", "smolvlm", "gemma3",
         "llava_next", "llava_onevision"]


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _cases(arch: str) -> list[tuple[str, list[Image.Image]]]:
    """(raw prompt, images): one image, two images, a longer text with one image."""
    if arch.startswith("llava"):
        return [
            ("USER: <image>\nDescribe the image. ASSISTANT:", [_image(60, 80, 1)]),
            ("USER: <image>\n<image>\nWhat is the same in both? ASSISTANT:", [_image(56, 56, 2), _image(90, 70, 3)]),
            ("USER: <image>\nThe cat sits on the mat. What color is the car? ASSISTANT:", [_image(70, 70, 4)]),
        ]
    if arch == "gemma3":
        turn = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
        return [
            (turn.format("<start_of_image>Describe the image."), [_image(60, 80, 1)]),
            (turn.format("<start_of_image><start_of_image>What is the same in both?"), [_image(56, 56, 2), _image(90, 70, 3)]),
            (turn.format("The cat sits on the mat. <start_of_image>What color is the car?"), [_image(70, 70, 4)]),
        ]
    ph = "<IMG_CONTEXT>\n" if arch == "internvl" else "<|vision_start|><|image_pad|><|vision_end|>"
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    if arch in ("idefics3", "smolvlm"):  # images split into 2x3, 3x3 and 3x3 tiles, each plus its global image
        ph, turn = "<image>", ("<|im_start|>" if arch == "smolvlm" else "") + "User:{}<end_of_utterance>\nAssistant:"
    return [
        (turn.format(f"{ph}Describe the image."), [_image(60, 80, 1)]),  # 4 image tokens
        (turn.format(f"{ph}{ph}What is the same in both?"), [_image(56, 56, 2), _image(140, 112, 3)]),
        (turn.format(f"The cat sits on the mat. {ph}What color is the car?"), [_image(200, 150, 4)]),  # windows
    ]


@functools.cache
def _hf_model(path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return AutoProcessor.from_pretrained(path), model.to(device).eval()


def _hf_generate(
    path, prompts: list[str], images: list[list[Image.Image]], device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[list[int]]:
    """The reference: the checkpoint's own processor and `generate()`, nothing of ours."""
    processor, model = _hf_model(path, device, dtype)
    # each prompt's images as a list of their own: every processor takes that (SmolVLM's only that),
    # and LLaVA-OneVision tiles only the lone image of a prompt
    inputs = processor(text=prompts, images=images, padding=True, padding_side="left", return_tensors="pt")
    inputs = inputs.to(device, dtype=dtype)  # casts the pixels only, as our engine does
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


@pytest.fixture(scope="module", params=ARCHS)
def arch_and_llm(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    return request.param, path, LLM(str(path), engine="hf")


def test_single_prompts_match_generate(arch_and_llm):
    arch, path, llm = arch_and_llm
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for prompt, images in _cases(arch)[:2]:  # one image, then two images
        [ours] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, greedy, use_tqdm=False)
        [reference] = _hf_generate(path, [prompt], [images])
        assert ours.outputs[0].token_ids == reference
        processor, _ = _hf_model(path)
        assert ours.prompt_token_ids == processor(text=[prompt], images=[images], return_tensors="pt")["input_ids"][0].tolist()


def test_batched_prompts_match_generate(arch_and_llm):
    arch, path, llm = arch_and_llm
    cases = _cases(arch)
    prompts = [p for p, _ in cases]
    images = [imgs for _, imgs in cases]
    outputs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outputs] == _hf_generate(path, prompts, images)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prompts_match_generate_on_cuda_bf16(tiny_model_dir, arch):
    """The same oracle on the GPU, in the dtype production runs use."""
    path = tiny_model_dir(arch)
    llm = LLM(str(path), engine="hf", device="cuda", dtype="bfloat16")
    cases = _cases(arch)
    outputs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        use_tqdm=False,
    )
    reference = _hf_generate(path, [p for p, _ in cases], [i for _, i in cases], "cuda", torch.bfloat16)
    assert [o.outputs[0].token_ids for o in outputs] == reference
