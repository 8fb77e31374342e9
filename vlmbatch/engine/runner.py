"""Turns a scheduled batch into one forward pass over the paged KV cache, then samples.

Owns the device state: the KV cache (one tensor pair per layer, sized from free GPU
memory unless `num_kv_blocks` is given), the attention backend, and on CUDA the decode
CUDA graphs, one per batch size in 1, 2, 4, 8, 16, 32, ... up to `max_num_seqs`,
captured over static input buffers and replayed with the batch padded to the next
captured size. Padding rows write their KV into one spare block past the ones the
block manager hands out, so they never touch a sequence's cache.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from vlmbatch.engine.attention import AttentionBackend, AttentionMetadata
from vlmbatch.engine.models.vlm import VisionLanguageModel
from vlmbatch.engine.sampler import SamplingBatch, sample
from vlmbatch.engine.scheduler import ScheduledBatch
from vlmbatch.engine.sequence import Sequence

_ACTIVATION_RESERVE_BYTES = 4 << 30  # vision tower (a full step of images), graphs and sampling beyond the measured prefill peak
_CPU_KV_CACHE_BYTES = 256 << 20  # default cache on the CPU, where free memory says little
# Decode graphs up to this batch launch their Triton kernels with programmatic dependent
# launch (`vlmbatch.kernels.pdl`): -3% step time at batch 1 on the H200, +3-5% at batch 64.
PDL_MAX_BATCH = 16


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 [num_seqs, longest] host tensor, unused entries -1."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 32 else sizes[-1] + 32)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


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
    ):
        self.model = model
        self.decoder = model.decoder
        self.backend = backend
        self.model.use_kernels(backend.elementwise_kernels)
        self.device = device
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.block_size = block_size
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.num_kv_blocks = num_kv_blocks or self._blocks_from_free_memory(max_num_batched_tokens, gpu_memory_utilization)
        self.kv_caches = self._allocate_cache(self.num_kv_blocks + 1)
        self.pad_slot = self.num_kv_blocks * block_size  # the spare block
        # Decode batch size -> its CUDA graph; None = the same static buffers run eagerly
        # (`prepare_static_decode(capture=False)`: lets the CPU tests cover the padding logic).
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.num_graph_replays = 0
        self.last_launch_s = 0.0  # host time of the last `run` until its forward and sampling were launched
        self._token_copies = TokenCopies(max_num_seqs, device)
        if device.type == "cuda" and not enforce_eager:
            self.prepare_static_decode(max_num_seqs, capture=True)

    # ---- KV cache -------------------------------------------------------------------
    def _block_bytes(self) -> int:
        per_token = 2 * len(self.decoder.layers) * self.decoder.num_kv_heads * self.decoder.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _allocate_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.decoder.num_kv_heads, self.decoder.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.decoder.layers]

    def _blocks_from_free_memory(self, max_num_batched_tokens: int, utilization: float) -> int:
        """What is left of `utilization` x device memory after the weights and the peak of
        a full-budget prefill (measured by running one)."""
        if self.device.type != "cuda":
            return max(1, _CPU_KV_CACHE_BYTES // self._block_bytes())
        num_tokens = max_num_batched_tokens
        blocks = (num_tokens + self.block_size - 1) // self.block_size
        self.kv_caches = self._allocate_cache(blocks + 1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        seq_meta = self._prefill_metadata_for_warmup(num_tokens, blocks)
        with torch.no_grad():
            embeds = self.decoder.embed_tokens(torch.zeros(num_tokens, dtype=torch.long, device=self.device))
            positions = torch.arange(num_tokens, device=self.device)
            if self.model.mrope:
                positions = positions.expand(3, -1)
            hidden = self.decoder(embeds, positions, self.kv_caches, seq_meta, self.backend)
            self.decoder.compute_logits(hidden[-1:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del self.kv_caches
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        budget = int(total * utilization) - peak - _ACTIVATION_RESERVE_BYTES
        num_blocks = budget // self._block_bytes()
        if num_blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)")
        return int(num_blocks)

    def _prefill_metadata_for_warmup(self, num_tokens: int, blocks: int) -> AttentionMetadata:
        return self._metadata(
            is_prefill=True,
            slot_mapping=list(range(num_tokens)),
            block_tables=[list(range(blocks))],
            q_lens=[num_tokens],
            context_lens=[num_tokens],
        )

    # ---- inputs -----------------------------------------------------------------------
    def _metadata(self, is_prefill: bool, slot_mapping: list[int], block_tables: list[list[int]], q_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
        tables = _padded_tables(block_tables)
        cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0, *context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        to = dict(device=self.device, non_blocking=True)
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(**to),
            block_tables=tables.to(**to),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(**to),
            cu_seqlens_q=cu_q.to(**to),
            cu_seqlens_k=cu_k.to(**to),
            max_q_len=max(q_lens),
            max_context_len=max(context_lens),
            q_lens=q_lens,
            context_lens_host=context_lens,
        )

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

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

    def _prefill_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, q_lens, ctx_lens = [], [], [], [], []
        media_rows, media_at = [], []  # media embedding rows and where they go in the flat batch
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.append(self._positions(seq, start, start + n))
            slots.extend(self._slots(seq, start, start + n))
            q_lens.append(n)
            ctx_lens.append(start + n)
            if seq.mm is not None and seq.mm.embeds is not None and start < seq.num_prompt_tokens:
                index = seq.mm.media_index[start : start + n]
                at = (index >= 0).nonzero().squeeze(1)
                media_rows.append(seq.mm.embeds[index[at]])
                media_at.append(at + offset)
            offset += n
        embeds = self.decoder.embed_tokens(torch.tensor(ids).to(self.device, non_blocking=True))
        if media_rows:
            embeds[torch.cat(media_at).to(self.device)] = torch.cat(media_rows).to(self.device, embeds.dtype)
        meta = self._metadata(True, slots, [s.block_table for s in batch.seqs], q_lens, ctx_lens)
        return embeds, torch.cat(positions, dim=-1).to(self.device, non_blocking=True), meta

    def _decode_host_inputs(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor, list[int], list[int]]:
        """Plain lists built in one pass: this runs every decode step for every sequence."""
        bs = self.block_size
        ids, positions, slots, lens = [], [], [], []
        for s in seqs:
            n = len(s)
            ids.append(s.token_ids[-1])
            positions.append(n - 1 + (s.mm.rope_delta if s.mm is not None else 0))
            slots.append(s.block_table[(n - 1) // bs] * bs + (n - 1) % bs)
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
        embeds, positions, meta = self._prefill_inputs(batch)
        hidden = self.decoder(embeds, positions, self.kv_caches, meta, self.backend)
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)) if s.num_computed_tokens + n == len(s)]
        last = torch.tensor(meta.q_lens).cumsum(0)[done] - 1
        return [batch.seqs[i] for i in done], self.decoder.compute_logits(hidden[last.to(self.device)])

    def launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> PendingTokens:
        """Launch the step's forward and sampling without waiting for the GPU; the sampled
        tokens arrive in pinned host memory (`PendingTokens.wait`)."""
        started = time.perf_counter()
        seqs, logits = self.forward_logits(batch, input_ids)
        if not seqs:
            self.last_launch_s = time.perf_counter() - started
            return PendingTokens([], None, None, None)
        sampling = SamplingBatch.build([s.params for s in seqs], [s.num_output_tokens for s in seqs], self.device)
        tokens = sample(logits, sampling)
        pending = self._token_copies.start(seqs, tokens)
        self.last_launch_s = time.perf_counter() - started
        return pending

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
        """Run the step; return the sequences that got a next token and those tokens."""
        pending = self.launch(batch)
        return pending.seqs, pending.wait()

    def _decode_logits(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> torch.Tensor:
        ids, positions, slots, ctx = self._decode_host_inputs(seqs)
        graph_size = next((b for b in sorted(self.graphs) if b >= len(seqs)), None)
        if graph_size is None:
            meta = self._metadata(False, slots, [s.block_table for s in seqs], [1] * len(seqs), ctx)
            device_ids = input_ids if input_ids is not None else torch.tensor(ids).to(self.device, non_blocking=True)
            hidden = self.decoder(self.decoder.embed_tokens(device_ids), positions.to(self.device, non_blocking=True), self.kv_caches, meta, self.backend)
            return self.decoder.compute_logits(hidden)
        return self._replay(graph_size, ids, positions, slots, [s.block_table for s in seqs], ctx, input_ids)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def use_backend(self, backend: AttentionBackend) -> None:
        """Switch attention backends (benchmarks compare them on one loaded model)."""
        self.backend = backend
        self.model.use_kernels(backend.elementwise_kernels)
        if self.graphs:
            capture = any(g is not None for g in self.graphs.values())
            self.graphs.clear()
            self.prepare_static_decode(len(self.static_inputs.ids), capture)

    @torch.no_grad()
    def prepare_static_decode(self, max_num_seqs: int, capture: bool) -> None:
        """Static decode buffers for batch sizes up to `max_num_seqs`, captured as CUDA graphs."""
        self.static_inputs = StaticDecodeInputs(max_num_seqs, 3 if self.model.mrope else 1, self.max_blocks_per_seq, self.device)
        self.graph_logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(graph_batch_sizes(max_num_seqs)):
            if not capture:
                self.graphs[size] = None
                continue
            self._stage(size, [], torch.zeros((3, 0) if self.model.mrope else (0,), dtype=torch.long), [], [], [])  # all padding
            meta = self._static_meta_view(size)
            graph = torch.cuda.CUDAGraph()
            with self._kernel_launch_scope(size):
                self._decode_forward(size, meta)  # warm up (autotuning, lazy init) outside the graph
                with torch.cuda.graph(graph, pool=pool):
                    self.graph_logits[size] = self._decode_forward(size, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        if capture:
            torch.cuda.synchronize()

    def _kernel_launch_scope(self, size: int) -> contextlib.AbstractContextManager:
        """Small decode batches launch the backend's Triton kernels with PDL."""
        kernels = self.backend.elementwise_kernels
        return kernels.launches_with_pdl(size <= PDL_MAX_BATCH) if kernels is not None else contextlib.nullcontext()

    def _static_meta_view(self, size: int) -> AttentionMetadata:
        inputs = self.static_inputs
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=inputs.slots[:size],
            block_tables=inputs.block_tables[:size],
            context_lens=inputs.context_lens[:size],
            max_context_len=self.max_blocks_per_seq * self.block_size,
        )

    def _decode_forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        self.static_inputs.spread(size)
        embeds = self.decoder.embed_tokens(self.static_inputs.ids[:size])
        hidden = self.decoder(embeds, self.static_inputs.positions[..., :size], self.kv_caches, meta, self.backend)
        return self.decoder.compute_logits(hidden)

    def _stage(self, size: int, ids: list[int], positions: torch.Tensor, slots: list[int], tables: list[list[int]], ctx: list[int]) -> None:
        self.static_inputs.stage(ids, positions, slots, tables, ctx, size, self.pad_slot, self.num_kv_blocks)

    def _replay(self, size: int, ids: list[int], positions: torch.Tensor, slots: list[int], tables: list[list[int]], ctx: list[int],
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

    def wait(self) -> list[int]:
        """The tokens; waits for this step only, not for steps launched after it."""
        if self.host is None:
            return []
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class TokenCopies:
    """Pinned buffers the sampled tokens are copied into, two in turn: the tokens of step n
    are read while step n + 1 runs, and step n + 2 is launched only after that."""

    def __init__(self, max_num_seqs: int, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.buffers = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=self.on_cuda) for _ in range(2)]
        self.turn = 0

    def start(self, seqs: list[Sequence], tokens: torch.Tensor) -> PendingTokens:
        if not self.on_cuda:
            return PendingTokens(seqs, tokens, tokens, None)
        host = self.buffers[self.turn][: len(seqs)]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingTokens(seqs, tokens, host, ready)


