"""JPEGs deferred to the engine (vlmbatch/engine/gpu_images.py): prompts built from the header
size carry exactly the CPU path's token ids and grids, bad files still fail at preparation,
the engine turns encoded items into the CPU path's tensors and the same tokens, and the
setting is refused where it cannot run.

The engine side runs on the CPU here (torchvision's CPU JPEG decoder stands in for nvJPEG
and decodes exactly as Pillow does); the CUDA comparison is marked `gpu`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from vlmbatch.config import EngineConfig, MediaConfig, WorkerConfig
from vlmbatch.engine.gpu_images import EncodedImageDecoder, defers_image_decoding
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, JobError
from vlmbatch.families.prompt import PreparedPrompt, collate
from vlmbatch.families.registry import load_adapter
from vlmbatch.io.readers import ColumnMap
from vlmbatch.job.prepare import media_loader_for, prepare_row
from vlmbatch.media.gpu_image import GPU_MAX_ABS_DIFF, GPU_MEAN_ABS_DIFF
from vlmbatch.media.image import load_image
from vlmbatch.media.types import EncodedImage
from vlmbatch.testing.data import encode_image, exif_rotated_jpeg, image_bytes, make_image, truncated_image_bytes

# Odd sizes included: smart_resize rounds each side to the patch*merge factor and scales to the bounds.
SIZES = [(64, 48), (97, 61), (33, 200), (448, 448), (1001, 37), (28, 28)]
QWEN_PROMPT = "<|im_start|>user\n{images}Describe.<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "qwen2_5_vl": lambda n: QWEN_PROMPT.format(images="<|vision_start|><|image_pad|><|vision_end|>" * n),
    "qwen2_vl": lambda n: QWEN_PROMPT.format(images="<|vision_start|><|image_pad|><|vision_end|>" * n),
    "llava": lambda n: "USER: " + "<image>\n" * n + "Describe. ASSISTANT:",
    "gemma3": lambda n: "<start_of_turn>user\n" + "<start_of_image>" * n + "Describe.<end_of_turn>\n<start_of_turn>model\n",
}


def _jpeg(size: tuple[int, int], seed: int = 0, mode: str = "RGB") -> bytes:
    return encode_image(make_image(*size, seed=seed, mode=mode), "JPEG", quality=90)


def _smooth_jpeg(size: tuple[int, int], seed: int = 0) -> bytes:
    """A smooth colour field without chroma subsampling: nvJPEG and libjpeg-turbo then differ
    only by IDCT rounding (a level of 255), so greedy tokens of a tiny random model are a
    fair check of the path rather than of a near-tie between two logits."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]] / max(size)
    channels = [rng.uniform(40, 200) + rng.uniform(-50, 50) * xs + rng.uniform(-50, 50) * ys for _ in range(3)]
    pixels = np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)
    return encode_image(Image.fromarray(pixels), "JPEG", quality=95, subsampling=0)


def _encoded(data: bytes) -> EncodedImage:
    with Image.open(io.BytesIO(data)) as image:
        return EncodedImage(data, image.width, image.height)


def _is_encoded(prompt: PreparedPrompt) -> bool:
    return bool(prompt.media) and all(item.encoded is not None for item in prompt.media)


def _grids(prompt: PreparedPrompt) -> list:
    return [item.tensors["image_grid_thw"].tolist() for item in prompt.media if "image_grid_thw" in item.tensors]


def _decoded(adapter, prompt: PreparedPrompt, device: str) -> dict[str, torch.Tensor]:
    return collate(EncodedImageDecoder(adapter.model_path, torch.device(device)).decode(prompt.media))


def _row(tmp_path: Path, arch: str, adapter, images: list[bytes], defer: bool = True):
    media = media_loader_for(tmp_path / "data.jsonl", None, MediaConfig())
    raw = {"prompt": PROMPTS[arch](len(images)), "images": images}
    return prepare_row(0, raw, ColumnMap(), SamplingParams(max_tokens=4), adapter, media, defer_jpegs=defer)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "llava", "gemma3"])
