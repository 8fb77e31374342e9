"""FP8 checkpoints and online FP8 on the CPU: formats read as published, refused when not ours.

Tiny checkpoints are rewritten in the two published layouts (`make-tiny-model
--quantization fp8-block|fp8-dynamic`). On the CPU the engine dequantizes the fp8 weights
at load (`engine/fp8_loading.py`), so its greedy tokens must equal a `transformers` model
holding the same dequantized weights, in fp32. Which reference each test uses is in its
docstring: transformers 5.24 dequantizes block-wise FP8 itself on the CPU (FineGrainedFP8,
`dequantize=True` without a GPU) for the dense families; it cannot read compressed-tensors
without the `compressed-tensors` package (not a dependency), nor per-expert FP8 experts of
Qwen3-VL-MoE (its qwen3_vl_moe conversion only handles fused experts), so those compare
against the original tiny model with the dequantized weights written into it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from engine_harness import build_requests, hf_greedy, run_greedy
from safetensors.torch import load_file

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.errors import JobError
from vlmbatch.families.registry import load_adapter, model_family
from vlmbatch.quantization import BLOCK, CHANNEL, checkpoint_scheme
from vlmbatch.testing.fp8_checkpoints import quantize_checkpoint

ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=48,
              min_admission_batch=1)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    """`fp8_dir(arch, fmt)`: a copy of the tiny `arch` checkpoint in FP8 layout `fmt`."""
    built: dict[tuple[str, str], Path] = {}

    def get(arch: str, fmt: str) -> Path:
        if (arch, fmt) not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            shutil.copytree(tiny_model_dir(arch), out, dirs_exist_ok=True)
            built[arch, fmt] = quantize_checkpoint(out, fmt)
        return built[arch, fmt]

    return get


def _dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight of an fp8 tensor and its scale ([N, 1] per channel or 128x128 blocks),
    written out here independently of the engine's code."""
    scale = scale.float()
    if scale.shape[0] != w.shape[0]:
        scale = scale.repeat_interleave(128, 0)[: w.shape[0]]
    if scale.shape[1] != 1:
        scale = scale.repeat_interleave(128, 1)[:, : w.shape[1]]
    return w.float() * scale


def dequantized_reference(original: Path, quantized: Path) -> torch.nn.Module:
    """The original tiny model (fp32, transformers) with every quantized weight of
    `quantized` replaced by its dequantized value; per-expert weights are stacked into
    transformers' fused expert tensors (gate rows first)."""
    model = load_hf_model(str(original), torch.float32, torch.device("cpu"))
    tensors = {}
    for path in quantized.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    names = dict(model.named_parameters())
    deq = {}
    for key, scale in tensors.items():
        if key.endswith((".weight_scale", ".weight_scale_inv")):
            base = key.rsplit(".", 1)[0]
            deq[base] = _dequantized(tensors[base + ".weight"], scale)
    with torch.no_grad():
        for base, weight in deq.items():
            if ".experts." in base:
                continue
            name = next(n for n in names if n.endswith("layers." + base.split("layers.", 1)[1] + ".weight")
                        and ("language_model" in n or "text_model" in n))
            names[name].copy_(weight)
        for name, param in names.items():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                prefix = name.split("layers.", 1)[1].rsplit(".", 1)[0]  # "{i}.mlp.experts"
                for expert in range(param.shape[0]):
                    stem = next(b for b in deq if b.endswith(f"layers.{prefix}.{expert}.down_proj")).rsplit(".", 1)[0]
                    if name.endswith("gate_up_proj"):
                        param[expert].copy_(torch.cat([deq[f"{stem}.gate_proj"], deq[f"{stem}.up_proj"]]))
                    else:
                        param[expert].copy_(deq[f"{stem}.down_proj"])
    return model


