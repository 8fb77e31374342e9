"""Loaded at start-up by every Python process of the vLLM peer (this folder leads its
PYTHONPATH, so vLLM's engine-core and model-inspection subprocesses get it too).

vLLM 0.26's `pixtral.py`, which its `llava.py` imports, so LLaVA-NeXT and LLaVA-OneVision
too, imports two names transformers 5 no longer has: `PixtralRotaryEmbedding` (now
`PixtralVisionRotaryEmbedding`) and `position_ids_in_meshgrid`. Without them vLLM refuses
those models ("failed to be inspected") before any request. Both are restored here; neither
runs on those families' path, whose towers are CLIP and SigLIP, not Pixtral's.
"""

from __future__ import annotations


def _restore_pixtral_names() -> None:
    try:
        import torch
        from transformers.models.pixtral import modeling_pixtral
    except Exception:  # noqa: BLE001 - no transformers here: nothing to restore
        return
    if not hasattr(modeling_pixtral, "PixtralRotaryEmbedding") and hasattr(modeling_pixtral, "PixtralVisionRotaryEmbedding"):
        modeling_pixtral.PixtralRotaryEmbedding = modeling_pixtral.PixtralVisionRotaryEmbedding
    if not hasattr(modeling_pixtral, "position_ids_in_meshgrid"):

        def position_ids_in_meshgrid(patch_embeds_list: list[torch.Tensor], max_width: int) -> torch.Tensor:
            """Each patch's row x max_width + column, image after image (patch grids [..., H, W])."""
            ids = []
            for patches in patch_embeds_list:
                height, width = patches.shape[-2:]
                rows = torch.arange(height).repeat_interleave(width)
                ids.append(rows * max_width + torch.arange(width).repeat(height))
            return torch.cat(ids)

        modeling_pixtral.position_ids_in_meshgrid = position_ids_in_meshgrid


_restore_pixtral_names()