def test_header_size_tokenisation_equals_the_cpu_path(arch: str, tiny_model_dir) -> None:
    adapter = load_adapter(str(tiny_model_dir(arch)))
    datas = [_jpeg(size, seed) for seed, size in enumerate(SIZES)] + [_jpeg((50, 70), 9, mode="L")]
    for data in datas:
        cpu = adapter.prepare(PROMPTS[arch](1), [load_image(data)], max_tokens=4)
        deferred = adapter.prepare_encoded(PROMPTS[arch](1), [_encoded(data)], max_tokens=4)
        assert deferred.prompt_token_ids == cpu.prompt_token_ids
        assert _grids(deferred) == _grids(cpu)
        assert [i.num_tokens for i in deferred.media] == [i.num_tokens for i in cpu.media]
    several = [_encoded(d) for d in datas[:3]]
    cpu = adapter.prepare(PROMPTS[arch](3), [load_image(p.data) for p in several], max_tokens=4)
    assert adapter.prepare_encoded(PROMPTS[arch](3), several, max_tokens=4).prompt_token_ids == cpu.prompt_token_ids


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava", "gemma3"])
def test_encoded_items_decode_to_the_cpu_path_tensors(arch: str, tiny_model_dir) -> None:
    adapter = load_adapter(str(tiny_model_dir(arch)))
    datas = [_jpeg(size, seed) for seed, size in enumerate(SIZES[:4])]
    cpu = collate(adapter.prepare(PROMPTS[arch](4), [load_image(d) for d in datas]).media)
    decoded = _decoded(adapter, adapter.prepare_encoded(PROMPTS[arch](4), [_encoded(d) for d in datas]), "cpu")
    assert sorted(decoded) == sorted(cpu)
    diff = (decoded["pixel_values"] - cpu["pixel_values"]).abs()
    assert diff.max() <= GPU_MAX_ABS_DIFF and diff.mean() <= GPU_MEAN_ABS_DIFF


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_rows_defer_only_plain_jpegs(arch: str, tiny_model_dir, tmp_path: Path) -> None:
    adapter = load_adapter(str(tiny_model_dir(arch)))
    jpeg, png = _jpeg((64, 48)), image_bytes(64, 48, fmt="PNG")
    assert _is_encoded(_row(tmp_path, arch, adapter, [jpeg, jpeg]).prepared)
    assert not _is_encoded(_row(tmp_path, arch, adapter, [jpeg], defer=False).prepared)
    for images in ([png], [jpeg, png], [exif_rotated_jpeg(64, 32)]):  # any non-plain image: the whole row on the CPU
        item = _row(tmp_path, arch, adapter, images)
        assert item.error is None and all("pixel_values" in i.tensors and i.encoded is None for i in item.prepared.media)


@pytest.mark.parametrize("bad", ["truncated", "corrupt_scan", "too_large"])
def test_bad_jpegs_fail_at_preparation(bad: str, tiny_qwen: Path, tmp_path: Path) -> None:
    adapter = load_adapter(str(tiny_qwen))
    good = image_bytes(256, 256, seed=1, fmt="JPEG")
    data = {
        "truncated": truncated_image_bytes("JPEG", keep=0.5),
        "corrupt_scan": good[:600] + bytes(len(good) - 602) + good[-2:],  # header intact, entropy data zeroed
        "too_large": _jpeg((4000, 3000)),
    }[bad]
    media = media_loader_for(tmp_path / "d.jsonl", {"image": {"max_pixels": 10_000_000}} if bad != "too_large" else {"image": {"max_pixels": 1_000_000}},
                             MediaConfig())
    item = prepare_row(0, {"prompt": PROMPTS["qwen2_5_vl"](1), "image": data}, ColumnMap(), SamplingParams(), adapter, media, defer_jpegs=True)
    cpu = prepare_row(0, {"prompt": PROMPTS["qwen2_5_vl"](1), "image": data}, ColumnMap(), SamplingParams(), adapter, media)
    expected = ErrorType.MEDIA_TOO_LARGE if bad == "too_large" else ErrorType.MEDIA_DECODE
    assert item.error is not None and item.error.error_type == expected
    assert cpu.error is not None and cpu.error.error_type == expected


def test_pool_workers_pass_encoded_jpegs_and_row_errors(tiny_qwen: Path, tmp_path: Path) -> None:
    """Through real worker processes: same ids and grids as the CPU path, bytes instead of pixels."""
    from vlmbatch.io.manifest import Manifest
    from vlmbatch.io.readers import open_dataset
    from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer
    from vlmbatch.testing.data import write_image_dataset

    dataset = write_image_dataset(tmp_path / "rows.jsonl", 8, image_mode="data_url", image_format="JPEG", bad_rows={2: "corrupt"})
    reader = open_dataset(dataset)
    manifest = Manifest.for_dataset(reader, output_dir=tmp_path / "out", model=str(tiny_qwen), engine="auto",
                                    sampling={"max_tokens": 4}, shard_size=100)  # fmt: skip
    rows = [row for batch in reader.iter_rows() for row in batch]
    spec, defaults = AdapterSpec(str(tiny_qwen)), SamplingParams(max_tokens=4)
    here, pool = (RowPreparer(WorkerConfig(preprocess_workers=n), MediaConfig()) for n in (0, 2))
    with here, pool:
        cpu = {i.row_id: i for i in here.prepare(rows, RowPreparation.for_job(manifest, spec, defaults, MediaConfig()))}
        encoded = {i.row_id: i for i in pool.prepare(rows, RowPreparation.for_job(manifest, spec, defaults, MediaConfig(),
                                                                                   defer_jpegs=True))}
    assert sorted(encoded) == sorted(cpu)
    assert encoded[2].error is not None and encoded[2].error.error_type == cpu[2].error.error_type == ErrorType.MEDIA_DECODE
    for row_id, item in encoded.items():
        if row_id != 2:
            assert item.prepared.prompt_token_ids == cpu[row_id].prepared.prompt_token_ids
            assert _is_encoded(item.prepared)
            assert _grids(item.prepared) == _grids(cpu[row_id].prepared)


