"""`vlmbatch bench decode-variants`: decode-step time of real-model shapes with and without
programmatic dependent launch.

    vlmbatch bench decode-variants [--shapes 3b,7b] [--batches 1,16,64] [--pdl-max-batches 0,16,512] [--json $OUT/decode_variants.json]

The sweep behind `PDL_MAX_BATCH` in `vlmbatch/engine/runner.py`: one engine with random
bf16 weights per shape; for each value the decode graphs are captured again with PDL for
batches up to it (0 = never) and the step is timed at each batch size against the
roofline. Each variant's greedy tokens on a few W1 requests (prefix cache cleared) must
equal the first variant's exactly: PDL changes when kernels start, never what they
compute, so a difference is a race. Prints a table; writes the JSON report (`--json`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def greedy_tokens(engine, prompts, tokens: int) -> list[list[int]]:
    from vlmbatch.engine.sampling_params import SamplingParams

    engine.scheduler.block_manager.reset_prefix_cache()  # each variant computes every prompt itself
    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [outputs[f"agree-{i}"] for i in range(len(prompts))]


def run(shapes: list[str], batches: list[int], pdl_max_batches: list[int], agree_requests: int, device_name: str,
        json_out: Path) -> bool:
    """Every shape x PDL variant x batch; False when a variant's tokens differ from the first's."""
    import torch

    from vlmbatch.bench import adapt
    from vlmbatch.bench.engine import BenchOptions, random_engine
    from vlmbatch.bench.roofline import decode_roofline, measure_ceilings
    from vlmbatch.bench.shapes import resolve_shape
    from vlmbatch.bench.workloads import build_workload

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ceilings = measure_ceilings(device)
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    report: dict = {"ceilings": ceilings, "rows": []}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    table = []
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            engine = random_engine(resolve_shape(shape), Path(tmp), BenchOptions(decode_batches=tuple(batches), device=device_name), dtype, device)
            prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, agree_requests, seed=31), engine.adapter, dtype)
            reference = None
            for max_batch in pdl_max_batches:
                adapt.capture_with_pdl_up_to(engine, max_batch)
                tokens = greedy_tokens(engine, prompts, 48)
                reference = reference if reference is not None else tokens
                row = {"shape": shape, "pdl_max_batch": max_batch, "agree": sum(a == b for a, b in zip(tokens, reference))}
                for batch in batches:
                    result = decode_roofline(engine, batch, ceilings)
                    row[f"b{batch}"] = {k: result[k] for k in ("decode_step_ms", "roofline_ms", "pct_of_roofline")}
                report["rows"].append(row)
                json_out.write_text(json.dumps(report, indent=2))
                cells = "  ".join(f"b{b} {row[f'b{b}']['decode_step_ms']:6.3f} ms {row[f'b{b}']['pct_of_roofline']:3.0f}%" for b in batches)
                table.append(f"{shape:4s} PDL up to batch {max_batch:<4d} {cells}  tokens equal {row['agree']}/{len(prompts)}")
                print(table[-1], flush=True)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n".join(["", "decode step (percent of the roofline):", *table]))
    return all(row["agree"] == agree_requests for row in report["rows"])
