"""Where the benchmarks meet the engine's internals, and nowhere else.

The harnesses drive the product through its public surface (`add_request`, `step`,
`EngineStats`); the few things that need more (the prompt type the engine takes, the
scheduler and runner stepped by hand for teacher forcing) live here, so a change of the
engine's internals is adapted in this one module.
"""

from __future__ import annotations

import torch

from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.models.base import PreparedPrompt


@torch.no_grad()
def teacher_forced_logits(engine, prompts: list[PreparedPrompt], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len(continuation) + 1, vocab] (fp32, host) of each prompt's last token and of
    each forced continuation token, through the engine's normal schedule (batched prefill,
    then decode steps): the engine's scheduler and runner stepped by hand, feeding the
    forced token instead of the sampled one."""
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    forced = {}
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        engine.add_request(f"teacher-forced-{i}", prompt, greedy.updated(max_tokens=len(continuation) + 1))
        forced[f"teacher-forced-{i}"] = (list(continuation), [])
    while engine.scheduler.has_unfinished():
        batch = engine.scheduler.schedule()
        engine._encode_media(batch)
        seqs, logits = engine.runner.forward_logits(batch)
        engine.scheduler.finish_step(batch)
        for seq, row in zip(seqs, logits.float().cpu()):
            continuation, rows = forced[seq.request_id]
            rows.append(row)
            if len(rows) <= len(continuation):
                seq.token_ids.append(continuation[len(rows) - 1])
            else:
                engine.abort_request(seq.request_id)
    return [torch.stack(rows) for _, rows in forced.values()]
