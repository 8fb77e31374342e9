"""The torch attention backend follows the paged-KV contract defined by the kernels' references."""

import pytest
import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.attention import AttentionMetadata, TorchBackend, available_backends, create_backend, resolve_backend
from vlmbatch.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from vlmbatch.kernels.testing import make_paged_kv

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def paged_setup(context_lens, q_lens, num_decode_rows=0):
    """A shuffled block pool holding random KV for each sequence, plus metadata."""
    torch.manual_seed(0)
    blocks_per_seq = [(c + BLOCK - 1) // BLOCK for c in context_lens]
    order = torch.randperm(sum(blocks_per_seq)).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(order[at : at + n] + [-1] * (max(blocks_per_seq) - n))
        at += n
    shape = (sum(blocks_per_seq), BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    slots = []
    for table, ctx, q_len in zip(tables, context_lens, q_lens):
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(ctx - q_len, ctx)]
    meta = AttentionMetadata(
        is_prefill=max(q_lens) > 1,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        max_q_len=max(q_lens),
        max_context_len=max(context_lens),
        q_lens=q_lens,
        context_lens_host=context_lens,
        num_decode_rows=num_decode_rows,
    )
    return k_cache, v_cache, meta


def step_kv(cache, meta):
    """The keys/values this step wrote (the backend receives them besides the cache)."""
    return cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping]


def test_decode_matches_reference():
    k_cache, v_cache, meta = paged_setup([1, 7, 13], [1, 1, 1])
    q = torch.randn(3, HEADS, DIM)
    out = TorchBackend().decode(q, k_cache, v_cache, meta, 0.3)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.3)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    ("context_lens", "q_lens", "num_decode_rows"),
    [
        ([11, 9, 4], [5, 9, 1], 0),  # a chunk after 6 cached tokens, a fresh prompt, one token after 3 cached
        ([9, 4, 13], [1, 4, 1], 0),  # decoding sequences share the step with a 4-token chunk, not first
        ([9, 13, 4], [1, 1, 4], 2),  # the scheduler's order: they lead, and run as one decode batch
        ([9, 13], [1, 1], 2),  # only one-token rows (each a prompt's last token)
    ],
)
def test_prefill_matches_reference(context_lens, q_lens, num_decode_rows):
    k_cache, v_cache, meta = paged_setup(context_lens, q_lens, num_decode_rows)
    q = torch.randn(sum(q_lens), HEADS, DIM)
    out = TorchBackend().prefill(q, step_kv(k_cache, meta), step_kv(v_cache, meta), k_cache, v_cache, meta, 0.3)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, 0.3)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("window", [2, 5])
def test_decode_with_a_sliding_window_matches_reference(window):
    k_cache, v_cache, meta = paged_setup([1, 7, 13], [1, 1, 1])
    q = torch.randn(3, HEADS, DIM)
    out = TorchBackend().decode(q, k_cache, v_cache, meta, 0.3, window)
    args = (q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.3)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args, window=window))
    assert not torch.allclose(out[2], paged_decode_attention_ref(*args)[2])


@pytest.mark.parametrize("window", [0, 3, 6])
@pytest.mark.parametrize(
    ("context_lens", "q_lens", "key_ends"),
    [
        # a fresh prompt with a span at 2..7; a chunk whose span began in the cache (6..10)
        ([9, 11], [9, 5], [1, 2, 7, 7, 7, 7, 7, 8, 9] + [10, 10, 10, 10, 11]),
        ([9, 4, 13], [1, 4, 1], None),  # decoding rows beside a causal chunk, window only
    ],
)
def test_prefill_with_windows_and_spans_matches_reference(window, context_lens, q_lens, key_ends):
    k_cache, v_cache, meta = paged_setup(context_lens, q_lens)
    if key_ends is not None:
        meta.key_ends = torch.tensor(key_ends, dtype=torch.int32)
    q = torch.randn(sum(q_lens), HEADS, DIM)
    out = TorchBackend().prefill(q, step_kv(k_cache, meta), step_kv(v_cache, meta), k_cache, v_cache, meta, 0.3, window)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                           0.3, window=window, key_ends=meta.key_ends)
    torch.testing.assert_close(out, expected)


