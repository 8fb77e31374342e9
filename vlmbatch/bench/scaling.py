"""`vlmbatch bench scaling`: does the queue scale across GPUs? Two workers (one per GPU) on one job against one.

    vlmbatch bench scaling [--model-shape 3b] [--rows 2048] [--redis-server .whl/redis/redis-server] [--json $OUT/scaling.json]

Everything is real: a private `redis-server` on 127.0.0.1, `vlmbatch worker` commands,
`vlmbatch submit` and `vlmbatch wait`. The model is the chosen shape's folder
(`bench.shapes`) with random bf16 weights (nothing is downloaded); the dataset is W1
(`bench.workloads`: one distinct 448x448 JPEG per row, 288-token prompts, 128 output
tokens), so no row can reuse another row's prefix or encoder output.

Run A starts the workers of `--gpus-a` (default `0`), run B those of `--gpus-b` (default
`0,1`: two processes of one command); each run waits until every worker process is
consuming, runs an untimed warm-up job (one shard per process, other rows: compilation
and allocator growth are paid there, not in the figure), then times a fresh job over the
dataset from the moment it is queued to its last committed part, and stops its workers,
so run B starts with empty caches too. Without CUDA both runs use CPU workers (B: two
`--gpus cpu` commands) for a smoke test with `--shape tiny`.

Where each shard's time went comes from the `shard timing` line every worker process logs
per shard (vlmbatch/job/shard.py): per process, rows/s, the seconds its engine sat idle
waiting for prepared rows, the seconds in engine steps, the rest (result rows, part
writes, queue hand-over), its preprocessing pool's size and how many pools it started
during the job (0: the pool it started with served every shard, as it should).
Preprocessing pools take the product's default size (each GPU worker's share of the
cores, less two for its engine) unless `--preprocess-workers` is given.

Prints timestamped progress and tables; writes the JSON report (`--json`). Exits 1 when
a run fails (a worker dies, a row errors, the job does not complete); the 1.9x target
is reported, not enforced.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmbatch.bench.workloads import W1_OUTPUT_TOKENS

TARGET_RATIO = 1.9
VLMBATCH = [sys.executable, "-m", "vlmbatch.cli"]
STARTED = time.monotonic()
SUCCEEDED = re.compile(r"^\[(?P<stamp>[\d-]+ [\d:]+),\d+: INFO/\w+\] Task \S+ succeeded in (?P<seconds>[\d.]+)s", re.M)
SHARD_TIMING = re.compile(r"shard timing: (?P<fields>.*)$", re.M)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


# ---- model and data -------------------------------------------------------------------
def build_model(shape: str, workdir: Path) -> Path:
    """The shape's folder with random bf16 weights on disk (the workers load it)."""
    from vlmbatch.bench.shapes import resolve_shape, save_random_checkpoint

    path = save_random_checkpoint(resolve_shape(shape), workdir)
    say(f"model {path} ({shape})")
    return path


