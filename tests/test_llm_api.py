"""The `LLM` Python API: inputs it accepts, per-request sampling behaviour, what it reports."""

from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vlmbatch import LLM, SamplingParams
from vlmbatch.errors import ErrorType, JobError, RowError

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _image(h: int = 64, w: int = 80, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(str(tiny_qwen), engine="hf")


def test_generate_accepts_str_dict_and_lists(llm):
    text = _turn("The cat sits on the mat.")
    image_prompt = _turn(f"{QWEN_IMAGE}Describe the image.")
    [single] = llm.generate(text, GREEDY, use_tqdm=False)
    [from_dict] = llm.generate({"prompt": image_prompt, "multi_modal_data": {"image": _image()}}, GREEDY)
    batch = llm.generate([text, {"prompt": image_prompt, "multi_modal_data": {"image": [_image()]}}], GREEDY)
    assert [o.outputs[0].token_ids for o in batch] == [single.outputs[0].token_ids, from_dict.outputs[0].token_ids]
    assert single.prompt == text and single.finished
    assert single.num_input_tokens == len(llm.tokenizer(text)["input_ids"])
    # The image's placeholder token expands to its patches after the 2x2 merge: 64x80 px → 56x84 → 2x3.
    assert from_dict.num_input_tokens == len(llm.tokenizer(image_prompt)["input_ids"]) - 1 + 6
    assert from_dict.num_generated_tokens == len(from_dict.outputs[0].token_ids) == 8


def test_several_images_in_one_prompt(llm):
    prompt = _turn(f"{QWEN_IMAGE}{QWEN_IMAGE}Compare the two images.")
    images = [_image(56, 56, 1), _image(112, 112, 2)]  # 2x2 and 4x4 merged tokens
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    assert out.prompt_token_ids.count(llm.adapter.image_token_id) == 4 + 16
    swapped = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[::-1]}}, GREEDY)[0]
    assert swapped.prompt_token_ids != out.prompt_token_ids  # media go in placeholder order


def test_bad_prompts_raise_their_row_error(llm):
    with pytest.raises(RowError) as info:
        llm.generate({"prompt": _turn(QWEN_IMAGE), "multi_modal_data": {}}, GREEDY)
    assert info.value.error_type == ErrorType.PLACEHOLDER_MISMATCH
    with pytest.raises(ValueError, match="multi_modal_data.audio"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": b""}})
    with pytest.raises(JobError, match="engine='fastest'.*choose one of auto, paged, hf"):
        LLM(llm.model_name, engine="fastest")
    with pytest.raises(JobError, match=r"unknown engine option\(s\) \['max_batch_size'\]"):
        LLM(llm.model_name, max_batch_size=8)  # an option the engine does not know is named, never dropped


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava", "qwen3_vl", "internvl", "idefics3", "smolvlm", "gemma3",
                                  "llava_next", "llava_onevision"])
def test_chat_with_data_url_images_matches_the_raw_prompt(tiny_model_dir, arch):
    chat_llm = LLM(str(tiny_model_dir(arch)), engine="hf")
    image = _image(70, 90, 3)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "What is shown in this picture?"},
    ]}]
    [chat] = chat_llm.chat(messages, GREEDY, use_tqdm=False)
    prompt = chat_llm.adapter.apply_chat_template(messages)
    [raw] = chat_llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)
    assert chat.prompt == prompt
    assert chat.outputs[0].token_ids == raw.outputs[0].token_ids
    pil_part = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "x"}]}]
    conversations = chat_llm.chat([messages, pil_part], GREEDY, use_tqdm=False)
    assert len(conversations) == 2 and conversations[0].outputs[0].token_ids == chat.outputs[0].token_ids


def test_per_request_max_tokens(llm):
    prompt = _turn("Write a caption for this image.")
    lengths = [1, 4, 7]
    outputs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in tokens] == lengths
    assert tokens[2][:4] == tokens[1] and tokens[1][:1] == tokens[0]  # one batch, each cut at its own length
    assert {o.outputs[0].finish_reason for o in outputs} == {"length"}


def test_stop_string_cuts_the_text_before_it(llm):
    prompt = _turn("Hello world")
    [full] = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert text.find(stop) > 0
    [cut] = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop, "never-seen"]))
    completion = cut.outputs[0]
    assert completion.text == text[: text.find(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full.outputs[0].token_ids[: len(completion.token_ids)]
    assert len(completion.token_ids) < 12


def test_eos_ends_generation_unless_ignored(tiny_qwen, llm, tmp_path):
    prompt = _turn("Describe the image in one sentence.")
    [free] = llm.generate(prompt, GREEDY)
    first = free.outputs[0].token_ids[0]
    # A checkpoint whose generation config lists the token the model emits first as EOS.
    checkpoint = shutil.copytree(tiny_qwen, tmp_path / "eos")
    config = json.loads((checkpoint / "generation_config.json").read_text())
    config["eos_token_id"] = [first]
    (checkpoint / "generation_config.json").write_text(json.dumps(config))
    eos_llm = LLM(str(checkpoint), engine="hf")
    assert first in eos_llm.adapter.eos_token_ids
    [stopped] = eos_llm.generate(prompt, GREEDY)
    assert stopped.outputs[0].token_ids == [first]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == first
    [ignored] = eos_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ignored.outputs[0].token_ids == free.outputs[0].token_ids
    assert ignored.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_alone_or_batched(llm):
    prompt = _turn("Tell me about the park.")
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    [alone] = llm.generate(prompt, seeded)
    batch = llm.generate(
        [_turn("Another prompt first."), prompt, prompt],
        [SamplingParams(max_tokens=8, temperature=1.0), seeded, SamplingParams(max_tokens=8, temperature=1.0, seed=8)],
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[2].outputs[0].token_ids != alone.outputs[0].token_ids
    state = torch.random.get_rng_state()
    llm.generate(prompt, seeded)
    assert torch.equal(torch.random.get_rng_state(), state)  # a seeded request leaves the shared RNG alone
    unseeded = [llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0))[0] for _ in range(2)]
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_completions_per_request(llm):
    [out] = llm.generate(_turn("Count the frames."), SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=2))
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert out.num_generated_tokens == 10


def test_run_reports_each_request_as_it_finishes(llm):
    prepared = llm.adapter.prepare(_turn("Where is the book?"), max_tokens=3)
    requests = [(f"r{i}", prepared, SamplingParams(max_tokens=2 + i, temperature=0)) for i in range(3)]
    seen = []
    results = llm.run(requests, on_output=lambda o: seen.append(o.request_id))
    assert sorted(seen) == ["r0", "r1", "r2"] and set(results) == set(seen)
    assert [len(results[f"r{i}"].outputs[0].token_ids) for i in range(3)] == [2, 3, 4]
    assert not llm.engine.has_unfinished_requests()


def test_auto_engine_is_the_paged_engine_where_it_supports_the_family(tiny_qwen):
    from vlmbatch.engine.paged import PagedEngine

    llm = LLM(str(tiny_qwen), max_num_seqs=8)
    assert isinstance(llm.engine, PagedEngine) and llm.engine.scheduler.max_num_seqs == 8
    [out] = llm.generate(_turn("Hello world"), GREEDY)
    assert len(out.outputs[0].token_ids) == 8
