"""`vlmbatch bench engine`: our paged engine against its peers on the same workloads, its
logits against `transformers` fp32, and its decode step against the roofline.

On a model shape from `bench.shapes` (random weights, nothing downloaded) or a real
checkpoint, the phases run in this order, each recorded even when another fails:
1. the vLLM peer in a child process on W1/W2 (`bench.peers.vllm`), while the GPU is empty;
2. the decode roofline's ceilings (a device copy, a bf16 matmul);
3. the `generate()` peer on W1/W2, warmed up and timed at each batch size (`bench.peers.hf`);
4. logits of prefill + forced decode steps per attention backend against `transformers`
   fp32 on the same weights, then asynchronous decoding against awaited steps;
5. W1 and W2 on our engine (the peers' requests, images and output lengths), after the same
   64 warm-up requests vLLM gets (its kernels' first compiles stay out of the timed passes;
   the report keeps their count); with a schema
   (`structured_schema`), W1 again under it (workload "w1+schema", on vLLM too) and the mask's
   cost per step at `mask_batches` (`bench.structured_w1`);
6. each workload's floor on this GPU (`bench.floor`: its matmuls at the measured bf16 rate,
   its decode steps' KV reads at the measured copy bandwidth), which the closing table
   turns into ours and vLLM as shares of it (FP8 products at the measured FP8 rate);
7. decode-step time against the roofline at a few batch sizes, for this and other shapes.
The report (JSON) is saved after every phase; it ends with our rate, each peer's, and the
ratios ours / vLLM and ours / the best `generate()` batch size.

With `repeats` > 1 our engine and vLLM time each workload that many times, each pass on
fresh requests ("w1", "w1#2", ...: other images and words, the same output lengths, so no
pass hits another's caches); the summary takes each engine's best pass and lists them
all. One engine's W1 on the same H200 has moved by 10-15% between runs of the same tree
(BENCHMARKS.md sessions 12-13), which a single pass reports as a change of ratio.
`generate()` runs the first pass only (its rate is a fraction of ours).

`stage_media` "on" builds our engine with `EngineConfig.stage_media`; "both" follows each
of our passes with one on fresh requests with staging on ("w1+staged", "w1+staged#2", ...),
so the two alternate on one engine and one GPU (`engine/media_staging.py`).
"""

from __future__ import annotations

import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from vlmbatch.bench import adapt
from vlmbatch.bench.correctness import check_async_decoding, check_backends, free_memory, logit_reference
from vlmbatch.bench.peers.hf import run_hf_peer
from vlmbatch.bench.peers.vllm import run_vllm_peer, vllm_missing
from vlmbatch.bench.profiles import profile_decode, profile_prefill, profile_vision
from vlmbatch.bench.roofline import decode_roofline, measure_ceilings
from vlmbatch.bench.floor import floor_lines, vision_flops_per_request, workload_floor
from vlmbatch.bench.fp8 import FP8_MIN_BOUND, round_trip_fp8_layers, simulate_fp8_activations, vllm_model_folder
from vlmbatch.bench.shapes import ModelShape, random_hf_model, resolve_shape, write_model_folder
from vlmbatch.bench.structured_w1 import mask_at_batches, mask_row, structured_run, use_full_size_vocab, warm_compile
from vlmbatch.bench.timing import RunResult, run_engine
from vlmbatch.bench.workloads import W2_OUTPUT_RANGE, Workload, build_workload, workload_prompt_tokens

WARMUP_REQUESTS = 64  # before the timed passes, on vLLM and on ours: the same W1 requests (seed 99)


