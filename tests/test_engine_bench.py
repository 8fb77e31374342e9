"""`vlmbatch bench engine` end to end on the CPU with the tiny shape (the device run's code path),
and the pieces of its report: the decode-step cost model and the table of peers and ratios."""

import json

import pytest
import torch
from typer.testing import CliRunner

from vlmbatch.bench.engine import summarize, summary_table
from vlmbatch.bench.roofline import decode_step_cost
from vlmbatch.bench.timing import RunResult, triton_compiles


def _bench_engine(tmp_path, *flags: str, shape: str = "tiny"):
    """`vlmbatch bench engine` on a tiny shape, W1 only, 4 requests (`flags` come last and
    win); (CLI result, report)."""
    from vlmbatch.cli.commands import app

    out = tmp_path / "engine.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(app, [
            "bench", "engine", "--model-shape", shape, "--device", "cpu", "--requests", "4", "--workloads", "w1",
            "--decode-batches", "2", "--extra-shapes", "", "--max-num-seqs", "4", "--max-num-batched-tokens", "600",
            "--backends", "torch", "--json", str(out), *flags,
        ])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def test_bench_engine_command_runs_our_engine_and_the_hf_peer_and_skips_vllm_on_the_cpu(tmp_path):
    result, report = _bench_engine(tmp_path, "--peer", "hf,vllm", "--peer-requests-w1", "3", "--peer-batches", "2",
                                   "--check-prompts", "2", "--decode-steps", "4")
    assert report["ok"] and not report["errors"]
    assert report["peers"]["vllm"] == {"status": "skipped", "reason": "vLLM runs on CUDA GPUs only"}
    assert "vllm: skipped (vLLM runs on CUDA GPUs only)" in result.output
    correctness = report["correctness"]
    assert correctness["bound_max_rel_err"] == 1e-4  # fp32 on both sides
    assert correctness["backends"]["torch"]["max_rel_err"] < 1e-4 and correctness["backends"]["torch"]["top1_agreement"] == 1.0
    runs = {r["engine"]: r for r in report["runs"]}
    # the peer ran 3 requests in batches of 2 (a full and a partial batch) after a full warm-up batch
    assert runs["hf-generate-b2"]["requests"] == 3 and runs["hf-generate-b2"]["output_tokens"] == 3 * 128
    assert runs["hf-generate-b2"]["extra"]["batches"] == 2 and runs["hf-generate-b2"]["extra"]["warmup_requests"] == 2
    assert runs["paged"]["output_tokens"] == 4 * 128 and runs["paged"]["extra"]["num_prefill_steps"] >= 1
    assert runs["paged"]["extra"]["triton_compiles"] == {}  # the torch backend on the CPU compiles no Triton kernel
    assert report["warmup"]["requests"] == 64 and "warm-up: 64 requests" in result.output  # as many as vLLM gets
    assert report["workloads"]["w1"]["prompt_tokens"] == 288
    assert report["async_decoding"]["ok"] and report["async_decoding"]["requests"] >= 2
    assert report["decode_roofline"]["tiny"][0]["batch"] == 2
    summary = report["summary"]["w1"]
    assert summary["paged_vs_hf_best"] == pytest.approx(runs["paged"]["requests_per_s"] / runs["hf-generate-b2"]["requests_per_s"])
    floor = report["floors"]["w1"]  # the tower's FLOPs counted on the workload's own images
    assert floor["requests"] == 4 and floor["flops_by_part"]["vision"] > 0 and floor["max_requests_per_s"] > runs["paged"]["requests_per_s"]
    assert "w1 floor: " in result.output and "at the measured ceilings" in result.output
    assert summary["vllm_requests_per_s"] is None and summary["paged_vs_vllm"] is None


def test_a_shape_whose_family_is_missing_is_refused_by_name(monkeypatch):
    from dataclasses import replace

    from vlmbatch.bench.shapes import SHAPES
    from vlmbatch.cli.commands import app

    monkeypatch.setitem(SHAPES, "future_vl", replace(SHAPES["qwen3_vl_8b"], name="future_vl", family="future_vl"))
    result = CliRunner().invoke(app, ["bench", "engine", "--model-shape", "future_vl", "--device", "cpu"])
    assert result.exit_code == 2 and "future_vl: family not available" in result.output