def _assert_greedy_equal(engine_dir: Path, reference: torch.nn.Module, family: str, count: int = 6, **options) -> PagedEngine:
    adapter = load_adapter(str(engine_dir))
    engine = PagedEngine(adapter, EngineConfig(**ENGINE, **options))
    prepared, outputs = run_greedy(engine, adapter, build_requests(adapter, family, count, seed=5))
    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(reference, adapter, prompt, max_tokens), request_id
    return engine


def test_block_fp8_qwen2_5_vl_matches_transformers_own_loading(fp8_dir):
    """Reference: transformers' own loading of the same fp8-block checkpoint (it dequantizes
    to fp32 on the CPU, exactly w * weight_scale_inv: checked here on one weight too)."""
    torch.set_num_threads(1)
    path = fp8_dir("qwen2_5_vl", "fp8-block")
    theirs = load_hf_model(str(path), torch.float32, torch.device("cpu"))
    tensors = load_file(str(path / "model.safetensors"))
    q = theirs.model.language_model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, _dequantized(tensors["model.layers.0.self_attn.q_proj.weight"],
                                       tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]))
    _assert_greedy_equal(path, theirs, "qwen2_5_vl")


@pytest.mark.parametrize("arch, fmt", [("qwen2_5_vl", "fp8-dynamic"), ("qwen3_vl_moe", "fp8-block"), ("qwen3_vl_moe", "fp8-dynamic")])
def test_fp8_checkpoint_matches_the_dequantized_reference(fp8_dir, tiny_model_dir, arch, fmt):
    """Reference: the original tiny model built by transformers, with the checkpoint's fp8
    weights dequantized into it (transformers cannot load these formats here, see the module
    docstring). MoE: experts stored one per tensor, as the published FP8 releases do."""
    torch.set_num_threads(1)
    path = fp8_dir(arch, fmt)
    _assert_greedy_equal(path, dequantized_reference(tiny_model_dir(arch), path), arch)


def test_online_fp8_matches_transformers_with_the_round_tripped_weights(tiny_model_dir):
    """Reference: the tiny bf16/fp32 model in transformers with each decoder projection
    replaced by its per-channel fp8 round trip (scale = channel amax / 448), which is what
    `--quantization fp8` runs; the round trip's error is bounded by e4m3's 3 mantissa bits
    (relative half-ulp 2^-4 per element, so at most 2^-4 relative L2 per channel)."""
    torch.set_num_threads(1)
    path = tiny_model_dir("qwen2_5_vl")
    reference = load_hf_model(str(path), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for layer in reference.model.language_model.layers:
            for linear in (*[getattr(layer.self_attn, f"{p}_proj") for p in "qkvo"],
                           layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):  # fmt: skip
                w = linear.weight
                scale = w.abs().amax(dim=1, keepdim=True) / 448.0
                round_trip = (w / scale).to(torch.float8_e4m3fn).float() * scale
                error = (round_trip - w).norm(dim=1) / w.norm(dim=1)
                assert error.max() < 2.0**-4 and error.mean() > 0
                linear.weight.copy_(round_trip)
    adapter = load_adapter(str(path))
    engine = PagedEngine(adapter, EngineConfig(**ENGINE, quantization="fp8"))
    prepared, outputs = run_greedy(engine, adapter, build_requests(adapter, "qwen2_5_vl", 6, seed=5))
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(reference, adapter, prompt, max_tokens), request_id
    assert engine.model.decoder.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # dequantized on the CPU


@pytest.mark.parametrize("quantization", ["fp8", "fp8-block"])
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava", "qwen3_vl", "qwen3_vl_moe", "internvl", "gemma3", "llava_next", "llava_onevision",
                                  "idefics3", "smolvlm"])  # fmt: skip
