"""The vLLM peer: vLLM's offline `LLM.generate` on the same workloads, in a child process.

It runs on the same model folder as ours (`bench.shapes.write_model_folder`: config.json
of the benchmarked sizes with `"architectures"`, the tiny checkpoint's tokenizer, a
processor whose pixel bounds keep a 448x448 image at its real token count) with
`load_format="dummy"` (random weights), bf16, one image per prompt (no video: none is
profiled either, whatever the folder's video processor allows), and the workloads'
own token ids with one image placeholder, which vLLM expands itself; its images are PIL
images that vLLM preprocesses on the CPU (its normal offline path). Sampling is forced to
each request's output length (`min_tokens` = `max_tokens`, EOS ignored, greedy, no
detokenisation). 64 other requests warm it up before the timed runs. With a schema
(`bench engine --structured`), W1 runs once more under it ("w1+schema") through vLLM's
structured outputs (`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`,
`guided_decoding=GuidedDecodingParams(json=...)` before vLLM 0.10.2), with the same
max_tokens but neither min_tokens nor ignore_eos: the grammar decides where a row ends, as in ours.

Videos (V1, `bench.video_v1`: `run_vllm_video_peer`): each prompt is the raw prompt's token
ids with one `<|vision_start|><|video_pad|><|vision_end|>` and `multi_modal_data={"video":
(frames, metadata)}`, the (T, H, W, 3) uint8 frames and the metadata dict of vLLM's own
video loader (`VideoMediaIO` with the backend vLLM picks for the model's video processor,
`qwen3_vl` for Qwen3-VL: OpenCV decoding, `frames_indices` / `fps` from which its processor
writes the timestamps), exactly what `LLM.chat` with a `video_url` hands on. The clips are
read and decoded from their files inside the timed `generate` call, as vLLM takes each
prompt (`VideoPrompts`: a lazy sequence; with `decode_threads` a pool decodes ahead); with
`predecoded` the frames are decoded before the clock starts. `LLM(enable_prefix_caching=
False, mm_processor_cache_gb=0)`: with both off vLLM gives each request's media its own
id, so no request reuses another's processing, encoder output or KV blocks. Each run
reports the frames the loader took, the prompts vLLM built (compared token for token with
ours per clip), its prompt-cache hits and when its frontend had added the last request.

Why a child process: vLLM holds its weights, KV cache, CUDA graphs and an engine-core
process of its own; `del llm` does not reliably give that memory back within one process
(distributed state, compiled graphs, the engine core). The child exits, its process group
is killed, and every byte is the driver's again before our engine sizes its KV cache from
free memory. A child that cannot `import vllm` reports the peer as skipped, with why.

Run as `python -m vlmbatch.bench.peers.vllm SPEC.json RESULT.json` by `run_vllm_peer`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence as CollectionSequence
from concurrent.futures import ThreadPoolExecutor
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from vlmbatch.bench.workloads import Workload

# What vLLM 0.26 needs on the lent H200 (../shared/FACTS.md); set unless the caller set them.
# Defaults of the child's environment; the caller's own variables win. DeepGEMM off: with it
# vLLM 0.26 compiles ~800 block-FP8 GEMM kernels at start (~1 s each on the H200, 13 minutes
# projected, BENCHMARKS.md session 15), past any call's time; its CUTLASS/Triton block-FP8
# kernels run instead (VLLM_USE_DEEP_GEMM=1 in the environment brings DeepGEMM back).
CHILD_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_DEEP_GEMM": "0"}
VLLM_SITE = Path(__file__).with_name("vllm_site")  # sitecustomize.py for the child's processes


# Modules vLLM 0.26's model of a family imports beyond what `import vllm` needs: its llava
# module imports pixtral's, which needs mistral_common (the H200 run failed at model
# inspection without it, after loading, BENCHMARKS.md session 10).
FAMILY_MODULES = {"llava_next": ("mistral_common",), "llava_onevision": ("mistral_common",)}


def vllm_missing(device_type: str, pythonpath: list[str], family: str = "") -> str | None:
    """Why the vLLM peer cannot run here (no CUDA, no `vllm` on the path, or a module its
    model of `family` imports), or None: said before the child starts, not minutes later."""
    if device_type != "cuda":
        return "vLLM runs on CUDA GPUs only"
    path = [*pythonpath, *sys.path]
    if PathFinder.find_spec("vllm", path) is None:
        return "vllm is not importable (install it, or pass its folder with --vllm-pythonpath)"
    absent = [name for name in FAMILY_MODULES.get(family, ()) if PathFinder.find_spec(name, path) is None]
    if absent:
        return f"vLLM's {family} model imports modules not on its path: {', '.join(absent)}"
    return None


def llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM(...)` arguments for a spec written by `run_vllm_peer`."""
    return {"model": spec["model"], "load_format": spec["load_format"], "dtype": "bfloat16",
            "limit_mm_per_prompt": {"image": 1, "video": 0}, "max_model_len": spec["max_model_len"],
            "gpu_memory_utilization": spec["gpu_memory_utilization"], "seed": 0}


