"""`transformers` inputs of our prepared prompts: what the engine tests feed `generate()` to
compare its tokens with ours on exactly the tensors the adapter prepared."""

from __future__ import annotations

import inspect

import torch

from vlmbatch.models.base import PreparedPrompt


def hf_inputs(adapter, prompts: list[PreparedPrompt], device: torch.device, hf_model) -> dict[str, torch.Tensor]:
    """One batch of prompts of one length (no padding); `mm_token_type_ids` only for
    `transformers` versions whose forward takes it."""
    ids = torch.tensor([p.prompt_token_ids for p in prompts])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in inspect.signature(hf_model.forward).parameters:
        inputs["mm_token_type_ids"] = adapter.mm_token_type_ids(ids)
    for key in prompts[0].mm_inputs:
        inputs[key] = torch.cat([p.mm_inputs[key] for p in prompts])
    return {k: v.to(device) for k, v in inputs.items()}
