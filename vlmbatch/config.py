"""Configuration: flags over `VLMBATCH_*` variables over defaults, read once at the edge.

The edges (the CLI commands, a worker process at start-up, `vlmbatch serve` at start-up,
`LLM(...)`) build these frozen objects with `from_env(<the process environment>, **flags)`
and pass them down; nothing below them reads or writes the environment. Every option knows its
variable, so the README's table and `--help` texts name the same thing.

An option the caller does not know (a typo in `LLM(..., max_num_seq=8)`, a stale job
file) is an error that names it, never silently dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Self, TypeVar

from vlmbatch.errors import JobError

C = TypeVar("C")


class ConfigError(JobError):
    """A configuration value or option name is wrong; the message names it."""


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"expected 1/0, true/false, on/off or yes/no, got {value!r}")


def parse_cpu_list(value: str) -> frozenset[int]:
    """`"0-7"` or `"0,2,4"` (Linux's cpu-list syntax) as a set of core numbers."""
    cores: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return frozenset(cores)


def _lower(value: str) -> str:
    return value.strip().lower()


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda value: None if value.strip().lower() in ("", "none", "auto") else parse(value)


def option(default: Any, env: str | None = None, parse: Callable[[str], Any] | None = None,
           choices: tuple[str, ...] | None = None, help: str = "") -> Any:
    """A dataclass field that knows its environment variable, how to parse it, and its choices."""
    metadata = {"env": env, "parse": parse, "choices": choices, "help": help}
    if isinstance(default, (dict, list, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _parse(f: Any, raw: str) -> Any:
    parse = f.metadata.get("parse")
    if parse is None:
        kind = type(f.default) if f.default not in (None, MISSING) else str
        parse = parse_bool if kind is bool else kind
    return parse(raw)


def _check_choices(instance: Any) -> None:
    for f in fields(instance):
        choices = f.metadata.get("choices")
        value = getattr(instance, f.name)
        if choices and value not in choices:
            where = f.metadata.get("env")
            raise ConfigError(f"{f.name}={value!r}{f' ({where})' if where else ''}: choose one of {', '.join(choices)}")


def load(cls: type[C], env: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """`cls` from `overrides` (flags; None means "not given") over `env` over the defaults."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ConfigError(f"unknown {getattr(cls, 'kind', cls.__name__)} option(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for name, f in known.items():
        variable = f.metadata.get("env")
        raw = (env or {}).get(variable, "") if variable else ""
        if raw.strip():
            try:
                values[name] = _parse(f, raw)
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r}: {exc}") from exc
        if overrides.get(name) is not None:
            values[name] = overrides[name]
    return cls(**values)


def to_json(config: Any) -> str:
    """`config` as JSON, for a child process's command line (`from_json` rebuilds it)."""
    return json.dumps(asdict(config), default=sorted)  # sets (a core list) as sorted lists


def from_json(cls: type[C], text: str, env: Mapping[str, str] | None = None) -> C:
    """The `cls` that `to_json` wrote; options it left unset (None) come from `env`, then
    the defaults. An unknown option name is a `ConfigError`, as for flags."""
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{getattr(cls, 'kind', cls.__name__)} configuration is not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{getattr(cls, 'kind', cls.__name__)} configuration must be a JSON object, got {text!r}")
    return load(cls, env, **values)


def describe(cls: type) -> list[tuple[str, str | None, Any, str]]:
    """(option, variable, default, help) of every option of `cls`, for docs and `--help`."""
    rows = []
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, f.metadata.get("env"), default, f.metadata.get("help", "")))
    return rows


class Options:
    """Base of the configuration classes: `from_env` is `load` for that class."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Flags (`overrides`, None meaning "not given") over `env` over the defaults."""
        return load(cls, env, **overrides)


ENGINES = ("auto", "paged", "hf")
ATTENTION_BACKENDS = ("auto", "triton", "torch", "flash-attn")
DECODE_LINEAR = ("auto", "skinny", "cublas")
GPU_IMAGE_DECODE = ("auto", "on", "off")
QUANTIZATION = ("none", "fp8", "fp8-block")
KV_CACHE_DTYPES = ("auto", "fp8")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig(Options):
    """How one model is run: which engine, on what, with which kernels and memory."""

    kind = "engine"

    engine: str = option("auto", "VLMBATCH_ENGINE", parse=_lower, choices=ENGINES,
                         help="paged (ours), hf (transformers generate(), the reference) or auto")
    dtype: str = option("auto", "VLMBATCH_DTYPE", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    device: str = option("auto", "VLMBATCH_DEVICE", help="auto, cpu, cuda or cuda:N")
    attention_backend: str = option("auto", "VLMBATCH_ATTENTION_BACKEND", parse=_lower, choices=ATTENTION_BACKENDS,
                                    help="paged attention kernels; auto: triton on CUDA, torch elsewhere")
    max_num_seqs: int | None = option(None, "VLMBATCH_MAX_NUM_SEQS", parse=_optional(int),
                                      help="most requests in one batch (default paged: 1024 on a GPU of >= 70 GiB, "
                                           "else 256; hf: 64)")
    max_num_batched_tokens: int | None = option(None, "VLMBATCH_MAX_NUM_BATCHED_TOKENS", parse=_optional(int),
                                                help="token budget of one prefill step (default: 16384 on a GPU of "
                                                     ">= 70 GiB, else 8192)")
    max_model_len: int | None = option(None, "VLMBATCH_MAX_MODEL_LEN", parse=_optional(int),
                                       help="context length cap (default: the model's)")
    gpu_memory_utilization: float = option(0.9, "VLMBATCH_GPU_MEMORY_UTILIZATION",
                                           help="share of GPU memory for weights, activations and the KV cache")
    num_kv_blocks: int | None = option(None, "VLMBATCH_NUM_KV_BLOCKS", parse=_optional(int),
                                       help="KV-cache blocks of every layer (default: sized from free memory)")
    block_size: int | None = option(None, "VLMBATCH_BLOCK_SIZE", parse=_optional(int),
                                    help="tokens per KV block (default: 256 on GPU, 16 on CPU)")
    enable_prefix_caching: bool = option(True, "VLMBATCH_ENABLE_PREFIX_CACHING", help="share KV blocks of equal prefixes")
    encoder_cache_size: int = option(256, "VLMBATCH_ENCODER_CACHE_SIZE",
                                     help="media items whose vision-tower outputs are kept for requests that repeat them "
                                          "(0: none reused, even two equal items in one step)")
    encoder_cache_mb: int = option(2048, "VLMBATCH_ENCODER_CACHE_MB",
                                   help="GPU memory (MiB) those kept outputs may hold; the oldest go first")
    enforce_eager: bool = option(False, "VLMBATCH_ENFORCE_EAGER", help="no CUDA graphs")
    min_admission_batch: int = option(64, "VLMBATCH_MIN_ADMISSION_BATCH",
                                      help="free slots before waiting requests join a running batch (1 = at once)")
    async_decode: bool = option(True, "VLMBATCH_ASYNC_DECODE", help="launch decode step n+1 before reading step n's tokens")
    stage_media: bool = option(False, "VLMBATCH_STAGE_MEDIA",
                               help="upload the pixels of the prompts waiting next while the GPU runs a step (a copy stream)")
    decode_linear: str = option("auto", "VLMBATCH_DECODE_LINEAR", parse=_lower, choices=DECODE_LINEAR,
                                help="decode-step linear layers: auto (measured choice), skinny (our kernel) or cublas")
    pdl: bool = option(True, "VLMBATCH_PDL", help="programmatic dependent launch in small decode graphs (Hopper+)")
    gpu_image_decode: str = option("auto", "VLMBATCH_GPU_IMAGE_DECODE", parse=_lower, choices=GPU_IMAGE_DECODE,
                                   help="JPEGs decoded by nvJPEG in the engine process (auto: paged engine on CUDA)")
    grammar_fill_threads: int = option(0, "VLMBATCH_GRAMMAR_FILL_THREADS",
                                       help="threads filling one step's structured-output masks (xgrammar's batch fill, GIL "
                                            "released); 0 = auto: half this process's cores, at most 8")
    quantization: str = option("none", "VLMBATCH_QUANTIZATION", parse=_lower, choices=QUANTIZATION,
                               help="fp8: quantize the language model's weights at load (per channel, dynamic per-token "
                                    "activations); fp8-block: in 128x128 blocks (1x128 activation groups), as Qwen's -FP8 "
                                    "releases; a checkpoint's own quantization_config always applies")
    quantize_vision: bool = option(False, "VLMBATCH_QUANTIZE_VISION", help="with --quantization fp8: the vision tower's linear layers too")
    kv_cache_dtype: str = option("auto", "VLMBATCH_KV_CACHE_DTYPE", parse=_lower, choices=KV_CACHE_DTYPES,
                                 help="KV-cache element type: auto (the compute dtype) or fp8 (e4m3, per-tensor scale 1)")
    load_format: str = option("auto", "VLMBATCH_LOAD_FORMAT", parse=_lower, choices=LOAD_FORMATS,
                              help="auto (the checkpoint's weights) or dummy (random weights of its shapes, built on the device "
                                   "in their final dtype, FP8 layers directly in fp8: benchmarks of models whose bf16 copy would not fit)")
    seed: int = option(0, "VLMBATCH_SEED", help="seeds torch, so unseeded sampling repeats run to run")
    trust_remote_code: bool = option(False, "VLMBATCH_TRUST_REMOTE_CODE", help="allow a checkpoint's own Python code")

    def __post_init__(self) -> None:
        _check_choices(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.encoder_cache_size < 0 or self.encoder_cache_mb < 0:
            raise ConfigError(f"encoder_cache_size and encoder_cache_mb must be 0 or more, got "
                              f"{self.encoder_cache_size!r} and {self.encoder_cache_mb!r}")
        if self.grammar_fill_threads < 0:
            raise ConfigError(f"grammar_fill_threads must be 0 (auto) or more, got {self.grammar_fill_threads!r}")

    @property
    def mask_fill_threads(self) -> int:
        """`grammar_fill_threads` with auto resolved. On the H200 host (16 cores) 8 threads took
        W1 under a six-field schema from 80.6% to 90.6% of W1 (BENCHMARKS.md, session 7); on 2
        shared cores threads gave no consistent gain, so auto leaves half the cores free."""
        if self.grammar_fill_threads:
            return self.grammar_fill_threads
        return max(1, min(8, len(os.sched_getaffinity(0)) // 2))

    def updated(self, **overrides: Any) -> "EngineConfig":
        """A copy with the non-None `overrides`; an unknown name is a `ConfigError`."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class MediaConfig(Options):
    """Defaults of media loading in this process (a job's and a row's own options apply on top)."""

    kind = "media"

    image_fetch_timeout: float = option(10.0, "VLMBATCH_IMAGE_FETCH_TIMEOUT", help="seconds before an image download is abandoned")
    video_fetch_timeout: float = option(30.0, "VLMBATCH_VIDEO_FETCH_TIMEOUT", help="seconds before a video download is abandoned")
    video_loader_backend: str = option("opencv", "VLMBATCH_VIDEO_LOADER_BACKEND",
                                       help="default video decoder: opencv, pyav, torchcodec, pynvvideocodec, deepstream")
    media_loading_thread_count: int = option(8, "VLMBATCH_MEDIA_LOADING_THREAD_COUNT", help="parallelism of media loading")
    video_options: dict[str, Any] = option({}, help="this process's video options (the `video` entry of "
                                                   "`vlmbatch worker --media-io-kwargs`), under each job's and row's own")


@dataclass(frozen=True)
class QueueConfig(Options):
    """How queued shards are delivered and retried."""

    kind = "queue"

    visibility_timeout: float = option(20.0, "VLMBATCH_QUEUE_VISIBILITY_TIMEOUT",
                                       help="seconds a running shard may go without a heartbeat before it is delivered again")
    poison_crashes: int = option(3, "VLMBATCH_QUEUE_POISON_CRASHES",
                                 help="crashes of one row range after which its shard is split to isolate a poison row")


@dataclass(frozen=True)
class WorkerConfig(Options):
    """What the process that runs shards may use besides the GPU: its cores and preprocessing pool."""

    kind = "worker"

    preprocess_workers: int | None = option(None, "VLMBATCH_PREPROCESS_WORKERS", parse=_optional(int),
                                            help="processes preparing rows (0: in the engine's thread; default: from the cores)")
    worker_cpus: frozenset[int] | None = option(None, "VLMBATCH_WORKER_CPUS", parse=parse_cpu_list,
                                                help="this GPU process's share of the cores (set by `vlmbatch worker`)")
    pin_worker_cpus: bool = option(True, "VLMBATCH_PIN_WORKER_CPUS", help="run each GPU process only on its share of the cores")
    gpu_media_budget_mb: int = option(4096, "VLMBATCH_GPU_MEDIA_BUDGET_MB",
                                      help="MB of decoded media that rows in flight may hold on the GPU")
    storage_options: dict[str, Any] | None = option(None, "VLMBATCH_STORAGE_OPTIONS", parse=json.loads,
                                                    help="options of s3:// (fsspec) job folders and datasets, over the "
                                                    "AWS configuration (`--storage-options`)")
    metrics_port: int | None = option(None, "VLMBATCH_METRICS_PORT", parse=_optional(int),
                                      help="Prometheus port of a `vlmbatch worker`'s first GPU process (the next "
                                      "slots take the next ports); unset: no metrics endpoint")

    def __post_init__(self) -> None:
        if self.worker_cpus is not None and not isinstance(self.worker_cpus, frozenset):
            object.__setattr__(self, "worker_cpus", frozenset(self.worker_cpus))  # e.g. a list, from JSON

    @property
    def gpu_media_budget_bytes(self) -> int:
        return self.gpu_media_budget_mb * 2**20