def vllm_requests(workload: Workload) -> list[dict[str, Any]]:
    """The workload as vLLM prompts: its token ids with one placeholder per image, its PIL
    images. The placeholder is the family adapter's (`<|image_pad|>` in Qwen's vision markers,
    LLaVA's and Idefics3/SmolVLM's `<image>`): vLLM's processor of each family replaces that
    one token by the image's expansion (Idefics3/SmolVLM: tile markers and the global image)."""
    prompts = []
    for index, request in enumerate(workload.requests):
        images = workload.images(index)
        prompts.append({"prompt_token_ids": list(request.prompt_token_ids),
                        "multi_modal_data": {"image": images[0] if len(images) == 1 else images}})
    return prompts


def sampling_kwargs(workload: Workload) -> list[dict[str, Any]]:
    """`vllm.SamplingParams(...)` arguments per request: exactly its output length, greedy."""
    return [{"max_tokens": r.output_tokens, "min_tokens": r.output_tokens, "ignore_eos": True, "temperature": 0.0,
             "detokenize": False} for r in workload.requests]


def structured_kwargs(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured-output argument for a JSON schema, in the installed version's API."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # vLLM before 0.10.2
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(json=schema)}
    return {"structured_outputs": StructuredOutputsParams(json=schema)}


def run_vllm_peer(model: Path, load_format: str, warmup: Workload, workloads: list[Workload], gpu_memory_utilization: float,
                  timeout_s: float, workdir: Path, env: dict[str, str], pythonpath: list[str],
                  structured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the child on `workloads` (after `warmup`) with `env`, and `pythonpath` as its
    PYTHONPATH when given; return what it wrote: `runs` (one per workload timed), `skipped`
    (why vLLM could not be imported), `error`. `structured` ({"workload", "schema"}) times
    that workload once more under the schema, as "<workload>+schema"."""
    longest = max(w.prompt_tokens + max(r.output_tokens for r in w.requests) for w in workloads)
    spec = {"model": str(model), "load_format": load_format, "max_model_len": max(4096, longest),
            "gpu_memory_utilization": gpu_memory_utilization, "warmup": warmup.to_json(),
            "workloads": [w.to_json() for w in workloads], "structured": structured}
    return run_child(spec, timeout_s, workdir, env, pythonpath)


def run_vllm_video_peer(spec: dict[str, Any], timeout_s: float, workdir: Path, env: dict[str, str],
                        pythonpath: list[str]) -> dict[str, Any]:
    """The child on a video spec (`bench.video_v1.vllm_video_spec`: "kind" "video", the
    clips with the loader's sampling rate, our frame indices and expanded prompt ids, the
    clip index of each warm-up and timed request); returns what `run_vllm_peer` does."""
    return run_child(dict(spec, kind="video"), timeout_s, workdir, env, pythonpath)

CHILD_LOG_TAIL_LINES = 40  # of the child's output kept in a failed run's error


def child_environment(env: dict[str, str], pythonpath: list[str]) -> dict[str, str]:
    """`env` with CHILD_ENV's defaults; `pythonpath`, when given, replaces its PYTHONPATH (a
    transformers carried for our engine must not reach vLLM), and VLLM_SITE leads it either
    way (its sitecustomize restores names vLLM imports)."""
    child_env = {**CHILD_ENV, **env}
    rest = pythonpath or [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join([str(VLLM_SITE), *rest])
    return child_env


def run_child(spec: dict[str, Any], timeout_s: float, workdir: Path, env: dict[str, str], pythonpath: list[str]) -> dict[str, Any]:
    """`python -m vlmbatch.bench.peers.vllm` on `spec` in its own session; its whole process
    group is killed when it exits or runs past `timeout_s`; returns its result file. Its
    output (vLLM's engine-core processes' too) goes to `vllm-child.log` in `workdir`; on a
    failure the error carries that log's last lines, where vLLM puts the root cause."""
    spec_path, result_path, log_path = workdir / "vllm-spec.json", workdir / "vllm-result.json", workdir / "vllm-child.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    child_env = child_environment(env, pythonpath)
    command = [sys.executable, "-m", "vlmbatch.bench.peers.vllm", str(spec_path), str(result_path)]
    error = None
    with log_path.open("w") as log:
        child = subprocess.Popen(command, env=child_env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = child.wait(timeout_s)
            if code != 0:
                error = f"the vLLM child exited with {code}"
        except subprocess.TimeoutExpired:
            error = f"the vLLM child ran past {timeout_s:.0f} s"
        finally:
            try:  # its whole group: vLLM's engine-core processes hold GPU memory too
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
    result = json.loads(result_path.read_text()) if result_path.exists() else {"runs": []}
    if (error or "error" in result) and "skipped" not in result:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-CHILD_LOG_TAIL_LINES:])
        result["error"] = f"{result.get('error') or error}\n--- the vLLM child's last output lines ---\n{tail}"
    return result


