"""Where the benchmarks meet the engine's prompt type and internals, and nowhere else.

The harnesses drive our engine through its public surface (`add_request`, `step`,
`has_unfinished_requests`, `EngineStats`). What needs more lives here, so a change of the
engine's internals is adapted in this one module: building the engine, turning a
workload into its prepared prompts, teacher forcing (the scheduler and runner stepped by
hand), switching attention backends, building a prefill step's inputs by hand (its host
cost), and reading the model's parts (the decoder's sizes for the roofline, the vision tower
for a profile, the encoder cache for the JPEG check).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vlmbatch.bench.workloads import Workload
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.config import EngineConfig
from vlmbatch.families.prompt import PreparedPrompt

PREPARE_THREADS = min(8, os.cpu_count() or 1)


def paged_engine(adapter, hf_model: torch.nn.Module | None, *, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, **options: Any):
    """Our engine on `adapter`'s model, taking over `hf_model`'s weights when given (its
    language model moves into the engine). `options`: `EngineConfig` settings (`max_num_seqs`,
    `max_num_batched_tokens`, `gpu_memory_utilization`, `min_admission_batch`,
    `attention_backend`, `async_decode`, `pdl`)."""
    from vlmbatch.engine.paged import PagedEngine

    config = EngineConfig(engine="paged", dtype=str(dtype).removeprefix("torch."), device=str(device),
                          max_model_len=max_model_len, **options)
    return PagedEngine(adapter, config, hf_model)


def engine_prompts(workload: Workload, adapter, dtype: torch.dtype) -> list[PreparedPrompt]:
    """The workload as our engine's prompts, through the model's own adapter (the product's
    path: processor pixels, content hashes), pixels cast to the engine's dtype as the jobs'
    preprocessing pools deliver them. Untimed, but GPU-machine time: made by a few threads
    (the processors' resizes and tensor work release the GIL; SmolVLM2's 17 tiles a request
    took ~100 ms each, 1,024 of them serially most of a call's spare minutes)."""

    def prepare(index: int) -> PreparedPrompt:
        request = workload.requests[index]
        prompt = adapter.prepare(request.prompt, images=workload.images(index), max_tokens=request.output_tokens)
        if prompt.num_tokens != workload.prompt_tokens:
            raise ValueError(f"{workload.name} request {index} is {prompt.num_tokens} tokens, not {workload.prompt_tokens}")
        for item in prompt.media:
            item.cast_pixels(dtype)
        return prompt

    with ThreadPoolExecutor(PREPARE_THREADS) as threads:
        return list(threads.map(prepare, range(len(workload.requests))))


@torch.no_grad()
def teacher_forced_logits(engine, prompts: list[PreparedPrompt], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len(continuation) + 1, vocab] (fp32, host) of each prompt's last token and of
    each forced continuation token, through the engine's normal schedule (batched prefill,
    then decode steps): the scheduler and runner stepped by hand, feeding the forced token
    instead of the sampled one."""
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    forced = {}
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        engine.add_request(f"teacher-forced-{i}", prompt, greedy.updated(max_tokens=len(continuation) + 1))
        forced[f"teacher-forced-{i}"] = (list(continuation), [])
    while engine.scheduler.has_unfinished():
        batch = engine.scheduler.schedule()
        engine._encode_media(batch)
        seqs, logits = engine.runner.forward_logits(batch)
        engine.scheduler.finish_step(batch)
        for seq, row in zip(seqs, logits.float().cpu()):
            continuation, rows = forced[seq.request_id]
            rows.append(row)
            if len(rows) <= len(continuation):
                seq.token_ids.append(continuation[len(rows) - 1])
            else:
                engine.abort_request(seq.request_id)
    return [torch.stack(rows) for _, rows in forced.values()]


def use_attention_backend(engine, name: str) -> str:
    """Switch the engine's attention backend (decode graphs are captured again); returns the
    name of the one it used before."""
    from vlmbatch.engine.attention import create_backend

    before = engine.runner.backend.name
    engine.runner.use_backend(create_backend(name, engine.model.kernels.pdl_max_rows))
    return before


def decoder(engine) -> torch.nn.Module:
    """The language model's decoder (its parameters and sizes set the decode roofline)."""
    return engine.model.decoder


def vision_tower(engine) -> dict[str, Any]:
    """Which vision tower runs (ours or transformers') and how its attention is batched."""
    return {"vision_tower": "vlmbatch" if getattr(engine.model, "tower", None) is not None else "transformers",
            "packed_vision_attention": getattr(engine.model, "packed_vision_attention", None)}


def encode_images(engine, prompts: list[PreparedPrompt]) -> None:
    """Run the vision tower on `prompts`' media in one batch (a prefill step's encode)."""
    engine.model.encode([p.media for p in prompts])


def with_pixels_on(prompts: list[PreparedPrompt], device: torch.device) -> list[PreparedPrompt]:
    """Copies of `prompts` whose media pixels already sit on `device` (what the engine's
    encode would upload first), for timing the tower without the upload."""
    moved = []
    for prompt in prompts:
        media = [item.with_tensors({k: v.to(device) for k, v in item.tensors.items() if k.startswith("pixel_values")})
                 for item in prompt.media]
        moved.append(PreparedPrompt(prompt.prompt_token_ids, media, prompt.prompt))
    return moved


def encoder_cache_keys(engine) -> list[str]:
    """Content keys of the media the engine encoded (engine-decoded JPEGs start with "jpeg:")."""
    return list(engine.model.encoder_cache)


def clear_encoder_cache(engine) -> None:
    engine.model.encoder_cache.clear()


def memory_summary(engine) -> dict[str, float]:
    """The KV cache the engine sized from what the weights left (blocks, tokens, GiB), and
    the GiB its decoder's weights take (FP8 weights at one byte). With KV-cache groups
    (sliding windows, `kv_groups.py`) a block holds one group's layers: `kv_tokens` is the
    context every layer can hold at once (the pool over its groups, as for a model without
    windows), `kv_window_tokens` what each sliding group keeps per sequence (0: none)."""
    runner = engine.runner
    layout = runner.kv_layout
    decoder = engine.model.decoder
    weights = sum(t.numel() * t.element_size() for t in [*decoder.parameters(), *decoder.buffers()])
    return {"kv_blocks": runner.num_kv_blocks, "kv_tokens": runner.num_kv_blocks // layout.num_groups * runner.block_size,
            "kv_groups": layout.num_groups, "kv_layers_per_group": layout.layers_per_group,
            "kv_window_tokens": max(layout.windows),
            "kv_gib": runner.num_kv_blocks * runner.block_bytes / 2**30, "decoder_weights_gib": weights / 2**30}


def next_prefill_inputs(engine) -> tuple[Callable[[], Any], int, int, int]:
    """Schedule the engine's next step (a prefill step: a prompt waits) and encode its media;
    returns a call that builds its inputs as `ModelRunner.run` does, and the step's rows,
    decoding rows (those built as a decode step's) and prompt tokens."""
    batch = engine.scheduler.schedule()
    engine._encode_media(batch)
    runner = engine.runner
    decoding = runner._leading_decode_rows(batch)
    return (lambda: runner._prefill_inputs(batch)), len(batch.seqs), decoding, batch.num_tokens - decoding
