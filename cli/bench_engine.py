"""`vlmbatch bench engine`: our engine against the `generate()` and vLLM peers on the same workloads, plus logit checks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from vlmbatch.cli.bench_options import int_list, model_shape_option, shape_or_exit, split


def bench_engine(
    model_shape: str = model_shape_option(),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Real Qwen-VL weights (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) instead of random ones."),
    requests: int = typer.Option(1024, "--requests", min=1, help="Requests per workload on our engine and on vLLM."),
    peer: str = typer.Option("hf,vllm", "--peer", help="Peers to run on the same workloads: hf (generate()), vllm; '' for none. "
                             "A peer that cannot run here is reported as skipped, with why."),
    peer_requests_w1: int = typer.Option(1024, "--peer-requests-w1", min=0, help="W1 requests on the generate() peer (0: not on W1)."),
    peer_requests_w2: int = typer.Option(512, "--peer-requests-w2", min=0, help="W2 requests on the generate() peer (0: not on W2)."),
    peer_batches: str = typer.Option("128,256", "--peer-batches", help="generate() static batch sizes, each warmed up with a full batch and timed."),
    vllm_gpu_memory_utilization: float = typer.Option(0.85, "--vllm-gpu-memory-utilization", help="vLLM's share of GPU memory."),
    vllm_timeout: float = typer.Option(300, "--vllm-timeout", help="Seconds the vLLM child may run (load, warm-up and both workloads)."),
    vllm_pythonpath: str = typer.Option("", "--vllm-pythonpath", help="PYTHONPATH of the vLLM child instead of ours (e.g. /tmp/site-vllm): "
                                        "vLLM's folder, without a transformers carried for our engine."),
    workloads: str = typer.Option("w1,w2", "--workloads", help="w1 (128 output tokens), w2 (16..512 output tokens)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed passes of each workload on our engine and vLLM, each on fresh "
                                "requests; the summary takes each engine's best pass and lists them all (generate(): the first only)."),
    backends: str = typer.Option("", "--backends", help="Attention backends whose logits are checked (default: every available one)."),
    attention_backend: str = typer.Option("auto", "--attention-backend", help="Backend of the timed runs: auto (the product's choice), triton, flash-attn, torch."),
    check_prompts: int = typer.Option(4, "--check-prompts", min=1, help="W1 prompts whose logits are checked per backend."),
    decode_steps: int = typer.Option(32, "--decode-steps", min=1, help="Teacher-forced decode steps checked after each prompt."),
    reference_layers: Optional[int] = typer.Option(
        None, "--reference-layers", min=1,
        help="Check the logits on the shape cut to its first N decoder layers (an fp32 reference of 30B-A3B does not fit on one GPU).",
    ),
    decode_batches: str = typer.Option("1,64", "--decode-batches", help="Batch sizes of the decode-step roofline."),
    extra_shapes: str = typer.Option("qwen2_5_vl_7b", "--extra-shapes", help="Shapes that get the decode-step roofline only ('' for none)."),
    profile_batches: str = typer.Option("", "--profile-batches", help="Decode batch sizes whose kernels (and the vision tower) are profiled, e.g. 1,64."),
    profile_prefill: bool = typer.Option(False, "--profile-prefill", help="Also profile one full prefill step (the language model alone): its wall time and costliest kernels."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", min=1,
                                               help="Most sequences in one batch (default: the engine's for this GPU)."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", min=1,
                                                         help="Token budget of one prefill step (default: the engine's for this GPU)."),
    admission_batch: int = typer.Option(64, "--admission-batch", min=1, help="Free slots before waiting requests join a running batch (1 = at once)."),
    gpu_memory_utilization: float = typer.Option(0.85, "--gpu-memory-utilization", help="Share of GPU memory for our weights, activations and KV cache."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    stage_media: str = typer.Option("off", "--stage-media", help="off, on (the engine option: the next admission's pixels "
                                    "uploaded while a step runs), or both: each of our passes followed by one with it (\"w1+staged\")."),
    async_decode: bool = typer.Option(True, "--async-decode/--sync-decode", help="Launch each decode step before reading the previous one's tokens (the engine's default), or await every step."),
    structured: Optional[str] = typer.Option(None, "--structured", help="Time W1 again under a built-in JSON schema (extraction6: six "
                                             "fields, the last an open string so rows run to 128 tokens), on our engine and vLLM, "
                                             "with the mask's cost per step at --mask-batches."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="As --structured, with the JSON schema in this file."),
    mask_batches: str = typer.Option("64,256", "--mask-batches", help="Batch sizes of the mask-per-step measurement (with a schema)."),
    grammar_fill_threads: int = typer.Option(0, "--grammar-fill-threads", min=0, help="Threads filling one step's masks (the engine option; 0 = auto: half the cores, at most 8)."),
    quantization: str = typer.Option("none", "--quantization", help="fp8 (per channel, dynamic per token) or fp8-block (128x128 "
                                     "blocks, 1x128 activation groups): our engine quantizes the language model online, vLLM runs a dummy "
                                     "checkpoint of the same published format, and the logits are checked against fp32 transformers on the "
                                     "round-tripped weights."),
    quantize_vision: bool = typer.Option(False, "--quantize-vision", help="With --quantization: our vision tower's linear layers in "
                                         "FP8 too (per channel); vLLM's checkpoint keeps its tower in bf16, as published ones do."),
    load_format: str = typer.Option("auto", "--load-format", help="dummy: our engine builds its random weights on the GPU in "
                                    "their final dtype (FP8 directly, no bf16 copy: qwen2_5_vl_72b on one H200); no generate() peer; "
                                    "logits checked only with --reference-layers."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="--no-reference (with --model): build no transformers "
                                   "model; our engine loads the checkpoint itself, as the product does (a pre-quantized one streamed "
                                   "from its files: a 72B FP8 checkpoint on one GPU); no generate() peer, no logit check."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="fp8: our engine's KV cache in e4m3 (per-tensor scale 1)."),
    json_out: Path = typer.Option(Path("bench-out/engine.json"), "--json", help="Where to write the figures (rewritten after every phase)."),
) -> None:
    """Requests/s and output tokens/s of W1/W2, ours next to generate() and vLLM with the ratios; logits vs transformers fp32; decode step vs roofline."""
    from vlmbatch.bench.engine import BenchOptions, run_bench
    from vlmbatch.bench.peers import PEERS
    from vlmbatch.bench.workloads import WORKLOADS

    peers = split(peer)
    for flag, given, known in (("--peer", peers, PEERS), ("--workloads", split(workloads), WORKLOADS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise typer.BadParameter(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}", param_hint=flag)
    if model is None:
        shape_or_exit(model_shape)
    from vlmbatch.bench.structured_w1 import bench_schema

    try:
        schema = bench_schema(structured, json_schema)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--structured / --json-schema") from None
    if quantization not in ("none", "fp8", "fp8-block"):
        raise typer.BadParameter("choose none, fp8 or fp8-block", param_hint="--quantization")
    if stage_media not in ("off", "on", "both"):
        raise typer.BadParameter("choose off, on or both", param_hint="--stage-media")
    if model is not None and not Path(model).is_dir():
        raise typer.BadParameter(f"no such model folder: {model}", param_hint="--model")
    if not reference and model is None:
        raise typer.BadParameter("needs --model: a checkpoint our engine loads itself", param_hint="--no-reference")
    if quantize_vision and quantization == "none":
        raise typer.BadParameter("needs --quantization fp8 or fp8-block", param_hint="--quantize-vision")
    options = BenchOptions(
        model_shape=model_shape, model=model, requests=requests, peers=peers, peer_requests_w1=peer_requests_w1,
        peer_requests_w2=peer_requests_w2, peer_batches=int_list(peer_batches, "--peer-batches"),
        vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, vllm_timeout_s=vllm_timeout,
        vllm_pythonpath=tuple(p for p in vllm_pythonpath.split(os.pathsep) if p), workloads=split(workloads),
        backends=split(backends), attention_backend=attention_backend, check_prompts=check_prompts, decode_steps=decode_steps,
        reference_layers=reference_layers,
        decode_batches=int_list(decode_batches, "--decode-batches"),
        extra_shapes=tuple(shape_or_exit(s).name for s in split(extra_shapes)),
        profile_batches=int_list(profile_batches, "--profile-batches", allow_empty=True), profile_prefill=profile_prefill,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, min_admission_batch=admission_batch,
        gpu_memory_utilization=gpu_memory_utilization, device=device, async_decode=async_decode, quantization=quantization,
        quantize_vision=quantize_vision, load_format=load_format, reference=reference, kv_cache_dtype=kv_cache_dtype,
        structured_schema=schema, mask_batches=int_list(mask_batches, "--mask-batches"), grammar_fill_threads=grammar_fill_threads,
        repeats=repeats, stage_media=stage_media,
    )
    json_out.parent.mkdir(parents=True, exist_ok=True)
    report = run_bench(options, echo=typer.echo, save=lambda partial: json_out.write_text(json.dumps(partial, indent=2)),
                       env=dict(os.environ))
    for phase, error in report["errors"].items():
        typer.echo(f"{phase} failed:\n{error}", err=True)
    typer.echo(f"wrote {json_out}")
    if not report["ok"] or report["errors"]:
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("engine")(bench_engine)