def test_quantize_vision_without_a_quantization_is_refused():
    from vlmbatch.cli.commands import app

    result = CliRunner().invoke(app, ["bench", "engine", "--model-shape", "3b", "--device", "cpu", "--quantize-vision"])
    assert result.exit_code == 2 and "needs --quantization fp8 or fp8-block" in result.output


def test_a_written_checkpoint_runs_through_the_products_loader_without_a_reference(tmp_path):
    """`bench make-checkpoint` then `bench engine --model DIR --no-reference` (the 72B FP8
    run's two commands): no transformers model, so no generate() peer (skipped, saying why)
    and no logit check; our engine loads the FP8 checkpoint itself and runs W1."""
    from vlmbatch.cli.commands import app

    made = CliRunner().invoke(app, ["bench", "make-checkpoint", str(tmp_path / "ckpt"), "--model-shape", "tiny",
                                    "--quantization", "fp8-block", "--shard-mib", "1"])
    assert made.exit_code == 0, made.output
    result, report = _bench_engine(tmp_path, "--model", str(tmp_path / "ckpt" / "tiny"), "--no-reference", "--peer", "hf")
    assert report["ok"] and not report["errors"] and report["correctness"]["backends"] == {}
    assert report["peers"]["hf"] == {"status": "skipped", "reason": "--no-reference builds no transformers model"}
    assert [r["engine"] for r in report["runs"]] == ["paged"] and report["runs"][0]["requests"] == 4


@pytest.mark.parametrize("flags, message", [(["--model-shape", "tiny", "--no-reference"], "needs --model"),
                                            (["--model", "/nonexistent/model"], "no such model folder")])
def test_bench_engine_refuses_a_reference_free_run_without_a_checkpoint(flags, message):
    from vlmbatch.cli.commands import app

    result = CliRunner().invoke(app, ["bench", "engine", "--device", "cpu", *flags])
    assert result.exit_code == 2 and message in result.output


def test_summary_puts_both_peers_beside_ours_with_the_ratios():
    runs = [RunResult("hf-generate-b128", "w1", 1024, 1024 / 21.6, 1024 * 128, extra={"batch_size": 128}),
            RunResult("hf-generate-b256", "w1", 1024, 1024 / 26.2, 1024 * 128, extra={"batch_size": 256}),
            RunResult("vllm", "w1", 1024, 1024 / 56.6, 1024 * 128),
            RunResult("paged", "w1", 1024, 1024 / 110.0, 1024 * 128)]
    summary = summarize(runs)["w1"]
    assert summary["hf_best_batch"] == "256" and summary["hf_best_requests_per_s"] == pytest.approx(26.2)
    assert summary["paged_vs_hf_best"] == pytest.approx(110 / 26.2) and summary["paged_vs_vllm"] == pytest.approx(110 / 56.6)
    table = "\n".join(summary_table(summarize(runs), {"vllm": {"status": "ran"}}))
    assert "hf b128" in table and "21.60" in table and "56.60" in table and f"{110 / 26.2:.2f}x" in table and f"{110 / 56.6:.2f}x" in table


def test_summary_takes_each_engines_best_pass_and_lists_them():
    runs = [RunResult("vllm", "w1", 1024, 1024 / 49.5, 1024 * 128), RunResult("vllm", "w1#2", 1024, 1024 / 57.6, 1024 * 128),
            RunResult("paged", "w1", 1024, 1024 / 62.5, 1024 * 128), RunResult("paged", "w1#2", 1024, 1024 / 70.7, 1024 * 128),
            RunResult("paged", "w1+schema", 1024, 1024 / 60.0, 1024 * 128)]
    summary = summarize(runs)
    assert set(summary) == {"w1", "w1+schema"}
    assert summary["w1"]["paged_requests_per_s"] == pytest.approx(70.7) and summary["w1"]["vllm_requests_per_s"] == pytest.approx(57.6)
    assert summary["w1"]["paged_vs_vllm"] == pytest.approx(70.7 / 57.6)
    assert summary["w1"]["passes"]["paged"] == pytest.approx([62.5, 70.7])
    table = "\n".join(summary_table(summary, {}))
    assert "w1 passes (the best of each engine above): ours 62.50, 70.70; vllm 49.50, 57.60" in table


