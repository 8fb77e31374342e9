"""Gemma 3 on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

The tiny checkpoint has a sliding window (12) shorter than one image (16 soft tokens) and
than every prompt, a global layer on another RoPE base with linear scaling, and images
whose tokens attend to each other (`token_type_ids`); a small KV cache and token budget
make batching, chunked prefill, preemption and prefix- and encoder-cache hits happen, and
the engine's counters prove they did. Pan-and-scan crops are checked against the
processor's own expansion and the model's own `generate()`.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from engine_harness import assert_greedy_matches_transformers, build_requests, gemma3_prompt, hf_greedy, make_image

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.registry import load_adapter

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)
BUDGET = 48


@pytest.fixture(scope="module")
def gemma3(tiny_model_dir):
    torch.set_num_threads(1)
    path = str(tiny_model_dir("gemma3"))
    return load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def small_engine(adapter, budget: int = BUDGET, num_kv_blocks: int = 32, prefix_caching: bool = True) -> PagedEngine:
    """32 blocks of every layer's KV (a pool of 128 one-layer blocks, `kv_groups.py`): small
    enough to preempt although the sliding layers free what falls out of their window."""
    return PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, block_size=4,
                                             max_num_seqs=6, max_num_batched_tokens=budget, min_admission_batch=1,
                                             enable_prefix_caching=prefix_caching))


def assert_matches_transformers(adapter, hf_model, count: int, seed: int) -> None:
    requests = build_requests(adapter, "gemma3", count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared = assert_greedy_matches_transformers(small_engine(adapter), adapter, hf_model, requests)
    assert all(prompt.num_tokens > hf_model.config.text_config.sliding_window for prompt, _ in prepared.values())
    assert {len(images) for _, _, images, _, _ in requests} == {0, 1, 2, 3}


def test_mixed_requests_match_transformers(gemma3):
    adapter, hf_model = gemma3
    assert_matches_transformers(adapter, hf_model, 10, seed=3)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(gemma3):
    adapter, hf_model = gemma3
    assert_matches_transformers(adapter, hf_model, 50, seed=5)


@pytest.mark.parametrize("prefix_caching,static_decode", [(True, False), (False, True)])
def test_sliding_layers_free_their_blocks_so_a_batch_fits_that_would_not(gemma3, prefix_caching, static_decode):
    """Six long requests (one with n = 2) run together without preemption in a pool of 56
    blocks of every layer: holding every layer's whole context they need far more (before
    sliding groups, 56 such blocks preempted 6 times here), but the three sliding layers'
    groups keep only their window.
    Chunked prefill, a prefix hit past the window (the repeat) and the fork still give
    `generate()`'s tokens, also through the CUDA graphs' static inputs (one slot row and
    block table per group), run eagerly here."""
    adapter, hf_model = gemma3
    engine = small_engine(adapter, num_kv_blocks=56, prefix_caching=prefix_caching)
    if static_decode:
        engine.runner.prepare_static_decode(6, capture=False)
    bm = engine.block_manager
    assert engine.runner.kv_layout.windows == (0, 12, 12, 12) and bm.num_blocks == 224
    words = "the cat sits on the mat and the dog runs in the park while a person rides a bicycle".split()
    texts = [" ".join(words[i:] + words[:i]) * 2 for i in range(5)]
    prompts = [adapter.prepare(gemma3_prompt(text, 0, False), [], max_tokens=24) for text in texts]
    prompts.append(prompts[0])  # the repeat: a prefix hit
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2 if i == 1 else 1))
    most_held = peak = 0
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        running = engine.scheduler.running
        most_held = max(most_held, sum(s.num_table_blocks for s in running) * bm.num_groups)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    assert most_held > 2 * bm.num_blocks >= 2 * peak  # whole contexts would need twice the pool
    stats = engine.stats
    assert stats.num_preemptions == 0 and stats.num_window_freed_blocks > 0 and stats.num_chunked_prefills > 0
    assert stats.num_forked_tokens > 0 and (stats.num_prefix_hit_tokens > 24) == prefix_caching
    assert (stats.num_graph_replays == stats.num_decode_steps > 0) == static_decode
    assert all(prompt.num_tokens > 4 * 12 for prompt in prompts)
    expected = [hf_greedy(hf_model, adapter, prompt, 24) for prompt in prompts[:5]]
    for i, output in outputs.items():
        assert [c.token_ids for c in output.outputs] == [expected[int(i) % 5]] * (2 if i == "1" else 1), i
    assert bm.num_free_blocks == bm.num_blocks


def test_rotary_tables_are_made_where_the_model_is(gemma3):
    """Our rotary tables are plain attributes (`.to()` leaves them): they must start on the
    device of transformers' buffers, or a GPU decoder multiplies CUDA positions by CPU tables
    (seen on the H200). A rotary module on "meta" stands in for one on the GPU."""
    from vlmbatch.families.gemma3.model import Gemma3Model

    _, hf_model = gemma3
    hf_rotary = copy.deepcopy(hf_model.model.language_model.rotary_emb).to("meta")
    rotaries = Gemma3Model.rotary_embeddings(hf_rotary, hf_model.config.text_config)
    assert set(rotaries) == {"full_attention", "sliding_attention"}
    assert {r.inv_freq.device.type for r in rotaries.values()} == {"meta"}


def test_a_chunk_that_would_end_inside_an_image_stops_before_it(gemma3):
    """The token budget ends inside the image: the first chunk stops at the image's first
    soft token and the next computes the image whole, so its tokens still see each other."""
    adapter, hf_model = gemma3
    prompt = adapter.prepare(gemma3_prompt("What is in the picture?", 1, False), [make_image(7, (64, 40))], max_tokens=8)
    ids = torch.tensor(prompt.prompt_token_ids)
    soft = (ids == adapter.soft_token_id).nonzero().squeeze(1)
    span_start, span_end = int(soft[0]), int(soft[-1]) + 1
    engine = small_engine(adapter, budget=span_start + 5)  # the budget's boundary falls inside the image
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0))
    chunks = []
    while engine.has_unfinished_requests():
        if engine.scheduler.waiting or engine.scheduler.running:
            seq = (engine.scheduler.waiting or engine.scheduler.running)[0]
            before = seq.num_computed_tokens
        outputs = engine.step()
        if seq.num_computed_tokens <= seq.num_prompt_tokens and seq.num_computed_tokens != before:
            chunks.append((before, seq.num_computed_tokens))
    assert chunks[0] == (0, span_start) and chunks[1][0] == span_start and chunks[1][1] >= span_end
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, 8)


@pytest.fixture(scope="module")
def pan_and_scan_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with pan-and-scan switched on in its image processor config."""
    folder = tmp_path_factory.mktemp("gemma3-pan-and-scan") / "model"
    shutil.copytree(tiny_model_dir("gemma3"), folder)
    for name in ("preprocessor_config.json", "processor_config.json"):
        config = json.loads((folder / name).read_text())
        image = config.get("image_processor", config)
        image.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=16)
        (folder / name).write_text(json.dumps(config))
    return str(folder)


