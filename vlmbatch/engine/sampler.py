"""Batched sampling on the device without host synchronisation.

Per-row settings travel as tensors, so one kernel sequence serves a batch that mixes
greedy and sampled rows, and nothing waits on the GPU until the runner copies the chosen
token ids back. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)
equals a draw from p), which needs no cumulative sum or multinomial. Rows with a seed
draw their noise from a generator keyed by (seed, output position), so a seeded
request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmbatch.engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, already on the device."""

    temperatures: torch.Tensor | None  # float32 [B]; 0 = greedy (None: all rows greedy)
    top_ps: torch.Tensor | None  # float32 [B]
    top_ks: torch.Tensor | None  # int64 [B]; <= 0 disables
    seeds: list[int | None]  # per row; None = the shared generator
    positions: list[int]  # output index of the token drawn now (keys seeded noise)
    all_greedy: bool
    needs_top_k_top_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], device: torch.device) -> "SamplingBatch":
        if all(p.greedy for p in params):  # the common batch case: no per-row tensors to ship
            return cls(None, None, None, [], positions, all_greedy=True, needs_top_k_top_p=False)
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device, non_blocking=True),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device, non_blocking=True),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64).to(device, non_blocking=True),
            seeds=[p.seed for p in params],
            positions=positions,
            all_greedy=all(p.greedy for p in params),
            needs_top_k_top_p=any((p.top_k > 0 or p.top_p < 1.0) and not p.greedy for p in params),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (the most likely
    token always survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab).unsqueeze(-1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_ps.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _exponential_noise(batch: SamplingBatch, shape: torch.Size, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for row, seed in enumerate(batch.seeds):
        if seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed((seed * 1_000_003 + batch.positions[row]) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[row].exponential_(generator=generator)
    return noise


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [B, 1 + k]: each row's log probability of its chosen token, then its k best;
    int64 [B, k]: the ids of those k. Computed where the logits are, so they travel back
    with the tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    if k == 0:
        return chosen, torch.empty((len(tokens), 0), dtype=torch.int64, device=logits.device)
    best = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, best.values], dim=1), best.indices


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [B] (int64, on the device) drawn from float logits [B, vocab]."""
    if batch.all_greedy:  # the widening copy below is exact, so argmax needs none of it
        return logits.argmax(dim=-1)
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0).unsqueeze(-1)
    scaled = logits / temperatures
    if batch.needs_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, batch.top_ks, batch.top_ps)
    probs = scaled.softmax(dim=-1)
    sampled = (probs / _exponential_noise(batch, probs.shape, logits.device)).argmax(dim=-1)
    return torch.where(batch.temperatures > 0, sampled, greedy_tokens)