def test_store_writes_each_token_into_its_slot():
    k_cache, v_cache, meta = paged_setup([6], [6])
    k, v = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    TorchBackend().store_kv(k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(k_cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping], v)


def test_auto_is_torch_on_cpu_and_says_why():
    assert available_backends(torch.device("cpu")) == ["torch"]
    name, why = resolve_backend("auto", torch.device("cpu"))
    assert (name, why) == ("torch", "auto: the only backend on the CPU")
    assert create_backend(name).name == "torch"


def test_an_explicit_backend_wins_over_auto_and_an_unknown_one_is_refused():
    """The configured name (flag over VLMBATCH_ATTENTION_BACKEND, read at the edge) is
    taken as it is; `auto` is a fixed rule, not a file a benchmark wrote."""
    backend = EngineConfig.from_env({"VLMBATCH_ATTENTION_BACKEND": "triton"}).attention_backend
    assert resolve_backend(backend, torch.device("cpu"))[0] == "triton"
    assert create_backend("triton", pdl_max_rows=16).name == "triton"
    assert EngineConfig.from_env({"VLMBATCH_ATTENTION_BACKEND": "triton"}, attention_backend="torch").attention_backend == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'fastest'"):
        resolve_backend("fastest", torch.device("cpu"))


def _fake_flash_attn(root, *files):
    for name in files:
        path = root / "flash_attn" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


