#!/usr/bin/env python
"""Decode-step time of real-model shapes with and without programmatic dependent launch.

    python scripts/gpu_decode_variants.py [--shapes 3b,7b] [--batches 1,16,64] [--pdl-max-batches 0,16,512]

The sweep behind `PDL_MAX_BATCH` in `vlmbatch/engine/runner.py`: one engine with random
bf16 weights per shape; for each value the decode graphs are captured again with PDL for
batches up to it (0 = never) and the step is timed at each batch size against the
roofline. Each variant's greedy tokens on a few W1 requests (prefix cache cleared) must
equal the first variant's exactly: PDL changes when kernels start, never what they
compute, so a difference is a race. Prints a table; writes decode_variants.json into
$OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels_bench import import_kernels_package  # noqa: E402  (maps kernels/ to vlmbatch.kernels)


def capture_with_pdl_up_to(engine, max_batch: int) -> None:
    """Capture the decode graphs again, launching with PDL for batches up to `max_batch`."""
    from vlmbatch.engine import runner
    from vlmbatch.engine.attention import create_backend

    runner.PDL_MAX_BATCH = max_batch
    engine.runner.use_backend(create_backend("triton", engine.device))


def greedy_tokens(engine, prompts, tokens: int) -> list[list[int]]:
    from vlmbatch.engine.sampling_params import SamplingParams

    engine.scheduler.block_manager.reset_prefix_cache()  # each variant computes every prompt itself
    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [outputs[f"agree-{i}"] for i in range(len(prompts))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="3b,7b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--pdl-max-batches", default="0,16,512", help="PDL_MAX_BATCH values; the first is the reference")
    parser.add_argument("--agree-requests", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny shape, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    import_kernels_package()
    import torch

    from vlmbatch.engine.bench import BenchOptions, _random_engine, decode_roofline, measure_ceilings, w1_prompts

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    ceilings = measure_ceilings(device)
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    report: dict = {"ceilings": ceilings, "rows": []}
    out = Path(os.environ.get("OUT", ".")) / "decode_variants.json"
    table = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            engine = _random_engine(shape, Path(tmp), BenchOptions(decode_batches=tuple(batches), device=args.device), dtype, device)
            prompts = w1_prompts(engine.adapter, args.agree_requests, seed=31, pixel_dtype=dtype)
            reference = None
            for max_batch in (int(b) for b in args.pdl_max_batches.split(",")):
                capture_with_pdl_up_to(engine, max_batch)
                tokens = greedy_tokens(engine, prompts, 48)
                reference = reference if reference is not None else tokens
                row = {"shape": shape, "pdl_max_batch": max_batch, "agree": sum(a == b for a, b in zip(tokens, reference))}
                for batch in batches:
                    result = decode_roofline(engine, engine.adapter, batch, ceilings)
                    row[f"b{batch}"] = {k: result[k] for k in ("decode_step_ms", "roofline_ms", "pct_of_roofline")}
                report["rows"].append(row)
                out.write_text(json.dumps(report, indent=2))
                cells = "  ".join(f"b{b} {row[f'b{b}']['decode_step_ms']:6.3f} ms {row[f'b{b}']['pct_of_roofline']:3.0f}%" for b in batches)
                table.append(f"{shape:4s} PDL up to batch {max_batch:<4d} {cells}  tokens equal {row['agree']}/{len(prompts)}")
                print(table[-1], flush=True)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n".join(["", "decode step (percent of the roofline):", *table]))
    return 0 if all(row["agree"] == len(prompts) for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
