"""Our SigLIP tower (`engine/layers/siglip.py`) gives transformers' tower features on the same
weights, for each family it is hooked into (Gemma 3, LLaVA-OneVision, Idefics3, SmolVLM), and
so does its InternViT variant (`engine/layers/internvit.py`: CLS token, layer scales folded)."""

import copy

import pytest
import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.layers.siglip import SiglipVisionTower, square_size, transformers_hidden
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.families.registry import FAMILIES
from vlmbatch.kernels.reference import dequantize_fp8_ref, quantize_fp8_ref

ARCHS = ("gemma3", "llava_onevision", "idefics3", "smolvlm", "internvl")
CLS_TOKEN = {"internvl": 1}  # rows before the patches in the tower's output
IMAGES = 5


def _engine_model(arch):
    return FAMILIES[arch].parts().ENGINE_MODEL


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tiny_model_dir):
    """The tiny checkpoint's transformers model (fp32, CPU) with every vision weight drawn
    afresh: the checkpoint's biases are zero and its norms the identity, which would hide
    a dropped bias (the Conv2d's, q/k/v's) or norm."""
    hf = load_hf_model(str(tiny_model_dir(request.param)), torch.float32, torch.device("cpu"))
    vision = getattr(hf.model, _engine_model(request.param).siglip_attr)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in vision.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            parameter.copy_(centre + 0.2 * torch.randn(parameter.shape, generator=generator))
    return request.param, hf


def _pixels(config, images=IMAGES, seed=0):
    side = square_size(config.image_size)
    return torch.randn(images, config.num_channels, side, side, generator=torch.Generator().manual_seed(seed))


def _relative_error(ours, reference):
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


