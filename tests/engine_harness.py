"""Shared by the engine and family tests: mixed requests of every kind, and the transformers reference.

Requests mix text-only prompts, one to `max_images` images of odd sizes (some shared, so
the encoder cache hits), a video (Qwen, InternVL and SmolVLM families) and exact repeats (so the prefix cache
hits); `hf_greedy` is what `transformers` `generate()` gives for the same prepared prompt.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from vlmbatch.engine.hf import generate_inputs
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.media.types import VideoFrames

WORDS = "the cat sits on the mat and the dog runs in the park while a person is riding a bicycle".split()
SYSTEM = "You are a helpful assistant. The user asks a question and the assistant answers it."


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def make_video(seed: int, frames: int = 4) -> VideoFrames:
    pixels = np.random.RandomState(seed).randint(0, 256, (frames, 56, 84, 3), dtype=np.uint8)
    return VideoFrames(pixels, [i / 2 for i in range(frames)], sampled_fps=2.0, source_fps=2.0, duration=frames / 2)


def qwen_prompt(text: str, num_images: int, with_video: bool) -> str:
    media = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    if with_video:
        media += "<|vision_start|><|video_pad|><|vision_end|>"
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"


def llava_prompt(text: str, num_images: int, with_video: bool) -> str:
    return f"{SYSTEM} USER: " + "<image>\n" * num_images + f"{text} ASSISTANT:"


def gemma3_prompt(text: str, num_images: int, with_video: bool) -> str:
    return f"<start_of_turn>user\n{SYSTEM}\n\n" + "<start_of_image>" * num_images + f"{text}<end_of_turn>\n<start_of_turn>model\n"


def internvl_prompt(text: str, num_images: int, with_video: bool) -> str:
    media = "<IMG_CONTEXT>\n" * num_images + ("<video>\n" if with_video else "")
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n"


def idefics3_prompt(text: str, num_images: int, with_video: bool) -> str:
    media = "<image>" * num_images + ("<video>" if with_video else "")
    return f"User:{SYSTEM} {media}{text}<end_of_utterance>\nAssistant:"


def smolvlm_prompt(text: str, num_images: int, with_video: bool) -> str:
    return "<|im_start|>" + idefics3_prompt(text, num_images, with_video)


def mistral_prompt(text: str, num_images: int, with_video: bool) -> str:
    return "[INST] " + "<image>\n" * num_images + f"{SYSTEM} {text} [/INST]"


def onevision_prompt(text: str, num_images: int, with_video: bool) -> str:
    media = "<image>" * num_images + ("<video>" if with_video else "")
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user {media}\n{text}<|im_end|>\n<|im_start|>assistant\n"


# by family-name prefix, the first that matches (so llava_next before llava)
PROMPTS = {"qwen": qwen_prompt, "llava_next": mistral_prompt, "llava_onevision": onevision_prompt, "llava": llava_prompt,
           "internvl": internvl_prompt, "idefics3": idefics3_prompt,
           "smolvlm": smolvlm_prompt, "gemma3": gemma3_prompt}
VIDEO_FAMILIES = ("qwen", "internvl", "smolvlm", "llava_onevision")
VIDEO_ALONE = ("smolvlm",)  # its prompts take images or videos, not both


def build_requests(adapter, family: str, count: int, seed: int, max_images: int = 2,
                   widths: tuple[int, ...] = (40, 56, 90, 112), heights: tuple[int, ...] = (40, 56, 84)):
    """Mixed requests: text-only, one to `max_images` images (a few shared), a video (Qwen, InternVL, SmolVLM), repeats."""
    rng = random.Random(seed)
    images = [make_image(i, (rng.choice(widths), rng.choice(heights))) for i in range(4)]
    make_prompt = next(builder for prefix, builder in PROMPTS.items() if family.startswith(prefix))
    requests = []
    for i in range(count):
        if i % 10 == 9:  # an exact repeat: its whole prefix is cached
            requests.append((f"{i}", *requests[-1][1:]))
            continue
        num_images = rng.choice([0, 1, *range(1, max_images + 1)])
        with_video = family.startswith(VIDEO_FAMILIES) and i % 10 == 4
        if with_video and family.startswith(VIDEO_ALONE):
            num_images = 0
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        chosen = [images[rng.randrange(len(images))] for _ in range(num_images)]
        videos = [make_video(i)] if with_video else []
        max_tokens = rng.randint(2, 24)
        requests.append((f"{i}", make_prompt(text, num_images, with_video), chosen, videos, max_tokens))
    return requests


def hf_greedy(hf_model, adapter, prompt, max_tokens) -> list[int]:
    """HF `generate()` on exactly the tensors the adapter prepared (one request, no padding)."""
    return hf_greedy_logprobs(hf_model, adapter, prompt, max_tokens)[0]


def hf_greedy_logprobs(hf_model, adapter, prompt, max_tokens) -> tuple[list[int], list[float]]:
    """`hf_greedy`'s tokens and each one's log probability under the raw logits."""
    out = hf_model.generate(**generate_inputs(hf_model, adapter, [prompt], adapter.tokenizer.pad_token_id or 0),
                            max_new_tokens=max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.num_tokens :].tolist()
    return tokens, [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]


# Greedy logprobs of ours against transformers' (fp32 on the CPU; batching and fused
# layouts change only the summation order: up to 5e-7 seen on Qwen2.5-VL, 1.1e-4 on Gemma 3,
# whose embeddings are scaled by sqrt(hidden)). Equal tokens alone miss errors that do not
# flip an argmax of the random tiny models: a decoding row's rotary position off by one kept
# every token and moved logprobs by up to 6.8e-4.
LOGPROB_ATOL = 2.5e-4


def assert_logprobs_match(output, expected: tuple[list[int], list[float]], request_id: str) -> None:
    """`output` (a finished `RequestOutput` run with `logprobs=0`) has transformers' greedy
    tokens and, token by token, their log probabilities."""
    ours = output.outputs[0]
    tokens, logprobs = expected
    assert ours.token_ids == tokens, request_id
    got = [entry.logprob for entry in ours.logprobs]
    assert max((abs(a - b) for a, b in zip(got, logprobs)), default=0.0) <= LOGPROB_ATOL, (request_id, got, logprobs)


def run_greedy(engine, adapter, requests) -> tuple[dict, dict]:
    """Prepare and add `build_requests`' requests greedily, run the engine dry; returns
    ({id: (prepared prompt, max_tokens)}, {id: finished output})."""
    prepared = {}
    for request_id, text, images, videos, max_tokens in requests:
        prepared[request_id] = (adapter.prepare(text, images, videos, max_tokens), max_tokens)
        engine.add_request(request_id, prepared[request_id][0], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0))
    return prepared, run_to_completion(engine)


def assert_greedy_matches_transformers(engine, adapter, hf_model, requests) -> dict:
    """Run `requests` greedily; every output must equal `generate()`'s tokens, and batching,
    chunked prefill, preemption and prefix- and encoder-cache hits must all have happened.
    Returns {id: (prepared prompt, max_tokens)}."""
    prepared, outputs = run_greedy(engine, adapter, requests)
    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        assert_logprobs_match(outputs[request_id], hf_greedy_logprobs(hf_model, adapter, prompt, max_tokens), request_id)
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    return prepared


def run_to_completion(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny matmuls are ~20x slower with two threads on a shared 2-core machine (import
    this fixture into an engine test module to use it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