def _child(spec: dict[str, Any], save) -> dict[str, Any]:
    """In the child: load vLLM, warm it up, time each workload; `save(result)` after each phase."""
    result: dict[str, Any] = {"runs": []}
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001  (any import failure means the peer cannot run here)
        result["skipped"] = f"import vllm failed: {type(exc).__name__}: {exc}"
        save(result)
        return result
    result["vllm_version"] = vllm.__version__
    if spec.get("kind") == "video":
        return _video_child(spec, save, result)
    started = time.perf_counter()
    llm = LLM(**llm_kwargs(spec))
    result["load_s"] = time.perf_counter() - started
    save(result)
    warmup = Workload.from_json(spec["warmup"])
    started = time.perf_counter()
    llm.generate(vllm_requests(warmup), [SamplingParams(**k) for k in sampling_kwargs(warmup)], use_tqdm=False)
    result["warmup_s"] = time.perf_counter() - started
    save(result)
    structured = spec.get("structured")
    runs = [(Workload.from_json(data), None) for data in spec["workloads"]]
    runs += [(w, structured["schema"]) for w, _ in runs if structured and w.name == structured["workload"]]
    for workload, schema in runs:
        kwargs = sampling_kwargs(workload)
        if schema is not None:
            kwargs = [dict(request, min_tokens=0, ignore_eos=False, **structured_kwargs(schema)) for request in kwargs]
        prompts, params = vllm_requests(workload), [SamplingParams(**k) for k in kwargs]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        generated = [len(o.outputs[0].token_ids) for o in outputs]
        result["runs"].append({
            "workload": workload.name + ("+schema" if schema is not None else ""), "requests": len(outputs), "seconds": seconds,
            "output_tokens": sum(generated),
            "lengths_as_forced": generated == [r.output_tokens for r in workload.requests],
            "prompt_tokens": sorted({len(o.prompt_token_ids) for o in outputs}),
            "image_tokens": sorted({n for o in outputs for n in _image_tokens(o)}), "fingerprint": workload.fingerprint(),
        })
        save(result)
    return result