@dataclass
class BenchOptions:
    model_shape: str = "qwen2_5_vl_3b"
    model: str | None = None  # real weights instead of random ones
    requests: int = 1024  # per workload, on our engine and on vLLM
    peers: tuple[str, ...] = ("hf", "vllm")
    peer_requests_w1: int = 1024  # on the generate() peer
    peer_requests_w2: int = 512
    peer_batches: tuple[int, ...] = (128, 256)  # generate() static batch sizes, each timed
    vllm_gpu_memory_utilization: float = 0.85
    vllm_timeout_s: float = 300.0
    vllm_pythonpath: tuple[str, ...] = ()  # the vLLM child's PYTHONPATH (replacing ours) when given
    workloads: tuple[str, ...] = ("w1", "w2")
    backends: tuple[str, ...] = ()  # attention backends to check; () = every available one
    attention_backend: str = "auto"  # what the timed runs use
    check_prompts: int = 4
    decode_steps: int = 32
    # Check the logits on a copy of the shape with only this many decoder layers (None: all):
    # an fp32 reference of 30B-A3B (122 GB) does not fit beside its bf16 model on one GPU.
    reference_layers: int | None = None
    decode_batches: tuple[int, ...] = (1, 64)
    extra_shapes: tuple[str, ...] = ("qwen2_5_vl_7b",)  # decode roofline only
    profile_batches: tuple[int, ...] = ()  # decode batch sizes whose kernels are profiled (main shape)
    profile_prefill: bool = False  # also one full prefill step's kernels (main shape)
    max_num_seqs: int | None = None  # None: the product's default for the device (`paged.scheduler_limits`)
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.85
    min_admission_batch: int = 64
    async_decode: bool = True  # False: every decode step awaited
    device: str = "auto"
    structured_schema: dict[str, Any] | None = None  # W1 again under this JSON schema ("w1+schema")
    mask_batches: tuple[int, ...] = (64, 256)  # batch sizes the mask's cost per step is measured at
    grammar_fill_threads: int = 0  # EngineConfig.grammar_fill_threads of the timed engine (0: auto)
    # fp8 / fp8-block: online FP8 on our engine, per channel or in 128x128 blocks (the logit
    # reference holds the round-tripped weights; vLLM gets the same format as a dummy checkpoint)
    quantization: str = "none"
    quantize_vision: bool = False  # with quantization: the vision tower's linear layers too (ours; the reference rounds them alike)
    # dummy: our engine builds random weights itself, FP8 directly in fp8 (the 72B shapes on one
    # GPU); no generate() peer, logits only with --reference-layers (a cut bf16 model)
    load_format: str = "auto"
    # False (with `model`): no transformers model; our engine loads the checkpoint itself, as
    # the product does (a pre-quantized one streamed: a 72B FP8 on one GPU); no generate() peer, no logit check
    reference: bool = True
    kv_cache_dtype: str = "auto"  # fp8: our engine's KV cache in e4m3
    repeats: int = 1  # timed passes of each workload on our engine and vLLM, each on fresh requests
    stage_media: str = "off"  # on: EngineConfig.stage_media; both: each pass of ours followed by one with it ("w1+staged")

    def peer_requests(self, workload: str) -> int:
        return self.peer_requests_w1 if workload == "w1" else self.peer_requests_w2


def pass_name(workload: str, index: int) -> str:
    """The name of a workload's `index`-th timed pass: "w1", then "w1#2", "w1#3", ..."""
    return workload if index == 0 else f"{workload}#{index + 1}"


def base_workload(name: str) -> str:
    """The workload a pass belongs to ("w1#2" -> "w1"; "w1+schema" stays itself)."""
    return name.split("#")[0]


