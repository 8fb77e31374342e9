"""`vlmbatch bench media`: images/s of decode + resize + normalise of 1080p JPEGs to a
model's input, per path (see docs/preprocessing.md). Every path ends in the
same tensors, the model's own image processor output (Qwen2-VL's, with a pixel budget of
side x side: 448 -> 200,704 pixels, i.e. 336 x 588 patches for a 16:9 picture):
- `pillow`: one process, Pillow decode (`load_image`) + the processor, image by image: the
  usual single-threaded loop and the peer;
- `cpu_pool/N`: the same per image in N worker processes of `ProcessPool` (the job's
  preprocessing pool), tensors pickled back to this process as the job receives them;
- `gpu`: nvJPEG batch decode + the processor on the GPU (`preprocess_images`).
The GPU path is also checked against the CPU path's tensors (IDCT rounding tolerance).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from vlmbatch.job.preparer import PRELOAD, use_one_thread
from vlmbatch.job.process_pool import ProcessPool, Task
from vlmbatch.media.gpu_image import GPU_MAX_ABS_DIFF, GPU_MEAN_ABS_DIFF, preprocess_images


@dataclass
class PathResult:
    path: str
    workers: int
    images: int
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


@dataclass
class MediaBenchReport:
    side: int
    source: str
    results: list[PathResult] = field(default_factory=list)
    gpu_parity: dict[str, float] | None = None
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        parity = self.gpu_parity
        return parity is None or (parity["max_abs_diff"] <= GPU_MAX_ABS_DIFF and parity["mean_abs_diff"] <= GPU_MEAN_ABS_DIFF)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, result in zip(data["results"], self.results):
            row["images_per_s"] = round(result.images_per_s, 1)
        data["ok"] = self.ok
        return data


def make_jpegs(count: int = 16, width: int = 1920, height: int = 1080) -> list[bytes]:
    """Distinct 1080p JPEGs (quality 90) of a noisy gradient: photo-like sizes (~1 MB)."""
    from vlmbatch.testing.data import encode_image, make_image

    return [encode_image(make_image(width, height, seed=seed), "JPEG", quality=90) for seed in range(count)]


def image_processor(side: int) -> Any:
    """Qwen2-VL's image processor with a pixel budget of side x side (torch backend)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=side * side, max_pixels=side * side)


def _cpu_preprocessor(side: int) -> Callable[[Task], torch.Tensor]:
    """Worker setup and single-process path alike: Pillow decode + the processor, one image."""
    from vlmbatch.media.image import load_image

    processor = image_processor(side)

    def preprocess(task: Task) -> torch.Tensor:
        return processor(images=[load_image(task[1])], return_tensors="pt")["pixel_values"]

    return preprocess


def _pool_preprocessor(side: int) -> Callable[[Task], torch.Tensor]:
    use_one_thread()  # as the job's pool workers do
    return _cpu_preprocessor(side)


def _cycle(jpegs: list[bytes], count: int) -> Iterator[Task]:
    return ((index, jpegs[index % len(jpegs)]) for index in range(count))