def test_online_fp8_of_every_family_matches_transformers_with_the_round_tripped_weights(tiny_model_dir, arch, quantization):
    """`--quantization fp8|fp8-block` on each family's decoder (Gemma 3's offset norms and
    tied embeddings, Qwen3's head norms, MoE experts, the Llama/Mistral/Qwen2 decoders of
    the others): greedy tokens equal transformers' with every decoder projection (and
    expert) replaced by its fp8 round trip in that layout (`bench.fp8.round_trip_fp8_layers`,
    whose per-channel round trip the Qwen2.5-VL test above writes out by hand), the towers
    untouched. Six requests: with three, one family's unquantized engine matched the
    round-tripped reference too (the tokens of a tiny model move little), with six none."""
    from vlmbatch.bench.fp8 import round_trip_fp8_layers

    torch.set_num_threads(1)
    path = tiny_model_dir(arch)
    reference = load_hf_model(str(path), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        assert round_trip_fp8_layers(reference, quantization) > 0
    adapter = load_adapter(str(path))
    engine = PagedEngine(adapter, EngineConfig(**ENGINE, quantization=quantization))
    prepared, outputs = run_greedy(engine, adapter, build_requests(adapter, arch, 6, seed=11))
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(reference, adapter, prompt, max_tokens), (arch, request_id)


def test_published_quantization_configs_parse():
    block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "model.visual"]}  # fmt: skip
    scheme = checkpoint_scheme(block)
    assert (scheme.format, scheme.block, scheme.scale_name) == (BLOCK, (128, 128), "weight_scale_inv")
    from vlmbatch.testing.fp8_checkpoints import quantization_config

    dynamic = checkpoint_scheme(quantization_config("fp8-dynamic"))
    assert (dynamic.format, dynamic.scale_name) == (CHANNEL, "weight_scale")
    assert checkpoint_scheme(None) is None


