"""`vlmbatch bench jpeg-w1`: is the GPU fed from real JPEGs? W1 three ways on one engine (issue #7's figure).

    vlmbatch bench jpeg-w1 [--model-shape 3b] [--rows 1024] [--json $OUT/gpu_jpeg_w1.json]
    vlmbatch bench jpeg-w1 --model-shape tiny --rows 16     # CPU smoke test of every step

W1 (`bench.workloads`): `--rows` requests, the same ones `vlmbatch bench engine` times
(its images, prompts and output lengths), on a model shape with random bf16 weights
(nothing is downloaded). One paged engine (the product's defaults) serves, in order:

1. pre-decoded: the requests as the engine benchmark feeds them (pixels ready in memory);
2. jpeg-gpu: the same requests as a Parquet file of their JPEGs through the in-process job path
   (`run_job_locally`: reader, preprocessing pool, engine, result part) with GPU decoding
   on: pool workers pass validated JPEG bytes, the engine decodes each step's images with
   nvJPEG and runs the processor on the device (`vlmbatch/engine/gpu_images.py`);
3. jpeg-cpu: the same file with GPU decoding off: the pool decodes and preprocesses.

Each is preceded by an untimed warm-up of 64 rows/requests (fewer if --rows is smaller)
(CUDA graphs, nvJPEG and the pool start are paid there: one preprocessing pool serves all
job runs, as in a `vlmbatch worker`). Each run prints where the engine's time went
(`EngineStats` phases) and the shards' timing lines (time idle waiting for rows). The
target: jpeg-gpu reaches >= 90% of pre-decoded requests/s (reported, not enforced). Without CUDA the jpeg-gpu run cannot happen (GPU decoding is
refused on a CPU engine) and is reported as skipped. Prints a table; writes the JSON
report (`--json`). Exits 1 if a run fails or a row errors.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

from vlmbatch.bench import adapt
from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.bench.scaling import say
from vlmbatch.bench.shapes import resolve_shape, save_random_checkpoint
from vlmbatch.bench.timing import run_engine
from vlmbatch.bench.workloads import W1_OUTPUT_TOKENS, Workload, build_workload, write_parquet

TARGET = 0.9
WARMUP_ROWS = 64
W1_SEED, WARMUP_SEED = 100, 99  # those of `vlmbatch bench engine`: the same requests


def pre_decoded(llm: Any, timed: Workload, warmup: Workload) -> dict[str, Any]:
    """The requests as the engine benchmark feeds them (pixels already made), on the job's engine."""
    dtype = llm.engine.runner.dtype
    llm.engine.block_manager.reset_prefix_cache()
    run_engine(llm.engine, adapt.engine_prompts(warmup, llm.adapter, dtype), [r.output_tokens for r in warmup.requests], "warmup")
    before = stats_now(llm)
    result = run_engine(llm.engine, adapt.engine_prompts(timed, llm.adapter, dtype), [r.output_tokens for r in timed.requests], "w1")
    return {"requests": result.requests, "seconds": result.seconds, "output_tokens": result.output_tokens, "phases": phases(llm, before)}


def phases(llm: Any, before: dict[str, float]) -> dict[str, float]:
    """The engine's phase seconds and step counts since `before` (a `stats_now` snapshot)."""
    now = stats_now(llm)
    return {k: round(now[k] - before[k], 3) for k in now}


def stats_now(llm: Any) -> dict[str, float]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(llm.engine.stats).items() if k.endswith("_s") or k.endswith("_steps")}


def job_run(llm: Any, model: Path, dataset: Path, warmup: Path, out: Path, mode: str, preparer: Any) -> dict[str, Any]:
    """W1 from JPEG Parquet through `run_job_locally` with GPU decoding `mode` (a warm-up job first)."""
    import pyarrow.parquet as pq

    from vlmbatch import job as jobs
    from vlmbatch.engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=W1_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    adapt.clear_encoder_cache(llm.engine)  # each run starts cold, and its cache shows which path it took
    llm.engine.block_manager.reset_prefix_cache()
    seconds, before = 0.0, stats_now(llm)
    for name, path in (("warmup", warmup), ("timed", dataset)):
        before = stats_now(llm)
        manifest, job_dir = jobs.plan_job(path, str(model), out / f"{mode}-{name}", engine="paged",
                                          sampling=sampling, shard_size=100_000)  # fmt: skip
        manifest.extra["gpu_image_decode"] = mode
        manifest.save()
        seconds = jobs.run_job_locally(manifest, job_dir, llm, preparer, show_progress=False)
    table = pq.read_table(job_dir / "results")
    errors = [e for e in table.column("error").to_pylist() if e]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed in the {mode} job, e.g. {errors[0]}")
    # Deferred images are cached under their bytes' hash ("jpeg:..."): proof the engine decoded them.
    gpu_decoded = sum(key.startswith("jpeg:") for key in adapt.encoder_cache_keys(llm.engine))
    if (mode == "on") != (gpu_decoded > 0):
        raise RuntimeError(f"GPU decoding {mode} but {gpu_decoded} engine-decoded images in the encoder cache")
    generated = table.column("num_generated_tokens").to_pylist()
    if set(generated) != {W1_OUTPUT_TOKENS}:
        raise RuntimeError(f"rows generated {sorted(set(generated))} tokens, not {W1_OUTPUT_TOKENS}")
    return {"requests": table.num_rows, "seconds": seconds, "output_tokens": sum(generated),
            "prompt_tokens": table.column("num_input_tokens").to_pylist()[0], "phases": phases(llm, before)}


