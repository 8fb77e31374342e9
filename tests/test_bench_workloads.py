"""The benchmark workloads and each engine's conversion of them: ours, `generate()`'s and vLLM's
get the same prompts, images and output lengths; the vLLM child rebuilds the same requests
from their description and reports the peer as skipped where vLLM cannot be imported."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from vlmbatch.bench.adapt import engine_prompts
from vlmbatch.bench.peers.hf import hf_inputs
from vlmbatch.bench.peers.vllm import run_vllm_peer, sampling_kwargs, vllm_missing, vllm_requests
from vlmbatch.bench.workloads import W2_OUTPUT_RANGE, Workload, build_workload, output_lengths


@pytest.fixture(scope="module")
def adapter(tiny_qwen):
    from vlmbatch.families.registry import load_adapter

    return load_adapter(str(tiny_qwen))


def test_w1_and_w2_have_exact_prompts_distinct_images_and_their_output_lengths(adapter):
    w1 = build_workload("w1", adapter, 3, seed=100)
    w2 = build_workload("w2", adapter, 40, seed=101)
    assert [r.output_tokens for r in w1.requests] == [128] * 3
    lengths = [r.output_tokens for r in w2.requests]
    assert lengths == output_lengths("w2", 40) and min(lengths) >= W2_OUTPUT_RANGE[0] and max(lengths) <= W2_OUTPUT_RANGE[1]
    assert len(set(lengths)) > 10
    for request in w1.requests:  # the text is single-token words: its ids are exact whoever tokenises it
        assert adapter.tokenizer(request.prompt)["input_ids"] == request.prompt_token_ids
        assert request.prompt_token_ids.count(adapter.image_token_id) == 1
        assert adapter.check(request.prompt, w1.images(0)) == 288
    images = [w1.images(i)[0] for i in range(3)] + [w2.images(0)[0]]
    assert all(image.size == (448, 448) for image in images)
    assert len({image.tobytes() for image in images}) == 4  # no two requests share an image (or a cache entry)
    assert w1.images(1)[0] is w1.images(1)[0] and w1.head(2).images(1)[0] is w1.images(1)[0]


def test_our_prompts_and_generate_inputs_carry_the_same_tokens_and_pixels(adapter):
    workload = build_workload("w1", adapter, 2, seed=100)
    ours = engine_prompts(workload, adapter, torch.float32)
    model = type("Forward", (), {"forward": lambda self, input_ids, attention_mask, pixel_values, image_grid_thw: None,
                                 "dtype": torch.float32})()
    batch = hf_inputs(adapter, workload, [0, 1], model, torch.device("cpu"))
    assert set(batch) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}  # what the forward takes
    assert batch["input_ids"].tolist() == [p.prompt_token_ids for p in ours] and all(p.num_tokens == 288 for p in ours)
    torch.testing.assert_close(batch["pixel_values"], torch.cat([i.tensors["pixel_values"] for p in ours for i in p.media]), rtol=0, atol=0)
    forced = hf_inputs(adapter, workload, [0], model, torch.device("cpu"), continuation=[7, 8, 9])
    assert forced["input_ids"][0].tolist() == ours[0].prompt_token_ids + [7, 8, 9] and forced["attention_mask"].shape == (1, 291)


def test_vllm_requests_are_the_workload_token_ids_images_and_forced_lengths(adapter):
    workload = build_workload("w2", adapter, 3, seed=101)
    prompts = vllm_requests(workload)
    for index, (prompt, request) in enumerate(zip(prompts, workload.requests)):
        assert prompt["prompt_token_ids"] == request.prompt_token_ids  # one placeholder: vLLM expands it
        assert prompt["multi_modal_data"]["image"] is workload.images(index)[0]  # the PIL image ours was made from
    for params, request in zip(sampling_kwargs(workload), workload.requests):
        assert params == {"max_tokens": request.output_tokens, "min_tokens": request.output_tokens, "ignore_eos": True,
                          "temperature": 0.0, "detokenize": False}
    rebuilt = Workload.from_json(workload.to_json())  # what the child process gets
    assert rebuilt.requests == workload.requests and rebuilt.fingerprint() == workload.fingerprint()
    assert build_workload("w2", adapter, 3, seed=102).fingerprint() != workload.fingerprint()


def test_vllm_peer_is_skipped_with_the_reason_where_it_cannot_run(adapter, tmp_path):
    assert vllm_missing("cpu", []) == "vLLM runs on CUDA GPUs only"
    if "vllm" in sys.modules or vllm_missing("cuda", []) is None:
        pytest.skip("vllm is importable here")
    assert "vllm is not importable" in vllm_missing("cuda", [])
    # The child itself: it cannot import vllm here, so it writes the peer down as skipped and exits cleanly.
    workload = build_workload("w1", adapter, 2, seed=100)
    result = run_vllm_peer(tmp_path / "model", "dummy", workload, [workload], 0.85, 120, tmp_path, {}, [])
    assert result["runs"] == [] and "error" not in result
    assert result["skipped"].startswith("import vllm failed: ModuleNotFoundError")


def test_a_family_whose_vllm_model_needs_a_missing_module_is_skipped_before_the_child(tmp_path):
    """With a `vllm` package on the path but no mistral_common, LLaVA-NeXT's peer is refused
    up front, naming the module; Qwen's is not, and mistral_common's presence clears it."""
    if importlib.util.find_spec("mistral_common") is not None:
        pytest.skip("mistral_common is installed here")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    assert vllm_missing("cuda", [str(tmp_path)], "llava_next") == (
        "vLLM's llava_next model imports modules not on its path: mistral_common")
    assert vllm_missing("cuda", [str(tmp_path)], "qwen2_5_vl") is None
    (tmp_path / "mistral_common").mkdir()
    (tmp_path / "mistral_common" / "__init__.py").write_text("")
    assert vllm_missing("cuda", [str(tmp_path)], "llava_onevision") is None


def test_gemma3_workload_vllm_prompts_and_teacher_forced_inputs(tmp_path):
    """On the gemma3_12b folder: exact 288-token W1 prompts around 256 image tokens; vLLM
    gets the one `<start_of_image>` to expand; the HF reference's `token_type_ids` (its
    bidirectional image mask) follow the forced continuation's length."""
    from vlmbatch.bench.shapes import resolve_shape, write_model_folder
    from vlmbatch.families.registry import load_adapter

    adapter = load_adapter(str(write_model_folder(resolve_shape("gemma3_12b"), tmp_path)))
    workload = build_workload("w1", adapter, 2, seed=100)
    boi = adapter.tokenizer.convert_tokens_to_ids("<start_of_image>")
    for prompt, request in zip(vllm_requests(workload), workload.requests):
        assert prompt["prompt_token_ids"].count(boi) == 1 and adapter.check(request.prompt, workload.images(0)) == 288
    ours = engine_prompts(workload, adapter, torch.float32)
    assert [len(p.media) for p in ours] == [1, 1] and ours[0].media[0].num_tokens == 256
    model = type("Forward", (), {"forward": lambda self, input_ids, attention_mask, pixel_values, token_type_ids: None,
                                 "dtype": torch.float32})()
    forced = hf_inputs(adapter, workload, [0], model, torch.device("cpu"), continuation=[100, 101, 102])
    assert forced["input_ids"][0].tolist() == ours[0].prompt_token_ids + [100, 101, 102]
    assert forced["token_type_ids"].shape == (1, 291) and int(forced["token_type_ids"].sum()) == 256
