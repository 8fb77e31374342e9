"""Token bitmasks: host fill, one copy, in-place masking of the constrained rows only, and
the empty-mask guard. The CPU runs xgrammar's C++ kernel; its Triton kernel runs under the
Triton interpreter with our shapes here and natively in the GPU test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import torch

from structured_harness import NESTED_SCHEMA, masked_reference, random_logits, tiny_grammar, unpack_bitmask  # noqa: F401
from vlmbatch.structured.bitmask import TokenBitmask, bitmask_words
from vlmbatch.structured.spec import parse_structured_output

NESTED = parse_structured_output({"guided_json": NESTED_SCHEMA})
CHOICES = ["red", "green", "blue"]


def _random_bitmask(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab_size)), generator=generator, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [640, 151_936, 1000])
def test_apply_masks_listed_rows_only(dtype, vocab_size):
    bitmask = TokenBitmask(8, vocab_size, "cpu", stop_token_id=2)
    bitmask.host.copy_(_random_bitmask(8, vocab_size, seed=vocab_size))
    rows = [1, 4, 5]
    bitmask.filled_rows = rows  # as `fill` leaves it, with masks of every shape a grammar cannot make
    logits = random_logits(torch.Generator().manual_seed(0), 8, vocab_size).to(dtype)
    expected = masked_reference(logits, bitmask.host, rows)
    bitmask.apply(logits)
    assert torch.equal(logits, expected)


def test_decode_loop_mixed_batch(tiny_grammar):
    """16 rows: schema, choice and free rows in one batch, random logits, masks from `fill`:
    every constrained row ends valid, and the free rows' logits are never touched."""
    vocab = tiny_grammar.vocab_size
    specs = [NESTED if i % 3 == 0 else parse_structured_output({"guided_choice": CHOICES}) if i % 3 == 1 else None for i in range(16)]
    matchers = {row: tiny_grammar.matcher(spec) for row, spec in enumerate(specs) if spec is not None}
    bitmask = TokenBitmask(16, vocab, "cpu", stop_token_id=tiny_grammar.eos)
    generator = torch.Generator().manual_seed(7)
    tokens: dict[int, list[int]] = {row: [] for row in matchers}
    for _ in range(300):
        live = [(row, m) for row, m in matchers.items() if not m.is_terminated]
        if not live:
            break
        logits = random_logits(generator, 16, vocab)
        free_before = logits[[r for r in range(16) if r not in matchers]].clone()
        assert bitmask.fill(live) == len(live)
        bitmask.apply(logits)
        assert torch.equal(logits[[r for r in range(16) if r not in matchers]], free_before)
        for row, matcher in live:
            token = int(logits[row].argmax())
            assert matcher.accept(token)
            tokens[row].append(token)
    for row, spec in enumerate(specs):
        if spec is NESTED:
            jsonschema.validate(json.loads(tiny_grammar.text(tokens[row])), NESTED_SCHEMA)
        elif spec is not None:
            assert tiny_grammar.text(tokens[row]) in CHOICES


def test_parallel_fill_gives_the_same_masks(tiny_grammar):
    vocab = tiny_grammar.vocab_size
    serial, parallel = (TokenBitmask(6, vocab, "cpu", stop_token_id=tiny_grammar.eos, fill_threads=n) for n in (1, 2))
    matchers = [tiny_grammar.matcher(NESTED) for _ in range(6)]
    prefix = tiny_grammar.tokenizer.encode('{"vendor": "Acme", "total": 12', add_special_tokens=False)
    for i, matcher in enumerate(matchers):  # each row at a different point of the grammar
        assert matcher.sync(prefix[: 2 * i])
    rows = list(enumerate(matchers))
    serial.fill(rows)
    parallel.fill(rows)
    assert torch.equal(serial.host, parallel.host)
    assert unpack_bitmask(serial.host, vocab)[0].sum() == 1  # the first token can only be "{"


