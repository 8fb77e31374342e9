"""Turns a scheduled batch into one forward pass over the paged KV cache, then samples.

Owns the device state: the KV cache (`kv_cache.py`: one tensor pair per layer, shared by
the KV-cache groups' layers of one slot (`kv_groups.py`), sized from free GPU memory unless
`num_kv_blocks` is given), the attention backend, and on CUDA the decode CUDA graphs
(`decode_graphs.py`), replayed with the batch padded to the next captured size. Each step
builds one `AttentionMetadata` per group (its slots and block tables) and hands every
layer its group's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vlmbatch.engine.attention import AttentionBackend, AttentionMetadata
from vlmbatch.engine.decode_graphs import StaticDecodeInputs, graph_batch_sizes
from vlmbatch.engine.decoder import DeepStack
from vlmbatch.engine.kv_cache import allocate_kv_cache, kv_block_bytes, kv_blocks_from_free_memory
from vlmbatch.engine.kv_groups import kv_layout
from vlmbatch.engine.logit_adjust import LogitAdjustments
from vlmbatch.engine.outputs import TokenLogprob
from vlmbatch.engine.sampler import SamplingBatch, sample, token_logprobs
from vlmbatch.engine.scheduler import ScheduledBatch
from vlmbatch.engine.sequence import PLACEHOLDER, Sequence
from vlmbatch.engine.vision_language import VisionLanguageModel


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 [num_seqs, longest] host tensor, unused entries -1."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)


class ModelRunner:
    def __init__(
        self,
        model: VisionLanguageModel,
        backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        eos_token_ids: frozenset[int] = frozenset(),
        kv_cache_dtype: torch.dtype | None = None,
    ):
        """`eos_token_ids`: what `min_tokens` keeps from being drawn too early. `kv_cache_dtype`:
        the KV cache's element type (None: the model's; float8_e4m3fn for `--kv-cache-dtype fp8`,
        half the bytes per token, so twice the tokens). `num_kv_blocks` counts blocks of the
        whole model (every layer's KV for `block_size` tokens): the pool gets that many per
        KV-cache group, the same memory whatever the grouping."""
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.decoder = model.decoder
        self._check_backend(backend)
        self.backend = backend
        self.device = device
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.kv_dtype = kv_cache_dtype or self.dtype
        self.block_size = block_size
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.kv_layout = kv_layout([layer.self_attn.window for layer in self.decoder.layers])
        self.num_kv_blocks = (num_kv_blocks * self.kv_layout.num_groups if num_kv_blocks
                              else self._blocks_from_free_memory(max_num_batched_tokens, gpu_memory_utilization))
        self.kv_caches = allocate_kv_cache(self.decoder, self.kv_layout, self.num_kv_blocks + 1, block_size, self.kv_dtype, device)
        # The spare block: CUDA-graph padding rows write there, and dropped table entries of
        # sliding groups (`BlockManager.null_block`) point there.
        self.pad_slot = self.num_kv_blocks * block_size
        # Decode batch size -> its CUDA graph; None = the same static buffers run eagerly
        # (`prepare_static_decode(capture=False)`: lets the CPU tests cover the padding logic).
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.num_graph_replays = 0
        self.num_mixed_decode_rows = 0  # decoding rows of prefill steps (`_leading_decode_rows`)
        self.last_launch_s = 0.0  # host time of the last `run` until its forward and sampling were launched
        self._token_copies = TokenCopies(max_num_seqs, device)
        if device.type == "cuda" and not enforce_eager:
            self.prepare_static_decode(max_num_seqs, capture=True)

    # ---- KV cache -------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one pool block: one group's layers for `block_size` tokens."""
        return kv_block_bytes(self.decoder, self.kv_layout, self.block_size, self.kv_dtype)

    def _blocks_from_free_memory(self, max_num_batched_tokens: int, utilization: float) -> int:
        """What is left of `utilization` x device memory after the weights and the peak of
        a full-budget prefill, measured by running one (`kv_cache.kv_blocks_from_free_memory`)."""

        def full_prefill() -> None:
            num_tokens = max_num_batched_tokens
            blocks = (num_tokens + self.block_size - 1) // self.block_size
            caches = allocate_kv_cache(self.decoder, self.kv_layout, blocks + 1, self.block_size, self.kv_dtype, self.device)
            meta = self._prefill_metadata_for_warmup(num_tokens, blocks)
            with torch.no_grad():
                embeds = self.decoder.embed_tokens(torch.zeros(num_tokens, dtype=torch.long, device=self.device))
                positions = torch.arange(num_tokens, device=self.device)
                if self.model.mrope:
                    positions = positions.expand(3, -1)
                hidden = self.decoder(embeds, positions, caches, meta, self.backend)
                self.decoder.compute_logits(hidden[-1:])

        return kv_blocks_from_free_memory(self.device, self.block_bytes, full_prefill, utilization)

    def _prefill_metadata_for_warmup(self, num_tokens: int, blocks: int) -> list[AttentionMetadata]:
        """Every group on the same blocks: only the memory peak matters here."""
        groups = self.kv_layout.num_groups
        return self._metadata(
            is_prefill=True,
            slots=torch.arange(num_tokens).expand(groups, -1),
            block_tables=[[list(range(blocks))] * groups],
            q_lens=[num_tokens],
            context_lens=[num_tokens],
        )

    # ---- inputs -----------------------------------------------------------------------
    def _metadata(self, is_prefill: bool, slots: torch.Tensor | list[list[int]], block_tables: list[list[list[int]]],
                  q_lens: list[int], context_lens: list[int], key_ends: torch.Tensor | None = None) -> list[AttentionMetadata]:
        """Per layer, its group's metadata. `slots` [groups, num_tokens]; `block_tables` per
        sequence, per group."""
        cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0, *context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        to = dict(device=self.device, non_blocking=True)
        slots = torch.as_tensor(slots, dtype=torch.int64).to(**to)
        shared = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=slots[0],
            block_tables=_padded_tables([tables[0] for tables in block_tables]).to(**to),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(**to),
            cu_seqlens_q=cu_q.to(**to),
            cu_seqlens_k=cu_k.to(**to),
            max_q_len=max(q_lens),
            max_context_len=max(context_lens),
            q_lens=q_lens,
            context_lens_host=context_lens,
            key_ends=None if key_ends is None else key_ends.to(**to),
            num_decode_rows=next((b for b, n in enumerate(q_lens) if n != 1), len(q_lens)) if is_prefill else 0,
        )
        groups = [shared] + [replace(shared, slot_mapping=slots[g], block_tables=_padded_tables([t[g] for t in block_tables]).to(**to))
                             for g in range(1, self.kv_layout.num_groups)]
        return self._per_layer(groups)

    def _per_layer(self, groups: list[AttentionMetadata]) -> list[AttentionMetadata]:
        return [groups[g] for g in self.kv_layout.layer_groups]

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """[groups, end - start]: the cache slots of tokens [start, end) in each group."""
        bs, first = self.block_size, start // self.block_size
        blocks = torch.tensor([table[first : (end - 1) // bs + 1] for table in seq.block_tables], dtype=torch.int64)
        positions = torch.arange(start, end)
        return blocks[:, positions // bs - first] * bs + positions % bs

    def _positions(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Rope positions of tokens [start, end): M-RoPE's [3, n] or 1-D [n]."""
        if not self.model.mrope:
            return torch.arange(start, end)
        mm = seq.mm
        if mm is None or mm.rope_positions is None:
            return torch.arange(start, end).expand(3, -1)
        prompt_end = min(end, seq.num_prompt_tokens)
        parts = [mm.rope_positions[:, start:prompt_end]] if start < prompt_end else []
        if end > seq.num_prompt_tokens:  # generated tokens being recomputed after preemption
            parts.append((torch.arange(max(start, seq.num_prompt_tokens), end) + mm.rope_delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    @staticmethod
    def _key_ends(seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """Per token of [start, end): the end of the keys it sees, its bidirectional span's
        end inside one (the scheduler keeps spans whole in a chunk), else its position + 1;
        None when no span overlaps."""
        spans = [(s, e) for s, e in seq.mm.bidirectional_spans if s < end and e > start] if seq.mm is not None else []
        if not spans:
            return None
        ends = torch.arange(start + 1, end + 1, dtype=torch.int32)
        for span_start, span_end in spans:
            ends[max(span_start, start) - start : span_end - start] = span_end
        return ends

    @staticmethod
    def _leading_decode_rows(batch: ScheduledBatch) -> int:
        """How many of the step's first sequences decode (one new token past the prompt):
        their inputs are a decode step's, built as plain lists (`_decode_host_inputs`)
        instead of tensors per sequence (~20 ms of host time for 440 such rows on the CPU
        machine, 0.5 ms as lists). The scheduler puts one-token rows first."""
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if n != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                return b
        return len(batch.seqs)

    def _prefill_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], DeepStack | None]:
        ids, positions, slots, q_lens, ctx_lens, key_ends = [], [], [], [], [], []
        decoding = self._leading_decode_rows(batch)
        self.num_mixed_decode_rows += decoding
        if decoding:
            ids, decode_positions, decode_slots, ctx_lens = self._decode_host_inputs(batch.seqs[:decoding])
            positions, slots = [decode_positions], [torch.tensor(decode_slots, dtype=torch.int64)]
            q_lens, key_ends = [1] * decoding, [None] * decoding
        media_rows, media_at = [], []  # media embedding rows and where they go in the flat batch
        offset = decoding
        for seq, n in zip(batch.seqs[decoding:], batch.num_new_tokens[decoding:]):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.append(self._positions(seq, start, start + n))
            slots.append(self._slots(seq, start, start + n))
            q_lens.append(n)
            ctx_lens.append(start + n)
            key_ends.append(self._key_ends(seq, start, start + n))
            if seq.mm is not None and seq.mm.embeds is not None and start < seq.num_prompt_tokens:
                index = seq.mm.media_index[start : start + n]
                at = (index >= 0).nonzero().squeeze(1)
                media_rows.append(seq.mm.embeds[seq.mm.embed_rows[index[at]]])
                media_at.append(at + offset)
            offset += n
        embeds = self.decoder.embed_tokens(torch.tensor(ids).to(self.device, non_blocking=True))
        deepstack = None
        if media_rows:
            at, rows = torch.cat(media_at).to(self.device), torch.cat(media_rows).to(self.device, embeds.dtype)
            hidden = embeds.shape[-1]
            embeds[at] = rows[:, :hidden]
            if self.model.deepstack_levels:  # the levels sit beside the embeddings (`encode_batch`)
                deepstack = DeepStack(at, rows[:, hidden:].view(len(at), self.model.deepstack_levels, hidden))
        ends = None
        if any(e is not None for e in key_ends):
            ends = torch.cat([e if e is not None else torch.arange(c - q + 1, c + 1, dtype=torch.int32)
                              for e, q, c in zip(key_ends, q_lens, ctx_lens)])
        meta = self._metadata(True, torch.cat(slots, dim=1), [s.block_tables for s in batch.seqs], q_lens, ctx_lens, ends)
        return embeds, torch.cat(positions, dim=-1).to(self.device, non_blocking=True), meta, deepstack

    def _decode_host_inputs(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor, list[list[int]], list[int]]:
        """Plain lists built in one pass: this runs every decode step for every sequence.
        Slots per group."""
        bs = self.block_size
        ids, positions, lens = [], [], []
        slots: list[list[int]] = [[] for _ in range(self.kv_layout.num_groups)]
        for s in seqs:
            n = len(s)
            ids.append(s.token_ids[-1])
            positions.append(n - 1 + (s.mm.rope_delta if s.mm is not None else 0))
            index, offset = (n - 1) // bs, (n - 1) % bs
            for group_slots, table in zip(slots, s.block_tables):
                group_slots.append(table[index] * bs + offset)
            lens.append(n)
        position_tensor = torch.tensor(positions)
        return ids, position_tensor.expand(3, -1) if self.model.mrope else position_tensor, slots, lens

    # ---- forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward_logits(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """Run the step; return the sequences that reach their last token and its logits.
        `input_ids` (decode only): the step's input tokens already on the device, in batch
        order (the previous step's samples), instead of each sequence's last token."""
        if not batch.is_prefill:
            return batch.seqs, self._decode_logits(batch.seqs, input_ids)
        embeds, positions, meta, deepstack = self._prefill_inputs(batch)
        hidden = self.decoder(embeds, positions, self.kv_caches, meta, self.backend, deepstack)
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)) if s.num_computed_tokens + n == len(s)]
        last = torch.tensor(meta[0].q_lens).cumsum(0)[done] - 1
        return [batch.seqs[i] for i in done], self.decoder.compute_logits(hidden[last.to(self.device)])

    def launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None,
               before_sample: Callable[[list[Sequence], torch.Tensor], None] | None = None) -> PendingTokens:
        """Launch the step's forward and sampling without waiting for the GPU; the sampled
        tokens arrive in pinned host memory (`PendingTokens.wait`). `before_sample(seqs,
        logits)` runs between the two, on the logits rows of `seqs` (structured-output masks)."""
        started = time.perf_counter()
        seqs, logits = self.forward_logits(batch, input_ids)
        if not seqs:
            self.last_launch_s = time.perf_counter() - started
            return PendingTokens([], None, None, None)
        params = [s.params for s in seqs]
        adjustments = LogitAdjustments.build(seqs, logits.shape[-1], self.eos_token_ids, PLACEHOLDER, self.device)
        if adjustments is not None:
            logits = adjustments.apply(logits, input_ids)
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        unmasked = logits
        if before_sample is not None:  # structured-output masks, in place: after the adjustments, before sampling
            unmasked = logits.clone() if k is not None else None  # logprobs are taken before the mask
            before_sample(seqs, logits)
        sampling = SamplingBatch.build(params, [s.num_output_tokens for s in seqs], self.device)
        tokens = sample(logits, sampling)
        logprobs = token_logprobs(unmasked, tokens, k) if k is not None else None
        pending = self._token_copies.start(seqs, tokens, logprobs)
        self.last_launch_s = time.perf_counter() - started
        return pending

    def run(self, batch: ScheduledBatch, before_sample: Callable[[list[Sequence], torch.Tensor], None] | None = None
            ) -> PendingTokens:
        """Run the step and wait for its tokens (`PendingTokens.seqs` got one each)."""
        pending = self.launch(batch, before_sample=before_sample)
        pending.wait()
        return pending

    def _decode_logits(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> torch.Tensor:
        ids, positions, slots, ctx = self._decode_host_inputs(seqs)
        graph_size = next((b for b in sorted(self.graphs) if b >= len(seqs)), None)
        if graph_size is None:
            meta = self._metadata(False, slots, [s.block_tables for s in seqs], [1] * len(seqs), ctx)
            device_ids = input_ids if input_ids is not None else torch.tensor(ids).to(self.device, non_blocking=True)
            hidden = self.decoder(self.decoder.embed_tokens(device_ids), positions.to(self.device, non_blocking=True), self.kv_caches, meta, self.backend)
            return self.decoder.compute_logits(hidden)
        return self._replay(graph_size, ids, positions, slots, [s.block_tables for s in seqs], ctx, input_ids)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _check_backend(self, backend: AttentionBackend) -> None:
        """A model with sliding windows or bidirectional spans needs a backend that does them."""
        needs = self.model.bidirectional_media or any(layer.self_attn.window for layer in self.decoder.layers)
        if needs and not backend.beyond_causal:
            raise ValueError(f"this model has sliding-window layers or bidirectional image attention, which the "
                             f"{backend.name} attention backend does not do: use --attention-backend triton or torch")

    def use_backend(self, backend: AttentionBackend) -> None:
        """Switch attention backends (benchmarks compare them on one loaded model; the
        model's other kernels stay as it was built with)."""
        self._check_backend(backend)
        self.backend = backend
        if self.graphs:
            capture = any(g is not None for g in self.graphs.values())
            self.graphs.clear()
            self.prepare_static_decode(len(self.static_inputs.ids), capture)

    @torch.no_grad()
    def prepare_static_decode(self, max_num_seqs: int, capture: bool) -> None:
        """Static decode buffers for batch sizes up to `max_num_seqs`, captured as CUDA graphs."""
        groups = self.kv_layout.num_groups
        self.static_inputs = StaticDecodeInputs(max_num_seqs, 3 if self.model.mrope else 1, self.max_blocks_per_seq, self.device, groups)
        self.graph_logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(graph_batch_sizes(max_num_seqs)):
            if not capture:
                self.graphs[size] = None
                continue
            positions = torch.zeros((3, 0) if self.model.mrope else (0,), dtype=torch.long)
            self._stage(size, [], positions, [[] for _ in range(groups)], [], [])  # all padding
            meta = self._static_meta_view(size)
            graph = torch.cuda.CUDAGraph()
            self._decode_forward(size, meta)  # warm up (autotuning, lazy init) outside the graph
            with torch.cuda.graph(graph, pool=pool):
                self.graph_logits[size] = self._decode_forward(size, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        if capture:
            torch.cuda.synchronize()

    def _static_meta_view(self, size: int) -> list[AttentionMetadata]:
        inputs = self.static_inputs
        return self._per_layer([AttentionMetadata(
            is_prefill=False,
            slot_mapping=inputs.slots[g, :size],
            block_tables=inputs.block_tables[g, :size],
            context_lens=inputs.context_lens[:size],
            max_context_len=self.max_blocks_per_seq * self.block_size,
        ) for g in range(self.kv_layout.num_groups)])

    def _decode_forward(self, size: int, meta: list[AttentionMetadata]) -> torch.Tensor:
        self.static_inputs.spread(size)
        embeds = self.decoder.embed_tokens(self.static_inputs.ids[:size])
        hidden = self.decoder(embeds, self.static_inputs.positions[..., :size], self.kv_caches, meta, self.backend)
        return self.decoder.compute_logits(hidden)

    def _stage(self, size: int, ids: list[int], positions: torch.Tensor, slots: list[list[int]], tables: list[list[list[int]]],
               ctx: list[int]) -> None:
        self.static_inputs.stage(ids, positions, slots, tables, ctx, size, self.pad_slot, self.num_kv_blocks)

    def _replay(self, size: int, ids: list[int], positions: torch.Tensor, slots: list[list[int]], tables: list[list[list[int]]], ctx: list[int],
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._stage(size, ids, positions, slots, tables, ctx)
        if input_ids is not None:  # after the staged copy on the same stream: these win
            self.static_inputs.staging[: len(ids)].copy_(input_ids)
        graph = self.graphs[size]
        if graph is None:
            self.graph_logits[size] = self._decode_forward(size, self._static_meta_view(size))
        else:
            graph.replay()
        self.num_graph_replays += 1
        return self.graph_logits[size][:len(ids)]


@dataclass
class PendingTokens:
    """A launched step's sampled tokens, on their way to pinned host memory."""

    seqs: list[Sequence]
    tokens: torch.Tensor | None  # [len(seqs)] on the device: the next decode step's inputs
    host: torch.Tensor | None  # where they land on the host
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU)
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # `token_logprobs`' pair, on the host
    _tokens: list[int] | None = None

    def wait(self) -> list[int]:
        """The tokens; waits for this step only, not for steps launched after it."""
        if self._tokens is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._tokens = [] if self.host is None else self.host.tolist()
        return self._tokens

    def token_logprobs(self) -> list[TokenLogprob | None]:
        """Per sequence (after `wait`): its token's logprob and its own top-k, or None."""
        if self.logprobs is None:
            return [None] * len(self.seqs)
        values, ids = self.logprobs[0].tolist(), self.logprobs[1].tolist()
        result = []
        for seq, token, row_values, row_ids in zip(self.seqs, self.wait(), values, ids):
            k = seq.params.logprobs
            result.append(None if k is None else TokenLogprob(token, row_values[0], list(zip(row_ids[:k], row_values[1 : k + 1]))))
        return result


class TokenCopies:
    """Pinned buffers the sampled tokens are copied into, two in turn: the tokens of step n
    are read while step n + 1 runs, and step n + 2 is launched only after that."""

    def __init__(self, max_num_seqs: int, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.buffers = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=self.on_cuda) for _ in range(2)]
        self.turn = 0

    def start(self, seqs: list[Sequence], tokens: torch.Tensor,
              logprobs: tuple[torch.Tensor, torch.Tensor] | None = None) -> PendingTokens:
        """`logprobs` (steps with rows that asked for them) travel in the same copy batch."""
        if not self.on_cuda:
            return PendingTokens(seqs, tokens, tokens, None, logprobs)
        host = self.buffers[self.turn][: len(seqs)]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs = tuple(_to_pinned(t) for t in logprobs)
        ready = torch.cuda.Event()
        ready.record()
        return PendingTokens(seqs, tokens, host, ready, logprobs)


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