def test_the_setting(tiny_qwen: Path) -> None:
    adapter = load_adapter(str(tiny_qwen))
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=16, block_size=4))
    assert engine.config.gpu_image_decode == "auto" and not engine.decodes_images_on_gpu
    assert not defers_image_decoding(engine, "auto")  # auto: the CPU engine keeps the CPU path
    assert not defers_image_decoding(engine, "off")
    with pytest.raises(JobError, match="needs the paged engine on a CUDA device"):
        defers_image_decoding(engine, "on")
    with pytest.raises(JobError, match="auto, on, off"):
        EngineConfig.from_env({"VLMBATCH_GPU_IMAGE_DECODE": "sometimes"})


# The variable's parsing is tested above; its end-to-end run is in `-m slow`.
@pytest.mark.parametrize("how", ["flag", pytest.param("env", marks=pytest.mark.slow)])
def test_forced_on_without_cuda_refuses_the_job(how: str, tiny_qwen: Path, tmp_path: Path) -> None:
    """The in-process job path: `submit` refuses with the reason, before any row runs."""
    import os
    import subprocess
    import sys

    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"prompt": "hello"}) + "\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLMBATCH_PREPROCESS_WORKERS": "0"}
    args = [sys.executable, "-m", "vlmbatch.cli", "submit", str(dataset), "--model", str(tiny_qwen),
            "--output", str(tmp_path / "out"), "--device", "cpu", "--max-tokens", "2"]  # fmt: skip
    if how == "flag":
        args += ["--gpu-image-decode", "on"]
    else:
        env["VLMBATCH_GPU_IMAGE_DECODE"] = "on"
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "needs the paged engine on a CUDA device" in done.stderr
    assert not list((tmp_path / "out").glob("*/results/*.parquet"))
    if how == "flag":
        typo = subprocess.run(args[:-1] + ["sometimes"], capture_output=True, text=True, env=env, timeout=300)
        assert typo.returncode == 2 and "auto, on, off" in typo.stderr


def _greedy(engine: Any, prompts: dict) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=6, temperature=0))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return outputs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_engine_decodes_encoded_images_to_the_same_tokens(arch: str, tiny_model_dir) -> None:
    path = str(tiny_model_dir(arch))
    adapter = load_adapter(path)
    datas = [_jpeg(size, seed) for seed, size in enumerate(SIZES[:4])]
    rows = [[datas[0]], [datas[1], datas[2]], [datas[0]], [datas[3]]]  # a repeated image
    engines = [PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)) for _ in range(2)]
    cpu = _greedy(engines[0], {str(i): adapter.prepare(PROMPTS[arch](len(r)), [load_image(d) for d in r]) for i, r in enumerate(rows)})
    encoded = {str(i): adapter.prepare_encoded(PROMPTS[arch](len(r)), [_encoded(d) for d in r]) for i, r in enumerate(rows)}
    assert _greedy(engines[1], encoded) == cpu
    assert engines[1].model.num_encoded_items == engines[0].model.num_encoded_items == 4  # the repeat is encoded once
    assert all(_is_encoded(p) for p in encoded.values())  # the prompts keep bytes, not pixels


