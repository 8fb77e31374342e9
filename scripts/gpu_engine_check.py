#!/usr/bin/env python
"""Check and time the paged engine on a GPU in one command (no install needed).

    python scripts/gpu_engine_check.py [--requests 1024] [--peer-requests 128] [--no-7b] [--backends triton,torch]

Qwen2.5-VL-3B shapes with random bf16 weights (built in memory from the published config
values; nothing is downloaded):
1. the `generate()` peer: W1 with static batches of 64 and 128, W2 with 128 (`--peer-requests`),
2. logits of prefill + 32 teacher-forced decode steps, per attention backend, against
   `transformers` fp32 on the same weights (bound: 2x transformers' own bf16 error, >= 2e-2),
3. W1 and W2 on the paged engine (`--requests` each; shorten it for a quick run),
4. decode-step time at batch 1 and 64 against the roofline, for 3B and 7B shapes.
Prints a table and writes engine_check.json into $OUT (or the current folder) after every
phase, so a run cut short keeps what it measured; a failing phase is recorded with its
traceback and the rest still run. Exits 1 when a backend's logits are out of bounds or a
phase failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels_bench import import_kernels_package  # noqa: E402  (maps kernels/ to vlmbatch.kernels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3b", help="3b, 7b, or tiny (a CPU smoke run)")
    parser.add_argument("--requests", type=int, default=1024, help="W1/W2 requests on the paged engine")
    parser.add_argument("--peer-requests", type=int, default=128, help="W1/W2 requests on the generate() peer")
    parser.add_argument("--no-7b", action="store_true", help="skip the 7B decode roofline")
    parser.add_argument("--backends", default="", help="attention backends to check (default: all available)")
    parser.add_argument("--no-peer", action="store_true", help="skip the generate() peer (quick iterations)")
    parser.add_argument("--peer-batches", default="64,128", help="static batch sizes of the peer (W2 runs the largest)")
    parser.add_argument("--profile-batches", default="", help="decode batch sizes whose kernels to profile, e.g. 1,64")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--admission-batch", type=int, default=64, help="free slots before waiting requests join (1 = at once)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--sync-decode", action="store_true", help="await every decode step (no asynchronous decoding)")
    args = parser.parse_args()
    import_kernels_package()
    from vlmbatch.engine.bench import BenchOptions, run_bench

    options = BenchOptions(
        shape=args.shape,
        requests=args.requests,
        peer_requests=args.peer_requests,
        extra_shapes=() if args.no_7b else ("7b",),
        backends=tuple(b for b in args.backends.split(",") if b),
        peer_batches=() if args.no_peer else tuple(int(b) for b in args.peer_batches.split(",") if b),
        profile_batches=tuple(int(b) for b in args.profile_batches.split(",") if b),
        max_num_seqs=args.max_num_seqs,
        min_admission_batch=args.admission_batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_decode=not args.sync_decode,
    )
    path = Path(os.environ.get("OUT", ".")) / "engine_check.json"
    report = run_bench(options, save=lambda partial: path.write_text(json.dumps(partial, indent=2)))
    for workload, figures in sorted(report.get("summary", {}).items()):
        print(f"{workload}: {figures}")
    for phase, error in report["errors"].items():
        print(f"{phase} failed:\n{error}")
    return 0 if report["ok"] and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
