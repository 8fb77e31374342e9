"""The engine benchmark end to end on the CPU with the tiny checkpoint (the GPU script's code path)."""

import torch

from vlmbatch.bench.engine import BenchOptions, decode_step_cost, run_bench


def test_bench_runs_peer_and_engine_checks_logits_and_records_failures():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saved = []
    try:
        report = run_bench(BenchOptions(
            shape="tiny", requests=4, peer_requests=2, peer_batches=(2,), workloads=("w1",), check_prompts=2,
            decode_steps=4, decode_batches=(2,), extra_shapes=(), max_num_seqs=4, max_num_batched_tokens=600,
            backends=("no-such-backend", "torch"),
        ), echo=lambda line: None, save=saved.append)
    finally:
        torch.set_num_threads(threads)
    correctness = report["correctness"]
    assert correctness["bound_max_rel_err"] == 1e-4  # fp32 on both sides
    # a backend that cannot run is recorded as failed; the rest of the run goes on with one that passed
    assert not report["ok"] and "unknown attention backend" in correctness["backends"]["no-such-backend"]["error"]
    assert correctness["fastest_backend"] == "torch" and not report["errors"]
    assert len(saved) > 3 and saved[-1] is report
    assert correctness["backends"]["torch"]["max_rel_err"] < 1e-4
    assert correctness["backends"]["torch"]["top1_agreement"] == 1.0
    runs = {r["engine"]: r for r in report["runs"]}
    assert runs["paged"]["output_tokens"] == 4 * 128 and runs["hf-generate-b2"]["output_tokens"] == 2 * 128
    assert runs["paged"]["extra"]["num_prefill_steps"] >= 1 and runs["paged"]["decode_step_ms"] > 0
    asynchronous = report["async_decoding"]
    assert asynchronous["requests"] >= 2 and asynchronous["ok"]  # as many as one prefill step holds
    assert asynchronous["equal"] == asynchronous["awaited_repeat_equal"] == asynchronous["requests"]
    roofline = report["decode_roofline"]["tiny"][0]
    assert roofline["batch"] == 2 and 0 < roofline["pct_of_roofline"]
    assert report["summary"]["w1"]["speedup"] > 0


def test_decode_step_cost_counts_weights_once_and_kv_per_sequence(tiny_qwen):
    from vlmbatch.engine.layers.rotary import RotaryEmbedding
    from vlmbatch.engine.models.decoder import Decoder
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(tiny_qwen).text_config
    decoder = Decoder(text, RotaryEmbedding(torch.ones(8), mrope_section=[2, 3, 3]), bias=True)
    one_bytes, one_flops = decode_step_cost(decoder, batch=1, context=0)
    weights = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens")) * 4
    assert one_bytes == weights and one_flops == 2 * weights // 4
    two_bytes, _ = decode_step_cost(decoder, batch=2, context=10)
    kv_per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * decoder.head_dim * 4
    assert two_bytes == weights + 2 * 10 * kv_per_token