class _Phases:
    """Runs the benchmark's phases so that one failing (a backend that does not compile, an
    OOM on the 7B shapes, a peer that crashes) is recorded in the report instead of losing
    the others; the report is saved after every phase, so a run cut short keeps its figures."""

    def __init__(self, report: dict[str, Any], save: Callable[[dict[str, Any]], None] | None, echo: Callable[[str], None]):
        self.report, self.save, self.echo = report, save, echo
        report["errors"] = {}
        report["phase_seconds"] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001  (any failure of a phase goes into the report)
            self.report["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
            self.echo(f"{name} failed: {exc.__class__.__name__}: {exc}")
            return None
        finally:
            self.report["phase_seconds"][name] = round(time.perf_counter() - started, 1)
            if self.save is not None:
                self.save(self.report)


def summarize(results: list[RunResult]) -> dict[str, Any]:
    """Per workload: our rate, each peer's (the best of an engine's passes), the ratios
    ours / vLLM and ours / the best `generate()` batch size, and every pass's rate."""
    summary = {}
    for workload in dict.fromkeys(base_workload(r.workload) for r in results):
        runs = [r for r in results if base_workload(r.workload) == workload]
        passes = {engine: [r.requests_per_s for r in runs if r.engine == engine] for engine in ("paged", "vllm")}
        ours, vllm = (max(passes[engine], default=None) for engine in ("paged", "vllm"))
        hf = {str(r.extra["batch_size"]): r.requests_per_s for r in runs if r.engine.startswith("hf-generate")}
        best_batch = max(hf, key=hf.get) if hf else None
        summary[workload] = {
            "paged_requests_per_s": ours, "hf_requests_per_s": hf, "hf_best_batch": best_batch,
            "hf_best_requests_per_s": hf[best_batch] if hf else None, "vllm_requests_per_s": vllm,
            "paged_vs_hf_best": ours / hf[best_batch] if ours and hf else None,
            "paged_vs_vllm": ours / vllm if ours and vllm else None,
            "passes": passes,
        }
    return summary


def summary_table(summary: dict[str, Any], peers: dict[str, Any]) -> list[str]:
    """The closing table: requests/s of ours and each peer side by side, and the ratios."""
    batches = sorted({b for s in summary.values() for b in s["hf_requests_per_s"]}, key=int)

    def cell(value: float | None, suffix: str = "") -> str:
        return f"{value:.2f}{suffix}" if value else "-"

    header = ["workload", "ours", *(f"hf b{b}" for b in batches), "hf best", "vllm", "ours/hf best", "ours/vllm"]
    rows = [header]
    for workload, s in summary.items():
        rows.append([workload, cell(s["paged_requests_per_s"]), *(cell(s["hf_requests_per_s"].get(b)) for b in batches),
                     cell(s["hf_best_requests_per_s"]), cell(s["vllm_requests_per_s"]), cell(s["paged_vs_hf_best"], "x"),
                     cell(s["paged_vs_vllm"], "x")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["requests/s (same run, same requests):"] + ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for workload, s in summary.items():
        repeated = {engine: rates for engine, rates in s.get("passes", {}).items() if len(rates) > 1}
        if repeated:
            listed = "; ".join(f"{'ours' if engine == 'paged' else engine} " + ", ".join(f"{r:.2f}" for r in rates)
                               for engine, rates in repeated.items())
            lines.append(f"  {workload} passes (the best of each engine above): {listed}")
    lines += [f"  {name}: skipped ({peer['reason']})" for name, peer in peers.items() if peer.get("status") == "skipped"]
    return lines


def _row(r: RunResult) -> str:
    step = f"{r.decode_step_ms:8.2f}" if r.decode_step_ms else "       -"
    return f"{r.engine:18s} {r.workload:4s} {r.requests:6d} req {r.requests_per_s:9.2f} req/s {r.output_tokens_per_s:10.0f} out tok/s  decode step {step} ms"


def _phase_row(r: RunResult) -> str:
    """Where a paged run's wall time went (seconds; per-step milliseconds for decode)."""
    x = r.extra
    steps = max(1, x["num_decode_steps"])
    return (f"  phases {r.workload}: add_request {x['add_request_s']:.2f} s, vision {x['vision_s']:.2f} s, "
            f"prefill {x['prefill_launch_s']:.2f}+{x['prefill_wait_s']:.2f} s ({x['num_prefill_steps']} steps), "
            f"decode {x['decode_launch_s']:.2f}+{x['decode_wait_s']:.2f} s ({steps} steps: "
            f"{1000 * x['decode_launch_s'] / steps:.2f} ms launch + {1000 * x['decode_wait_s'] / steps:.2f} ms wait), "
            f"host {x['host_s']:.2f} s ({1000 * x['host_s'] / max(1, x['num_steps']):.2f} ms/step)  [launch+wait]; "
            f"triton compiles {sum(x['triton_compiles'].values())} {x['triton_compiles'] or ''}")


def _roofline_row(shape: str, row: dict[str, float]) -> str:
    return (f"decode {shape} batch {row['batch']:4d}: {row['decode_step_ms']:.2f} ms/step, roofline {row['roofline_ms']:.2f} ms "
            f"= {row['pct_of_roofline']:.0f}% of roofline (launch {row['launch_ms']:.2f} + wait {row['wait_ms']:.2f} ms)")


def _check_row(name: str, errors: dict[str, Any], bound: float) -> str:
    if "error" in errors:
        return f"logits vs transformers fp32 [{name}]: FAILED to run ({errors['error'].splitlines()[-1]})"
    return (f"logits vs transformers fp32 [{name}]: max rel err {errors['max_rel_err']:.2e} (bound {bound:.2e}), "
            f"top-1 agreement {100 * errors['top1_agreement']:.1f}%, decode step b64 {errors['decode_step_ms_b64']:.2f} ms "
            f"-> {'ok' if errors['ok'] else 'FAIL'}")


def _engine(adapter, hf_model, options: BenchOptions, dtype: torch.dtype, device: torch.device, max_num_seqs: int | None,
            load_format: str | None = None):
    return adapt.paged_engine(
        adapter, hf_model, dtype=dtype, device=device, max_model_len=workload_prompt_tokens(adapter) + W2_OUTPUT_RANGE[1],
        max_num_seqs=max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
        gpu_memory_utilization=options.gpu_memory_utilization, min_admission_batch=options.min_admission_batch,
        attention_backend=options.attention_backend, async_decode=options.async_decode, quantization=options.quantization,
        quantize_vision=options.quantize_vision, load_format=load_format or options.load_format, kv_cache_dtype=options.kv_cache_dtype,
        grammar_fill_threads=options.grammar_fill_threads, stage_media=options.stage_media == "on",
    )


def random_engine(shape: ModelShape, workdir: Path, options: BenchOptions, dtype: torch.dtype, device: torch.device):
    """Our engine on `shape` with random weights, sized for the decode rooflines only."""
    from vlmbatch.families.registry import load_adapter

    folder = write_model_folder(shape, workdir)
    hf_model = None if options.load_format == "dummy" else random_hf_model(folder, dtype, device)
    return _engine(load_adapter(str(folder)), hf_model, options, dtype, device, max(options.decode_batches))


def _reduced_correctness(shape: ModelShape, options: BenchOptions, workdir: Path, dtype: torch.dtype, device: torch.device,
                         ceilings: dict[str, float]) -> dict[str, Any]:
    """The logit check on the shape cut to its first `options.reference_layers` decoder
    layers (every other size, the vision tower and DeepStack whole), built, checked and freed
    before the full model is built."""
    from dataclasses import replace as replace_shape

    from vlmbatch.engine.attention import available_backends
    from vlmbatch.families.registry import load_adapter

    layers = options.reference_layers
    cut = replace_shape(shape, name=f"{shape.name}_first{layers}", text={**shape.text, "num_hidden_layers": layers})
    folder = write_model_folder(cut, workdir)
    adapter = load_adapter(str(folder))
    hf_model = random_hf_model(folder, dtype, device)
    reference = logit_reference(hf_model, adapter, options.check_prompts, options.decode_steps, device,
                                min_bound=_fp8_reference(hf_model, options, device))
    engine = _engine(adapter, hf_model, options, dtype, device, options.max_num_seqs, load_format="auto")
    del hf_model
    correctness = check_backends(engine, reference, list(options.backends) or available_backends(device), ceilings)
    correctness["reference_layers"] = layers
    del engine
    free_memory(device)
    return correctness


def _fp8_reference(hf_model: torch.nn.Module, options: BenchOptions, device: torch.device) -> float | None:
    """Make `hf_model` the logit reference of our FP8 engine: the weights it will run (round
    tripped), and on the GPU, where our layers quantize activations, their inputs rounded
    too. Returns the bound's floor: none where the reference then computes our function,
    else `FP8_MIN_BOUND` (MoE experts, an FP8 KV cache). On the CPU our engine runs the
    dequantized weights on unrounded inputs, so the reference rounds none either."""
    exact = options.kv_cache_dtype != "fp8"
    if options.quantization != "none":
        round_trip_fp8_layers(hf_model, options.quantization, options.quantize_vision)
        exact = exact and device.type == "cuda" and simulate_fp8_activations(hf_model, options.quantization, options.quantize_vision)
    return None if exact else FP8_MIN_BOUND


def _wait_for_memory(device: torch.device, free_before: int, timeout_s: float = 60.0) -> None:
    """Until the GPU memory a finished child held is free again (its processes die a moment
    after it exits), so our engine sizes its KV cache from all of it."""
    deadline = time.monotonic() + timeout_s
    while torch.cuda.mem_get_info(device)[0] < free_before - (1 << 30) and time.monotonic() < deadline:
        time.sleep(0.5)


def run_bench(options: BenchOptions, echo: Callable[[str], None] = print,
              save: Callable[[dict[str, Any]], None] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every phase of the module docstring; returns the report (`save` gets it after each
    phase). `env`: the environment of the vLLM child. Raises `ShapeError` for a shape that
    cannot run (unknown, or its family not available)."""
    from vlmbatch.engine.attention import available_backends
    from vlmbatch.engine.loading import load_hf_model, resolve_device
    from vlmbatch.families.registry import load_adapter

    device = resolve_device(options.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = None if options.model else resolve_shape(options.model_shape)
    extra_shapes = [] if options.model else [resolve_shape(s) for s in options.extra_shapes]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "model": options.model or shape.name, "options": asdict(options), "peers": {}, "runs": [],
                              "decode_roofline": {}}
    phases = _Phases(report, save, echo)
    results: list[RunResult] = []

    def record(result: RunResult) -> None:
        results.append(result)
        report["runs"].append(result.to_dict())
        report["summary"] = summarize(results)
        echo(_row(result))
        if result.engine == "paged":
            echo(_phase_row(result))

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(options.model) if options.model else write_model_folder(shape, Path(tmp))
        adapter = load_adapter(str(folder))
        if options.model and not adapter.family.name.startswith("qwen"):
            raise ValueError(f"the engine benchmark's workloads need a Qwen-VL model, not {adapter.family.name}")
        peer_counts = {pass_name(name, index): options.peer_requests(name) if "hf" in options.peers and index == 0 else 0
                       for name in options.workloads for index in range(options.repeats)}  # generate(): the first pass only
        # fresh images per workload and pass: no cache hits across runs
        workloads = {pass_name(name, index): replace(build_workload(name, adapter, max(options.requests, peer_counts[pass_name(name, index)]),
                                                                    seed=100 + number + 1000 * index), name=pass_name(name, index))
                     for number, name in enumerate(options.workloads) for index in range(options.repeats)}
        report["workloads"] = {name: {"requests": options.requests, "hf_requests": peer_counts[name], "prompt_tokens": w.prompt_tokens,
                                      "image_side": w.image_side, "output_tokens": w.head(options.requests).output_tokens}
                               for name, w in workloads.items()}

        if "vllm" in options.peers:
            phases.run("peer-vllm", _vllm_peer, options, device, folder, adapter, workloads, Path(tmp), env or {}, report, record, echo)
        ceilings = report["ceilings"] = measure_ceilings(device)
        fp8_rate = f", fp8 matmul {ceilings['fp8_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s" if "fp8_matmul_flops_per_s" in ceilings else ""
        echo(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"
             f"{fp8_rate}")
        reduced = None
        if options.reference_layers and shape is not None:
            reduced = phases.run("correctness-reduced", _reduced_correctness, shape, options, Path(tmp), dtype, device, ceilings)
        dummy = options.load_format == "dummy"  # our engine builds its own random weights: no transformers copy
        if dummy or not options.reference:
            hf_model = None
        else:
            hf_model = load_hf_model(options.model, dtype, device) if options.model else random_hf_model(folder, dtype, device)
        if "hf" in options.peers and hf_model is None:
            why = "--load-format dummy" if dummy else "--no-reference"
            report["peers"]["hf"] = {"status": "skipped", "reason": f"{why} builds no transformers model"}
        elif "hf" in options.peers:
            report["peers"]["hf"] = {"status": "ran"}
            for name, workload in workloads.items():
                for batch_size in options.peer_batches if peer_counts[name] else ():  # 0 requests: not on this workload
                    result = phases.run(f"peer-hf-{name}-b{batch_size}", run_hf_peer, hf_model, adapter,
                                        workload.head(peer_counts[name]), batch_size, device, echo)
                    if result is not None:
                        record(result)
        min_bound = _fp8_reference(hf_model, options, device) if hf_model is not None else None
        reference = None if options.reference_layers or hf_model is None else logit_reference(
            hf_model, adapter, options.check_prompts, options.decode_steps, device, min_bound=min_bound)
        engine = _engine(adapter, hf_model, options, dtype, device, options.max_num_seqs)
        del hf_model
        memory = report["memory"] = adapt.memory_summary(engine)
        groups = (f" in {memory['kv_groups']} groups of {memory['kv_layers_per_group']} layers, sliding ones keeping "
                  f"{memory['kv_window_tokens']} tokens a sequence" if memory["kv_groups"] > 1 else "")
        echo(f"memory: decoder weights {memory['decoder_weights_gib']:.1f} GiB; KV cache {memory['kv_blocks']} blocks = "
             f"{memory['kv_tokens']} tokens of every layer{groups} ({memory['kv_gib']:.1f} GiB) sized from what is left")
        report.update(adapt.vision_tower(engine))
        echo(f"vision tower: {report['vision_tower']} (transformers' attention batched per window length: {report['packed_vision_attention']})")
        if reference is not None:
            correctness = check_backends(engine, reference, list(options.backends) or available_backends(device), ceilings)
        else:
            correctness = reduced or {"backends": {}, "timed_backend": engine.runner.backend.name, "fastest_backend": None}
        report["correctness"] = correctness
        for name, errors in correctness["backends"].items():
            echo(_check_row(name, errors, correctness["bound_max_rel_err"]))
        echo(f"timed runs use the {correctness['timed_backend']} backend (fastest within the bound: {correctness['fastest_backend']})")
        asynchronous = report["async_decoding"] = phases.run("async-decoding", check_async_decoding, engine)
        if asynchronous is not None:
            echo(f"asynchronous decoding: {asynchronous['equal']}/{asynchronous['requests']} requests with the awaited steps' tokens "
                 f"(two awaited runs: {asynchronous['awaited_repeat_equal']}/{asynchronous['requests']}) "
                 f"-> {'ok' if asynchronous['ok'] else 'FAIL'} {asynchronous['differing'] or ''}")
        warmup = phases.run("paged-warmup", _timed_run, engine, build_workload("w1", adapter, WARMUP_REQUESTS, seed=99), dtype)
        if warmup is not None:
            report["warmup"] = {"requests": warmup.requests, "seconds": warmup.seconds, "triton_compiles": warmup.extra["triton_compiles"]}
            echo(f"warm-up: {warmup.requests} requests in {warmup.seconds:.1f} s, triton compiles {warmup.extra['triton_compiles']}")
        for index, (name, workload) in enumerate(workloads.items()):
            result = phases.run(f"paged-{name}", _timed_run, engine, workload.head(options.requests), dtype)
            if result is not None:
                record(result)
            if options.stage_media == "both":
                base, hash_sign, number = name.partition("#")
                staged = replace(build_workload(base, adapter, options.requests, seed=5000 + index),
                                 name=f"{base}+staged{hash_sign}{number}")
                engine.stage_media = True
                result = phases.run(f"paged-{staged.name}", _timed_run, engine, staged, dtype)
                engine.stage_media = False
                if result is not None:
                    record(result)
        if options.structured_schema is not None and "w1" in workloads:
            phases.run("paged-w1-schema", _structured_phases, engine, workloads["w1"].head(options.requests), dtype, options, report,
                       record, echo)
        floors = phases.run("floor", _floors, engine, {name: workloads[name].head(options.requests) for name in options.workloads},
                            ceilings, dtype)
        if floors is not None:
            report["floors"] = floors
        owned = [engine]  # handed over: each other shape's engine is built once this one is freed
        del engine
        _rooflines(owned, [shape, *extra_shapes], options, Path(tmp), dtype, device, ceilings, report, phases, echo)
    for line in summary_table(report.get("summary", {}), report["peers"]) + floor_lines(report.get("floors", {}), report.get("summary", {})):
        echo(line)
    report["ok"] = ((bool(correctness["backends"]) or not options.reference) and all(e["ok"] for e in correctness["backends"].values())
                    and bool(report.get("async_decoding") and report["async_decoding"]["ok"]))
    if save is not None:
        save(report)
    return report


def _rooflines(owned: list, shapes: list[ModelShape | None], options: BenchOptions, workdir: Path, dtype: torch.dtype,
               device: torch.device, ceilings: dict[str, float], report: dict[str, Any], phases: _Phases,
               echo: Callable[[str], None]) -> None:
    """Decode-step rooflines on the engine in `owned` (the first shape; None: real weights;
    taken out of the list, so freeing it frees its memory), then on an engine built for
    each other shape in turn; profiles of the first when asked."""
    engine = owned.pop()
    for number, shape in enumerate(shapes):
        label = shape.name if shape else options.model
        if number:
            del engine
            free_memory(device)
            engine = phases.run(f"build-{label}", random_engine, shape, workdir, options, dtype, device)
            if engine is None:
                continue
        for batch in options.decode_batches:
            row = phases.run(f"roofline-{label}-b{batch}", decode_roofline, engine, batch, ceilings)
            if row is not None:
                report["decode_roofline"].setdefault(label, []).append(row)
                echo(_roofline_row(label, row))
        if (options.profile_batches or options.profile_prefill) and not number:
            _profiles(engine, options, label, report, phases, echo)
    del engine
    free_memory(device)


def _timed_run(engine, workload: Workload, dtype: torch.dtype) -> RunResult:
    """One workload on our engine; its prompts (pixels made by the adapter) are prepared first, untimed."""
    return run_engine(engine, adapt.engine_prompts(workload, engine.adapter, dtype), [r.output_tokens for r in workload.requests],
                      workload.name)


def _floors(engine, workloads: dict[str, Workload], ceilings: dict[str, float], dtype: torch.dtype) -> dict[str, Any]:
    """Each workload's floor on this GPU (`bench.floor`), its tower FLOPs counted on its own media."""
    return {name: workload_floor(engine, workload, ceilings, vision_flops_per_request(engine, workload, dtype))
            for name, workload in workloads.items()}


def _structured_phases(engine, workload: Workload, dtype: torch.dtype, options: BenchOptions, report: dict[str, Any],
                       record: Callable[[RunResult], None], echo: Callable[[str], None]) -> None:
    """W1 under the schema ("w1+schema", beside "w1" in the summary), then the mask at fixed batch sizes."""
    schema = options.structured_schema
    vocab = use_full_size_vocab(engine)
    report["structured"] = {"schema": schema, "grammar_vocab_size": vocab, "compile_s": warm_compile(engine, schema)}
    echo(f"structured: grammars over a {vocab}-token vocabulary, schema compiled in {report['structured']['compile_s']:.2f} s")
    prompts, lengths = adapt.engine_prompts(workload, engine.adapter, dtype), [r.output_tokens for r in workload.requests]
    result = structured_run(engine, prompts, lengths, "w1+schema", schema)  # beside vLLM's "w1+schema" in the summary
    record(result)
    x = result.extra
    echo(f"  mask over W1: fill {x['mask_fill_ms_per_step']:.3f} ms + apply {x['mask_apply_ms_per_step']:.3f} ms per step "
         f"({x['mask_rows_per_step']:.0f} rows on average)")
    rows = report["structured"]["mask_at_batches"] = mask_at_batches(engine, prompts, lengths, options.mask_batches, schema)
    for row in rows:
        echo(mask_row(row))
    free = report.get("summary", {}).get("w1", {}).get("paged_requests_per_s")
    if free:
        report["structured"]["w1_schema_vs_w1"] = result.requests_per_s / free
        echo(f"W1 under the schema: {result.requests_per_s:.2f} req/s = {100 * result.requests_per_s / free:.1f}% of W1 without "
             f"({result.output_tokens} of {sum(lengths)} tokens generated)")


def _vllm_peer(options: BenchOptions, device: torch.device, folder: Path, adapter, workloads: dict[str, Workload], workdir: Path,
               env: dict[str, str], report: dict[str, Any], record: Callable[[RunResult], None], echo: Callable[[str], None]) -> None:
    """vLLM on the same workloads in a child process (`bench.peers.vllm`); skipped, with the
    reason, where it cannot run. A run whose requests differ from ours is an error."""
    missing = vllm_missing(device.type, list(options.vllm_pythonpath), adapter.family.name)
    if missing:
        report["peers"]["vllm"] = {"status": "skipped", "reason": missing}
        echo(f"vllm: skipped ({missing})")
        return
    timed = {name: w.head(options.requests) for name, w in workloads.items()}
    warmup = build_workload("w1", adapter, WARMUP_REQUESTS, seed=99)
    free_before = torch.cuda.mem_get_info(device)[0]
    echo(f"vllm: {len(timed)} workloads of {options.requests} requests after {WARMUP_REQUESTS} warm-up requests, in a child process")
    structured = {"workload": "w1", "schema": options.structured_schema} if options.structured_schema and "w1" in timed else None
    if options.quantization != "none" and not options.model:  # the same FP8 format as ours, dummy weights
        folder = vllm_model_folder(folder, options.quantization)
    result = run_vllm_peer(folder, "auto" if options.model else "dummy", warmup, list(timed.values()),
                           options.vllm_gpu_memory_utilization, options.vllm_timeout_s, workdir, env, list(options.vllm_pythonpath),
                           structured)
    _wait_for_memory(device, free_before)
    if "skipped" in result:
        report["peers"]["vllm"] = {"status": "skipped", "reason": result["skipped"]}
        echo(f"vllm: skipped ({result['skipped']})")
        return
    report["peers"]["vllm"] = {"status": "ran", **{k: result[k] for k in ("vllm_version", "load_s", "warmup_s") if k in result}}
    problems = []
    for run in result["runs"]:
        constrained = run["workload"] == "w1+schema"  # its lengths are the grammar's: not forced
        workload = timed["w1" if constrained else run["workload"]]
        same = run["fingerprint"] == workload.fingerprint()
        extra = {k: run[k] for k in ("prompt_tokens", "image_tokens", "lengths_as_forced")}
        record(RunResult("vllm", run["workload"], run["requests"], run["seconds"], run["output_tokens"], extra=dict(extra, same_requests=same)))
        problem = _vllm_mismatch(workload, dict(run, lengths_as_forced=True) if constrained else run, same)
        if problem:
            problems.append(f"{run['workload']}: {problem}")
    if "error" in result or problems:
        raise RuntimeError("; ".join(filter(None, [result.get("error"), *problems])))


def _vllm_mismatch(workload: Workload, run: dict[str, Any], same: bool) -> str | None:
    """What made vLLM's run differ from ours, if anything: other requests, another image
    token count (its processor shrank the image), or output lengths not as forced. vLLM may
    report prompts before or after it expands the image placeholder: both lengths are ours."""
    unexpanded = sorted({len(r.prompt_token_ids) for r in workload.requests})
    image_tokens = workload.prompt_tokens - unexpanded[0] + 1  # one placeholder per prompt
    if not same:
        return "its requests are not ours"
    if run["prompt_tokens"] not in ([workload.prompt_tokens], unexpanded) or run["image_tokens"] not in ([], [image_tokens]):
        return (f"prompts of {run['prompt_tokens']} tokens with images of {run['image_tokens']} tokens; "
                f"ours: {workload.prompt_tokens} with {image_tokens}")
    if not run["lengths_as_forced"]:
        return "output lengths differ from the forced ones"
    return None


def _profiles(engine, options: BenchOptions, label: str, report: dict[str, Any], phases: _Phases, echo: Callable[[str], None]) -> None:
    vision = phases.run("profile-vision", profile_vision, engine)
    if vision is not None:
        report["vision_profile"] = vision
        echo(f"vision: {vision['images']} images encoded in {vision['ms']:.1f} ms from host pixels; their upload alone "
             f"{vision['upload_ms']:.1f} ms, the encode of pixels already on the device {vision['on_device_ms']:.1f} ms; "
             "costliest ops of one profiled encode:")
        for op in vision["ops"]:
            echo(f"  {op['ms']:9.2f} ms {op['calls']:7d} calls  {op['op']}")
    if options.profile_prefill:
        prefill = phases.run(f"profile-{label}-prefill", profile_prefill, engine)
        if prefill is not None:
            report["prefill_profile"] = prefill
            echo(f"prefill {label}: one step of {prefill['prompts']} prompts ({prefill['tokens']} tokens) in {prefill['ms']:.1f} ms; kernels:")
            for k in prefill["kernels"]:
                echo(f"  {k['ms']:9.2f} ms {k['calls']:6d} calls  {k['kernel']}")
    for batch in options.profile_batches:
        kernels = phases.run(f"profile-{label}-b{batch}", profile_decode, engine, batch)
        if kernels is not None:
            report.setdefault("decode_kernels", {})[f"{label}-b{batch}"] = kernels
            echo(f"decode {label} batch {batch} kernels per step:")
            for k in kernels:
                echo(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f} calls  {k['kernel']}")