def device_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def in_child(function: Any, *args: Any) -> Any:
    """Run `function` in a fresh process, so this one never holds GPU memory or a CUDA
    context that the workers' memory sizing would see on GPU 0."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def write_dataset(model: Path, path: Path, rows: int, seed: int) -> Path:
    """`rows` W1 requests (`bench.workloads`, images seeded by `seed`) as Parquet job rows."""
    from vlmbatch.bench.workloads import build_workload, write_parquet
    from vlmbatch.families.registry import load_adapter

    workload = build_workload("w1", load_adapter(str(model)), rows, seed)
    write_parquet(workload, path)
    say(f"dataset {path}: {rows} rows of {workload.prompt_tokens}-token prompts, {path.stat().st_size / 2**20:.1f} MiB")
    return path


# ---- redis and workers ----------------------------------------------------------------
class PrivateRedis:
    """`redis-server` from a given path (its libraries beside it), no persistence."""

    def __init__(self, binary: Path, log: Path, env: dict[str, str]):
        from vlmbatch.workers.local import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        env = dict(env, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")])))
        cmd = [str(binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        import redis

        from vlmbatch.workers.local import wait_until

        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                return bool(redis.Redis.from_url(self.url, socket_connect_timeout=1).ping())
            except redis.RedisError:
                return False

        wait_until(answers, 30, "redis-server to answer")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@dataclass
class Worker:
    """One `vlmbatch worker --gpus SPEC` command and when each of its processes got ready."""

    gpus: str
    log: Path
    process: subprocess.Popen[bytes]
    started: float
    ready_after: list[float] = field(default_factory=list)

    @property
    def expected(self) -> int:
        return len(self.gpus.split(","))

    def poll_ready(self) -> bool:
        """Celery logs `ready.` once a process consumes; the model is loaded before that."""
        seen = self.log.read_bytes().count(b" ready.")
        while len(self.ready_after) < seen:
            self.ready_after.append(time.monotonic() - self.started)
        return seen >= self.expected

    def shard_seconds(self, since: float) -> list[float]:
        """Run time of each shard this command's processes finished after `since` (epoch s),
        from Celery's `succeeded in` lines: shows imbalance or a per-shard slowdown."""
        found = []
        for match in SUCCEEDED.finditer(self.log.read_text(errors="replace")):
            stamp = time.mktime(time.strptime(match["stamp"], "%Y-%m-%d %H:%M:%S"))
            if stamp + 1 >= since:
                found.append(round(float(match["seconds"]), 2))
        return found

    def shard_timings(self, job_id: str) -> list[dict[str, Any]]:
        """The `shard timing` lines this command's processes logged for `job_id`."""
        found = []
        for match in SHARD_TIMING.finditer(self.log.read_text(errors="replace")):
            fields = dict(pair.split("=", 1) for pair in match["fields"].split())
            if fields.get("job") == job_id:
                found.append({k: v if k in ("job", "gpu") else float(v) for k, v in fields.items()})
        return found

    def stop(self) -> None:
        """SIGTERM to the command (it forwards it once to each process), then force."""
        import psutil

        if self.process.poll() is not None:
            return
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            say(f"worker --gpus {self.gpus} ignored SIGTERM for 60 s: killing it")
            self.process.kill()
            self.process.wait()
        for child in children:
            if child.is_running():
                child.kill()


def start_worker(model: Path, broker: str, gpus: str, dtype: str, log: Path, env: dict[str, str]) -> Worker:
    cmd = VLMBATCH + ["worker", "--model", str(model), "--broker", broker, "--gpus", gpus, "--dtype", dtype]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Worker(gpus, log, process, time.monotonic())


def check_alive(workers: list[Worker]) -> None:
    for worker in workers:
        if worker.process.poll() is not None:
            raise RuntimeError(f"worker --gpus {worker.gpus} exited with {worker.process.returncode}; see {worker.log}")