def test_decode_step_cost_counts_weights_once_and_kv_per_sequence(tiny_qwen):
    from transformers import AutoConfig

    from vlmbatch.engine.decoder import Decoder, DecoderSpec
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS
    from vlmbatch.engine.layers.rotary import RotaryEmbedding

    text = AutoConfig.from_pretrained(tiny_qwen).text_config
    decoder = Decoder(text, RotaryEmbedding(torch.ones(8), mrope_section=[2, 3, 3]), DecoderSpec(qkv_bias=True), TORCH_KERNELS)
    one_bytes, one_flops = decode_step_cost(decoder, batch=1, context=0)
    weights = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens")) * 4
    assert one_bytes == weights and one_flops == 2 * weights // 4
    two_bytes, _ = decode_step_cost(decoder, batch=2, context=10)
    kv_per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * decoder.head_dim * 4
    assert two_bytes == weights + 2 * 10 * kv_per_token


def test_workload_floor_counts_every_matmul_and_the_decode_steps_kv_reads(tiny_qwen):
    """The floor's parts against sums written out token by token: the LM head per sampled
    token, attention over each prompt position's and each decoded token's context, and the
    KV bytes the decode steps read."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vlmbatch.bench.floor import workload_floor
    from vlmbatch.bench.workloads import Request, Workload
    from vlmbatch.engine.decoder import Decoder, DecoderSpec
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS
    from vlmbatch.engine.layers.rotary import RotaryEmbedding

    text = AutoConfig.from_pretrained(tiny_qwen).text_config
    decoder = Decoder(text, RotaryEmbedding(torch.ones(8), mrope_section=[2, 3, 3]), DecoderSpec(qkv_bias=True), TORCH_KERNELS)
    engine = SimpleNamespace(model=SimpleNamespace(decoder=decoder), runner=SimpleNamespace(kv_dtype=torch.float32))
    prompt, outputs = 10, [3, 5]
    workload = Workload("w2", 28, prompt, [Request("", [], [], n) for n in outputs])
    ceilings = {"matmul_flops_per_s": 1e12, "copy_bytes_per_s": 1e11}

    floor = workload_floor(engine, workload, ceilings, vision_per_request=(7e6, 0.0))

    layers, heads, kv_heads, dim = text.num_hidden_layers, decoder.layers[0].self_attn.num_heads, decoder.num_kv_heads, decoder.head_dim
    decode_contexts = [c for n in outputs for c in range(prompt + 1, prompt + n)]
    contexts = list(range(1, prompt + 1)) * len(outputs) + decode_contexts
    parts = floor["flops_by_part"]
    assert parts["lm_head"] == 2 * text.vocab_size * text.hidden_size * sum(outputs)
    assert parts["attention"] == sum(4 * layers * heads * dim * c for c in contexts)
    assert parts["vision"] == 7e6 * len(outputs)
    linear_weights = sum(m.weight.numel() for m in decoder.layers.modules() if isinstance(m, torch.nn.Linear))
    tokens = sum(prompt + n - 1 for n in outputs)
    assert 2 * linear_weights * tokens <= parts["linear"] <= 1.1 * 2 * linear_weights * tokens  # the norms' weights count too
    assert floor["kv_read_bytes"] == sum(layers * 2 * kv_heads * dim * 4 * c for c in decode_contexts)
    assert floor["fp8_flops"] == 0 and floor["seconds"] == pytest.approx(sum(parts.values()) / 1e12 + floor["kv_read_bytes"] / 1e11)
    assert floor["max_requests_per_s"] == pytest.approx(2 / floor["seconds"])

    window = 12  # a sliding first layer (Gemma 3's kind): it attends to, and reads, its window only
    decoder.layers[0].self_attn.window = window
    windowed = workload_floor(engine, workload, ceilings, vision_per_request=(7e6, 0.0))
    per_layer = 4 * heads * dim
    assert windowed["flops_by_part"]["attention"] == sum(per_layer * (min(c, window) + (layers - 1) * c) for c in contexts)
    assert windowed["kv_read_bytes"] == sum(2 * kv_heads * dim * 4 * (min(c, window) + (layers - 1) * c) for c in decode_contexts)


def test_workload_floor_takes_the_fp8_products_at_the_fp8_rate(tiny_model_dir):
    """A decoder built in FP8 (`Fp8Linear` projections, e4m3 experts, as `load_format="dummy"`
    builds it where FP8 GEMMs run): its projections' and top-k experts' FLOPs and the tower's
    FP8 ones go at the FP8 rate, everything else at bf16's; the FLOPs are those of the same
    decoder in bf16."""
    import dataclasses
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vlmbatch.bench.floor import workload_floor
    from vlmbatch.bench.roofline import fp8_flops_per_token
    from vlmbatch.bench.workloads import Request, Workload
    from vlmbatch.engine.decoder import Decoder
    from vlmbatch.engine.dummy_weights import materialize
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS, Fp8Gemms
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    from vlmbatch.engine.layers.rotary import RotaryEmbedding
    from vlmbatch.families.registry import FAMILIES
    from vlmbatch.kernels import fp8 as fp8_kernels
    from vlmbatch.quantization import online_scheme

    text = AutoConfig.from_pretrained(tiny_model_dir("qwen3_vl_moe")).text_config
    spec = FAMILIES["qwen3_vl_moe"].parts().ENGINE_MODEL.decoder_spec(text)
    gemms = Fp8Gemms(*(None,) * 4, fp8_kernels.scaled_mm_supported, None, None)  # never called: the floor runs nothing
    kernels = dataclasses.replace(TORCH_KERNELS, name="triton", fp8=gemms)  # "triton": the experts are the fused kernels' (FP8)

    def decoder(scheme):
        with torch.device("meta"):
            built = Decoder(text, RotaryEmbedding(torch.ones(8)), spec, kernels)
        materialize(built, torch.device("cpu"), torch.float32, scheme, kernels)
        return built

    fp8, plain = decoder(online_scheme("fp8-block")), decoder(None)
    projections = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    moe = fp8.layers[0].mlp
    assert projections and moe.fp8_scales
    per_token = 2 * sum(m.weight.numel() for m in projections) + 2 * len(fp8.layers) * moe.top_k * (moe.gate_up[0].numel() + moe.down[0].numel())
    assert fp8_flops_per_token(fp8) == per_token and fp8_flops_per_token(plain) == 0
    workload = Workload("w1", 28, 10, [Request("", [], [], n) for n in (3, 5)])
    ceilings = {"matmul_flops_per_s": 1e12, "fp8_matmul_flops_per_s": 2e12, "copy_bytes_per_s": 1e11}
    floors = [workload_floor(SimpleNamespace(model=SimpleNamespace(decoder=d), runner=SimpleNamespace(kv_dtype=torch.float32)),
                             workload, ceilings, (7e6, 3e6)) for d in (fp8, plain)]  # fmt: skip
    ours, bf16 = floors
    fp8_flops = per_token * sum(10 + n - 1 for n in (3, 5)) + 3e6 * 2
    assert ours["flops"] == bf16["flops"] and ours["fp8_flops"] == fp8_flops and bf16["fp8_flops"] == 3e6 * 2
    assert ours["seconds"] == pytest.approx((ours["flops"] - fp8_flops) / 1e12 + fp8_flops / 2e12 + ours["kv_read_bytes"] / 1e11)


def test_decode_step_cost_of_a_mixture_of_experts_counts_the_experts_a_batch_reads():
    from transformers import Qwen3VLMoeTextConfig

    from vlmbatch.engine.decoder import Decoder, DecoderSpec
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS
    from vlmbatch.engine.layers.rotary import RotaryEmbedding
    from vlmbatch.families.qwen3_vl_moe.model import moe_or_dense

    text = Qwen3VLMoeTextConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                                vocab_size=100, decoder_sparse_step=1, mlp_only_layers=[])
    decoder = Decoder(text, RotaryEmbedding(torch.ones(4)), DecoderSpec(qk_norm=True, mlp=moe_or_dense), TORCH_KERNELS)
    per_expert = 3 * 32 * 16
    dense = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens") and "gate_up" not in n and ".down" not in n)
    one, one_flops = decode_step_cost(decoder, batch=1, context=0)
    assert one == pytest.approx(4 * (dense + 2 * 2 * per_expert))  # batch 1 reads its top-2 experts per layer
    many, _ = decode_step_cost(decoder, batch=10_000, context=0)
    assert many == pytest.approx(4 * (dense + 2 * 8 * per_expert))  # a large batch reads every expert
    assert one_flops == 2 * (dense + 2 * 2 * per_expert)


def test_bench_engine_times_w1_under_a_schema_with_the_mask_per_step(tmp_path):
    """`--structured extraction6`: W1 again under the schema ("w1+schema" beside "w1"), rows
    running to max_tokens (the open `notes` string), and the mask's cost at the asked batch sizes."""
    result, report = _bench_engine(tmp_path, "--peer", "", "--check-prompts", "1", "--decode-steps", "2",
                                   "--structured", "extraction6", "--mask-batches", "2,4")
    assert not report["errors"]
    runs = {r["workload"]: r for r in report["runs"] if r["engine"] == "paged"}
    constrained = runs["w1+schema"]["extra"]
    assert constrained["mask_num_masked_steps"] >= 128 and constrained["mask_fill_ms_per_step"] > 0
    assert runs["w1+schema"]["output_tokens"] > 3 * 100  # the open string keeps rows going (a few may close)
    assert [row["batch"] for row in report["structured"]["mask_at_batches"]] == [2, 4]
    assert all(row["mask_rows_per_step"] > 1 and row["mask_apply_ms_per_step"] > 0 for row in report["structured"]["mask_at_batches"])
    assert report["structured"]["w1_schema_vs_w1"] > 0 and "W1 under the schema:" in result.output
    assert "w1+schema" in report["summary"]