@torch.no_grad()
def test_tower_matches_transformers(model):
    arch, hf = model
    family = _engine_model(arch)
    vision = getattr(hf.model, family.siglip_attr)
    tower = family.siglip_from_hf(hf, torch.device("cpu"), torch.float32)
    assert isinstance(tower, SiglipVisionTower)
    pixels = _pixels(vision.config)
    for batch in (pixels, pixels[:1], pixels[1:3]):
        expected = family.transformers_hidden(hf, batch)
        ours = tower(batch)
        patches = (square_size(vision.config.image_size) // square_size(vision.config.patch_size)) ** 2
        assert ours.shape == expected.shape == (len(batch), CLS_TOKEN.get(arch, 0) + patches, vision.config.hidden_size)
        assert _relative_error(ours, expected) <= 1e-5
    # images do not attend to each other: one alone gives its rows of the batch
    torch.testing.assert_close(tower(pixels[2:3]), tower(pixels)[2:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [(-1,), (-2,), (1,), (0,), (-2, -1)])
@torch.no_grad()
def test_inner_feature_layers_build_only_the_layers_used(tiny_model_dir, layers):
    """`vision_feature_layer` (LLaVA-OneVision's; the released checkpoints read -1 of a tower
    already cut to 26 layers): hidden states before the post-layernorm, only the layers up to
    the deepest one read are built, so their weights (and the head's) are not loaded."""
    hf = load_hf_model(str(tiny_model_dir("llava_onevision")), torch.float32, torch.device("cpu"))
    vision = hf.model.vision_tower
    torch.manual_seed(2)
    with torch.no_grad():
        for parameter in vision.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    tower = SiglipVisionTower.from_hf(vision, torch.device("cpu"), torch.float32, layers)
    total = vision.config.num_hidden_layers
    assert len(tower.encoder.layers) == max(i % (total + 1) for i in layers) and tower.post_layernorm is None
    pixels = _pixels(vision.config, images=3)
    expected = transformers_hidden(vision, pixels, layers)
    assert _relative_error(tower(pixels), expected) <= 1e-5


def test_a_grid_other_than_the_position_grid_is_refused(model):
    arch, hf = model
    family = _engine_model(arch)
    vision = getattr(hf.model, family.siglip_attr)
    if type(vision).__name__ not in ("SiglipVisionModel", "InternVLVisionModel"):
        pytest.skip("bucketed position ids take any grid")
    tower = family.siglip_from_hf(hf, torch.device("cpu"), torch.float32)
    config = vision.config
    side = square_size(config.image_size)
    with pytest.raises(ValueError, match="interpolation"):
        tower(torch.zeros(1, config.num_channels, side, 2 * side))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_runs_our_tower_and_quantize_vision_converts_its_linear_layers(tiny_model_dir, arch):
    """transformers' tower is dropped once ours holds its weights; `quantize_vision` holds the
    per-channel fp8 round trip of our linear layers but the patch embedding."""
    from vlmbatch.engine.paged import PagedEngine
    from vlmbatch.families.registry import load_adapter

    adapter = load_adapter(str(tiny_model_dir(arch)))
    engine = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=2)
    plain = PagedEngine(adapter, EngineConfig(**engine)).model
    attr = type(plain).siglip_attr
    assert isinstance(plain.tower, SiglipVisionTower) and getattr(plain.hf.model, attr) is None
    assert plain.vision_modules() == [plain.tower, plain.hf]
    tower = PagedEngine(adapter, EngineConfig(**engine, quantization="fp8", quantize_vision=True)).model.tower
    assert torch.equal(tower.embeddings.patch_embedding.weight, plain.tower.embeddings.patch_embedding.weight)
    for name in ("encoder.layers.0.self_attn.qkv", "encoder.layers.1.mlp.fc2"):
        w = plain.tower.get_submodule(name).weight
        assert torch.equal(tower.get_submodule(name).weight, dequantize_fp8_ref(*quantize_fp8_ref(w))), name


@pytest.mark.gpu
@torch.no_grad()
def test_bf16_tower_on_cuda_matches_transformers_fp32(model):
    """bf16 on the GPU (flash / cuDNN SDPA on the strided q/k/v views) against transformers
    fp32: within twice transformers' own bf16 error, or 2e-2."""
    arch, hf = model
    family = _engine_model(arch)
    device = torch.device("cuda")
    pixels = _pixels(getattr(hf.model, family.siglip_attr).config).to(device)
    reference = family.transformers_hidden(copy.deepcopy(hf).to(device), pixels)
    theirs = family.transformers_hidden(copy.deepcopy(hf).to(device, torch.bfloat16), pixels.bfloat16())
    tower = family.siglip_from_hf(hf, device, torch.bfloat16)
    ours = tower(pixels.bfloat16())
    bound = max(2 * _relative_error(theirs, reference), 2e-2)
    assert _relative_error(ours, reference) <= bound


def _copies_around_attention(tower, pixels, monkeypatch):
    """(q/k/v SDPA got are views of the fused q/k/v output, out_proj reads SDPA's output
    in place) for the first layer of `tower` on `pixels`."""
    from vlmbatch.engine.layers import siglip

    seen = {}
    real = siglip.F.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        out = real(q, k, v, **kwargs)
        seen.setdefault("views", all(t._base is not None for t in (q, k, v)) and q._base is k._base is v._base)
        seen.setdefault("out", out.data_ptr())
        return out

    monkeypatch.setattr(siglip.F, "scaled_dot_product_attention", sdpa)
    layer = tower.encoder.layers[0].self_attn
    def read(_, args):
        seen.setdefault("read", args[0].data_ptr())  # returns None: the input stays as it is

    handle = layer.out_proj.register_forward_pre_hook(read)
    try:
        with torch.no_grad():
            tower(pixels)
    finally:
        handle.remove()
    return seen["views"], seen["out"] == seen["read"]


def test_q_k_v_and_the_attention_output_are_not_copied(model, monkeypatch):
    """The point of the layout: SDPA reads strided views of the one q/k/v matmul, and the
    output projection reads SDPA's output as [B, L, H*D] in place (CPU SDPA, fp32)."""
    arch, hf = model
    family = _engine_model(arch)
    tower = family.siglip_from_hf(hf, torch.device("cpu"), torch.float32)
    assert _copies_around_attention(tower, _pixels(getattr(hf.model, family.siglip_attr).config, images=2), monkeypatch) == (True, True)


@pytest.mark.gpu
def test_no_copies_around_attention_on_cuda(model, monkeypatch):
    """As above with bf16 on CUDA (flash / cuDNN SDPA: whichever backend SDPA picks)."""
    arch, hf = model
    family = _engine_model(arch)
    device = torch.device("cuda")
    tower = family.siglip_from_hf(hf, device, torch.bfloat16)
    pixels = _pixels(getattr(hf.model, family.siglip_attr).config, images=2).to(device, torch.bfloat16)
    assert _copies_around_attention(tower, pixels, monkeypatch) == (True, True)