@pytest.mark.parametrize(
    ("files", "flavour"),
    [
        (("cute/__init__.py",), "fa4"),  # the flash-attn-4 wheel: a namespace holding `cute`
        (("__init__.py",), "fa2"),  # the flash-attn 2/3 package
        (("README",), None),  # a bare namespace directory is no FlashAttention
    ],
)
def test_flash_attn_flavour_follows_what_is_installed(tmp_path, monkeypatch, files, flavour):
    import sys

    from vlmbatch.engine.attention import flash_attn_flavour

    _fake_flash_attn(tmp_path, *files)
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    # Only the fake on the path: namespace packages merge every path entry's `flash_attn`,
    # so a real FlashAttention installed elsewhere would otherwise join the fake.
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(sys, "path_importer_cache", {})
    assert flash_attn_flavour() == flavour


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", available_backends(DEVICE))
def test_every_backend_matches_the_reference_in_bf16(name):
    """Real-model head shapes (16 query / 2 KV heads, dim 128) and the GPU block size, over
    a cache laid out as the engine leaves it (scattered blocks, garbage in unused ones);
    every backend this device has (only torch on the CPU)."""
    block, kv_heads, heads, dim, scale = 256, 2, 16, 128, 0.088
    context_lens, q_lens = [513, 700, 300], [1, 200, 300]  # a decoding row leads, as the scheduler orders them
    kv = make_paged_kv(context_lens, kv_heads, dim, block, torch.bfloat16, DEVICE, seed=1)
    to = dict(device=DEVICE, dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(1, device=DEVICE, dtype=torch.int64),
        block_tables=kv.block_tables, context_lens=kv.context_lens,
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(**to), cu_seqlens_k=torch.tensor([0, *context_lens]).cumsum(0).to(**to),
        max_q_len=max(q_lens), max_context_len=max(context_lens), q_lens=q_lens, context_lens_host=context_lens,
        num_decode_rows=1,
    )
    backend = create_backend(name)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), heads, dim, generator=generator).to(DEVICE, torch.bfloat16)
    tables = kv.block_tables.tolist()
    slots = torch.tensor([tables[b][i // block] * block + i % block for b, (c, n) in enumerate(zip(context_lens, q_lens)) for i in range(c - n, c)], device=DEVICE)
    step_k, step_v = (cache.view(-1, kv_heads, dim)[slots] for cache in (kv.k_cache, kv.v_cache))
    out = backend.prefill(q, step_k, step_v, kv.k_cache, kv.v_cache, meta, scale)
    expected = paged_prefill_attention_ref(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, meta.cu_seqlens_q, kv.context_lens, scale)
    assert (out.float() - expected).norm() / expected.norm() < 1e-2
    q1 = torch.randn(3, heads, dim, generator=generator).to(DEVICE, torch.bfloat16)
    decoded = backend.decode(q1, kv.k_cache, kv.v_cache, meta, scale)
    expected = paged_decode_attention_ref(q1.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.context_lens, scale)
    assert (decoded.float() - expected).norm() / expected.norm() < 1e-2


@pytest.mark.gpu  # the interpreter compiles nothing
def test_prefill_compiles_once_whatever_slices_and_table_widths_a_step_passes():
    """A mixed step passes the prefill kernel its sequences past the leading decode rows as
    slices (addresses aligned or not) and block tables as wide as its longest sequence:
    none of that may compile a new variant mid-run (session 15's first passes compiled two).
    Each slice computes what the whole step computes for its sequences."""
    from vlmbatch.bench.timing import triton_compiles
    from vlmbatch.kernels import PrefillConfig, paged_prefill_attention
    from vlmbatch.kernels.testing import make_paged_kv

    q_lens, context_lens = [1, 1, 1, 11, 40, 33], [20, 37, 50, 27, 40, 33]
    kv = make_paged_kv(context_lens, 2, 64, 8, torch.bfloat16, "cuda", seed=7)
    q = torch.randn(sum(q_lens), 8, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    wider = torch.cat([kv.block_tables, torch.full((len(q_lens), 13), -1, dtype=torch.int32, device="cuda")], dim=1)

    def run(rows: int, tables: torch.Tensor) -> torch.Tensor:
        return paged_prefill_attention(q, kv.k_cache, kv.v_cache, tables[rows:], cu[rows:], kv.context_lens[rows:], max(q_lens[rows:]),
                                       0.3, config=PrefillConfig(block_m=64, block_n=32))  # fmt: skip

    whole = run(0, kv.block_tables)
    with triton_compiles() as compiled:
        for rows in (1, 2, 3):
            for tables in (kv.block_tables, wider):
                first = int(cu[rows])
                assert torch.equal(run(rows, tables)[first:], whole[first:]), (rows, tables.shape)
    assert compiled == {}


@pytest.mark.gpu  # the interpreter compiles nothing
def test_decode_compiles_once_whatever_split_counts_and_table_widths_a_step_takes():
    """The split count follows the step's batch size and the block tables are as wide as
    its longest sequence: once the kernel has run with and without splits, neither may
    compile a new variant (session 16: one mid-run compile in LLaVA-OneVision's W1)."""
    from vlmbatch.bench.timing import triton_compiles
    from vlmbatch.kernels import paged_decode_attention
    from vlmbatch.kernels.testing import make_paged_kv

    context_lens = [20, 37, 50, 27, 140, 33]
    kv = make_paged_kv(context_lens, 2, 64, 8, torch.bfloat16, "cuda", seed=8)
    q = torch.randn(len(context_lens), 8, 64, device="cuda", dtype=torch.bfloat16)
    expected = paged_decode_attention_ref(q.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables, kv.context_lens, 0.3)
    for splits in (1, 2):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3, num_splits=splits)
    with triton_compiles() as compiled:
        for extra_columns in (0, 13, 16 - kv.block_tables.shape[1] % 16):
            tables = torch.cat([kv.block_tables, torch.full((len(context_lens), extra_columns), -1, dtype=torch.int32, device="cuda")], dim=1)
            for splits in (1, 3, 4, 16):
                out = paged_decode_attention(q, kv.k_cache, kv.v_cache, tables, kv.context_lens, 0.3, num_splits=splits)
                assert (out.float() - expected).norm() / expected.norm() < 1e-2, (extra_columns, splits)
    assert compiled == {}
