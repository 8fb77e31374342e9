"""`vlmbatch bench tower` on the CPU with the tiny Qwen3-VL shape (the device run's code path), and its refusal of families without a tower of ours."""

import json

import pytest
import torch
from typer.testing import CliRunner

from vlmbatch.cli.commands import app


def test_bench_tower_times_both_towers_and_compares_them(tmp_path):
    out = tmp_path / "tower.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(app, ["bench", "tower", "--model-shape", "tiny_qwen3_vl", "--images", "2", "--device", "cpu",
                                          "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["family"] == "qwen3_vl" and report["images"] == 2 and report["dtype"] == "float32"
    assert len(report["relative_error_per_level"]) == 3 and report["relative_error"] <= 1e-5  # merged + 2 DeepStack levels
    for tower in ("transformers", "vlmbatch"):
        assert len(report[tower]["times_ms"]) == 5 and report[tower]["ms_per_image"] > 0 and report[tower]["flops"] > 0
    assert "vlmbatch" in result.output and "ms / image" in result.output


def test_bench_tower_refuses_a_family_without_a_tower_of_ours():
    result = CliRunner().invoke(app, ["bench", "tower", "--model-shape", "tiny_llava_next", "--device", "cpu"])
    assert result.exit_code == 2
    assert "llava_next family runs transformers' vision tower" in result.output and "qwen3_vl_8b" in result.output


@pytest.mark.parametrize("shape, family", [("tiny_gemma3", "gemma3"), ("tiny_llava_onevision", "llava_onevision"),
                                           ("tiny_smolvlm", "smolvlm"), ("tiny_internvl", "internvl")])
def test_bench_tower_runs_the_siglip_families(tmp_path, shape, family):
    """Our SigLIP tower (and its InternViT variant) against transformers' on every tile of the W1 images (CPU, fp32)."""
    out = tmp_path / "tower.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # OneVision also with SDPA held to one backend: math runs here, cuDNN's has no CPU kernel
        backends = ["--sdpa-backends", "math,cudnn"] if family == "llava_onevision" else []
        result = CliRunner().invoke(app, ["bench", "tower", "--model-shape", shape, "--images", "2", "--device", "cpu",
                                          "--json", str(out), "--profile", *backends])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["family"] == family and report["images"] == 2 and report["tiles"] >= 2
    assert len(report["relative_error_per_level"]) == 1 and report["relative_error"] <= 1e-5
    for tower in ("transformers", "vlmbatch"):
        assert report[tower]["ms_per_image"] > 0 and report[tower]["flops"] > 0
        assert report["profile"][tower] and all(row["ms"] >= 0 and 0 <= row["share"] <= 1 for row in report["profile"][tower])
    if backends:
        assert report["vlmbatch sdpa=math"]["relative_error"] <= 1e-5 and report["vlmbatch sdpa=math"]["ms_per_image"] > 0
        assert "error" in report["vlmbatch sdpa=cudnn"] and "vlmbatch sdpa=math" in report["profile"]


def test_bench_tower_refuses_an_unknown_sdpa_backend():
    result = CliRunner().invoke(app, ["bench", "tower", "--model-shape", "tiny_gemma3", "--device", "cpu", "--sdpa-backends", "fa9"])
    assert result.exit_code == 2 and "unknown fa9" in result.output


def test_bench_tower_times_ours_in_fp8_as_quantize_vision_builds_it(tmp_path):
    """`--quantize-vision` on the tiny Qwen2.5-VL shape (CPU: the tower's weights round-tripped
    through e4m3 per channel): a row of its own whose error against transformers' tower is
    FP8's rounding, above fp32's and within e4m3's relative half ulp (2^-4)."""
    out = tmp_path / "tower.json"
    result = CliRunner().invoke(app, ["bench", "tower", "--model-shape", "tiny", "--images", "2", "--device", "cpu",
                                      "--json", str(out), "--quantize-vision"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    fp8 = report["vlmbatch fp8"]
    assert report["relative_error"] <= 1e-5 and 1e-4 < fp8["relative_error"] < 2.0**-4
    assert fp8["ms_per_image"] > 0 and "vlmbatch fp8" in result.output