class StaticDecodeInputs:
    """The decode graphs' input buffers, filled by one host-to-device copy per step.

    Token ids, positions, slots, context lengths and block tables of the `size` rows a
    graph replays (padding rows included) are packed into a pinned host buffer and
    copied in one transfer; the graph itself spreads the first four into the static
    tensors it reads (`spread`, captured with the forward: their place in the packed
    buffer depends only on `size`), and one device copy places the block tables, whose
    width varies. A dozen small host-side tensor ops per step used to cost about as much
    host time as the whole batch-1 forward takes on the GPU.
    """

    def __init__(self, max_num_seqs: int, position_rows: int, max_blocks: int, device: torch.device):
        n = max_num_seqs
        self.position_rows = position_rows
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((position_rows, n), dtype=torch.long, device=device)
        if position_rows == 1:
            self.positions = self.positions[0]
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks), -1, dtype=torch.int32, device=device)
        capacity = n * (3 + position_rows + max_blocks)
        # Two host buffers in turn: a step is staged while the previous one may still be
        # queued on the GPU (asynchronous decoding), so its buffer must not be rewritten
        # before its own copy has run (`copied`).
        self.hosts = [torch.empty(capacity, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.staging = torch.empty(capacity, dtype=torch.int64, device=device)

    def stage(self, ids: list[int], positions: torch.Tensor, slots: list[int], tables: list[list[int]], ctx: list[int],
              size: int, pad_slot: int, pad_block: int) -> None:
        """Rows [0, len(ids)) from the batch, rows up to `size` padding: slot `pad_slot`,
        context 1 in block `pad_block`. Table entries past a row's width keep whatever an
        earlier step left: kernels read a table only up to the row's context length."""
        n, p = len(ids), self.position_rows
        width = max((len(t) for t in tables), default=0) or 1
        turn, self.turn = self.turn, self.turn ^ 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # long done: it was queued two steps ago
        host_tensor = self.hosts[turn]
        host = host_tensor.numpy()
        at = 0

        def section(length: int):
            nonlocal at
            view = host[at : at + length]
            at += length
            return view

        host_ids, host_positions, host_slots, host_ctx = section(size), section(p * size).reshape(p, size), section(size), section(size)
        host_tables = section(size * width).reshape(size, width)
        host_ids[:n], host_ids[n:] = ids, 0
        host_positions[:, :n], host_positions[:, n:] = positions.reshape(p, n).numpy(), 0
        host_slots[:n], host_slots[n:] = slots, pad_slot
        host_ctx[:n], host_ctx[n:] = ctx, 1
        host_tables.fill(-1)
        for row, table in enumerate(tables):
            host_tables[row, : len(table)] = table
        host_tables[n:, 0] = pad_block
        self.staging[:at].copy_(host_tensor[:at], non_blocking=True)
        if self.staging.is_cuda:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()
        tables_at = (3 + p) * size
        self.block_tables[:size, :width].copy_(self.staging[tables_at : tables_at + size * width].view(size, width))

    def spread(self, size: int) -> None:
        """Ids, positions, slots and context lengths of a `size`-row step from the staging
        buffer into the static tensors (part of each captured graph)."""
        p = self.position_rows
        ids, positions, slots, ctx = self.staging[: (3 + p) * size].split([size, p * size, size, size])
        self.ids[:size].copy_(ids)
        self.positions[..., :size].copy_(positions.view(p, size) if p > 1 else positions)
        self.slots[:size].copy_(slots)
        self.context_lens[:size].copy_(ctx)