def test_pan_and_scan_crops_match_the_processor_and_transformers(gemma3, pan_and_scan_dir):
    """A wide image gets crops, each its own run of soft tokens (and bidirectional block);
    the ids are the processor's own with pan-and-scan asked for explicitly."""
    _, hf_model = gemma3
    adapter = load_adapter(pan_and_scan_dir)
    images = [make_image(11, (150, 40)), make_image(12, (48, 48))]  # crops; too square for any
    text = gemma3_prompt("Describe both.", 2, False)
    prompt = adapter.prepare(text, images, max_tokens=6)
    direct = adapter.processor(text=[text], images=images, return_tensors="pt", do_pan_and_scan=True,
                               pan_and_scan_min_crop_size=16)
    assert prompt.prompt_token_ids == direct["input_ids"][0].tolist()
    assert len(prompt.media) == len(direct["pixel_values"]) > len(images)
    assert adapter.check(text, images, max_tokens=6) == prompt.num_tokens
    per_row = gemma3[0].prepare(text, images, max_tokens=6, processor_kwargs={"do_pan_and_scan": True,
                                                                               "pan_and_scan_min_crop_size": 16})
    assert per_row.prompt_token_ids == prompt.prompt_token_ids  # a row's mm_processor_kwargs do it too
    assert gemma3[0].check(text, images, processor_kwargs={"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}) \
        == prompt.num_tokens
    engine = small_engine(adapter)
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0))
    assert len(engine.scheduler.waiting[0].mm.bidirectional_spans) == len(prompt.media)
    [output] = [o for o in _run(engine)]
    assert output.outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, 6)