def wait_workers_ready(workers: list[Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all([w.poll_ready() for w in workers]):
        check_alive(workers)
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not ready after {timeout:.0f} s; see {[str(w.log) for w in workers]}")
        time.sleep(0.2)


# ---- jobs -----------------------------------------------------------------------------
def run_job(dataset: Path, model: Path, broker: str, output: Path, shard_size: int, workers: list[Worker],
            env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Submit, time from queued to the last committed part, confirm with `vlmbatch wait`,
    and total the results."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from vlmbatch.io.manifest import Manifest, results_dir
    from vlmbatch.job.parts import committed_shards
    from vlmbatch.job.queue import job_status

    cmd = VLMBATCH + ["submit", str(dataset), "--model", str(model), "--broker", broker, "--output", str(output),
                      "--shard-size", str(shard_size), "--max-tokens", str(W1_OUTPUT_TOKENS)]
    submitted = time.monotonic()
    submit = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert submit.stdout is not None
    job_id = submit.stdout.readline().strip()
    queued, queued_epoch = time.monotonic(), time.time()  # the id is printed after planning, just before the shards are queued
    _, submit_err = submit.communicate(timeout=120)
    if submit.returncode != 0 or not job_id:
        raise RuntimeError(f"vlmbatch submit failed ({submit.returncode}): {submit_err}")
    manifest = Manifest.load(output / job_id)
    deadline = queued + timeout
    last_status = time.monotonic()
    while len(committed_shards(manifest)) < manifest.num_shards:
        check_alive(workers)
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} not done after {timeout:.0f} s")
        if time.monotonic() - last_status > 2:  # a shard that raised is not retried: stop at once
            last_status = time.monotonic()
            status = job_status(output / job_id, broker)
            if status.state == "failed":
                raise RuntimeError(f"job {job_id} failed: {status.errors}; see {[str(w.log) for w in workers]}")
        time.sleep(0.05)
    done = time.monotonic()
    waited = subprocess.run(VLMBATCH + ["wait", job_id, "--output", str(output), "--broker", broker],
                            env=env, capture_output=True, text=True, timeout=120)
    if waited.returncode != 0:
        raise RuntimeError(f"vlmbatch wait {job_id} exited {waited.returncode}: {waited.stderr[-2000:]}")
    table = pq.read_table(results_dir(output / job_id), columns=["error_type", "num_input_tokens", "num_generated_tokens"])
    failed = table.num_rows - pc.sum(pc.is_null(table["error_type"]).cast("int64")).as_py()
    if table.num_rows != manifest.num_rows or failed:
        errors = pc.unique(table["error_type"].drop_null()).to_pylist()
        raise RuntimeError(f"job {job_id}: {table.num_rows}/{manifest.num_rows} rows, {failed} failed ({errors})")
    seconds = done - queued
    return {
        "job_id": job_id,
        "rows": table.num_rows,
        "shards": manifest.num_shards,
        "seconds": seconds,
        "seconds_with_submit": done - submitted,
        "rows_per_s": table.num_rows / seconds,
        "generated_tokens": pc.sum(table["num_generated_tokens"]).as_py(),
        "input_tokens_mean": pc.mean(table["num_input_tokens"]).as_py(),
        "shard_seconds_by_command": [w.shard_seconds(queued_epoch) for w in workers],
        "per_process": per_process([t for w in workers for t in w.shard_timings(job_id)]),
    }


def per_process(timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shard timings summed per worker process: where its time went."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for timing in timings:
        by_pid.setdefault(int(timing["pid"]), []).append(timing)
    summary = []
    for pid, shards in sorted(by_pid.items()):
        total = {key: sum(s[key] for s in shards) for key in ("rows", "seconds", "idle_for_rows", "engine")}
        summary.append({
            "pid": pid,
            "gpu": shards[0]["gpu"],
            "shards": len(shards),
            "rows": int(total["rows"]),
            "shard_seconds": round(total["seconds"], 2),
            "rows_per_s": round(total["rows"] / total["seconds"], 2) if total["seconds"] else 0.0,
            "idle_for_rows_s": round(total["idle_for_rows"], 2),
            "engine_s": round(total["engine"], 2),
            "other_s": round(total["seconds"] - total["idle_for_rows"] - total["engine"], 2),
            "pool_workers": int(shards[-1]["pool_workers"]),
            "pool_starts": int(sum(s["pool_starts"] for s in shards)),
            "worker_restarts": int(sum(s["worker_restarts"] for s in shards)),
        })
    return summary


def run_config(label: str, gpus: list[str], model: Path, broker: str, dtype: str, datasets: tuple[Path, Path],
               shard_size: int, workdir: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Start the workers, warm them up, time the job, stop them."""
    say(f"run {label}: starting workers {['--gpus ' + g for g in gpus]}")
    workers = [start_worker(model, broker, spec, dtype, workdir / f"worker-{label}-{i}.log", env) for i, spec in enumerate(gpus)]
    try:
        wait_workers_ready(workers, timeout)
        startup = [round(s, 1) for w in workers for s in w.ready_after]
        say(f"run {label}: {len(startup)} worker processes consuming; start-up s {startup}")
        warmup, timed = datasets
        warm = run_job(warmup, model, broker, workdir / "out", shard_size, workers, env, timeout)
        say(f"run {label}: warm-up job {warm['job_id']} done in {warm['seconds']:.1f} s")
        result = run_job(timed, model, broker, workdir / "out", shard_size, workers, env, timeout)
        say(f"run {label}: job {result['job_id']}: {result['rows']} rows in {result['seconds']:.1f} s = "
            f"{result['rows_per_s']:.2f} rows/s, {result['generated_tokens']} generated tokens; "
            f"shard seconds per worker command {result['shard_seconds_by_command']}")
        for p in result["per_process"]:
            say(f"run {label}: process {p['pid']} (gpu {p['gpu']}): {p['shards']} shards, {p['rows']} rows, "
                f"{p['rows_per_s']:.2f} rows/s; idle for rows {p['idle_for_rows_s']:.2f} s, engine {p['engine_s']:.1f} s, "
                f"other {p['other_s']:.2f} s; pool {p['pool_workers']} processes, {p['pool_starts']} starts, "
                f"{p['worker_restarts']} restarts")
    finally:
        for worker in workers:
            worker.stop()
    return dict(result, gpus=gpus, processes=len(startup), startup_s=startup, warmup_s=warm["seconds"])


# ---- main -----------------------------------------------------------------------------
def default_gpus(cuda: bool) -> tuple[str, str]:
    return ("0", "0,1") if cuda else ("cpu", "cpu cpu")


def print_table(a: dict[str, Any], b: dict[str, Any], ratio: float) -> None:
    print(f"\n{'run':<4} {'worker --gpus':<16} {'procs':>5} {'start-up s':>14} {'rows':>6} {'seconds':>8} "
          f"{'rows/s':>8} {'gen tokens':>11} {'in tok/row':>10}")
    for label, run in (("A", a), ("B", b)):
        startup = "/".join(f"{s:.0f}" for s in run["startup_s"])
        print(f"{label:<4} {' | '.join(run['gpus']):<16} {run['processes']:>5} {startup:>14} {run['rows']:>6} "
              f"{run['seconds']:>8.1f} {run['rows_per_s']:>8.2f} {run['generated_tokens']:>11} {run['input_tokens_mean']:>10.1f}")
    print(f"\n{'run':<4} {'pid':>8} {'gpu':>4} {'shards':>6} {'rows':>5} {'shard s':>8} {'rows/s':>7} "
          f"{'idle for rows s':>15} {'engine s':>9} {'other s':>8} {'pool procs':>10} {'pool starts':>11} {'restarts':>8}")
    for label, run in (("A", a), ("B", b)):
        for p in run["per_process"]:
            print(f"{label:<4} {p['pid']:>8} {p['gpu']:>4} {p['shards']:>6} {p['rows']:>5} {p['shard_seconds']:>8.1f} "
                  f"{p['rows_per_s']:>7.2f} {p['idle_for_rows_s']:>15.2f} {p['engine_s']:>9.1f} {p['other_s']:>8.2f} "
                  f"{p['pool_workers']:>10} {p['pool_starts']:>11} {p['worker_restarts']:>8}")
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    print(f"B/A = {ratio:.2f}x ({verdict} the {TARGET_RATIO}x target)\n", flush=True)


def run(shape: str, rows: int, shard_size: int, gpus_a: str | None, gpus_b: str | None, redis_server: Path, workdir: Path,
        preprocess_workers: int | None, timeout: float, json_out: Path, env: dict[str, str]) -> bool:
    """Runs A and B (`gpus_*`: space-separated `--gpus` values, one worker command each;
    None: one GPU against two, or CPU workers without CUDA); False when a run failed."""
    import torch

    cuda = torch.cuda.is_available()
    default_a, default_b = default_gpus(cuda)
    gpus_a, gpus_b = gpus_a or default_a, gpus_b or default_b
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    env = dict(env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if preprocess_workers is not None:
        env["VLMBATCH_PREPROCESS_WORKERS"] = str(preprocess_workers)
    if not cuda:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # a CPU smoke test on a shared box
    dtype = "bfloat16" if cuda else "auto"
    report: dict[str, Any] = {"shape": shape, "rows": rows, "shard_size": shard_size, "cuda": cuda,
                              "devices": in_child(device_names),
                              "preprocess_workers_per_worker": preprocess_workers, "target_ratio": TARGET_RATIO}
    say(f"devices {report['devices'] or ['cpu']}; workdir {workdir}")
    private_redis = PrivateRedis(redis_server.absolute(), workdir / "redis.log", env)
    try:
        private_redis.wait_ready()
        say(f"redis-server on {private_redis.url}")
        model = in_child(build_model, shape, workdir)
        processes_b = sum(len(spec.split(",")) for spec in gpus_b.split())
        warmup = write_dataset(model, workdir / "warmup.parquet", shard_size * processes_b, seed=99)
        timed = write_dataset(model, workdir / "w1.parquet", rows, seed=100)
        for label, gpus in (("A", gpus_a), ("B", gpus_b)):
            report[label] = run_config(label, gpus.split(), model, private_redis.url, dtype, (warmup, timed),
                                       shard_size, workdir, env, timeout)
        report["ratio"] = report["B"]["rows_per_s"] / report["A"]["rows_per_s"]
        report["meets_target"] = report["ratio"] >= TARGET_RATIO
        report["ok"] = True
        print_table(report["A"], report["B"], report["ratio"])
    except Exception as exc:  # noqa: BLE001  (the report says what failed; the caller exits 1)
        report["ok"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
        say(f"FAILED: {report['error']}\n{traceback.format_exc()}")
    finally:
        private_redis.stop()
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        say(f"wrote {json_out}")
    return report["ok"]