def video_llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM(...)` arguments of a video spec: one video per prompt and no image (none is
    profiled), and no reuse of repeated media (with the prefix cache and the processor cache
    both off, vLLM gives each request's media its own id: `renderers/base.py`,
    `_process_mm_uuids`). `mm_processor_kwargs`: what makes its processor build our prompts
    (Qwen3-VL: `cap_pixels_per_frame`, as our adapter asks of the same transformers)."""
    kwargs = {"model": spec["model"], "load_format": spec["load_format"], "dtype": "bfloat16",
              "limit_mm_per_prompt": {"image": 0, "video": 1}, "max_model_len": spec["max_model_len"],
              "gpu_memory_utilization": spec["gpu_memory_utilization"], "seed": 0,
              "enable_prefix_caching": False, "mm_processor_cache_gb": 0}
    if spec.get("mm_processor_kwargs"):
        kwargs["mm_processor_kwargs"] = spec["mm_processor_kwargs"]
    return kwargs


def video_loader(spec: dict[str, Any], model_config: Any = None) -> tuple[str, Any]:
    """(backend name, load(clip) -> (frames, metadata)): vLLM's own `VideoMediaIO` with the
    loader vLLM picks for the model's video processor (as `MediaConnector.fetch_video` does
    for a `video_url`), `num_frames` and the clip's sampling `fps` as `media_io_kwargs`."""
    from vllm import envs
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO
    from vllm.multimodal.video import get_video_loader_backend_for_processor

    name = spec.get("video_processor")
    if model_config is not None:
        try:
            from vllm.transformers_utils.processor import get_video_processor_cls_name

            name = get_video_processor_cls_name(model_config) or name
        except Exception:  # noqa: BLE001  (an older layout: the folder's own class name, from the spec)
            pass
    backend = get_video_loader_backend_for_processor(name) or envs.VLLM_VIDEO_LOADER_BACKEND

    def load(clip: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        io = VideoMediaIO(ImageMediaIO(), num_frames=spec["num_frames"], video_backend=backend, fps=clip["fps"])
        return io.load_file(Path(clip["path"]))

    return backend, load


class VideoPrompts(CollectionSequence):
    """vLLM prompts whose videos are loaded when vLLM takes each prompt (`LLM.generate`
    renders and adds them one at a time, its engine core already running the earlier ones),
    by a pool of `threads` decoding up to `window` prompts ahead (0: in the taking thread),
    or taken from `predecoded` (clip index -> (frames, metadata)). Records each prompt's
    load seconds and the frame indices its loader took."""

    def __init__(self, token_ids: list[int], clips: list[dict[str, Any]], order: list[int], load: Any, threads: int = 0,
                 predecoded: dict[int, Any] | None = None, window: int = 32):
        self.token_ids, self.clips, self.order, self.load = list(token_ids), clips, list(order), load
        self.predecoded = predecoded
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="vllm-video") if threads and predecoded is None else None
        self.window = window
        self.futures: dict[int, Any] = {}
        self.submitted = 0
        self.load_s: list[float | None] = [None] * len(order)
        self.frame_indices: list[list[int] | None] = [None] * len(order)

    def __len__(self) -> int:
        return len(self.order)

    def _load(self, index: int) -> Any:
        started = time.perf_counter()
        video = self.load(self.clips[self.order[index]])
        self.load_s[index] = time.perf_counter() - started
        return video

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if self.predecoded is not None:
            video = self.predecoded[self.order[index]]
        elif self.pool is None:
            video = self._load(index)
        else:
            while self.submitted < min(len(self), index + self.window):
                self.futures[self.submitted] = self.pool.submit(self._load, self.submitted)
                self.submitted += 1
            future = self.futures.pop(index, None)
            video = future.result() if future is not None else self._load(index)
        self.frame_indices[index] = [int(i) for i in video[1]["frames_indices"]]
        return {"prompt_token_ids": list(self.token_ids), "multi_modal_data": {"video": video}}

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def video_run_summary(spec: dict[str, Any], order: list[int], outputs: list[Any], prompts: VideoPrompts) -> dict[str, Any]:
    """What a video run did, checked against ours: output lengths as forced, prompts token
    for token ours (per clip), the loader's frames ours, no prompt-cache hits."""
    clips, video_token = spec["clips"], spec["video_token_id"]
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    same_prompts = [list(o.prompt_token_ids) == clips[k]["prompt_token_ids"] for o, k in zip(outputs, order)]
    same_frames = [seen == clips[k]["frame_indices"] for seen, k in zip(prompts.frame_indices, order)]
    loads = [s for s in prompts.load_s if s is not None]
    return {
        "requests": len(outputs), "output_tokens": sum(generated), "lengths_as_forced": set(generated) == {spec["output_tokens"]},
        "prompt_tokens": sorted({len(o.prompt_token_ids) for o in outputs}),
        "video_tokens": sorted({list(o.prompt_token_ids).count(video_token) for o in outputs}),
        "prompts_identical_to_ours": sum(same_prompts), "frames_identical_to_ours": sum(same_frames),
        "frame_indices": sorted({tuple(f) for f in prompts.frame_indices if f is not None}),
        "cached_prompt_tokens": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs),
        "load_s_total": sum(loads), "load_s_mean": sum(loads) / len(loads) if loads else None,
    }


def _engine_config(llm: Any) -> dict[str, Any]:
    """The scheduler and cache settings vLLM chose (its defaults for this GPU and model)."""
    try:
        config = llm.llm_engine.vllm_config
        return {"max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "num_gpu_blocks": config.cache_config.num_gpu_blocks, "block_size": config.cache_config.block_size,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "mm_processor_cache_gb": config.model_config.multimodal_config.mm_processor_cache_gb}
    except Exception as exc:  # noqa: BLE001  (reporting only)
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def _timed_video_generate(llm: Any, spec: dict[str, Any], order: list[int], load: Any, threads: int,
                          predecoded: dict[int, Any] | None) -> dict[str, Any]:
    """One `generate` over the requests `order` (clip indices), timed from before the first
    prompt is taken to the last output; the frontend's `add_request` times are recorded."""
    from vllm import SamplingParams

    n = spec["output_tokens"]
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False) for _ in order]
    prompts = VideoPrompts(spec["prompt_token_ids"], spec["clips"], order, load, threads, predecoded)
    added: list[float] = []
    engine = llm.llm_engine
    original = engine.add_request

    def add_request(*args: Any, **kwargs: Any) -> Any:
        request_id = original(*args, **kwargs)
        added.append(time.perf_counter())
        return request_id

    engine.add_request = add_request
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        del engine.add_request  # the instance attribute: the class's method again
        prompts.close()
    run = {"seconds": seconds, **video_run_summary(spec, order, outputs, prompts), "decode_threads": threads}
    run["all_added_after_s"] = added[-1] - started if added else None  # the frontend: load, process, add each request
    return run


def _video_child(spec: dict[str, Any], save, result: dict[str, Any]) -> dict[str, Any]:
    """Load vLLM, warm it up on `spec["warmup"]`, then time `spec["timed"]` once per mode
    ("files": decoded in the timed call; "predecoded": each clip decoded before it)."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**video_llm_kwargs(spec))
    result["load_s"] = time.perf_counter() - started
    result["config"] = _engine_config(llm)
    backend, load = video_loader(spec, getattr(llm, "model_config", None))
    result["video_loader"] = backend
    save(result)
    threads = spec.get("decode_threads", 0)
    warm = _timed_video_generate(llm, spec, spec["warmup"], load, threads, None)
    result["warmup_s"], result["warmup"] = warm["seconds"], warm
    save(result)
    for mode in spec.get("modes", ["files"]):
        predecoded = {k: load(spec["clips"][k]) for k in sorted(set(spec["timed"]))} if mode == "predecoded" else None
        run = _timed_video_generate(llm, spec, spec["timed"], load, threads, predecoded)
        result["runs"].append({"workload": "v1", "mode": mode, **run})
        save(result)
    return result


def _image_tokens(output: Any) -> list[int]:
    """Tokens of each image of a vLLM output, where its version reports them (else none)."""
    placeholders = getattr(output, "multi_modal_placeholders", None) or {}
    ranges = placeholders.get("image", []) if isinstance(placeholders, dict) else []
    return [int(r.length) for r in ranges if hasattr(r, "length")]


def main(argv: list[str]) -> int:
    """The child's entry point: 0 when every workload ran (or vLLM is not importable), else
    1 with the traceback in the result under `error`, after the runs that did finish."""
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    result: dict[str, Any] = {"runs": []}

    def save(current: dict[str, Any]) -> None:  # whole files only: the parent may kill us mid-run
        result.update(current)
        partial = result_path.with_suffix(".partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(result_path)

    try:
        _child(json.loads(spec_path.read_text()), save)
    except Exception:  # noqa: BLE001  (an OOM or a vLLM error: the parent reports it with the runs done so far)
        save({"error": traceback.format_exc()[-4000:]})
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written: skip vLLM's exit handlers, which can wait on its engine core; the parent kills the group

