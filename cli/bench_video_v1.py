"""`vlmbatch bench video-v1`: V1 (Qwen3-VL on 16-frame samples of 60 s 720p h264 clips) through the job path, against vLLM and generate(); `vlmbatch bench make-clips`: its clips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from vlmbatch.cli.bench_options import int_list, model_shape_option, shape_or_exit, split


def bench_video_v1(
    model_shape: str = model_shape_option("qwen3_vl_8b"),
    clips: Path = typer.Option(Path("bench-out/v1-clips"), "--clips", help="Folder of the clips (`vlmbatch bench make-clips`); "
                               "made here first when it has none and ffmpeg exists."),
    requests: int = typer.Option(256, "--requests", min=1, help="Timed requests (rows) on our engine and on vLLM."),
    frames: int = typer.Option(16, "--frames", min=2, help="Frames sampled uniformly over each clip."),
    output_tokens: int = typer.Option(128, "--output-tokens", min=1, help="Tokens generated per request (EOS ignored)."),
    warmup: int = typer.Option(8, "--warmup", min=1, help="Warm-up requests on our engine and on vLLM."),
    peer: str = typer.Option("vllm,hf", "--peer", help="Peers in the same run: vllm, hf (generate()); '' for none. "
                             "A peer that cannot run here is reported as skipped, with why."),
    ours: bool = typer.Option(True, "--ours/--no-ours", help="Time our engine (--no-ours: the peers only, e.g. generate() in a second call)."),
    vllm_pythonpath: str = typer.Option("", "--vllm-pythonpath", help="PYTHONPATH of the vLLM child instead of ours (e.g. /tmp/site-vllm)."),
    vllm_timeout: float = typer.Option(420, "--vllm-timeout", help="Seconds the vLLM child may run (load, warm-up, timed runs)."),
    vllm_gpu_memory_utilization: float = typer.Option(0.85, "--vllm-gpu-memory-utilization", help="vLLM's share of GPU memory."),
    vllm_decode_threads: int = typer.Option(4, "--vllm-decode-threads", min=0, help="Threads of the vLLM child decoding clips "
                                            "ahead of its frontend (0: each in the frontend as it takes the prompt, as LLM.chat does)."),
    vllm_omp_threads: int = typer.Option(0, "--vllm-omp-threads", min=0, help="OMP_NUM_THREADS of the vLLM child: the torch "
                                         "threads of its video processor (0: unset, vLLM's default of 1)."),
    vllm_modes: str = typer.Option("files", "--vllm-modes", help="files (decoded in the timed call), predecoded (decoded before it)."),
    hf_requests: int = typer.Option(64, "--hf-requests", min=1, help="Rows timed on the generate() peer."),
    hf_batches: str = typer.Option("32", "--hf-batches", help="generate() static batch sizes, each warmed up with a full batch."),
    gpu_memory_utilization: float = typer.Option(0.85, "--gpu-memory-utilization", help="Our engine's share of GPU memory."),
    max_num_batched_tokens: int = typer.Option(16384, "--max-num-batched-tokens", min=1, help="Our engine's token budget of one prefill step."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Model folder, datasets and job outputs (default: a temporary folder)."),
    json_out: Path = typer.Option(Path("bench-out/video_v1.json"), "--json", help="Where to write the figures (after every phase)."),
) -> None:
    """Requests/s of V1 on our job path from video files, vLLM decoding the same files, and generate(), with every fairness check."""
    from vlmbatch.bench.video_v1 import V1Options, find_clips, make_clips, run
    from vlmbatch.config import MediaConfig, WorkerConfig

    shape_or_exit(model_shape)
    peers = split(peer)
    unknown = [p for p in peers if p not in ("vllm", "hf")]
    modes = split(vllm_modes)
    if unknown:
        raise typer.BadParameter(f"unknown {', '.join(unknown)}; choose from vllm, hf", param_hint="--peer")
    if not modes or any(m not in ("files", "predecoded") for m in modes):
        bad = [m for m in modes if m not in ("files", "predecoded")]
        raise typer.BadParameter(f"unknown {', '.join(bad) or 'none given'}; choose files and/or predecoded", param_hint="--vllm-modes")
    try:
        find_clips(clips)
    except FileNotFoundError:
        typer.echo(f"no clips in {clips}: making them")
        make_clips(clips)
    options = V1Options(
        model_shape=model_shape, clips=clips, workdir=workdir, requests=requests, frames=frames, output_tokens=output_tokens,
        warmup=warmup, peers=peers, ours=ours, vllm_pythonpath=tuple(p for p in vllm_pythonpath.split(os.pathsep) if p),
        vllm_timeout_s=vllm_timeout, vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
        vllm_decode_threads=vllm_decode_threads, vllm_modes=modes, hf_requests=hf_requests,
        hf_batches=int_list(hf_batches, "--hf-batches"), gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens, device=device,
    )
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(vllm_omp_threads)} if vllm_omp_threads else {}))  # the vLLM child's
    if not run(options, json_out, MediaConfig.from_env(os.environ), WorkerConfig.from_env(os.environ), env):
        raise typer.Exit(1)


def bench_make_clips(
    directory: Path = typer.Argument(Path("bench-out/v1-clips"), help="Where the clips and their clips.json go."),
    count: int = typer.Option(4, "--count", min=1, help="Distinct clips (each hue-rotated)."),
    crf: int = typer.Option(32, "--crf", min=0, max=51, help="libx264 quality: 32 puts four 60 s 720p clips in ~24 MiB."),
    seconds: float = typer.Option(60, "--seconds", min=1, help="Clip length."),
    size: str = typer.Option("1280x720", "--size", help="Clip size WxH."),
    fps: int = typer.Option(30, "--fps", min=1, help="Frames per second."),
) -> None:
    """Write V1's h264 clips (FFmpeg's testsrc2 pattern) with ffmpeg, to carry to the GPU machine."""
    from vlmbatch.bench.video_v1 import make_clips

    try:
        make_clips(directory, count, crf, seconds, size, fps, echo=typer.echo)
    except RuntimeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("video-v1")(bench_video_v1)
    bench_app.command("make-clips")(bench_make_clips)
