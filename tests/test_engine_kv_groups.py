"""KV-cache groups: which layers share block tables, and which cache tensors."""

from vlmbatch.engine.kv_groups import kv_layout


def gemma3_windows(num_layers: int, window: int = 1024) -> list[int]:
    """Five sliding layers, then a global one (Gemma 3's pattern)."""
    return [0 if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_a_model_without_windows_is_one_group_of_every_layer():
    layout = kv_layout([0] * 28)
    assert layout.windows == (0,) and layout.layers_per_group == 28
    assert layout.layer_groups == (0,) * 28 and layout.layer_slots == tuple(range(28))


def test_gemma3_12b_is_a_global_group_and_five_sliding_ones_of_eight_layers():
    layout = kv_layout(gemma3_windows(48))
    assert layout.windows == (0, 1024, 1024, 1024, 1024, 1024) and layout.layers_per_group == 8
    assert [layer for layer in range(48) if layout.layer_groups[layer] == 0] == list(range(5, 48, 6))
    # the j-th layer of each group shares cache pair j: every pair serves one layer per group
    pairs = [(layout.layer_groups[layer], layout.layer_slots[layer]) for layer in range(48)]
    assert sorted(pairs) == [(group, slot) for group in range(6) for slot in range(8)]


def test_a_layer_count_that_does_not_divide_leaves_the_last_group_short():
    layout = kv_layout(gemma3_windows(62))  # Gemma-3-27B: 10 global, 52 sliding layers
    assert layout.windows == (0,) + (1024,) * 6 and layout.layers_per_group == 10
    assert sum(group == 6 for group in layout.layer_groups) == 2


def test_layers_with_different_windows_get_different_groups():
    layout = kv_layout([4, 8, 0, 4, 8, 0])
    assert layout.windows == (0, 4, 8) and layout.layer_groups == (1, 2, 0, 1, 2, 0)
