"""`vlmbatch bench video-v1`: V1, video through the job path from files, against vLLM and `generate()` in one run.

    vlmbatch bench make-clips bench-out/v1-clips        # here, with ffmpeg: 4 clips, 24.5 MiB
    vlmbatch bench video-v1 --model-shape qwen3_vl_8b --clips bench-out/v1-clips \
        --peer vllm,hf --vllm-pythonpath /tmp/site-vllm --json $OUT/v1-qwen3-vl-8b.json
    vlmbatch bench video-v1 --model-shape qwen3_vl_30b_a3b --clips bench-out/v1-clips --peer vllm ...
    vlmbatch bench video-v1 --model-shape tiny_qwen3_vl --requests 4 --output-tokens 8 \
        --hf-requests 4 --hf-batches 2 --clips DIR                                  # CPU smoke

On the H200: vLLM 0.26 installed into /tmp/site-vllm by earlier calls (../shared/FACTS.md),
then one call carrying `bench-out/v1-clips` (24.5 MiB) and `.whl` (transformers 5.24 for our
engine and `generate()`), `source scripts/device-setup.sh` and the command above.

V1 (the Qwen3-VL issue): `--requests` (256) requests, each one job row (a short text prompt
and the path of a video file), each video a sample of `--frames` (16) frames uniformly
over a 60 s 1280x720 h264 30 fps clip, exactly `--output-tokens` (128) tokens generated
(greedy, EOS ignored), on a model shape with random weights (nothing is downloaded). The
clips are made on a machine with ffmpeg (`vlmbatch bench make-clips`: FFmpeg's `testsrc2`
pattern, hue-rotated so no two clips share their pixels, libx264 at crf 32 so that four fit
the GPU machine's upload) and read by every engine from the same files; request r takes
clip r mod the number of clips. (A command of its own rather than a `bench engine`
workload: V1 goes through the job path from files, as `jpeg-w1` does, and vLLM decodes
its videos itself; `bench engine` feeds ready prompts to the engine and checks logits and
rooflines.)

Engines, in this order, each recorded even when another fails:
1. vLLM (`--peer vllm`, in a child process while the GPU is empty; `bench.peers.vllm`):
   its offline `LLM.generate` on the raw prompt's token ids and `multi_modal_data={"video":
   (frames, metadata)}` from vLLM's own video loader (`VideoMediaIO` with the loader vLLM
   picks for the model: `qwen3_vl`, OpenCV), the files read and decoded inside the timed
   call as vLLM takes each prompt (`--vllm-decode-threads`, 4, decode up to 32 clips ahead
   of it; 0: in its frontend thread, as `LLM.chat` with a `video_url` does). `--vllm-modes predecoded`
   times it once more on frames decoded before the clock starts (its ceiling).
2. `generate()` (`--peer hf`, the transformers model of the same folder, random weights):
   static batches of `--hf-batches`, each warmed up with one full batch of its size, then
   timed over `--hf-requests` rows; only `generate()` is timed (its frames are decoded and
   processed before each batch: it has no video loader of its own), so its rate is an
   upper bound.
3. Ours: the job path, `run_job_locally` on a Parquet of the rows (reader, the
   preprocessing pool decoding with the product's default video backend, the paged engine,
   the result Parquet), the job's `media_io_kwargs` `{"video": {"num_frames": 16}}`; a
   warm-up job of `--warmup` rows first (CUDA graphs, the pool's start, the tower's first
   shapes), then the timed job. Its `EngineStats` phases are printed.

Fairness, checked and reported, not assumed:
- the same frames: our sampler's indices (`media/video/sampling.py`) and those vLLM's
  loader takes (`frames_indices` of its metadata; its sampling rate is chosen per clip so
  that its rule, `round(linspace(0, total - 1, n))`, picks n frames) are compared for
  every request;
- the same prompts: vLLM's prompt token ids (timestamps, vision markers and video tokens
  included) are compared with ours for each clip, and the video-token counts of both are
  printed (Qwen3-VL: our adapter asks transformers' video processor for its per-frame
  pixel cap, `cap_pixels_per_frame`; vLLM's processor gets the same option);
- no engine reuses work on the repeated clips: ours runs without prefix caching and with
  `encoder_cache_size` 0 (each request's clip goes through the tower for it alone; the
  run fails if the tower ran fewer times than there are requests), vLLM with prefix
  caching and its processor cache off (each request's media then has its own id: no
  processor, encoder-cache or KV reuse; its prompt-cache hits are reported);
- both engines are warmed (`--warmup` requests each; `generate()` with a full batch at
  each timed size) and read the clips from files inside the timed region.

Prints a table (requests/s, output tokens/s, prompt and video tokens, ours / vLLM); writes
the JSON report after every phase (`--json`). Exits 1 if a phase fails, a row errors, or a
fairness check fails. Needs CUDA for vLLM; elsewhere it is reported as skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from vlmbatch.bench.scaling import say

V1_REQUESTS, V1_FRAMES, V1_OUTPUT_TOKENS, V1_WARMUP = 256, 16, 128, 8
V1_QUESTION = "Describe what happens in this video."
# The clips: 60 s of 1280x720 at 30 fps, h264; crf 32 puts four of them in ~24 MiB.
CLIP_SECONDS, CLIP_SIZE, CLIP_FPS, CLIP_CRF, CLIP_COUNT = 60, "1280x720", 30, 32, 4
CLIPS_MANIFEST = "clips.json"


def v1_prompt(adapter: Any) -> str:
    """The raw (templated) prompt of every row: one video, then the question."""
    return f"<|im_start|>user\n{adapter.video_placeholder}{V1_QUESTION}<|im_end|>\n<|im_start|>assistant\n"


# ---- clips -----------------------------------------------------------------------------
def make_clips(directory: Path, count: int = CLIP_COUNT, crf: int = CLIP_CRF, seconds: float = CLIP_SECONDS,
               size: str = CLIP_SIZE, fps: int = CLIP_FPS, echo: Callable[[str], None] = say) -> list[Path]:
    """`count` h264 clips of FFmpeg's `testsrc2`, clip k hue-rotated by 360 k / count
    degrees (no two share their pixels), libx264 veryfast at `crf`, encoder-default
    keyframes; kept when already there. Writes `clips.json` (files, bytes, sha256, settings)."""
    if shutil.which("ffmpeg") is None:
        raise RuntimeError("making clips needs the ffmpeg command line (the GPU machine has none: make them here and carry them)")
    directory.mkdir(parents=True, exist_ok=True)
    width, _, height = size.partition("x")
    paths = []
    for k in range(count):
        path = directory / f"v1_{k:02d}_{size}_{seconds:g}s_{fps}fps_crf{crf}.mp4"
        if not path.exists():
            partial = path.with_suffix(".partial.mp4")
            subprocess.run(
                ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi",
                 "-i", f"testsrc2=size={width}x{height}:rate={fps}:duration={seconds}", "-vf", f"hue=h={360 * k / count:g}",
                 "-c:v", "libx264", "-preset", "veryfast", "-crf", str(crf), "-pix_fmt", "yuv420p", str(partial)],
                check=True,
            )
            partial.replace(path)
        echo(f"clip {path.name}: {path.stat().st_size / 2**20:.2f} MiB")
        paths.append(path)
    version = subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True).stdout.splitlines()[0]
    manifest = {"content": "testsrc2, clip k hue-rotated by 360 k / count degrees", "seconds": seconds, "size": size, "fps": fps,
                "codec": "h264 (libx264 veryfast, yuv420p, default keyframe interval)", "crf": crf, "ffmpeg": version,
                "clips": [{"file": p.name, "bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                          for p in paths]}
    (directory / CLIPS_MANIFEST).write_text(json.dumps(manifest, indent=2))
    echo(f"{count} clips, {sum(c['bytes'] for c in manifest['clips']) / 2**20:.1f} MiB in {directory}")
    return [p.resolve() for p in paths]


def find_clips(directory: Path) -> list[Path]:
    """The clips of `directory`: those its `clips.json` lists, else its `*.mp4` files."""
    manifest = directory / CLIPS_MANIFEST
    if manifest.exists():
        paths = [directory / c["file"] for c in json.loads(manifest.read_text())["clips"]]
    else:
        paths = sorted(p for p in directory.glob("*.mp4") if not p.name.endswith(".partial.mp4"))
    missing = [p for p in paths if not p.exists()]
    if not paths or missing:
        raise FileNotFoundError(f"no clips in {directory} ({', '.join(map(str, missing)) or 'none'}): run `vlmbatch bench make-clips`")
    return [p.resolve() for p in paths]


def clip_info(path: Path) -> dict[str, Any]:
    """What OpenCV reads from the container (what vLLM's OpenCV loader sees): size, rate, frames, codec."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    try:
        fourcc = int(capture.get(cv2.CAP_PROP_FOURCC))
        return {"path": str(path), "bytes": path.stat().st_size, "width": int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
                "height": int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)), "fps": float(capture.get(cv2.CAP_PROP_FPS)),
                "frames": int(capture.get(cv2.CAP_PROP_FRAME_COUNT)),
                "codec": "".join(chr((fourcc >> 8 * i) & 0xFF) for i in range(4)).strip("\x00")}
    finally:
        capture.release()


