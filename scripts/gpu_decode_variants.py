#!/usr/bin/env python
"""Decode-step time of real-model shapes under kernel variants, in one command (a GPU).

    python scripts/gpu_decode_variants.py [--shapes 3b,7b] [--batches 1,64] [--variants base,pdl,...]

The sweep behind the decode policy of `vlmbatch/engine/models/decoder.py`: one engine
with random bf16 weights per shape; for each variant, programmatic dependent launch on or
off (`VLMBATCH_PDL`), the L2 prefetch budget of the skinny GEMM, and which linear layers
take the skinny-GEMM kernel up to how many rows with which launch shape; the decode
graphs are captured again and the step timed at each batch size against the roofline.
Each variant's greedy tokens on a few W1 requests are compared with the first variant's:
variants that differ only in PDL or prefetch must agree exactly (a race shows here); a
different linear kernel may flip a bf16 near-tie. Prints a table; writes
decode_variants.json into $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels_bench import import_kernels_package  # noqa: E402  (maps kernels/ to vlmbatch.kernels)

GATE_UP = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
LM_HEAD = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5}
NARROW = {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 4}
NARROW_WIDE_K = {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 3}
STRIP32 = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4}
MB = 1 << 20


@dataclass
class Variant:
    name: str
    pdl: bool
    prefetch_bytes: int = 16 * MB
    # layer -> (rows up to which the skinny kernel serves it, launch shape); missing = cuBLAS
    linears: dict[str, tuple[int, dict[str, int]]] = field(default_factory=lambda: {"gate_up": (16, GATE_UP), "lm_head": (16, LM_HEAD)})


def _all(launch: dict[str, int], rows: int = 16) -> dict[str, tuple[int, dict[str, int]]]:
    return {"gate_up": (rows, GATE_UP), "lm_head": (rows, LM_HEAD), "qkv": (rows, launch), "o": (rows, launch), "down": (rows, launch)}


VARIANTS = {v.name: v for v in [
    Variant("base", pdl=False),
    Variant("pdl", pdl=True),
    Variant("pdl-noprefetch", pdl=True, prefetch_bytes=0),
    Variant("all-strip32", pdl=True, linears=_all(STRIP32)),
    Variant("all-narrow", pdl=True, linears=_all(NARROW)),
    Variant("all-narrow-widek", pdl=True, linears=_all(NARROW_WIDE_K)),
    Variant("all-narrow-nopdl", pdl=False, linears=_all(NARROW)),
    Variant("all-narrow-prefetch32", pdl=True, prefetch_bytes=32 * MB, linears=_all(NARROW)),
    Variant("all-narrow-64rows", pdl=True, linears=_all(NARROW, rows=64)),
]}


def apply(engine, variant: Variant) -> None:
    """Set the variant's switches and capture the decode graphs again."""
    import vlmbatch.kernels.skinny_gemm as skinny_gemm
    from vlmbatch.engine.attention import create_backend
    from vlmbatch.kernels import pdl

    os.environ["VLMBATCH_PDL"] = "1" if variant.pdl else "0"
    os.environ["VLMBATCH_DECODE_LINEAR"] = "auto"
    pdl.reset()
    skinny_gemm.L2_PREFETCH_BYTES = variant.prefetch_bytes
    decoder = engine.model.decoder
    layers = {"lm_head": [decoder.lm_head], "gate_up": [l.mlp.gate_up_proj for l in decoder.layers],
              "down": [l.mlp.down_proj for l in decoder.layers], "qkv": [l.self_attn.qkv_proj for l in decoder.layers],
              "o": [l.self_attn.o_proj for l in decoder.layers]}
    for name, modules in layers.items():
        rows, launch = variant.linears.get(name, (0, {}))
        for module in modules:
            module.skinny_rows, module.skinny_launch = rows, dict(launch)
    engine.runner.use_backend(create_backend("triton", engine.device))


def greedy_tokens(engine, prompts, tokens: int) -> list[list[int]]:
    from vlmbatch.engine.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [outputs[f"agree-{i}"] for i in range(len(prompts))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="3b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, the first is the reference: {', '.join(VARIANTS)}")
    parser.add_argument("--profile", default="", help="variant:batch pairs whose kernels to profile, e.g. all-narrow:1")
    parser.add_argument("--agree-requests", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny shape, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    import_kernels_package()
    import torch

    from vlmbatch.engine.bench import BenchOptions, _random_engine, decode_roofline, measure_ceilings, profile_decode, w1_prompts

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    names = [n for n in args.variants.split(",") if n]
    profiles = [tuple(p.split(":")) for p in args.profile.split(",") if p]
    ceilings = measure_ceilings(device)
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    report: dict = {"ceilings": ceilings, "rows": [], "profiles": {}}
    out = Path(os.environ.get("OUT", ".")) / "decode_variants.json"
    table = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            engine = _random_engine(shape, Path(tmp), BenchOptions(decode_batches=tuple(batches), device=args.device), dtype, device)
            prompts = w1_prompts(engine.adapter, args.agree_requests, seed=31, pixel_dtype=dtype)
            reference = None
            for name in names:
                variant = VARIANTS[name]
                row = {"shape": shape, "variant": name}
                try:
                    apply(engine, variant)
                    tokens = greedy_tokens(engine, prompts, 48)
                    reference = reference if reference is not None else tokens
                    row["agree"] = sum(a == b for a, b in zip(tokens, reference))
                    for batch in batches:
                        result = decode_roofline(engine, engine.adapter, batch, ceilings)
                        row[f"b{batch}_ms"], row[f"b{batch}_pct"] = result["decode_step_ms"], result["pct_of_roofline"]
                        row[f"b{batch}_roofline_ms"] = result["roofline_ms"]
                    for prof_name, prof_batch in profiles:
                        if prof_name == name:
                            kernels = profile_decode(engine, engine.adapter, int(prof_batch))
                            report["profiles"][f"{shape}-{name}-b{prof_batch}"] = kernels
                            print(f"{shape} {name} batch {prof_batch} kernels per step:")
                            for k in kernels:
                                print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f} calls  {k['kernel']}")
                except Exception as error:  # one variant failing (a kernel that does not compile) keeps the others
                    import traceback

                    row["error"] = traceback.format_exc()
                    print(f"{shape} {name} FAILED:\n{row['error']}", flush=True)
                report["rows"].append(row)
                out.write_text(json.dumps(report, indent=2))
                cells = "  ".join(f"b{b} {row.get(f'b{b}_ms', float('nan')):6.3f} ms {row.get(f'b{b}_pct', float('nan')):4.0f}%" for b in batches)
                line = f"{shape:3s} {name:24s} {cells}  agree {row.get('agree', '-')}/{len(prompts)}"
                table.append(line)
                print(line, flush=True)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n".join(["", "decode step per variant (roofline % in brackets):", *table]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