def time_pillow(jpegs: list[bytes], side: int, count: int) -> PathResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one process, one thread: the loop the issue is about
    try:
        preprocess = _cpu_preprocessor(side)
        preprocess((0, jpegs[0]))
        start = time.perf_counter()
        for task in _cycle(jpegs, count):
            preprocess(task)
        return PathResult("pillow", 1, count, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def _no_failure(task: Task, error_type: str, message: str) -> None:
    raise RuntimeError(f"benchmark image {task[0]} failed: {error_type}: {message}")


def time_cpu_pool(jpegs: list[bytes], side: int, count: int, workers: int) -> PathResult:
    with ProcessPool(_pool_preprocessor, side, _no_failure, workers, max_pending=4 * workers, preload=PRELOAD) as pool:
        for _ in pool.imap_unordered(_cycle(jpegs, 2 * workers)):  # every worker loaded and warm
            pass
        start = time.perf_counter()
        for _ in pool.imap_unordered(_cycle(jpegs, count)):
            pass
        return PathResult("cpu_pool", workers, count, time.perf_counter() - start)


def time_gpu(jpegs: list[bytes], side: int, count: int, batch: int = 64) -> PathResult:
    processor = image_processor(side)
    preprocess_images(jpegs[:batch], processor, device="cuda")  # nvJPEG handles and kernels warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, count, batch):
        datas = [jpegs[index % len(jpegs)] for index in range(first, min(count, first + batch))]
        preprocess_images(datas, processor, device="cuda")
    torch.cuda.synchronize()
    return PathResult("gpu", 0, count, time.perf_counter() - start)


def gpu_parity(jpegs: list[bytes], side: int) -> dict[str, float]:
    """Largest and mean |GPU - CPU| over the processor outputs of `jpegs`."""
    cpu = _cpu_preprocessor(side)
    gpu = preprocess_images(jpegs, image_processor(side), device="cuda")
    diffs = [(out["pixel_values"].float().cpu() - cpu((i, data))).abs() for i, (data, out) in enumerate(zip(jpegs, gpu))]
    return {
        "max_abs_diff": max(float(d.max()) for d in diffs),
        "mean_abs_diff": float(torch.cat([d.flatten() for d in diffs]).mean()),
        "images": len(jpegs),
    }


def worker_counts(max_workers: int | None) -> list[int]:
    """1, 2, 4, ... up to the usable cores (or `max_workers`), the top count always included."""
    top = max_workers or len(os.sched_getaffinity(0))
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n < top]
    return counts + [top]