def run(shape: str, rows: int, workdir: Path, json_out: Path, worker: WorkerConfig, media: MediaConfig) -> bool:
    """The three runs; False if one failed."""
    import torch

    from vlmbatch import job as jobs
    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.gpu_images import defers_image_decoding
    from vlmbatch.job.preparer import RowPreparer

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("vlmbatch.job.shard").setLevel(logging.INFO)  # its "shard timing" lines

    cuda = torch.cuda.is_available()
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"shape": shape, "rows": rows, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "preprocess_workers": worker.preprocess_workers,
                              "cpu_count": os.cpu_count(), "runs": {}}  # fmt: skip
    ok = True
    try:
        model = save_random_checkpoint(resolve_shape(shape), workdir)
        llm = jobs.load_llm(str(model), EngineConfig(engine="paged", dtype="bfloat16" if cuda else "float32",
                                                     device="cuda" if cuda else "cpu"))
        timed = build_workload("w1", llm.adapter, rows, seed=W1_SEED)
        warmup_requests = build_workload("w1", llm.adapter, min(WARMUP_ROWS, rows), seed=WARMUP_SEED)
        dataset = write_parquet(timed, workdir / "w1-jpeg.parquet")
        warmup = write_parquet(warmup_requests, workdir / "w1-jpeg-warmup.parquet")
        say(f"datasets: {rows} + {len(warmup_requests.requests)} warm-up rows of distinct JPEGs, {timed.prompt_tokens}-token prompts")
        runs = report["runs"]
        runs["pre-decoded"] = pre_decoded(llm, timed, warmup_requests)
        say(f"pre-decoded: {runs['pre-decoded']}")
        preparer = RowPreparer(worker, media)
        try:
            if defers_image_decoding(llm.engine, "auto"):
                runs["jpeg-gpu"] = job_run(llm, model, dataset, warmup, workdir / "jobs", "on", preparer)
                say(f"jpeg-gpu: {runs['jpeg-gpu']}")
            else:
                say("jpeg-gpu: skipped (GPU decoding needs the paged engine on CUDA)")
            runs["jpeg-cpu"] = job_run(llm, model, dataset, warmup, workdir / "jobs", "off", preparer)
            say(f"jpeg-cpu: {runs['jpeg-cpu']}")
        finally:
            preparer.close()
    except Exception:  # report what ran, then fail
        traceback.print_exc()
        report["error"] = traceback.format_exc(limit=3)
        ok = False
    base = report["runs"].get("pre-decoded")
    print(f"\n{'run':<12} {'requests':>8} {'seconds':>8} {'req/s':>8} {'out tok/s':>10} {'vs pre-decoded':>15}")
    for name, run in report["runs"].items():
        run["requests_per_s"] = run["requests"] / run["seconds"]
        run["output_tokens_per_s"] = run["output_tokens"] / run["seconds"]
        ratio = run["requests_per_s"] / base["requests_per_s"] if base else float("nan")
        run["ratio_to_pre_decoded"] = ratio
        print(f"{name:<12} {run['requests']:>8} {run['seconds']:>8.1f} {run['requests_per_s']:>8.2f} "
              f"{run['output_tokens_per_s']:>10.0f} {ratio:>14.1%}")  # fmt: skip
    gpu = report["runs"].get("jpeg-gpu")
    if gpu:
        report["target_met"] = gpu["ratio_to_pre_decoded"] >= TARGET
        print(f"target: jpeg-gpu >= {TARGET:.0%} of pre-decoded: {'met' if report['target_met'] else 'NOT met'}")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(report, indent=2))
    say(f"wrote {json_out}")
    return ok
