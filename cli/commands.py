"""The `vlmbatch` app: every command module is imported and registers its commands on it."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="vlmbatch",
    help="Batch-offline inference for vision-language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: print a table and write JSON (see BENCHMARKS.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Top-level command groups, then the benchmark groups; each module has `register(...)`.
COMMAND_MODULES = ["submit_cmd", "results_cmd", "tiny_cmd", "queue_cmds", "serve_cmd"]
BENCH_MODULES = [
    "bench_engine", "bench_decode_variants", "bench_jpeg_w1", "bench_kernels", "bench_video", "bench_video_gpu", "bench_media",
    "bench_queue", "bench_serve", "bench_scaling", "bench_dryrun", "bench_structured", "bench_moe", "bench_sampling", "bench_step_inputs",
    "bench_tower", "bench_video_v1", "bench_checkpoint",
]

for names, target in ((COMMAND_MODULES, app), (BENCH_MODULES, bench_app)):
    for name in names:
        importlib.import_module(f"vlmbatch.cli.{name}").register(target)