def test_the_reference_engine_decodes_encoded_prompts_it_is_given(tiny_qwen: Path) -> None:
    """Jobs never defer JPEGs for `--engine hf`, but a prompt built that way still works there."""
    from vlmbatch.engine.hf import HFEngine

    adapter = load_adapter(str(tiny_qwen))
    engine = HFEngine(adapter, EngineConfig(dtype="float32", device="cpu"))
    datas = [_smooth_jpeg(size, seed) for seed, size in enumerate(SIZES[:3])]
    cpu = {str(i): adapter.prepare(PROMPTS["qwen2_5_vl"](1), [load_image(d)]) for i, d in enumerate(datas)}
    encoded = {str(i): adapter.prepare_encoded(PROMPTS["qwen2_5_vl"](1), [_encoded(d)]) for i, d in enumerate(datas)}
    mixed = {"0": encoded["0"], "1": cpu["1"], "2": encoded["2"]}  # one batch of both kinds
    assert _greedy(engine, mixed) == _greedy(engine, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_nvjpeg_path_matches_the_cpu_path_end_to_end(arch: str, tiny_model_dir) -> None:
    path = str(tiny_model_dir(arch))
    adapter = load_adapter(path)
    # Smooth JPEGs: the stated tolerance is for natural images. On pure-noise 4:2:0 JPEGs
    # single pixels differ by up to ~1.0 (measured on the H200: nvJPEG and libjpeg-turbo
    # upsample chroma differently), which test_gpu_image's photo-like images do not show.
    datas = [_smooth_jpeg(size, seed) for seed, size in enumerate(SIZES)]
    for data in datas:
        cpu = collate(adapter.prepare(PROMPTS[arch](1), [load_image(data)]).media)
        on_gpu = _decoded(adapter, adapter.prepare_encoded(PROMPTS[arch](1), [_encoded(data)]), "cuda")
        diff = (on_gpu["pixel_values"].cpu() - cpu["pixel_values"]).abs()
        assert diff.max() <= GPU_MAX_ABS_DIFF and diff.mean() <= GPU_MEAN_ABS_DIFF
    engines = [PagedEngine(adapter, EngineConfig(dtype="float32", device="cuda", num_kv_blocks=64, block_size=16)) for _ in range(2)]
    cpu_prompts = {str(i): adapter.prepare(PROMPTS[arch](1), [load_image(d)]) for i, d in enumerate(datas)}
    gpu_prompts = {str(i): adapter.prepare_encoded(PROMPTS[arch](1), [_encoded(d)]) for i, d in enumerate(datas)}
    assert defers_image_decoding(engines[1], "on")
    assert _greedy(engines[1], gpu_prompts) == _greedy(engines[0], cpu_prompts)
    torch.cuda.synchronize()


def _job_results(model: Path, tmp_path: Path, device: str, modes: tuple[str, ...]) -> dict[str, list[tuple]]:
    """Run one JPEG Parquet job (a corrupt row included) in-process once per GPU-decode mode."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmbatch import job as jobs
    from vlmbatch.testing.data import corrupt_image_bytes

    images = [_smooth_jpeg(SIZES[i % len(SIZES)], i) for i in range(12)]
    images[3] = corrupt_image_bytes()
    dataset = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": [PROMPTS["qwen2_5_vl"](1)] * 12, "image": images}), dataset)
    from vlmbatch.job.preparer import RowPreparer

    llm = jobs.load_llm(str(model), EngineConfig(engine="paged", dtype="float32", device=device))
    results = {}
    for mode in modes:
        manifest, job_dir = jobs.plan_job(dataset, str(model), tmp_path / mode, sampling=SamplingParams(max_tokens=8, temperature=0.0), shard_size=5)
        manifest.extra["gpu_image_decode"] = mode
        manifest.save()
        with RowPreparer(WorkerConfig(), MediaConfig()) as preparer:
            jobs.run_job_locally(manifest, job_dir, llm, preparer, show_progress=False)
        table = pq.read_table(job_dir / "results").sort_by("row_id").to_pylist()
        results[mode] = [(r["row_id"], r["generated_text"], r["num_input_tokens"], r["error_type"]) for r in table]
    return results


def test_the_job_setting_travels_in_the_manifest(tiny_qwen: Path, tmp_path: Path) -> None:
    results = _job_results(tiny_qwen, tmp_path, "cpu", ("auto", "off"))
    assert results["auto"] == results["off"]
    assert results["off"][3][3] == ErrorType.MEDIA_DECODE and sum(r[3] is None for r in results["off"]) == 11


@pytest.mark.gpu
def test_a_job_with_gpu_decode_on_gives_the_same_results_as_off(tiny_qwen: Path, tmp_path: Path) -> None:
    """In-process job, paged engine on CUDA in fp32: JPEG rows (and a corrupt one) end alike."""
    results = _job_results(tiny_qwen, tmp_path, "cuda", ("on", "off"))
    assert results["on"] == results["off"]
    assert results["on"][3][3] == ErrorType.MEDIA_DECODE and sum(r[3] is None for r in results["on"]) == 11


def test_worker_flag_is_checked() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vlmbatch.cli", "worker", "--broker", "redis://127.0.0.1:1", "--model", "m",
                           "--gpu-image-decode", "sometimes"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "auto, on, off" in done.stderr
