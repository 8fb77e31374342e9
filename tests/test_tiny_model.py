"""The tiny checkpoints load and run through the same Hugging Face path as hub models."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import typer
from PIL import Image
from transformers import AutoProcessor, AutoModelForImageTextToText
from typer.testing import CliRunner

from vlmbatch.cli.tiny_cmd import register
from vlmbatch.testing.tiny import ARCHS, make_tiny_model


def _image(h: int = 90, w: int = 130, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_generates_with_an_image(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert model.config.model_type == arch
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[_image()], return_tensors="pt")
    image_token = model.config.image_token_id if arch != "llava" else model.config.image_token_index
    num_image_tokens = int((inputs["input_ids"] == image_token).sum())
    assert 4 <= num_image_tokens <= 256  # tiny processor settings keep images cheap (anyres tiles included)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5


def test_qwen_template_ids_and_architecture(tiny_qwen):
    processor = AutoProcessor.from_pretrained(tiny_qwen)
    tok = processor.tokenizer
    config = json.loads((tiny_qwen / "config.json").read_text())
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    text = config["text_config"]
    assert text["num_attention_heads"] > text["num_key_value_heads"]  # GQA
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert config["vision_config"]["fullatt_block_indexes"] == [1]
    generation = json.loads((tiny_qwen / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Ordinary English tokenises into words, not bytes.
    assert len(tok("The cat sits on the mat.")["input_ids"]) <= 8
    assert (tiny_qwen / "video_preprocessor_config.json").exists()


def test_llava_template_and_ids(tiny_llava):
    processor = AutoProcessor.from_pretrained(tiny_llava)
    tok = processor.tokenizer
    config = json.loads((tiny_llava / "config.json").read_text())
    assert config["image_token_index"] == tok.convert_tokens_to_ids("<image>")
    assert config["text_config"]["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("</s>")
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True,
    )
    assert prompt == "USER: <image>\nWhat is this? ASSISTANT:"
    assert tok("hello")["input_ids"][0] == tok.convert_tokens_to_ids("<s>")


def test_same_seed_gives_identical_weights(tmp_path, tiny_qwen):
    again = make_tiny_model(tmp_path / "again", "qwen2_5_vl", seed=0)
    other = make_tiny_model(tmp_path / "other", "qwen2_5_vl", seed=1)
    assert _sha(again / "model.safetensors") == _sha(tiny_qwen / "model.safetensors")
    assert _sha(other / "model.safetensors") != _sha(tiny_qwen / "model.safetensors")


def test_cli_writes_a_loadable_checkpoint(tmp_path):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps Typer in multi-command mode
    runner = CliRunner()
    help_result = runner.invoke(app, ["make-tiny-model", "--help"])
    assert help_result.exit_code == 0 and "--arch" in help_result.output
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--arch", "llava", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "m").config.model_type == "llava"
    bad = runner.invoke(app, ["make-tiny-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert bad.exit_code != 0
