"""Tiny random-weight Gemma 3 checkpoints: a SigLIP tower, the pooling projector and a
Gemma 3 decoder with sliding-window layers interleaved with a global one.

The sizes keep every feature the engine must reproduce in play on a CPU: a window (12)
shorter than an image (16 tokens), so a sliding layer's window cuts into an image span
and long prompts run past it; a global layer with linear RoPE scaling on another base;
q/k norms; `query_pre_attn_scalar` different from the head size; a final logit soft cap.
Norm weights and the projector (zero at init in `transformers`) are drawn at random, so
(1 + w) and the image features matter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint, token_id_fields, train_tokenizer

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", BOI, EOI, IMAGE_TOKEN]
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 32, 4, 16  # 8x8 patches pooled 2x2 into 16 tokens
SLIDING_WINDOW = 12
# Gemma's vocabulary spells runs of newlines as single tokens ("\n\n" around each image), and
# vLLM's Gemma 3 processor looks "\n" to "\n\n\n\n" up by that text (`gemma3_mm.py`), which a
# byte-level BPE alone would spell "Ċ", "ĊĊ"...: the tokenizer adds them as written.
NEWLINES = ["\n" * n for n in range(1, 5)]

# Gemma 3's prompt format: a system message is folded into the first user turn, the
# assistant's role is "model", each image is a `<start_of_image>` the processor expands.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def processor() -> Any:
    from transformers import Gemma3ImageProcessor, Gemma3Processor, TokenizersBackend

    trained = train_tokenizer(SPECIAL_TOKENS, add_bos="<bos>", literal_tokens=NEWLINES)
    tokenizer = TokenizersBackend(
        tokenizer_object=trained.backend_tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN},
    )
    image_processor = Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        do_pan_and_scan=False, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                           image_seq_length=TOKENS_PER_IMAGE)


def config(tokenizer: Any) -> Any:
    from transformers import Gemma3Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision_config = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, layer_norm_eps=1e-6, vision_use_head=False,
    )
    text_config = dict(
        model_type="gemma3_text",
        vocab_size=padded_vocab(tokenizer),
        **{**TINY_DECODER, "num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=30.0,
        max_position_embeddings=2048,
        **token_id_fields(ids, "<bos>", "<eos>", "<pad>"),
    )
    return Gemma3Config(
        vision_config=vision_config, text_config=text_config, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids[BOI], eoi_token_index=ids[EOI], image_token_index=ids[IMAGE_TOKEN],
    )


def _randomise_zero_init(out: Path, seed: int) -> None:
    """Gemma's norm weights (applied as 1 + w) and the projector start at zero in
    `transformers`: draw them, so a test could tell w from 1 + w and see the image."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "vision_tower" not in name or "mm_input_projection" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if "norm" in name else 0.2))
    model.save_pretrained(out)


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    proc = processor()
    cfg = config(proc.tokenizer)
    end_of_turn = proc.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    out = save_checkpoint(dir, cfg, proc, [cfg.text_config.eos_token_id, end_of_turn], seed)
    _randomise_zero_init(out, seed)
    return out
