"""Load a pre-quantized FP8 checkpoint into the paged engine on one GPU and report what it took.

    python scripts/fp8_load_check.py MODEL_DIR                    # a real checkpoint (e.g. Qwen2.5-VL-72B-Instruct-FP8-dynamic)
    python scripts/fp8_load_check.py --shape 72b [--layers 40]   # writes a random one of that shape first (--workdir)

The lent GPU machines reach no hub, so `--shape` writes a checkpoint of a benchmark shape
(`vlmbatch/bench/shapes.py`) in the published FP8 layout (`--format`: compressed-tensors
per channel, or Qwen's 128x128 blocks) with random weights: the vision tower as
transformers builds it, every decoder projection as random e4m3 values with their scales,
the rest random bf16, in shards of about 5 GB. The 80 layers of 72B take ~75 GB of disk
(nvidia-h200-x2 has 128 GB; one H200 machine 64 GB: use `--layers 40` there).

Reported: load seconds; the decoder's GiB; the most GPU memory allocated while loading (the
KV cache is sized after it); the process's peak resident memory (VmHWM, reset before the
load) and the most checkpoint bytes the loader held at once; the KV tokens left; then a few
greedy requests (gibberish on random weights; text on a real checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from pathlib import Path

import torch

SHARD_BYTES = 5 * 2**30
_PROJECTION = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def write_checkpoint(shape_name: str, layers: int | None, fmt: str, workdir: Path, device: str = "cuda") -> Path:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmbatch.bench.shapes import resolve_shape, write_model_folder
    from vlmbatch.testing.fp8_checkpoints import quantization_config

    shape = resolve_shape(shape_name)
    path = write_model_folder(shape, workdir)
    config = json.loads((path / "config.json").read_text())
    if layers is not None:
        config["text_config"]["num_hidden_layers"] = layers
        if config["text_config"].get("layer_types"):
            config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:layers]
    config["quantization_config"] = quantization_config(fmt)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = AutoConfig.from_pretrained(path)
    del hf_config.quantization_config
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.bfloat16)
    shard: dict[str, torch.Tensor] = {}
    size, weight_map = 0, {}

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    def add(key: str, tensor: torch.Tensor) -> None:
        nonlocal size
        if size + tensor.numel() * tensor.element_size() > SHARD_BYTES and shard:
            flush()
        shard[key] = tensor.cpu()
        size += tensor.numel() * tensor.element_size()

    gen = torch.Generator(device).manual_seed(0)
    for key, param in meta.state_dict().items():
        dims = tuple(param.shape)
        if _PROJECTION.search(key) and "visual" not in key:
            weight = torch.empty(dims, device=device, dtype=torch.float8_e4m3fn)
            for start in range(0, dims[0], 4096):  # a few MB of bf16 temporary at a time
                rows = weight[start : start + 4096]
                rows.copy_(torch.randn(rows.shape, device=device, generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn))
            add(key, weight)
            if fmt == "fp8-block":
                add(key.removesuffix("weight") + "weight_scale_inv", torch.full((-(-dims[0] // 128), -(-dims[1] // 128)), 0.02))
            else:
                add(key.removesuffix("weight") + "weight_scale", torch.full((dims[0], 1), 0.02, dtype=torch.bfloat16))
        elif re.search(r"(norm\d?|ln_q)\.weight$", key):
            add(key, torch.ones(dims, device=device, dtype=torch.bfloat16))
        else:
            add(key, torch.randn(dims, device=device, generator=gen, dtype=torch.bfloat16) * 0.02)
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


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