def test_terminated_rows_are_left_out(tiny_grammar):
    matcher = tiny_grammar.matcher(parse_structured_output({"guided_choice": ["red"]}))
    for token in tiny_grammar.tokenizer.encode("red", add_special_tokens=False) + [tiny_grammar.eos]:
        assert matcher.accept(token)
    bitmask = TokenBitmask(2, tiny_grammar.vocab_size, "cpu", stop_token_id=tiny_grammar.eos)
    assert bitmask.fill([(0, matcher)]) == 0
    logits = torch.zeros(2, tiny_grammar.vocab_size)
    bitmask.apply(logits)
    assert torch.equal(logits, torch.zeros_like(logits))


def test_empty_mask_is_guarded_with_the_stop_token_and_flagged(tiny_grammar):
    """A row whose mask allows nothing samples the stop token (not NaN, not a random id),
    and its matcher refuses that token: the engine's signal to flag the row."""
    vocab = tiny_grammar.vocab_size
    matchers = [tiny_grammar.matcher(NESTED), tiny_grammar.matcher(NESTED)]
    bitmask = TokenBitmask(2, vocab, "cpu", stop_token_id=tiny_grammar.eos)
    bitmask.fill(list(enumerate(matchers)))
    bitmask.host[1] = 0  # a dead end: no token may continue row 1
    logits = random_logits(torch.Generator().manual_seed(1), 2, vocab)
    bitmask.apply(logits)
    assert torch.isfinite(logits[1]).sum() == 1 and int(logits[1].argmax()) == tiny_grammar.eos
    assert not torch.isnan(logits.softmax(-1)).any()
    assert tiny_grammar.text([int(logits[0].argmax())]) == "{"  # the healthy row is masked as usual
    assert not matchers[1].accept(tiny_grammar.eos) and matchers[1].rejected_token == tiny_grammar.eos


def test_stop_token_in_bit_31_of_its_word():
    """The guard's bit arithmetic in int32: token 63 is the sign bit of word 1."""
    bitmask = TokenBitmask(1, 640, "cpu", stop_token_id=63)
    bitmask.host[0] = 0
    bitmask.filled_rows = [0]
    logits = torch.zeros(1, 640)
    bitmask.apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [63]


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel
    from tests.structured_harness import masked_reference
    for vocab, rows, batch in ((151936, [0, 2], 3), (640, [1, 3, 4], 5)):
        words = (vocab + 31) // 32
        g = torch.Generator().manual_seed(vocab)
        logits = torch.randn(batch, vocab, generator=g)
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=g, dtype=torch.int64).to(torch.int32)
        expected = masked_reference(logits, mask, rows)
        indices = torch.tensor(rows, dtype=torch.int32)
        apply_token_bitmask_inplace_kernel[(4,)](logits, mask, indices, len(rows), vocab, logits.stride(0), mask.stride(0), 4, 4096)
        assert torch.equal(logits, expected), vocab
    print("ok")
    """
)


@pytest.mark.timeout(300)
def test_xgrammar_triton_kernel_under_the_interpreter_with_our_shapes():
    """The kernel `apply` runs on CUDA (xgrammar's Triton one) on the Qwen vocabulary and the tiny one, with an index tensor."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root},
        cwd=root, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.gpu
def test_on_the_gpu_bf16_qwen_vocab_without_host_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    vocab, batch = 151_936, 256
    bitmask = TokenBitmask(batch, vocab, "cuda", stop_token_id=151_645)
    rows = list(range(0, batch, 2))
    for step in range(3):
        bitmask.host.copy_(_random_bitmask(batch, vocab, seed=step))
        if step == 2:
            bitmask.host[rows[0]] = 0
        expected_mask = bitmask.host.clone()
        bitmask.filled_rows = rows
        logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
        expected = masked_reference(logits.cpu(), expected_mask, rows).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call in apply raises
        try:
            bitmask.apply(logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if step == 2:
            assert torch.isfinite(logits[rows[0]]).nonzero().flatten().tolist() == [151_645]
            logits[rows[0]], expected[rows[0]] = 0, 0
        assert torch.equal(logits, expected)