def test_dry_run_counts_and_chat_template_match_prepare(gemma3):
    adapter, _ = gemma3
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "What?"}]}]
    text = adapter.apply_chat_template(messages)
    assert text.startswith("<start_of_turn>user\nBe brief.\n\n<start_of_image>What?") and text.endswith("<start_of_turn>model\n")
    images = [make_image(3, (97, 29)), make_image(4, (37, 150))]
    for prompt in (text, gemma3_prompt("two of them", 2, False)):
        shown = images[: prompt.count("<start_of_image>")]
        prepared = adapter.prepare(prompt, shown)
        assert adapter.check(prompt, shown) == prepared.num_tokens
        assert prepared.prompt_token_ids.count(adapter.tokenizer.bos_token_id) == 1


def _run(engine):
    from engine_harness import run_to_completion

    return run_to_completion(engine).values()


# ---- everywhere the other families work: jobs, the dry run, serve -------------------------

IMAGE_PROMPT = "<start_of_turn>user\n<start_of_image>Describe it.<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    from family_harness import make_media_folder

    folder = make_media_folder(tmp_path_factory.mktemp("gemma3-media"))
    make_image(2, (40, 150)).save(folder / "tall.png")
    return folder


@pytest.mark.slow
def test_a_job_with_images_chat_and_bad_rows_completes(tiny_model_dir, media_folder, tmp_path):
    """Through `vlmbatch submit` (dry run, then the job): images, a chat row, and rows the
    family refuses (a video; a prompt without its image's placeholder) as per-row errors."""
    from family_harness import run_job

    odd, tall = str(media_folder / "odd.png"), str(media_folder / "tall.png")
    rows = [
        {"id": "image", "prompt": IMAGE_PROMPT, "image": odd},
        {"id": "two", "prompt": IMAGE_PROMPT.replace("<start_of_image>", "<start_of_image>" * 2), "images": [odd, tall]},
        {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": tall}}, {"type": "text", "text": "What?"}]}]},
        {"id": "video", "prompt": "<start_of_turn>user\nWhat happens?<end_of_turn>\n", "video": str(media_folder / "h264_mp4.mp4")},
        {"id": "no-placeholder", "prompt": "<start_of_turn>user\nHi<end_of_turn>\n", "image": odd},
    ]
    by_id = run_job(rows, str(tiny_model_dir("gemma3")), tmp_path, "placeholder_mismatch")
    assert by_id["video"]["error_type"] == "unsupported_media"
    assert by_id["no-placeholder"]["error_type"] == "placeholder_mismatch"
    for key in ("image", "two", "chat"):
        assert by_id[key]["error_type"] is None and by_id[key]["num_generated_tokens"] == 4, by_id[key]
    assert by_id["two"]["num_input_tokens"] > by_id["image"]["num_input_tokens"] + 16


@pytest.mark.slow
def test_serve_answers_images(tiny_model_dir, media_folder):
    from family_harness import ask, media_parts, served_client

    model = str(tiny_model_dir("gemma3"))
    image, _ = media_parts(media_folder)
    with served_client(model, media_folder) as client:
        for parts in ([image], [image, image]):
            reply = ask(client, model, *parts)
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage.prompt_tokens > 20 * len(parts)
        crops = ask(client, model, image, extra_body={"mm_processor_kwargs": {"do_pan_and_scan": True,
                                                                               "pan_and_scan_min_crop_size": 16}})
        assert crops.usage.prompt_tokens > ask(client, model, image).usage.prompt_tokens  # odd.png is wide: crops


GEMMA_TRITON_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
from engine_harness import gemma3_prompt, hf_greedy, make_image, run_greedy
from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.families.registry import load_adapter

path = sys.argv[1]
adapter = load_adapter(path)
engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", attention_backend="triton", num_kv_blocks=16,
                     block_size=8, max_num_batched_tokens=40, min_admission_batch=1))