@pytest.mark.parametrize("change, named", [
    (lambda qc: {"quant_method": "awq", "bits": 4}, "'awq'"),
    (lambda qc: {**qc, "weight_block_size": [64, 64]}, "[64, 64]"),
    (lambda qc: {**qc, "activation_scheme": "static"}, "'static'"),
])  # fmt: skip
def test_unsupported_formats_are_refused_at_submit_naming_what_was_found(fp8_dir, tmp_path, change, named):
    """`model_family` is what `submit` checks a model with: the job is refused before it starts."""
    path = tmp_path / "model"
    shutil.copytree(fp8_dir("qwen2_5_vl", "fp8-block"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = change(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match="unsupported") as caught:
        model_family(str(path))
    assert named in str(caught.value)


def test_unsupported_compressed_tensors_schemes_are_refused():
    from vlmbatch.testing.fp8_checkpoints import quantization_config

    per_tensor = quantization_config("fp8-dynamic")
    per_tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(JobError, match="strategy 'tensor'"):
        checkpoint_scheme(per_tensor)
    int8 = quantization_config("fp8-dynamic")
    int8["format"] = "int-quantized"
    with pytest.raises(JobError, match="'int-quantized'"):
        checkpoint_scheme(int8)


def test_quantize_vision_round_trips_the_towers_linear_layers_but_the_patch_embedding(tiny_model_dir):
    """`quantize_vision` on the CPU: every linear layer of our Qwen2.5-VL tower holds its
    per-channel fp8 round trip (dequantized), the patch embedding its original weight."""
    path = str(tiny_model_dir("qwen2_5_vl"))
    adapter = load_adapter(path)
    plain = PagedEngine(adapter, EngineConfig(**ENGINE)).model.tower
    tower = PagedEngine(adapter, EngineConfig(**ENGINE, quantization="fp8", quantize_vision=True)).model.tower
    assert torch.equal(tower.patch_embed.weight, plain.patch_embed.weight)
    w = plain.blocks[0].attn.qkv.weight
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    assert torch.equal(tower.blocks[0].attn.qkv.weight, (w / scale).to(torch.float8_e4m3fn).float() * scale)
    assert not torch.equal(tower.merger_fc2.weight, plain.merger_fc2.weight)


def test_dummy_load_builds_the_full_depth_without_transformers_weights(tiny_model_dir):
    """`load_format="dummy"`: transformers builds a one-layer language model (only its tower
    and position rules are kept), our decoder gets the checkpoint's full depth of random
    weights, and requests run."""
    path = str(tiny_model_dir("qwen2_5_vl"))
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(**ENGINE, load_format="dummy", quantization="fp8"))
    decoder = engine.model.decoder
    from transformers import AutoConfig

    assert len(decoder.layers) == AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers == 2  # the cut model has 1
    assert all(not p.is_meta for p in decoder.parameters()) and torch.equal(decoder.norm.weight, torch.ones_like(decoder.norm.weight))
    _, outputs = run_greedy(engine, adapter, build_requests(adapter, "qwen2_5_vl", 2, seed=1))
    assert all(o.outputs[0].token_ids for o in outputs.values())


def test_fp8_kv_cache_on_the_torch_backend(tiny_model_dir):
    """`kv_cache_dtype="fp8"`: the caches are float8_e4m3fn (a quarter of fp32's bytes per
    block, so four times the blocks from the same memory), the torch backend's decode over
    them equals the reference over the same e4m3 values, and requests run through it."""
    from vlmbatch.engine.attention import AttentionMetadata, TorchBackend
    from vlmbatch.kernels import paged_decode_attention_ref
    from vlmbatch.kernels.testing import make_paged_kv

    kv = make_paged_kv([3, 20], 2, 16, 4, torch.float32, "cpu", seed=1)
    k_cache, v_cache = kv.k_cache.to(torch.float8_e4m3fn), kv.v_cache.to(torch.float8_e4m3fn)
    q = torch.randn(2, 4, 16)
    meta = AttentionMetadata(False, torch.zeros(2, dtype=torch.long), kv.block_tables.clamp(min=0), kv.context_lens)
    torch.testing.assert_close(TorchBackend().decode(q, k_cache, v_cache, meta, 0.25),
                               paged_decode_attention_ref(q, k_cache, v_cache, kv.block_tables, kv.context_lens, 0.25))  # fmt: skip

    adapter = load_adapter(str(tiny_model_dir("qwen2_5_vl")))
    options = {**ENGINE, "num_kv_blocks": None}
    plain, fp8 = (PagedEngine(adapter, EngineConfig(**options, kv_cache_dtype=kv)) for kv in ("auto", "fp8"))
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn and fp8.runner.block_bytes * 4 == plain.runner.block_bytes
    assert fp8.runner.num_kv_blocks == 4 * plain.runner.num_kv_blocks
    _, outputs = run_greedy(fp8, adapter, build_requests(adapter, "qwen2_5_vl", 3, seed=2))
    assert len(outputs) == 3 and all(o.outputs[0].token_ids for o in outputs.values())
    assert fp8.runner.kv_caches[0][0].float().abs().sum() > 0


def test_fp8_kv_cache_holds_gemma3s_sliding_and_global_groups_in_e4m3(tiny_model_dir):
    """Gemma 3 keeps its sliding layers' KV in groups of their own (`kv_groups`): with an FP8
    cache every group is e4m3, written by the requests, which all finish with tokens (prompts
    past the sliding window included)."""
    adapter = load_adapter(str(tiny_model_dir("gemma3")))
    engine = PagedEngine(adapter, EngineConfig(**{**ENGINE, "num_kv_blocks": None}, kv_cache_dtype="fp8"))
    assert engine.runner.kv_layout.num_groups > 1
    _, outputs = run_greedy(engine, adapter, build_requests(adapter, "gemma3", 4, seed=3))
    assert len(outputs) == 4 and all(o.outputs[0].token_ids for o in outputs.values())
    caches = [cache for layer in engine.runner.kv_caches for cache in layer]
    assert all(cache.dtype == torch.float8_e4m3fn for cache in caches) and all(cache.float().abs().sum() > 0 for cache in caches)


def test_submit_refuses_an_unsupported_checkpoint_format(fp8_dir, tmp_path):
    """The job is refused before anything is written, with the format named."""
    from typer.testing import CliRunner

    from vlmbatch.cli.commands import app

    model = tmp_path / "model"
    shutil.copytree(fp8_dir("qwen2_5_vl", "fp8-block"), model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"prompt": "hello"}) + "\n")
    result = CliRunner().invoke(app, ["submit", str(dataset), "--model", str(model), "--output", str(tmp_path / "out")])
    assert result.exit_code != 0 and "quant_method 'gptq'" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---- streaming: transformers never builds an FP8 checkpoint's language model -----------------


