"""Load a pre-quantized FP8 checkpoint into the paged engine on one GPU and report what it took.

    python scripts/fp8_load_check.py MODEL_DIR                    # a real checkpoint (e.g. Qwen2.5-VL-72B-Instruct-FP8-dynamic)
    python scripts/fp8_load_check.py --shape 72b [--layers 40]   # writes a random one of that shape first (--workdir)

The lent GPU machines reach no hub, so `--shape` writes a checkpoint of a benchmark shape
(`vlmbatch/bench/shapes.py`) in the published FP8 layout (`--format`: compressed-tensors
per channel, or Qwen's 128x128 blocks) with random weights, shard by shard, as `vlmbatch
bench make-checkpoint` does (`vlmbatch/bench/checkpoint.py`). The 80 layers of 72B take
~77 GB of disk (nvidia-h200-x2 has 128 GB; one H200 machine 64 GB: use `--layers 40` there,
or write all 80 with `vlmbatch bench make-checkpoint ... --overflow /dev/shm` and pass its folder).

Reported: load seconds; the decoder's GiB; the most GPU memory allocated while loading (the
KV cache is sized after it); the process's peak resident memory (VmHWM, reset before the
load) and the most checkpoint bytes the loader held at once; the KV tokens left; then a few
greedy requests (gibberish on random weights; text on a real checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path

import torch

def write_checkpoint(shape_name: str, layers: int | None, fmt: str, workdir: Path, device: str = "cuda") -> Path:
    """`vlmbatch bench make-checkpoint`'s writer, on the shape cut to `layers` decoder layers when given."""
    from dataclasses import replace

    from vlmbatch.bench.checkpoint import write_random_checkpoint
    from vlmbatch.bench.shapes import resolve_shape

    shape = resolve_shape(shape_name)
    if layers is not None:
        shape = replace(shape, text={**shape.text, "num_hidden_layers": layers})
    return write_random_checkpoint(shape, workdir, fmt, device=torch.device(device))


def host_peak_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)
    except OSError as exc:
        print(f"cannot reset the peak resident memory ({exc}): VmHWM covers the whole process")


def host_peak_gib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a pre-quantized FP8 checkpoint folder")
    parser.add_argument("--shape", help="write a random FP8 checkpoint of this benchmark shape (e.g. 72b) first")
    parser.add_argument("--layers", type=int, help="with --shape: this many decoder layers instead of the shape's")
    parser.add_argument("--format", default="fp8-dynamic", choices=("fp8-dynamic", "fp8-block"))
    parser.add_argument("--workdir", default="/tmp/fp8-load-check", type=Path)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script (bf16, no GPU figures)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.paged import PagedEngine
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.families.registry import load_adapter

    if args.shape:
        started = time.perf_counter()
        args.model = str(write_checkpoint(args.shape, args.layers, args.format, args.workdir, args.device))
        print(f"wrote {args.model} in {time.perf_counter() - started:.0f} s", flush=True)
    if not args.model:
        parser.error("give a checkpoint folder or --shape")
    adapter = load_adapter(args.model)
    model_cls = adapter.family.parts().ENGINE_MODEL
    build = model_cls.build.__func__
    after_build = {}

    cuda = args.device.startswith("cuda")

    def measured_build(cls, *a, **kw):  # the GPU peak of loading, before the KV cache is sized
        model = build(cls, *a, **kw)
        if cuda:
            torch.cuda.synchronize()
            after_build["peak"] = torch.cuda.max_memory_allocated()
        after_build["seconds"] = time.perf_counter() - started
        return model

    model_cls.build = classmethod(measured_build)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    host_peak_reset()
    started = time.perf_counter()
    engine = PagedEngine(adapter, EngineConfig(device=args.device, dtype="bfloat16", **({} if cuda else {"num_kv_blocks": 64})))
    host = host_peak_gib()
    decoder = engine.model.decoder
    weights = sum(t.numel() * t.element_size() for t in (*decoder.parameters(), *decoder.buffers()))
    kv_tokens = engine.runner.num_kv_blocks * engine.block_manager.block_size
    print(f"load: {after_build['seconds']:.0f} s to the engine model, {time.perf_counter() - started:.0f} s with the KV cache", flush=True)
    gpu = (f"GPU peak while loading {after_build['peak'] / 2**30:.1f} GiB of {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}; "
           if cuda else "")
    print(f"decoder weights {weights / 2**30:.1f} GiB; {gpu}KV cache {kv_tokens} tokens", flush=True)
    print(f"host: peak resident {host:.1f} GiB during the load (VmHWM)", flush=True)
    prompt = adapter.apply_chat_template([{"role": "user", "content": "Describe the colours of a sunset in one sentence."}])
    for index in range(args.requests):
        engine.add_request(str(index), adapter.prepare(prompt, max_tokens=24), SamplingParams(max_tokens=24, temperature=0))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    print("greedy:", done["0"].outputs[0].token_ids, repr(done["0"].outputs[0].text))


if __name__ == "__main__":
    main()
