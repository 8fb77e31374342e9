"""Logit bias, penalties and min_tokens for one step, batched on the device.

Only the rows that use one of them are touched, and a step where none does skips this
module (`SamplingParams.adjusts_logits`). Token counts are not kept between steps: each
step scatters the rows' generated tokens into a [rows, vocab] count tensor on the device
(the tokens as one flat host-to-device copy with their row indices), so preemption, forks (n > 1) and aborts need no
bookkeeping. The newest token of a sequence under asynchronous decoding is still on the
device (the host holds a placeholder): it is taken from the step's input ids, so nothing
waits for the GPU. The order and formulas are transformers' (`SequenceBiasLogitsProcessor`,
`RepetitionPenaltyLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`), with OpenAI's
frequency and presence penalties after the repetition penalty, as vLLM applies them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from vlmbatch.engine.sequence import Sequence


def _flat(rows: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of `rows`, on the device: built flat on the host
    (no padding to the longest row), where the indices' count is known without a sync."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    index = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int64), lengths))
    ids = torch.from_numpy(np.concatenate(rows) if rows else np.empty(0, dtype=np.int64))
    return index.to(device, non_blocking=True), ids.to(device, non_blocking=True)


@dataclass
class LogitAdjustments:
    """The adjusting rows of one step (`rows`: their index in the step's batch) and their
    settings, as device tensors; None where no row uses the setting."""

    rows: torch.Tensor  # int64 [R]
    vocab: int
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (index in R, token id, value)
    repetition: torch.Tensor | None  # float32 [R, 1]
    frequency: torch.Tensor | None  # float32 [R, 1]
    presence: torch.Tensor | None  # float32 [R, 1]
    prompt_ids: tuple[torch.Tensor, torch.Tensor] | None  # `_flat` prompt tokens (repetition rows only)
    output_ids: tuple[torch.Tensor, torch.Tensor] | None  # `_flat` generated tokens the host knows
    in_flight: torch.Tensor | None  # bool [R]: the row's newest token is the step's input id
    min_token_rows: torch.Tensor | None  # int64: indices in R still under their min_tokens
    eos: torch.Tensor | None  # int64 [E]

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, eos_token_ids: Collection[int], placeholder: int,
              device: torch.device) -> "LogitAdjustments | None":
        """`placeholder`: the token id a sequence holds for its token still on the device."""
        rows = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
        if not rows:
            return None
        chosen = [seqs[i] for i in rows]
        params = [s.params for s in chosen]
        to = dict(device=device, non_blocking=True)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(**to)

        bias = None
        pairs = [(r, token, value) for r, p in enumerate(params) for token, value in p.logit_bias if token < vocab]
        if pairs:
            index, tokens, values = zip(*pairs)
            bias = (torch.tensor(index).to(**to), torch.tensor(tokens).to(**to), torch.tensor(values, dtype=torch.float32).to(**to))
        repeats = any(p.repetition_penalty != 1.0 for p in params)
        counts = repeats or any(p.frequency_penalty or p.presence_penalty for p in params)
        outputs = [s.output_token_ids for s in chosen] if counts else []
        in_flight = [bool(out) and out[-1] == placeholder for out in outputs]
        outputs = [np.array(out[:-1] if flying else out, dtype=np.int64) for out, flying in zip(outputs, in_flight)]
        under_min = [r for r, s in enumerate(chosen) if s.num_output_tokens < s.params.min_tokens]
        return cls(
            rows=torch.tensor(rows).to(**to),
            vocab=vocab,
            bias=bias,
            repetition=column([p.repetition_penalty for p in params]) if repeats else None,
            frequency=column([p.frequency_penalty for p in params]) if counts else None,
            presence=column([p.presence_penalty for p in params]) if counts else None,
            prompt_ids=_flat([s.prompt_id_array for s in chosen], device) if repeats else None,
            output_ids=_flat(outputs, device) if counts else None,
            in_flight=torch.tensor(in_flight).to(**to) if any(in_flight) else None,
            min_token_rows=torch.tensor(under_min).to(**to) if under_min else None,
            eos=torch.tensor(sorted(eos_token_ids), dtype=torch.int64).to(**to) if under_min and eos_token_ids else None,
        )

    def _output_counts(self, input_ids: torch.Tensor | None) -> torch.Tensor:
        """float32 [R, vocab + 1]: how often each row generated each token (column `vocab`
        counts the rows without a token in flight)."""
        counts = torch.zeros((len(self.rows), self.vocab + 1), dtype=torch.float32, device=self.rows.device)
        index, ids = self.output_ids
        counts.index_put_((index, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if self.in_flight is not None and input_ids is not None:
            newest = torch.where(self.in_flight, input_ids[self.rows], self.vocab).unsqueeze(1)
            counts.scatter_add_(1, newest, torch.ones_like(newest, dtype=torch.float32))
        return counts

    def apply(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [B, vocab] with the adjustments applied; `input_ids`: the step's
        input tokens in batch order (asynchronous decoding), where in-flight tokens are."""
        logits = logits.float()
        adjusted = logits[self.rows]
        if self.bias is not None:
            index, tokens, values = self.bias
            adjusted.index_put_((index, tokens), values, accumulate=True)
        if self.output_ids is not None:
            counts = self._output_counts(input_ids)
            if self.repetition is not None:
                seen = counts > 0
                seen.index_put_(self.prompt_ids, torch.ones_like(self.prompt_ids[1], dtype=torch.bool))
                penalised = torch.where(adjusted < 0, adjusted * self.repetition, adjusted / self.repetition)
                adjusted = torch.where(seen[:, : self.vocab], penalised, adjusted)
            counts = counts[:, : self.vocab]
            adjusted = adjusted - self.frequency * counts - self.presence * (counts > 0)
        if self.eos is not None:
            under = self.min_token_rows.unsqueeze(1)
            adjusted[under, self.eos.unsqueeze(0)] = float("-inf")
        logits[self.rows] = adjusted
        return logits
