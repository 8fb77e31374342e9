"""`vlmbatch bench step-inputs`: host time to build a prefill step's inputs beside decoding rows.

A prefill step carries one token of every decoding sequence (hundreds under W1's
admission waves: up to ~470 per LLaVA-OneVision-7B step on the H200, what its KV cache holds), and prefill steps are
synchronous: the GPU waits while the host builds their inputs. This times
`ModelRunner._prefill_inputs` on a step of `rows` decoding W1 requests plus the next W1
prompt, on random weights of a shape (`tiny` runs on the CPU machine), median of `repeats`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path


def run(shape_name: str, rows: int, repeats: int, device_name: str, json_out: Path) -> dict:
    import torch

    from vlmbatch.bench import adapt
    from vlmbatch.bench.engine import BenchOptions, random_engine
    from vlmbatch.bench.shapes import resolve_shape
    from vlmbatch.bench.workloads import build_workload
    from vlmbatch.engine.sampling_params import SamplingParams

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        options = BenchOptions(decode_batches=(rows + 1,), device=device_name, min_admission_batch=1)
        engine = random_engine(resolve_shape(shape_name), Path(tmp), options, dtype, device)
        engine.async_decode = False  # no step in flight while the next one is built by hand
        prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, rows + 1, seed=43), engine.adapter, dtype)
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(prompts[:rows]):
            engine.add_request(str(i), prompt, params)
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
            engine.step()
        engine.add_request("next", prompts[rows], params)
        build, step_rows, decoding, prompt_tokens = adapt.next_prefill_inputs(engine)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            build()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
    result = {"shape": shape_name, "device": str(device), "rows": step_rows, "decoding_rows": decoding,
              "prompt_tokens": prompt_tokens, "median_ms": 1e3 * statistics.median(times),
              "us_per_decoding_row": 1e6 * statistics.median(times) / max(1, decoding), "repeats": repeats}  # fmt: skip
    print(f"{shape_name}: a prefill step of {decoding} decoding rows + {result['prompt_tokens']} prompt tokens: "
          f"inputs built in {result['median_ms']:.2f} ms (median of {repeats})")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    return result
