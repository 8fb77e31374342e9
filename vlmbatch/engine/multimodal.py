"""Where a prompt's media go: which prompt positions each item's embeddings fill, and its positions.

Built once per request when it is added (`place_media`) and kept on the sequence, so a
preempted sequence is recomputed without looking at its media again.
"""

from __future__ import annotations

import torch

from vlmbatch.engine.sequence import MultimodalData
from vlmbatch.engine.vision_language import VisionLanguageModel
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.prompt import PreparedPrompt


def place_media(model: VisionLanguageModel, prompt: PreparedPrompt, dtype: torch.dtype) -> MultimodalData:
    """The media items in placeholder order, the token span of each, the embedding row each
    media token takes (`media_index`), and the model's prompt positions (M-RoPE)."""
    for item in prompt.media:  # pixels already on the GPU (GPU video decoders) wait there: in the tower's dtype
        item.cast_pixels(dtype, on_device_only=True)
    ids = torch.tensor(prompt.prompt_token_ids)
    media_index = torch.full_like(ids, -1)
    spans, row = [], 0
    for kind, token_id in model.placeholder_token_ids.items():
        where = (ids == token_id).nonzero().squeeze(1)
        items = [i for i in prompt.media if i.kind == kind]
        if sum(i.num_tokens for i in items) != len(where):
            raise RowError(ErrorType.PLACEHOLDER_MISMATCH, f"{len(where)} {kind} tokens for {len(items)} {kind}(s)", "prompt")
        for item, positions in zip(items, where.split([i.num_tokens for i in items])):
            spans.append((item, (int(positions[0]), int(positions[-1]) + 1)))
            media_index[positions] = torch.arange(row, row + item.num_tokens)
            row += item.num_tokens
    rope_positions, rope_delta = model.prompt_positions(prompt.prompt_token_ids, prompt.media)
    return MultimodalData(
        items=[item for item, _ in spans], token_spans=[span for _, span in spans], media_index=media_index,
        rope_positions=rope_positions, rope_delta=rope_delta,
        bidirectional_spans=media_runs(media_index) if model.bidirectional_media else [],
    )


def media_runs(media_index: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive media tokens: the groups `transformers`
    builds from `token_type_ids` for Gemma 3's bidirectional mask (one per image, or per
    pan-and-scan crop: each is wrapped in its own begin/end-of-image tokens)."""
    is_media = torch.cat([torch.zeros(1, dtype=torch.bool), media_index >= 0, torch.zeros(1, dtype=torch.bool)])
    edges = (is_media[1:] != is_media[:-1]).nonzero().squeeze(1).tolist()
    return list(zip(edges[::2], edges[1::2]))