def _spy_build(monkeypatch, arch: str) -> dict:
    """Record what `ENGINE_MODEL.build` is handed: the devices of transformers' language-model
    parameters and of the others, and the checkpoint the decoder streams from."""
    from vlmbatch.families.registry import FAMILIES

    model_cls = FAMILIES[arch].parts().ENGINE_MODEL
    original = model_cls.build.__func__
    seen: dict = {}

    def build(cls, hf_model, *args, **kwargs):
        skipped = [*getattr(hf_model.model, cls.language_model_attr).parameters(), *hf_model.lm_head.parameters()]
        seen["language_model"] = {p.device.type for p in skipped}
        seen["rest"] = {p.device.type for p in hf_model.parameters() if all(p is not q for q in skipped)}
        seen["checkpoint"] = args[5] if len(args) > 5 else kwargs.get("checkpoint")
        return original(cls, hf_model, *args, **kwargs)

    monkeypatch.setattr(model_cls, "build", classmethod(build))
    return seen


@pytest.mark.parametrize("arch, fmt", [("qwen2_5_vl", "fp8-block"), ("qwen3_vl_moe", "fp8-dynamic")])
def test_fp8_checkpoint_language_model_is_never_built_by_transformers(fp8_dir, arch, fmt, monkeypatch):
    """The old path built transformers' whole language model in the compute dtype (146 GB for
    a 72B model) before our decoder existed: now every parameter of it stays on "meta"
    (never allocated), the tower and projector are real, and the decoder is complete."""
    seen = _spy_build(monkeypatch, arch)
    engine = PagedEngine(load_adapter(str(fp8_dir(arch, fmt))), EngineConfig(**ENGINE))
    assert seen["language_model"] == {"meta"} and seen["rest"] == {"cpu"}
    assert seen["checkpoint"] is not None and not seen["checkpoint"].leftover()
    assert all(not t.is_meta for t in (*engine.model.decoder.parameters(), *engine.model.decoder.buffers()))
    assert engine.model.hf.lm_head is None and engine.model.hf.model.language_model is None


def _layer_bytes(path: Path) -> tuple[dict[str, int], int, int]:
    """Bytes of each decoder layer's tensors in the checkpoint, of its largest other
    language-model tensor, and of all its language-model tensors."""
    from safetensors import safe_open

    from vlmbatch.engine.weight_loading import language_model_name

    layers: dict[str, int] = {}
    other = total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                name = language_model_name(key)
                if name is None:
                    continue
                t = f.get_slice(key)
                size = int(torch.tensor(t.get_shape()).prod()) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[t.get_dtype()]
                total += size
                if name.startswith("layers."):
                    layer = name.split(".")[1]
                    layers[layer] = layers.get(layer, 0) + size
                else:
                    other = max(other, size)
    return layers, other, total


