"""`vlmbatch bench sampling` on the tiny shape (CPU smoke run of what the lead runs on the H200)."""

from __future__ import annotations

import json

import torch

from vlmbatch.bench.sampling import run


def test_every_variant_runs_and_neutral_adjustments_keep_the_greedy_tokens(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run("tiny", 4, 3, "cpu", tmp_path / "sampling.json")
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "sampling.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"greedy", "neutral_adjustments", "penalties", "logprobs5", "penalties+logprobs5", "n4_seeded"}
    assert rows["neutral_adjustments"]["tokens_equal_greedy"] is True
    assert rows["n4_seeded"]["requests"] == 1 and rows["n4_seeded"]["num_forked_tokens"] > 0
    assert all(r["num_async_decode_steps"] > 0 and r["output_tokens_per_s"] > 0 for r in rows.values())
