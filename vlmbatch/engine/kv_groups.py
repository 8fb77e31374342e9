"""KV-cache groups: layers of one attention type that share block tables.

Sliding-window layers need only their last `window` tokens' KV while global layers need
all of it, so each type gets its own block tables (a sliding group drops the blocks that
fall out of its window) while all groups draw from one pool of equal blocks: no memory
split between types to tune. For that, every group has the same number of layers,
`layers_per_group` (the fewest layers any type has, as vLLM's hybrid KV-cache manager
picks), and one block holds one group's KV for `block_size` tokens across that group's
layers: the cache is `layers_per_group` K/V tensor pairs, and the j-th layer of every
group uses pair j. A type whose layer count is not a multiple leaves the last pairs of
its last group unused (Gemma-3-27B: 10 global, 52 sliding layers -> 6 sliding groups,
the last of 2 layers): with global layers the fewest, that waste is in sliding blocks,
of which a sequence holds only a window's worth, never in the global blocks that hold
the whole context (a size dividing 52, say 13, would waste 3 of every global block's
13 layers). A model without windows is one group of all its layers, exactly
the one block table per sequence it always had.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Which group and which cache tensor pair each layer uses."""

    windows: tuple[int, ...]  # per group: its layers' sliding window, 0 = global
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its K/V tensor pair
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_layout(layer_windows: list[int]) -> KVLayout:
    """Groups for layers with these windows: global groups first, then by window."""
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in by_window.values())
    windows, groups, slots = [], [0] * len(layer_windows), [0] * len(layer_windows)
    for window in sorted(by_window):
        layers = by_window[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                groups[layer], slots[layer] = len(windows), slot
            windows.append(window)
    return KVLayout(tuple(windows), tuple(groups), tuple(slots), size)