# ---- what each engine is given ------------------------------------------------------------
def vllm_loader_fps(info: dict[str, Any], frames: int) -> float:
    """The `fps` media option that makes vLLM's `qwen3_vl` loader take `frames` frames of a
    clip: it takes int(total / clip fps x fps) of them (then clamps), so aim half a frame above."""
    return (frames + 0.5) * info["fps"] / info["frames"]


def vllm_loader_indices(info: dict[str, Any], fps: float, min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """The frames vLLM 0.26's `Qwen3VLVideoBackend.compute_frames_index_to_sample` takes."""
    import numpy as np

    total = info["frames"]
    count = min(max(int(total / info["fps"] * fps), min_frames), max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def vllm_processor_kwargs(adapter: Any) -> dict[str, Any]:
    """vLLM's `mm_processor_kwargs` that make its video processor resize as ours: our
    adapter asks transformers (which has the option) for the per-frame pixel cap when the
    processor leaves it unset (`Qwen2VLAdapter._video_inputs`); vLLM's processor is told the same."""
    video_processor = getattr(adapter.processor, "video_processor", None)
    if video_processor is None or not hasattr(video_processor, "cap_pixels_per_frame"):
        return {}
    cap = video_processor.cap_pixels_per_frame
    return {"cap_pixels_per_frame": True if cap is None else bool(cap)}


@dataclass
class ClipPlan:
    """One clip as both engines will take it: our frames and prompt, vLLM's loader rate and frames."""

    info: dict[str, Any]
    frame_indices: list[int]
    timestamps: list[float]
    prompt_token_ids: list[int]  # ours, expanded (timestamps, markers and video tokens)
    video_tokens: int
    vllm_fps: float
    vllm_frame_indices: list[int]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def plan_clips(adapter: Any, clips: list[Path], frames: int, media: Any) -> list[ClipPlan]:
    """Each clip decoded and prepared as a job row of ours is (the process's default video
    options under the job's `num_frames`, the family's frame convention), untimed."""
    from vlmbatch.media.video import default_video_options, load_video, parse_video_options

    options = parse_video_options({"num_frames": frames}, default_video_options(media))
    prompt = v1_prompt(adapter)
    plans = []
    for path in clips:
        info = clip_info(path)
        video = load_video(str(path), options, convention=adapter.frame_convention)
        prepared = adapter.prepare(prompt, [], [video], max_tokens=V1_OUTPUT_TOKENS)
        fps = vllm_loader_fps(info, frames)
        plans.append(ClipPlan(info, list(video.frame_indices), list(video.timestamps), list(prepared.prompt_token_ids),
                              sum(item.num_tokens for item in prepared.media), fps, vllm_loader_indices(info, fps)))
    return plans


def request_clips(requests: int, clips: int) -> list[int]:
    """Request r takes clip r mod `clips`."""
    return [r % clips for r in range(requests)]


def write_rows(path: Path, clips: list[Path], order: list[int], prompt: str, name: str) -> Path:
    """The job's rows as Parquet: id, the raw prompt, the video's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [f"{name}-{r:04d}" for r in range(len(order))], "prompt": [prompt] * len(order),
                      "video": [str(clips[k]) for k in order]})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def vllm_video_spec(model: Path, plans: list[ClipPlan], adapter: Any, warmup: list[int], timed: list[int], options: V1Options,
                    max_model_len: int) -> dict[str, Any]:
    """What the vLLM child needs (`bench.peers.vllm._video_child`)."""
    return {
        "model": str(model), "load_format": "dummy", "max_model_len": max_model_len,
        "gpu_memory_utilization": options.vllm_gpu_memory_utilization, "mm_processor_kwargs": vllm_processor_kwargs(adapter),
        "video_processor": type(adapter.processor.video_processor).__name__, "num_frames": options.frames,
        "prompt_token_ids": list(adapter.tokenizer(v1_prompt(adapter))["input_ids"]), "video_token_id": adapter.video_token_id,
        "clips": [{"path": p.info["path"], "fps": p.vllm_fps, "frame_indices": p.frame_indices,
                   "prompt_token_ids": p.prompt_token_ids} for p in plans],
        "warmup": warmup, "timed": timed, "output_tokens": options.output_tokens,
        "decode_threads": options.vllm_decode_threads, "modes": list(options.vllm_modes),
    }


# ---- the runs --------------------------------------------------------------------------------
@dataclass
class V1Options:
    model_shape: str = "qwen3_vl_8b"
    clips: Path = Path("bench-out/v1-clips")
    workdir: Path | None = None  # model folder, datasets and job outputs (default: a temporary folder)
    requests: int = V1_REQUESTS
    frames: int = V1_FRAMES
    output_tokens: int = V1_OUTPUT_TOKENS
    warmup: int = V1_WARMUP  # requests, on our engine and on vLLM
    peers: tuple[str, ...] = ("vllm", "hf")
    ours: bool = True  # False: the peers only (a second call for generate() where one call's 10 minutes are short)
    vllm_pythonpath: tuple[str, ...] = ()
    vllm_timeout_s: float = 420.0
    vllm_gpu_memory_utilization: float = 0.85
    vllm_decode_threads: int = 4
    vllm_modes: tuple[str, ...] = ("files",)
    hf_requests: int = 64
    hf_batches: tuple[int, ...] = (32,)
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int = 16384
    device: str = "auto"


def our_run(llm: Any, model: Path, dataset: Path, warmup: Path, out: Path, preparer: Any, options: V1Options) -> dict[str, Any]:
    """The warm-up job, then the timed one, through `run_job_locally`; the timed job's rows,
    its phases, and how many clips the tower encoded (each request's own: no reuse)."""
    import pyarrow.parquet as pq

    from vlmbatch import job as jobs
    from vlmbatch.engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=options.output_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.time_phases = True  # a sync after each tower run: its time is its own in the phases
    for name, path in (("warmup", warmup), ("timed", dataset)):
        before, model_before = asdict(llm.engine.stats), _tower_counts(llm)
        manifest, job_dir = jobs.plan_job(path, str(model), out / name, engine="paged", sampling=sampling,
                                          media_io_kwargs={"video": {"num_frames": options.frames}}, shard_size=100_000)
        seconds = jobs.run_job_locally(manifest, job_dir, llm, preparer, show_progress=False)
        say(f"ours: {name} job of {manifest.num_rows} rows in {seconds:.1f} s")
    table = pq.read_table(job_dir / "results")
    errors = [e for e in table.column("error").to_pylist() if e]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed in our timed job, e.g. {errors[0]}")
    generated = table.column("num_generated_tokens").to_pylist()
    encoded, hits = (now - then for now, then in zip(_tower_counts(llm), model_before))
    return {"requests": table.num_rows, "seconds": seconds, "output_tokens": sum(generated),
            "lengths_as_forced": set(generated) == {options.output_tokens},
            "prompt_tokens": sorted(set(table.column("num_input_tokens").to_pylist())),
            "phases": {k: round(v - before[k], 3) for k, v in asdict(llm.engine.stats).items()},  # `EngineStats` of the timed job
            "tower_items": encoded, "encoder_cache_hits": hits}


def _tower_counts(llm: Any) -> tuple[int, int]:
    return llm.engine.model.num_encoded_items, llm.engine.model.num_encoder_cache_hits


def hf_runs(folder: Path, adapter: Any, plans: list[ClipPlan], clips: list[Path], options: V1Options, device: Any,
            media: Any, report: dict[str, Any], phases: Any) -> None:
    """`generate()` at each batch size on the first `hf_requests` rows (their clips decoded
    once, untimed: `generate()` has nothing to reuse between batches)."""
    import torch

    from vlmbatch.bench.correctness import free_memory
    from vlmbatch.bench.peers.hf import run_hf_video_peer
    from vlmbatch.bench.shapes import random_hf_model
    from vlmbatch.media.video import default_video_options, load_video, parse_video_options

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_hf_model(folder, dtype, device)
    video_options = parse_video_options({"num_frames": options.frames}, default_video_options(media))
    videos = [load_video(str(path), video_options, convention=adapter.frame_convention) for path in clips]
    order = request_clips(options.hf_requests, len(clips))
    prompt = v1_prompt(adapter)
    try:
        for batch in options.hf_batches:
            result = phases.run(f"peer-hf-b{batch}", run_hf_video_peer, model, adapter, [prompt] * len(order),
                                [videos[k] for k in order], options.output_tokens, batch, device, say)
            if result is not None:
                result.extra["prompt_tokens"] = sorted({plans[k].prompt_tokens for k in order})
                report["runs"][result.engine] = result.to_dict()
    finally:
        del model
        free_memory(device)


def vllm_phase(spec: dict[str, Any], options: V1Options, device: Any, workdir: Path, env: dict[str, str],
               report: dict[str, Any]) -> None:
    """The vLLM child on the spec, in `env`; its runs (checked: same frames, same prompts, forced
    lengths, no prompt-cache hits) go into the report, mismatches raise."""
    import torch

    from vlmbatch.bench.engine import _wait_for_memory
    from vlmbatch.bench.peers.vllm import run_vllm_video_peer, vllm_missing

    missing = vllm_missing(device.type, list(options.vllm_pythonpath))
    if missing:
        report["peers"]["vllm"] = {"status": "skipped", "reason": missing}
        say(f"vllm: skipped ({missing})")
        return
    free_before = torch.cuda.mem_get_info(device)[0]
    say(f"vllm: {len(spec['warmup'])} warm-up and {len(spec['timed'])} timed requests ({', '.join(spec['modes'])}), in a child process")
    result = run_vllm_video_peer(spec, options.vllm_timeout_s, workdir, env, list(options.vllm_pythonpath))
    _wait_for_memory(device, free_before)
    if "skipped" in result:
        report["peers"]["vllm"] = {"status": "skipped", "reason": result["skipped"]}
        say(f"vllm: skipped ({result['skipped']})")
        return
    report["peers"]["vllm"] = {"status": "ran" if result["runs"] else "failed", **{k: result.get(k) for k in ("vllm_version", "load_s", "warmup_s", "config",
                                                                              "video_loader")},
                               "omp_num_threads": env.get("OMP_NUM_THREADS")}  # its processor's torch threads (1 when unset)
    problems = []
    for run in result["runs"]:
        name = f"vllm-{run['mode']}"
        report["runs"][name] = dict(run, requests_per_s=run["requests"] / run["seconds"],
                                    output_tokens_per_s=run["output_tokens"] / run["seconds"])
        say(f"{name}: {run['requests']} requests in {run['seconds']:.1f} s = {run['requests'] / run['seconds']:.2f} req/s; "
            f"all added after {run['all_added_after_s'] or 0:.1f} s; loads {run['load_s_total']:.1f} s in all")
        problems += [f"{name}: {p}" for p in vllm_video_problems(run)]
    if "error" in result or problems:
        raise RuntimeError("; ".join(filter(None, [result.get("error"), *problems])))


def vllm_video_problems(run: dict[str, Any]) -> list[str]:
    """Why a vLLM video run is not comparable with ours, if it is not."""
    problems = []
    if run["prompts_identical_to_ours"] != run["requests"]:
        problems.append(f"{run['requests'] - run['prompts_identical_to_ours']} prompts differ from ours "
                        f"({run['prompt_tokens']} tokens, {run['video_tokens']} video tokens)")
    if run["mode"] == "files" and run["frames_identical_to_ours"] != run["requests"]:
        problems.append(f"its loader took other frames for {run['requests'] - run['frames_identical_to_ours']} requests "
                        f"({run['frame_indices'][:2]})")
    if not run["lengths_as_forced"]:
        problems.append("output lengths differ from the forced ones")
    if run["cached_prompt_tokens"]:
        problems.append(f"{run['cached_prompt_tokens']} prompt tokens came from its prefix cache")
    return problems


def fairness_problems(plans: list[ClipPlan], ours: dict[str, Any] | None) -> list[str]:
    """Checks on our side: vLLM's loader rule takes our frames; our engine encoded each
    request's clip itself (no reuse), its rows generated the forced lengths."""
    problems = [f"clip {Path(p.info['path']).name}: vLLM's loader would take frames {p.vllm_frame_indices}, ours are "
                f"{p.frame_indices}" for p in plans if p.vllm_frame_indices != p.frame_indices]
    if ours is not None:
        if ours["tower_items"] != ours["requests"] or ours["encoder_cache_hits"]:
            problems.append(f"our tower encoded {ours['tower_items']} clips for {ours['requests']} requests "
                            f"({ours['encoder_cache_hits']} cache hits)")
        if ours["phases"].get("num_prefix_hit_tokens"):
            problems.append(f"{ours['phases']['num_prefix_hit_tokens']} of our prompt tokens came from the prefix cache")
        if not ours["lengths_as_forced"]:
            problems.append("our rows did not all generate the forced length")
    return problems


def run(options: V1Options, json_out: Path, media: Any, worker: Any, env: dict[str, str]) -> bool:
    """Every phase of the module docstring, with this process's media and worker
    configurations and `env` for the vLLM child; True when all ran and every check held."""
    import torch

    from vlmbatch import job as jobs
    from vlmbatch.bench.engine import _Phases
    from vlmbatch.bench.shapes import resolve_shape, write_model_folder
    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.loading import resolve_device
    from vlmbatch.families.registry import load_adapter
    from vlmbatch.job.preparer import RowPreparer

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("vlmbatch.job.shard").setLevel(logging.INFO)  # its "shard timing" lines
    device = resolve_device(options.device)
    clips = find_clips(options.clips)
    shape = resolve_shape(options.model_shape)
    report: dict[str, Any] = {
        "benchmark": "v1", "model": shape.name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_count": os.cpu_count(), "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "video_backend": media.video_loader_backend, "peers": {}, "runs": {},
    }
    report["options"]["vllm_pythonpath"] = list(options.vllm_pythonpath)

    def save(current: dict[str, Any]) -> None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(current, indent=2, default=str))

    phases = _Phases(report, save, say)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = options.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        folder = write_model_folder(shape, workdir / "models")
        adapter = load_adapter(str(folder))
        plans = plan_clips(adapter, clips, options.frames, media)
        report["clips"] = [dict(p.info, frame_indices=p.frame_indices, timestamps=p.timestamps, prompt_tokens=p.prompt_tokens,
                                video_tokens=p.video_tokens, vllm_fps=p.vllm_fps, vllm_frame_indices=p.vllm_frame_indices)
                           for p in plans]
        for p in plans:
            info = p.info
            say(f"clip {Path(info['path']).name}: {info['width']}x{info['height']} {info['codec']} {info['fps']:g} fps, "
                f"{info['frames']} frames ({info['frames'] / info['fps']:.1f} s), {info['bytes'] / 2**20:.1f} MiB; frames "
                f"{p.frame_indices}; prompt {p.prompt_tokens} tokens, {p.video_tokens} video tokens")
        timed, warmup = request_clips(options.requests, len(clips)), request_clips(options.warmup, len(clips))
        prompt = v1_prompt(adapter)
        dataset = write_rows(workdir / "v1.parquet", clips, timed, prompt, "v1")
        warmup_rows = write_rows(workdir / "v1-warmup.parquet", clips, warmup, prompt, "v1-warmup")
        max_model_len = max(8192, max(p.prompt_tokens for p in plans) + options.output_tokens)
        if "vllm" in options.peers:
            spec = vllm_video_spec(folder, plans, adapter, warmup, timed, options, max_model_len)
            phases.run("peer-vllm", vllm_phase, spec, options, device, workdir, env, report)
        if "hf" in options.peers:
            report["peers"]["hf"] = {"status": "ran", "timed": "generate() only (frames decoded and processed before each batch)"}
            phases.run("peer-hf", hf_runs, folder, adapter, plans, clips, options, device, media, report, phases)
        if not options.ours:
            report["fairness_problems"] = fairness_problems(plans, None)
            return _finish(report, plans, save, json_out)
        config = EngineConfig(engine="paged", dtype="bfloat16" if device.type == "cuda" else "float32", device=str(device),
                              load_format="dummy", enable_prefix_caching=False, encoder_cache_size=0,
                              max_model_len=max_model_len, max_num_batched_tokens=options.max_num_batched_tokens,
                              gpu_memory_utilization=options.gpu_memory_utilization)
        report["our_engine_config"] = asdict(config)
        llm = phases.run("load-ours", jobs.load_llm, str(folder), config)
        if llm is not None:
            preparer = RowPreparer(worker, media)
            try:
                report["preprocess_workers"] = preparer.num_workers
                ours = phases.run("ours", our_run, llm, folder, dataset, warmup_rows, workdir / "jobs", preparer, options)
            finally:
                preparer.close()
            if ours is not None:
                report["runs"]["paged"] = dict(ours, requests_per_s=ours["requests"] / ours["seconds"],
                                               output_tokens_per_s=ours["output_tokens"] / ours["seconds"])
        report["fairness_problems"] = fairness_problems(plans, report["runs"].get("paged"))
    return _finish(report, plans, save, json_out)


def _finish(report: dict[str, Any], plans: list[ClipPlan], save: Callable[[dict[str, Any]], None], json_out: Path) -> bool:
    for line in summary_lines(report, plans):
        print(line)
    save(report)
    say(f"wrote {json_out}")
    return not report["errors"] and not report["fairness_problems"]


def summary_lines(report: dict[str, Any], plans: list[ClipPlan]) -> list[str]:
    """The closing table and the fairness lines."""
    runs = report["runs"]
    vllm = runs.get("vllm-files")
    frames = sorted({tuple(p.frame_indices) for p in plans})
    sizes = ", ".join(sorted({f"{p.info['width']}x{p.info['height']} {p.info['codec']}" for p in plans}))
    lines = [f"\nV1 on {report['model']} ({report['device']}): {report['options']['requests']} requests, "
             f"{report['options']['frames']} frames of {len(plans)} clips ({sizes}), {report['options']['output_tokens']} output tokens",
             f"{'engine':<30} {'requests':>8} {'seconds':>8} {'req/s':>8} {'out tok/s':>10} {'prompt tok':>11} {'video tok':>10} {'vs vllm':>8}"]
    for name, r in runs.items():
        video = r.get("video_tokens") or sorted({p.video_tokens for p in plans})
        prompt = r.get("prompt_tokens") or r.get("extra", {}).get("prompt_tokens", [])
        ratio = f"{r['requests_per_s'] / vllm['requests_per_s']:.2f}x" if vllm else "-"
        lines.append(f"{_label(name):<30} {r['requests']:>8} {r['seconds']:>8.1f} {r['requests_per_s']:>8.2f} "
                     f"{r['output_tokens_per_s']:>10.0f} {','.join(map(str, prompt)):>11} {','.join(map(str, video)):>10} {ratio:>8}")
    ours = runs.get("paged")
    if ours:
        x = ours["phases"]
        lines.append(f"ours, phases: vision {x['vision_s']:.2f} s, prefill {x['prefill_launch_s']:.2f}+{x['prefill_wait_s']:.2f} s "
                     f"({x['num_prefill_steps']} steps), decode {x['decode_launch_s']:.2f}+{x['decode_wait_s']:.2f} s "
                     f"({x['num_decode_steps']} steps), host {x['host_s']:.2f} s [launch+wait]; tower ran on "
                     f"{ours['tower_items']} clips, {ours['encoder_cache_hits']} cache hits; {x['num_chunked_prefills']} chunked "
                     f"prefills, {x['num_preemptions']} preemptions")
    lines.append(f"same frames: {'yes' if all(p.vllm_frame_indices == p.frame_indices for p in plans) else 'NO'} "
                 f"({'; '.join(','.join(map(str, f)) for f in frames)})")
    if vllm:
        lines.append(f"same prompts: vLLM's {vllm['prompts_identical_to_ours']}/{vllm['requests']} identical to ours token for "
                     f"token; its loader's frames ours for {vllm['frames_identical_to_ours']}/{vllm['requests']}; "
                     f"{vllm['cached_prompt_tokens']} prompt tokens from its prefix cache; frontend added the last request "
                     f"after {vllm['all_added_after_s'] or 0:.1f} s of {vllm['seconds']:.1f} s")
    lines.append("no reuse of repeated clips: ours without prefix caching, encoder_cache_size 0"
                 + ("; vLLM without prefix caching, mm_processor_cache_gb 0 (a media id per request); both read the files "
                    "in the timed region" if vllm else ""))
    lines += [f"{name}: skipped ({peer['reason']})" for name, peer in report["peers"].items() if peer.get("status") == "skipped"]
    lines += [f"FAIRNESS: {p}" for p in report["fairness_problems"]]
    lines += [f"{name} failed: {error.strip().splitlines()[-1]}" for name, error in report["errors"].items()]
    return lines


def _label(name: str) -> str:
    return {"paged": "ours (job, from files)", "vllm-files": "vllm (from files)", "vllm-predecoded": "vllm (pre-decoded)"}.get(
        name, f"{name} (pre-decoded)" if name.startswith("hf-") else name)
