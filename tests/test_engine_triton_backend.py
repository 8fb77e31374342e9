"""The `triton` attention backend plugged into the engine, run by Triton's CPU interpreter.

The interpreter must be switched on before triton is imported, so the check runs in a
fresh process: greedy tokens with our kernels (KV write, paged varlen prefill with a
chunk and a prefix-cache hit, split-KV decode, fused SiLU-and-mul, and the decode-step
linear layers through the skinny-GEMM kernel where the measured policy says, or all of
them) must equal
transformers' generate(). Qwen3-VL adds the q/k head norms fused into the rotary kernel.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.hf import generate_inputs
    from vlmbatch.engine.loading import load_hf_model
    from vlmbatch.engine.paged import PagedEngine
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.families.registry import load_adapter

    path, decode_linear = sys.argv[1], sys.argv[2]
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", attention_backend="triton",
                         num_kv_blocks=16, block_size=16, max_num_batched_tokens=24, decode_linear=decode_linear))
    text = "<|im_start|>user\nThe quick brown fox jumps over the lazy dog. What color is the car?<|im_end|>\n"
    prompts = [adapter.prepare(text + "<|im_start|>assistant\n")] * 2  # the repeat hits the prefix cache
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert engine.stats.num_chunked_prefills > 0 and engine.stats.num_prefix_hit_tokens > 0, engine.stats
    skinny_layers = [m for m in engine.model.decoder.modules() if getattr(m, "skinny", None) is not None]
    layers = len(engine.model.decoder.layers)
    assert len(skinny_layers) == {"auto": layers + 1, "skinny": 4 * layers + 1}[decode_linear]  # gate/up + LM head, or all
    hf = load_hf_model(path, torch.float32, torch.device("cpu"))
    expected = hf.generate(**generate_inputs(hf, adapter, prompts[:1], 0), max_new_tokens=4,
                           min_new_tokens=4, do_sample=False)[0, prompts[0].num_tokens:].tolist()
    assert outputs == {"0": expected, "1": expected}, (outputs, expected)

    from vlmbatch.engine.layers.activation import silu_and_mul
    from vlmbatch.kernels import fused_silu_and_mul
    gate_up = torch.randn(3, 2 * 1500)  # two column blocks, a ragged tail
    torch.testing.assert_close(fused_silu_and_mul(gate_up), silu_and_mul(gate_up), rtol=1e-5, atol=1e-6)
    bf16 = gate_up.to(torch.bfloat16)  # the interpreter rounds casts toward zero: allow 2 bf16 ulps
    torch.testing.assert_close(fused_silu_and_mul(bf16), silu_and_mul(bf16), rtol=2e-2, atol=1e-2)
    print("ok")
    """
)


# The all-skinny policy runs in `-m slow` (the skinny kernel itself is tested in
# test_kernels_elementwise.py, the measured policy here by default).
@pytest.mark.parametrize(("arch", "decode_linear"), [("qwen2_5_vl", "auto"), pytest.param("qwen2_5_vl", "skinny", marks=pytest.mark.slow),
                                                     ("qwen3_vl", "auto")])
def test_triton_backend_matches_transformers_under_the_interpreter(tiny_model_dir, arch, decode_linear):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir(arch)), decode_linear], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

