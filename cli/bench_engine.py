"""`vlmbatch bench engine`: the paged engine against the `generate()` peer, plus logit checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def bench_engine(
    shape: str = typer.Option("3b", "--shape", help="Qwen2.5-VL shapes with random weights: 3b, 7b (or tiny for a CPU smoke run)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Real Qwen2.5-VL weights instead of random ones."),
    requests: int = typer.Option(1024, "--requests", help="Requests per workload on our engine."),
    peer_requests: int = typer.Option(128, "--peer-requests", help="Requests per workload on the generate() peer (it is slow)."),
    peer_batches: str = typer.Option("64,128", "--peer-batches", help="Static batch sizes of the peer on W1 (W2 runs the largest; '' skips the peer)."),
    workloads: str = typer.Option("w1,w2", "--workloads", help="w1 (128 output tokens), w2 (16..512 output tokens)."),
    backends: str = typer.Option("", "--backends", help="Attention backends to check (default: every available one)."),
    extra_shapes: str = typer.Option("7b", "--extra-shapes", help="Shapes that get the decode-step roofline only ('' for none)."),
    profile_batches: str = typer.Option("", "--profile-batches", help="Decode batch sizes whose kernels (and the vision tower) are profiled, e.g. 1,64."),
    max_num_seqs: int = typer.Option(512, "--max-num-seqs", help="Most sequences in one batch."),
    max_num_batched_tokens: int = typer.Option(16384, "--max-num-batched-tokens", help="Token budget of one prefill step."),
    admission_batch: int = typer.Option(64, "--admission-batch", min=1, help="Free slots before waiting requests join a running batch (1 = at once)."),
    gpu_memory_utilization: float = typer.Option(0.85, "--gpu-memory-utilization", help="Share of GPU memory for weights, activations and KV cache."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    async_decode: bool = typer.Option(True, "--async-decode/--sync-decode", help="Launch each decode step before reading the previous one's tokens (the engine's default), or await every step."),
    json_out: Path = typer.Option(Path("bench-engine.json"), "--json", help="Where to write the figures."),
) -> None:
    """Requests/s, output tokens/s, decode-step time and % of roofline, ours vs generate(); logits vs transformers fp32."""
    from vlmbatch.bench.engine import SHAPES, BenchOptions, run_bench

    if shape not in SHAPES:
        raise typer.BadParameter(f"choose one of {', '.join(SHAPES)}", param_hint="--shape")
    options = BenchOptions(
        shape=shape, model=model, requests=requests, peer_requests=peer_requests,
        peer_batches=tuple(int(b) for b in _split(peer_batches)), workloads=_split(workloads),
        backends=_split(backends), extra_shapes=_split(extra_shapes), profile_batches=tuple(int(b) for b in _split(profile_batches)),
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, min_admission_batch=admission_batch,
        gpu_memory_utilization=gpu_memory_utilization, device=device, async_decode=async_decode,
    )
    report = run_bench(options, echo=typer.echo, save=lambda partial: json_out.write_text(json.dumps(partial, indent=2)))
    for workload, figures in sorted(report.get("summary", {}).items()):
        speedup = f"{figures['speedup']:.1f}x the best peer" if figures["speedup"] else "no peer run"
        typer.echo(f"{workload}: {figures['paged_requests_per_s']:.1f} req/s, {speedup}")
    for phase, error in report["errors"].items():
        typer.echo(f"{phase} failed:\n{error}", err=True)
    typer.echo(f"wrote {json_out}")
    if not report["ok"] or report["errors"]:
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("engine")(bench_engine)
