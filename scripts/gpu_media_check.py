#!/usr/bin/env python
"""Check the GPU image path against the CPU path and time every preprocessing path (no install needed).

    python scripts/gpu_media_check.py [--side 448] [--images 256] [--max-workers 16]

Makes 1080p JPEGs in memory; compares the nvJPEG path's pixel_values with the CPU path's
(Pillow decode, same processor; tolerance GPU_MAX_ABS_DIFF / GPU_MEAN_ABS_DIFF in
vlmbatch/media/gpu_image.py, the IDCT rounding of two JPEG decoders); times images/s for
Pillow in one process, the CPU pool with 1..N processes and the GPU path; prints one table
and writes media_bench.json into $OUT when it is set. Exits 1 on a pixel mismatch.
Needs torch, torchvision, transformers, pillow, pyarrow, numpy and httpx; ~2 minutes on 16 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=448, help="model input pixel budget: side x side")
    parser.add_argument("--images", type=int, default=256, help="images per CPU-pool measurement (x4 on the GPU)")
    parser.add_argument("--max-workers", type=int, default=None, help="largest pool size (default: usable cores)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from vlmbatch.media.bench import run_media_bench

    report = run_media_bench(args.side, args.images, args.max_workers)
    pillow = next(r for r in report.results if r.path == "pillow").images_per_s
    print(f"\n1080p JPEG -> {args.side}x{args.side} pixel budget; {report.source}; {report.machine}")
    print(f"{'path':<10} {'processes':>9} {'images':>7} {'images/s':>9} {'vs pillow':>9}")
    for r in report.results:
        workers = str(r.workers) if r.workers else "-"
        print(f"{r.path:<10} {workers:>9} {r.images:>7} {r.images_per_s:>9.0f} {r.images_per_s / pillow:>8.1f}x")
    print(f"GPU vs CPU pixel_values: {report.gpu_parity} -> {'ok' if report.ok else 'MISMATCH'}")
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "media_bench.json"
        path.write_text(json.dumps({"benchmark": "media", **report.to_dict()}, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
