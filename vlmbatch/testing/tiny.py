"""Tiny random-weight checkpoints in the real Hugging Face layout.

Tests, the README demo and the benchmarks need models that load exactly like hub models
(`AutoProcessor` / `AutoModelForImageTextToText.from_pretrained(dir)`), with the family's
real architecture features (Qwen2.5-VL: GQA, M-RoPE, windowed vision attention, 2x2 patch
merge; LLaVA-1.5: CLIP tower + projector + Llama), but small enough to build in a second
and run on a CPU. Nothing is downloaded: the tokenizer is trained here on a built-in
corpus and the weights are random, seeded, and byte-identical for the same seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

Arch = Literal["qwen2_5_vl", "qwen2_vl", "llava"]
ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen2_vl", "llava")

# Enough ordinary English for a byte-level BPE to learn common words, so prompts
# tokenise into a sensible number of tokens and generated text decodes to words.
_CORPUS = """
Describe the image in one sentence. What is shown in this picture? The photo shows a red
square on a white background. A small blue circle is next to a green triangle. How many
objects are there in the video? Please answer the question with a short answer.
The cat sits on the mat and the dog runs in the park. A person is riding a bicycle down
the street while the sun is shining. There are two people standing near the water.
Write a caption for this image. The quick brown fox jumps over the lazy dog.
You are a helpful assistant. The user asks a question and the assistant answers it.
What color is the car? The car is yellow. Where is the book? The book is on the table.
This is a test of the batch inference system for vision language models. Count the
frames, read the text, and summarise what happens from the start to the end of the clip.
Hello world, this is a tiny model with random weights used only for testing.
""".strip()

_QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

# ChatML with Qwen's vision markers; a system turn is added when the caller gives none,
# as in the released Qwen2-VL / Qwen2.5-VL templates.
_QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# LLaVA-1.5: "USER: <image>\n<text> ASSISTANT:"; images first within a turn, then text.
_LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'].upper() + ': ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] + ' ' }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ '<image>\\n' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] + ' ' }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '</s>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

# The language model of every family: 2 layers, hidden 64, 4 query heads of dim 16.
_TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

_BPE_VOCAB_SIZE = 600  # learned tokens; specials come first, so ids are small and fixed


def _train_tokenizer(special_tokens: list[str], add_bos: str | None):
    """A byte-level BPE trained on `_CORPUS`, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import TokenizersBackend

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    if add_bos is not None:
        bos_id = tok.token_to_id(add_bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{add_bos} $A", pair=f"{add_bos} $A $B", special_tokens=[(add_bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return TokenizersBackend(tokenizer_object=tok, additional_special_tokens=special_tokens)


def _padded_vocab(tokenizer) -> int:
    """Model vocab rounded up to a multiple of 64, like real checkpoints (ids past the
    tokenizer's exist but are never produced by it)."""
    return (len(tokenizer) + 63) // 64 * 64


def _qwen_processor(arch: str):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = _train_tokenizer(_QWEN_SPECIAL_TOKENS, add_bos=None)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    # Few pixels so an image costs 4..64 tokens after the 2x2 merge.
    size = {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}
    image_processor = Qwen2VLImageProcessor(size=size)
    video_processor = Qwen2VLVideoProcessor(size=size)
    processor_cls = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=_QWEN_CHAT_TEMPLATE,
    )


def _qwen_config(arch: str, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=_padded_vocab(tokenizer),
        **_TINY_DECODER,
        num_key_value_heads=2,  # GQA, as in the released models
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if arch == "qwen2_5_vl":
        vision_config = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            tokens_per_second=2,
            window_size=56,  # 2x2 merged units per window: images larger than 56 px use several windows
            fullatt_block_indexes=[1],  # block 0 windowed, block 1 full attention
        )
        return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **common)
    vision_config = dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2
    )
    return Qwen2VLConfig(text_config=text_config, vision_config=vision_config, **common)


def _llava_processor():
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer = _train_tokenizer(_LLAVA_SPECIAL_TOKENS, add_bos="<s>")
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    tokenizer.unk_token, tokenizer.pad_token = "<unk>", "<pad>"
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 56},
        crop_size={"height": 56, "width": 56},
        do_center_crop=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
        chat_template=_LLAVA_CHAT_TEMPLATE,
    )


def _llava_config(tokenizer):
    from transformers import LlavaConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _LLAVA_SPECIAL_TOKENS}
    vision_config = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
        projection_dim=32,
    )
    text_config = dict(
        model_type="llama",
        vocab_size=_padded_vocab(tokenizer),
        **_TINY_DECODER,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=ids["<image>"],
        image_seq_length=16,  # (56 / 14) ** 2 patches, CLS dropped
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )


def make_tiny_model(dir: str | Path, arch: Arch = "qwen2_5_vl", seed: int = 0) -> Path:
    """Write a tiny random-weight `arch` checkpoint (config, weights, tokenizer, processor,
    chat template, generation config) into `dir` and return its path."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)

    if arch == "llava":
        processor = _llava_processor()
        config = _llava_config(processor.tokenizer)
        text = config.text_config
        eos_ids: int | list[int] = text.eos_token_id
    else:
        processor = _qwen_processor(arch)
        config = _qwen_config(arch, processor.tokenizer)
        text = config.text_config
        eos_ids = [text.eos_token_id, text.pad_token_id]  # <|im_end|> and <|endoftext|>
    config.dtype = torch.float32

    # Fork the RNG so building a checkpoint leaves the caller's global seed untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=eos_ids, pad_token_id=text.pad_token_id
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # Hub checkpoints also carry the per-component files (preprocessor_config.json,
    # video_preprocessor_config.json) that older transformers and other tools read.
    processor.image_processor.save_pretrained(out)
    if getattr(processor, "video_processor", None) is not None:
        processor.video_processor.save_pretrained(out)
    return out