request = ("What color is the car?", [make_image(5, (90, 56))], [], 4)
prepared, outputs = run_greedy(engine, adapter, [("0", gemma3_prompt(request[0], 1, False), *request[1:])])
again, repeated = run_greedy(engine, adapter, [("1", gemma3_prompt(request[0], 1, False), *request[1:])])  # a prefix hit
prepared.update(again)
outputs.update(repeated)
assert engine.stats.num_chunked_prefills > 0 and engine.stats.num_prefix_hit_tokens > 0, engine.stats
assert type(engine.model.decoder.norm).__name__ == "OffsetRMSNorm" and engine.model.decoder.norm.kernel is not None
assert engine.model.decoder.layers[0].mlp.act.func.__name__ == "fused_gelu_tanh_and_mul"
hf = load_hf_model(path, torch.float32, torch.device("cpu"))
for request_id, (prompt, max_tokens) in prepared.items():
    assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf, adapter, prompt, max_tokens), request_id
print("ok")
"""


@pytest.mark.slow
def test_triton_kernels_match_transformers_under_the_interpreter(tiny_model_dir):
    """The triton backend and kernels on Gemma 3 (windowed, span-aware prefill; windowed
    split-KV decode; the fused (1 + w) norm and GeGLU), in a fresh interpreter process."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", GEMMA_TRITON_SCRIPT, str(tiny_model_dir("gemma3")), str(Path(__file__).parent)],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_a_backend_without_windows_or_spans_is_refused(gemma3):
    from vlmbatch.engine.attention import TorchBackend

    class CausalOnly(TorchBackend):  # what the flash-attn backend declares
        name = "causal-only"
        beyond_causal = False

    adapter, _ = gemma3
    engine = small_engine(adapter)
    with pytest.raises(ValueError, match="sliding-window layers or bidirectional image attention.*triton or torch"):
        engine.runner.use_backend(CausalOnly())
    assert engine.runner.backend.name == "torch"


def test_rows_take_pan_and_scan_per_row_and_defer_plain_jpegs(tiny_model_dir, tmp_path):
    """In CI's default run (no subprocesses): a row's `mm_processor_kwargs` turn pan-and-scan
    on for that row (CPU path); a bad option is its `invalid_row`; a plain JPEG row is
    deferred to the engine's GPU decoder with the CPU path's token ids; a video is
    `unsupported_media`."""
    import io

    from vlmbatch.config import MediaConfig
    from vlmbatch.errors import ErrorType
    from vlmbatch.io.readers import ColumnMap
    from vlmbatch.job.prepare import media_loader_for, prepare_row

    adapter = load_adapter(str(tiny_model_dir("gemma3")))
    buffer = io.BytesIO()
    make_image(2, (150, 40)).save(buffer, format="JPEG", quality=90)
    media = media_loader_for(tmp_path / "data.jsonl", None, MediaConfig())

    def row(options=None, **kwargs):
        raw = {"prompt": IMAGE_PROMPT, "image": buffer.getvalue(), "mm_processor_kwargs": options}
        return prepare_row(0, raw, ColumnMap(), SamplingParams(max_tokens=4), adapter, media, **kwargs)

    deferred, cpu = row(defer_jpegs=True), row()
    assert deferred.error is None and [i.encoded is not None for i in deferred.prepared.media] == [True]
    assert deferred.prepared.prompt_token_ids == cpu.prepared.prompt_token_ids
    crops = row({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}, defer_jpegs=True)
    assert crops.error is None and len(crops.prepared.media) > 1 and all(i.encoded is None for i in crops.prepared.media)
    assert row({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}, check_only=True).error is None
    for bad in ({"crops": 2}, {"pan_and_scan_max_num_crops": 0}):
        error = row(bad).error
        assert error is not None and error.error_type == ErrorType.INVALID_ROW and error.param == "mm_processor_kwargs"
    raw = {"prompt": IMAGE_PROMPT.replace("<start_of_image>", ""), "video": buffer.getvalue()}
    video = prepare_row(0, raw, ColumnMap(), SamplingParams(max_tokens=4), adapter, media)
    assert video.error is not None and video.error.error_type == ErrorType.UNSUPPORTED_MEDIA