def _reshard(source: Path, out: Path, files: int) -> Path:
    """`source` split into `files` safetensors shards with an index, tensors dealt round-robin
    (so a layer's q, k and v, and an expert's gate and up, sit in different shards)."""
    from safetensors.torch import save_file

    shutil.copytree(source, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    shards: list[dict] = [{} for _ in range(files)]
    for i, key in enumerate(sorted(tensors)):
        shards[i % files][key] = tensors[key]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_sharded_fp8_checkpoint_streams_one_layer_at_a_time(fp8_dir, tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint in 3 shards, tensors dealt across them: the same greedy tokens as the
    dequantized reference; each language-model tensor read once; and at no point more
    checkpoint tensors alive on the host than one layer's (bf16 load, so none is adopted
    as a final weight on this CPU)."""
    torch.set_num_threads(1)
    path = _reshard(fp8_dir("qwen2_5_vl", "fp8-dynamic"), tmp_path / "sharded", 3)
    seen = _spy_build(monkeypatch, "qwen2_5_vl")
    _assert_greedy_equal(path, dequantized_reference(tiny_model_dir("qwen2_5_vl"), path), "qwen2_5_vl", count=4)
    layers, other, total = _layer_bytes(path)
    assert seen["checkpoint"].read_bytes == total  # every language-model tensor, each once
    from vlmbatch.engine.weight_loading import CheckpointTensors

    held_between_layers = []
    release = CheckpointTensors.release_layer

    def release_layer(self, index):
        held_between_layers.append(self.host_bytes)
        release(self, index)

    monkeypatch.setattr(CheckpointTensors, "release_layer", release_layer)
    PagedEngine(load_adapter(str(path)), EngineConfig(**{**ENGINE, "dtype": "bfloat16"}))
    checkpoint = seen["checkpoint"]
    assert len(checkpoint.files) == 3 and checkpoint.peak_host_bytes <= max(max(layers.values()), other)
    assert held_between_layers == [0] * len(layers) and checkpoint.host_bytes == 0  # nothing kept past its layer


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava", "idefics3", "gemma3", "internvl", "qwen2_vl", "llava_next", "llava_onevision", "smolvlm"])
def test_fp8_checkpoint_of_each_decoder_layout_matches_the_dequantized_reference(fp8_dir, tiny_model_dir, arch, monkeypatch):
    """Every other family's decoder layout (q/k norms; Llama, Mistral, Qwen2 and Gemma 3 layers; tied embeddings) and
    checkpoint prefixes (`language_model.model.`, `model.text_model.`): streamed, and the
    same greedy tokens as the original model with the dequantized weights written into it."""
    torch.set_num_threads(1)
    seen = _spy_build(monkeypatch, arch)
    path = fp8_dir(arch, "fp8-block")
    _assert_greedy_equal(path, dequantized_reference(tiny_model_dir(arch), path), arch, count=3)
    assert seen["language_model"] == {"meta"} and not seen["checkpoint"].leftover()


def test_streaming_refuses_a_checkpoint_missing_a_decoder_tensor(fp8_dir, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model"
    shutil.copytree(fp8_dir("qwen2_5_vl", "fp8-block"), path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(JobError, match="no tensor layers.1.mlp.down_proj.weight"):
        PagedEngine(load_adapter(str(path)), EngineConfig(**ENGINE))


@pytest.mark.parametrize("shape_name, family, fmt", [("tiny", "qwen2_5_vl", "fp8-dynamic"), ("tiny_qwen3_vl_moe", "qwen3_vl_moe", "fp8-block")])
def test_a_checkpoint_written_shard_by_shard_streams_into_the_engine(tmp_path, shape_name, family, fmt):
    """`bench make-checkpoint` (how a 72B FP8 checkpoint is made on the GPU machine) writes a
    shape's random weights without building the model. Written in bf16 and in `fmt` from
    the same draws, in shards of 32 KiB: the FP8 one is the bf16 one quantized (experts one
    per tensor), its index names every shard, and our engine streams it to the same greedy
    tokens as transformers holding the bf16 checkpoint with the dequantized weights."""
    from vlmbatch.bench.checkpoint import write_random_checkpoint
    from vlmbatch.bench.shapes import resolve_shape
    from vlmbatch.testing.fp8_checkpoints import quantization_config

    torch.set_num_threads(1)
    shape, cpu = resolve_shape(shape_name), torch.device("cpu")
    plain = write_random_checkpoint(shape, tmp_path / "bf16", "none", shard_bytes=1 << 15, seed=3, device=cpu, echo=lambda _: None)
    path = write_random_checkpoint(shape, tmp_path / fmt, fmt, shard_bytes=1 << 15, seed=3, device=cpu, echo=lambda _: None)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and set(weight_map.values()) == {p.name for p in path.glob("*.safetensors")}
    assert json.loads((path / "config.json").read_text())["quantization_config"] == quantization_config(fmt)
    assert all(load_file(str(path / file))[key].dtype == torch.float8_e4m3fn for key, file in weight_map.items() if ".experts." in key
               and key.endswith(".weight"))  # fmt: skip
    _assert_greedy_equal(path, dequantized_reference(plain, path), family, count=4)


def _greedy_tokens(model_dir: Path, family: str) -> dict[str, list[int]]:
    adapter = load_adapter(str(model_dir))
    _, outputs = run_greedy(PagedEngine(adapter, EngineConfig(**ENGINE)), adapter, build_requests(adapter, family, 3, seed=5))
    return {request_id: output.outputs[0].token_ids for request_id, output in outputs.items()}


def test_shards_the_disk_has_no_room_for_spill_to_another_filesystem_and_still_load(tmp_path):
    """How the 77 GB 72B FP8 checkpoint is written on a machine with a 64 GiB disk: the
    shards the folder's filesystem has no room for go to an overflow directory on another
    filesystem (tmpfs here, as on the GPU machine), linked from the folder by name. The
    linked folder holds the same tensors as one written whole, and our engine streams it to
    the same greedy tokens. A checkpoint the directories cannot hold is refused before any
    shard is written, saying what each could take."""
    from vlmbatch.bench.checkpoint import KEEP_FREE, write_random_checkpoint
    from vlmbatch.bench.shapes import resolve_shape

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    torch.set_num_threads(1)
    shape, cpu = resolve_shape("tiny"), torch.device("cpu")
    options = dict(shard_bytes=1 << 16, seed=3, device=cpu, echo=lambda _: None)
    whole = write_random_checkpoint(shape, tmp_path / "whole", "fp8-block", **options)
    overflow = Path(tempfile.mkdtemp(dir=shm))
    try:
        disk = tmp_path / "disk"
        two_shards = KEEP_FREE + 2 * (1 << 16)
        spilled = write_random_checkpoint(shape, disk, "fp8-block", overflow=[overflow],
                                          room=lambda home: two_shards if home.is_relative_to(disk) else 1 << 40, **options)
        shards = sorted(p.name for p in whole.glob("*.safetensors"))
        assert len(shards) > 2 and sorted(p.name for p in spilled.glob("*.safetensors")) == shards
        links = [name for name in shards if (spilled / name).is_symlink()]
        assert links and not (spilled / shards[0]).is_symlink()
        assert all((spilled / name).resolve().parent == overflow / shape.name for name in links)
        for name in shards:
            theirs, ours = load_file(str(whole / name)), load_file(str(spilled / name))
            assert theirs.keys() == ours.keys()
            assert all(torch.equal(theirs[k].view(torch.uint8), ours[k].view(torch.uint8)) for k in theirs)
        assert _greedy_tokens(spilled, "qwen2_5_vl") == _greedy_tokens(whole, "qwen2_5_vl")

        with pytest.raises(OSError, match=r"needs .* GiB in \d+ shards.*--overflow"):
            write_random_checkpoint(shape, tmp_path / "full", "fp8-block", room=lambda home: KEEP_FREE, **options)
        assert not list((tmp_path / "full").rglob("*.safetensors"))
    finally:
        shutil.rmtree(overflow)