# slow (dense shapes): the MoE case runs the same command with block FP8 on its attention
# projections too, and the dummy-load test below runs per-channel fp8 with its logits checked.
@pytest.mark.parametrize("shape, quantization", [
    pytest.param("tiny", "fp8", marks=pytest.mark.slow), pytest.param("tiny", "fp8-block", marks=pytest.mark.slow),
    ("tiny_qwen3_vl_moe", "fp8-block"),
])  # fmt: skip
def test_bench_engine_with_online_fp8_checks_logits_against_the_round_tripped_weights(tmp_path, shape, quantization):
    """On the CPU our engine dequantizes the FP8 weights at load, so against transformers
    holding the same round-tripped weights in fp32 the logits agree to float32 rounding
    (requantizing a round-tripped weight gives back its fp8 values; MoE experts included);
    the reported bound is the FP8 one used on the GPU."""
    from vlmbatch.bench.fp8 import FP8_MIN_BOUND

    _, report = _bench_engine(tmp_path, "--requests", "2", "--peer", "", "--check-prompts", "2", "--decode-steps", "4",
                              "--quantization", quantization, shape=shape)
    correctness = report["correctness"]
    assert correctness["bound_max_rel_err"] == FP8_MIN_BOUND
    assert correctness["backends"]["torch"]["max_rel_err"] < 1e-4 and correctness["backends"]["torch"]["top1_agreement"] == 1.0


