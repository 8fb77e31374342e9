"""`vlmbatch bench sampling`: what penalties, logprobs and n > 1 cost the paged engine.

    vlmbatch bench sampling [--shape qwen2_5_vl_3b] [--requests 256] [--output-tokens 128] [--json bench-out/sampling.json]

One engine with random weights (bf16 on a GPU) runs the same W1 prompts once per variant,
every request forced to `output_tokens` tokens: greedy (the reference), penalties
(repetition, frequency, presence and a logit bias), logprobs (top 5), both, and n = 4 (a
quarter of the requests, four samples each: the same number of sequences). Output tokens/s
and the ratio to greedy are printed per variant, with the decode steps that replayed CUDA
graphs and ran asynchronously (the adjustments must keep both) and the prompt tokens the
n = 4 samples shared. Also a correctness gate: penalties of zero (a logit bias of 0 on one
token) must give the greedy tokens exactly.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any


def variants(output_tokens: int) -> dict[str, tuple[Any, int]]:
    """name -> (SamplingParams, divisor of the request count)."""
    from vlmbatch.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={"13": -5.0})
    return {
        "greedy": (greedy, 1),
        "neutral_adjustments": (greedy.updated(logit_bias={"13": 0.0}), 1),
        "penalties": (greedy.updated(**penalties), 1),
        "logprobs5": (greedy.updated(logprobs=5), 1),
        "penalties+logprobs5": (greedy.updated(logprobs=5, **penalties), 1),
        "n4_seeded": (greedy.updated(temperature=1.0, seed=1, n=4), 4),
    }


def _run(engine, prompts, params, label: str) -> tuple[float, dict[str, list[int]], dict[str, int]]:
    engine.block_manager.reset_prefix_cache()
    before = {k: getattr(engine.stats, k) for k in ("num_decode_steps", "num_graph_replays", "num_async_decode_steps", "num_forked_tokens")}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = [t for o in output.outputs for t in o.token_ids]
    seconds = time.perf_counter() - start
    return seconds, tokens, {k: getattr(engine.stats, k) - v for k, v in before.items()}


def run(shape_name: str, requests: int, output_tokens: int, device_name: str, json_out: Path) -> bool:
    """Every variant; False when neutral adjustments change a greedy token."""
    import torch

    from vlmbatch.bench import adapt
    from vlmbatch.bench.engine import BenchOptions, random_engine
    from vlmbatch.bench.shapes import resolve_shape
    from vlmbatch.bench.workloads import build_workload

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        options = BenchOptions(decode_batches=(requests,), device=device_name, min_admission_batch=requests)
        engine = random_engine(resolve_shape(shape_name), Path(tmp), options, dtype, device)
        prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, requests, seed=41), engine.adapter, dtype)
        # Warm-up on every prompt: each image is encoded once here (the encoder cache then
        # serves every variant alike), and the adjusting kernels compile and autotune.
        _run(engine, prompts, variants(2)["penalties+logprobs5"][0], "warmup")
        baseline = None
        for name, (params, divisor) in variants(output_tokens).items():
            chosen = prompts[: max(1, requests // divisor)]
            seconds, tokens, counts = _run(engine, chosen, params, name)
            generated = sum(len(t) for t in tokens.values())
            rate = generated / seconds
            baseline = baseline or rate
            if name == "greedy":
                reference = [tokens[f"greedy-{i}"] for i in range(len(chosen))]
            row = {"variant": name, "requests": len(chosen), "n": params.n, "output_tokens_per_s": rate,
                   "vs_greedy": rate / baseline, **counts}
            if name == "neutral_adjustments":
                row["tokens_equal_greedy"] = [tokens[f"{name}-{i}"] for i in range(len(chosen))] == reference
            rows.append(row)
            print(f"{name:22s} {len(chosen):4d} req x n={params.n}  {rate:9.0f} out tok/s  {rate / baseline:5.2f}x greedy  "
                  f"decode steps {counts['num_decode_steps']} (graphs {counts['num_graph_replays']}, "
                  f"async {counts['num_async_decode_steps']})  forked prompt tokens {counts['num_forked_tokens']}", flush=True)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps({"shape": shape_name, "device": str(device), "output_tokens": output_tokens, "rows": rows}, indent=2))
    return all(row.get("tokens_equal_greedy", True) for row in rows)