def run_media_bench(
    side: int = 448,
    images: int = 256,
    max_workers: int | None = None,
    gpu: bool | None = None,
    log: Callable[[str], None] = print,
) -> MediaBenchReport:
    """Time every path on `images` 1080p JPEGs; `gpu=None` includes the GPU when there is one."""
    jpegs = make_jpegs()
    use_gpu = torch.cuda.is_available() if gpu is None else gpu
    report = MediaBenchReport(
        side=side,
        source=f"{len(jpegs)} distinct 1920x1080 JPEGs, {sum(map(len, jpegs)) // len(jpegs) // 1000} kB average",
        machine={"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                 "cores": len(os.sched_getaffinity(0)),
                 "gpu": torch.cuda.get_device_name() if use_gpu else None},  # fmt: skip
    )
    if use_gpu:
        report.gpu_parity = gpu_parity(jpegs[:8], side)
        log(f"gpu parity: {report.gpu_parity}")
        report.results.append(time_gpu(jpegs, side, images * 4))
        log(f"gpu: {report.results[-1].images_per_s:.0f} images/s")
    report.results.append(time_pillow(jpegs, side, max(16, images // 8)))
    log(f"pillow: {report.results[-1].images_per_s:.0f} images/s")
    for workers in worker_counts(max_workers):
        report.results.append(time_cpu_pool(jpegs, side, images, workers))
        log(f"cpu_pool/{workers}: {report.results[-1].images_per_s:.0f} images/s")
    return report


def run(side: int, images: int, max_workers: int | None, gpu: bool | None, memory_rows: int | None, output: Path) -> bool:
    """The command: the pool-memory probe (`memory_rows`) or every path's throughput; prints a
    table, writes `output`; False on a GPU/CPU pixel mismatch."""
    err = Console(stderr=True)
    if memory_rows is not None:
        result = pool_memory(memory_rows, max_workers)
        Console().print_json(data=result)
        _write(output, {"benchmark": "media_pool_memory", **result})
        err.print(f"wrote {output}")
        return True
    report = run_media_bench(side, images, max_workers, gpu, log=err.print)
    table = Table(title=f"media preprocessing: 1080p JPEG -> {side}x{side} pixel budget ({report.source})")
    for column in ("path", "processes", "images", "images/s", "vs pillow"):
        table.add_column(column, justify="right")
    pillow = next(r for r in report.results if r.path == "pillow").images_per_s
    for r in report.results:
        workers = str(r.workers) if r.workers else "-"
        table.add_row(r.path, workers, str(r.images), f"{r.images_per_s:.0f}", f"{r.images_per_s / pillow:.1f}x")
    Console().print(table)
    if report.gpu_parity is not None:
        verdict = "ok" if report.ok else "MISMATCH"
        err.print(f"GPU vs CPU pixel_values: {json.dumps(report.gpu_parity)} -> {verdict}")
    _write(output, {"benchmark": "media", **report.to_dict()})
    err.print(f"wrote {output}")
    return report.ok


def _write(output: Path, data: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=2) + "\n")


def _rss_mb() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def _qwen_prompt_parquet(source: Any, target: Any) -> Any:
    """`source` (write_large_parquet) with raw Qwen prompts that hold the image placeholder,
    so every row goes through the processor; rewritten row group by row group (flat memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmbatch.families.qwen2_vl.adapter import Qwen2VLAdapter

    prompt = (f"<|im_start|>user\n{Qwen2VLAdapter.image_placeholder}What is in this picture?<|im_end|>\n"
              "<|im_start|>assistant\n")  # fmt: skip
    data = pq.ParquetFile(source)
    with pq.ParquetWriter(target, data.schema_arrow) as writer:
        for group in range(data.num_row_groups):
            table = data.read_row_group(group)
            prompts = pa.array([prompt] * table.num_rows, pa.string())
            writer.write_table(table.set_column(table.schema.get_field_index("prompt"), "prompt", prompts))
    return target


def pool_memory(rows: int, workers: int | None = None, workdir: str | None = None) -> dict[str, Any]:
    """RSS of this process (the consumer that holds the prepared rows) while `rows` rows of a
    generated Parquet file (64x64 PNGs, raw Qwen prompts, the tiny Qwen2.5-VL processor) go
    through a `RowPreparer`: sampled every 500 rows, so a flat maximum across row
    counts means the pool does not accumulate rows.
    """
    import tempfile

    from vlmbatch.config import MediaConfig, WorkerConfig
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.io.manifest import Manifest
    from vlmbatch.io.readers import open_dataset
    from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer
    from vlmbatch.testing.data import write_large_parquet
    from vlmbatch.testing.tiny import make_tiny_model

    folder = Path(workdir or tempfile.mkdtemp(prefix="vlmbatch-pool-memory-"))
    model = make_tiny_model(folder / "model", "qwen2_5_vl")
    generated = write_large_parquet(folder / "generated.parquet", rows)
    reader = open_dataset(_qwen_prompt_parquet(generated, folder / "rows.parquet"))
    generated.unlink()
    manifest = Manifest.for_dataset(reader, output_dir=folder / "out", model=str(model), engine="hf",
                                    sampling={"max_tokens": 4}, shard_size=rows)  # fmt: skip
    source = (row for batch in reader.iter_rows() for row in batch)
    preparer = RowPreparer(WorkerConfig(preprocess_workers=workers), MediaConfig())
    workers = preparer.num_workers
    rss_before, rss_max, failed = _rss_mb(), 0, 0
    start = time.perf_counter()
    preparation = RowPreparation.for_job(manifest, AdapterSpec(str(model)), SamplingParams(max_tokens=4), MediaConfig())
    with preparer:
        for count, item in enumerate(preparer.prepare(source, preparation), start=1):
            failed += item.error is not None
            if count % 500 == 0:
                rss_max = max(rss_max, _rss_mb())
    seconds = time.perf_counter() - start
    return {
        "rows": rows,
        "failed_rows": failed,
        "workers": workers,
        "rows_per_s": round(rows / seconds, 1),
        "rss_before_mb": rss_before,
        "rss_max_during_mb": rss_max,
    }
