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
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from vlmbatch.bench.workloads import Workload

# What vLLM 0.26 needs on the lent H200 (../shared/FACTS.md); set unless the caller set them.
CHILD_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_missing(device_type: str, pythonpath: list[str]) -> str | None:
    """Why the vLLM peer cannot run here (no CUDA, or no `vllm` on the path), or None."""
    if device_type != "cuda":
        return "vLLM runs on CUDA GPUs only"
    if PathFinder.find_spec("vllm", [*pythonpath, *sys.path]) is None:
        return "vllm is not importable (install it, or pass its folder with --vllm-pythonpath)"
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
    spec_path, result_path = workdir / "vllm-spec.json", workdir / "vllm-result.json"
    longest = max(w.prompt_tokens + max(r.output_tokens for r in w.requests) for w in workloads)
    spec = {"model": str(model), "load_format": load_format, "max_model_len": max(4096, longest),
            "gpu_memory_utilization": gpu_memory_utilization, "warmup": warmup.to_json(),
            "workloads": [w.to_json() for w in workloads], "structured": structured}
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    child_env = {**CHILD_ENV, **env}
    if pythonpath:  # replaces ours: a transformers carried for our engine must not reach vLLM
        child_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    command = [sys.executable, "-m", "vlmbatch.bench.peers.vllm", str(spec_path), str(result_path)]
    child = subprocess.Popen(command, env=child_env, start_new_session=True)
    error = None
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
    if error and "skipped" not in result:
        result["error"] = result.get("error") or error
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