def test_bench_engine_dummy_load_reports_the_kv_cache_left_and_checks_a_cut_model(tmp_path):
    """`--load-format dummy` (the 72B path): no transformers copy of the model, so no
    generate() peer; the logits are checked on the shape cut to --reference-layers."""
    result, report = _bench_engine(tmp_path, "--requests", "2", "--peer", "hf", "--check-prompts", "1", "--decode-steps", "2",
                                   "--decode-batches", "1", "--quantization", "fp8", "--load-format", "dummy",
                                   "--reference-layers", "1")
    assert report["peers"]["hf"]["status"] == "skipped" and report["correctness"]["reference_layers"] == 1
    assert report["memory"]["kv_blocks"] > 0 and report["memory"]["decoder_weights_gib"] > 0
    assert "KV cache" in result.output and {r["engine"] for r in report["runs"]} == {"paged"}


# slow: a developer's profile of the timed shapes; no other option of the command depends on it.
@pytest.mark.slow
def test_bench_engine_profiles_a_full_prefill_step_and_decode_steps(tmp_path):
    """`--profile-prefill` fills one step's token budget (600 // 288 = 2 prompts) with images
    encoded beforehand and reports that step's costliest ops; `--profile-batches` the decode's."""
    result, report = _bench_engine(tmp_path, "--peer", "", "--profile-prefill", "--profile-batches", "2", "--check-prompts", "1",
                                   "--decode-steps", "2")
    prefill = report["prefill_profile"]
    assert prefill["prompts"] == 2 and prefill["tokens"] == 576 and prefill["ms"] > 0
    assert prefill["encoder_cache_hits"] == 2  # the step ran the language model alone: both images came from the cache
    assert prefill["kernels"] and all(k["ms"] > 0 and k["calls"] >= 1 for k in prefill["kernels"])
    assert any("linear" in k["kernel"] or "mm" in k["kernel"] for k in prefill["kernels"])  # the decoder's GEMMs are in it
    assert report["decode_kernels"]["tiny-b2"] and report["vision_profile"]["images"] > 0
    vision = report["vision_profile"]
    assert 0 < vision["upload_ms"] and 0 < vision["on_device_ms"] and vision["ops"]  # the encode split: upload, then the rest
    assert "prefill tiny: one step of 2 prompts (576 tokens)" in result.output


def test_bench_step_inputs_times_a_prefill_step_with_its_decoding_rows(tmp_path):
    from vlmbatch.bench.step_inputs import run

    result = run("tiny", 6, 2, "cpu", tmp_path / "step-inputs.json")
    assert result["decoding_rows"] == 6 and result["rows"] == 7 and result["prompt_tokens"] > 0
    assert json.loads((tmp_path / "step-inputs.json").read_text())["median_ms"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles nothing under the CPU interpreter)")
def test_triton_compiles_counts_each_new_specialization_of_a_kernel_once():
    import triton
    import triton.language as tl

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)

    x = torch.ones(8, device="cuda")
    with triton_compiles() as first:
        double[(1,)](x, 8, BLOCK=8)
        double[(1,)](x, 8, BLOCK=8)  # the same specialization: compiled once
    with triton_compiles() as again:
        double[(1,)](x, 8, BLOCK=8)
    with triton_compiles() as wider:
        double[(1,)](x, 8, BLOCK=16)
    assert first == {"double": 1} and again == {} and wider == {"double": 1}
    assert torch.equal(x, torch.full((8,), 16.0, device="cuda"))


def test_repeats_and_stage_media_both_time_each_pass_on_fresh_requests(tmp_path):
    """`--repeats 2` times each workload again on requests no earlier pass cached, the
    summary keeping the best; `--stage-media both` (how staging is timed against the plain
    uploads in one call) follows each of our passes with one with staging on, on other
    requests, reported as its own workload beside the plain one."""
    result, report = _bench_engine(tmp_path, "--repeats", "2", "--stage-media", "both", "--peer", "")
    assert result.exit_code == 0 and report["ok"], result.output
    assert [r["workload"] for r in report["runs"]] == ["w1", "w1+staged", "w1#2", "w1+staged#2"]
    assert all(r["output_tokens"] == 4 * 128 for r in report["runs"])
    assert all(r["extra"]["num_prefix_hit_tokens"] == 0 for r in report["runs"][1:]), "a later pass must not reuse an earlier one's cache"
    plain = [r for r in report["runs"] if r["workload"] in ("w1", "w1#2")]
    assert report["summary"]["w1"]["paged_requests_per_s"] == max(r["requests_per_s"] for r in plain)
    assert "w1 passes" in result.output
    assert set(report["summary"]) == {"w1", "w1+staged"} and len(report["summary"]["w1+staged"]["passes"]["paged"]) == 2
    staged = {r["workload"]: r["extra"]["num_staged_media_used"] for r in report["runs"]}
    assert staged["w1"] == staged["w1#2"] == 0 and staged["w1+staged"] > 0 and staged["w1+staged#2"] > 0

    from vlmbatch.cli.commands import app

    refused = CliRunner().invoke(app, ["bench", "engine", "--device", "cpu", "--stage-media", "sometimes"])
    assert refused.exit_code == 2 and "choose off, on or both" in refused.output
