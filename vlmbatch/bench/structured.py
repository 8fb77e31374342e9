"""Grammar libraries compared where the engine spends time: tokenizer set-up, compile, and the
per-step fill of a batch's masks, on a Qwen-size vocabulary built here (151,936 tokens).

Rows are spread evenly along a tokenised instance of the schema, so one step's batch mixes
every grammar state (inside strings, numbers, between fields), as a running batch does.
Each fill is timed over `steps` steps; the matchers then accept their next token. Paths:
- `xgrammar serial`: `GrammarMatcher.fill_next_token_bitmask` row by row (`TokenBitmask`
  with `fill_threads=1`);
- `xgrammar batch/N`: `BatchGrammarMatcher` with N C++ threads (`fill_threads=N`);
- `xgrammar pythreads/N`: a Python thread pool over the serial calls; the GIL probe says
  whether xgrammar drops the GIL while filling (a counter thread's rate while this one fills);
- `llguidance serial` and `llguidance par/N`: its matcher and its parallel executor.
On CUDA it also times `TokenBitmask.apply` (copy + empty-row guard + xgrammar's kernel).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vlmbatch.testing.invoices import INVOICE_SCHEMA, invoice_fields

Echo = Callable[[str], None]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


# The invoice schema bounds its strings with patterns (a random-weight model must end them);
# `plain` is the same six fields with types only, what most users write.
SCHEMAS: dict[str, dict[str, Any]] = {
    "invoice": INVOICE_SCHEMA,
    "plain": {
        **INVOICE_SCHEMA,
        "properties": {
            name: {"enum": spec["enum"]} if "enum" in spec else {"type": spec["type"]}
            for name, spec in INVOICE_SCHEMA["properties"].items()
        },
    },
}


def _instance_text() -> str:
    return json.dumps({key: value for key, value in invoice_fields(1).items() if key in INVOICE_SCHEMA["properties"]})


def _fill_times(make: Callable[[], Any], consume: Callable[[Any, int], None], fill: Callable[[list[Any]], None],
                tokens: list[int], batch: int, steps: int) -> dict[str, float]:
    """Median wall and CPU ms (all threads of this process: on a busy machine the CPU time of
    the serial path is its cost on an idle core) of one batch fill; rows spread evenly along `tokens` (so every batch size sees
    the same mix of grammar states) and reset at its end."""
    span = len(tokens) - 1  # the stop token is never consumed here: the rows keep going
    matchers, positions = [], []
    for row in range(batch):
        matcher, position = make(), row * span // batch
        for token in tokens[:position]:
            consume(matcher, token)
        matchers.append(matcher)
        positions.append(position)
    walls, cpus = [], []
    for _ in range(steps):
        cpu = time.process_time()
        walls.append(_timed(lambda: fill(matchers))[1])
        cpus.append(time.process_time() - cpu)
        for row, matcher in enumerate(matchers):
            if positions[row] == span:
                matcher.reset()
                positions[row] = 0
            consume(matcher, tokens[positions[row]])
            positions[row] += 1
    return {"wall_ms": statistics.median(walls) * 1e3, "cpu_ms": statistics.median(cpus) * 1e3}


def _gil_probe(fill: Callable[[], None], seconds: float = 1.5) -> dict[str, float]:
    """Iterations/s of a pure-Python counter thread while this thread sleeps, runs Python, or
    fills masks: near the sleeping rate means the fill releases the GIL (threads can help)."""
    import threading

    def busy() -> None:
        total = 0
        for i in range(20_000):
            total += i

    def rate(work: Callable[[], None]) -> float:
        stop, counts = threading.Event(), []

        def count() -> None:
            n = 0
            while not stop.is_set():
                n += 1
            counts.append(n)

        thread = threading.Thread(target=count)
        thread.start()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            work()
        stop.set()
        thread.join()
        return counts[0] / seconds

    return {"sleeping": rate(lambda: time.sleep(0.005)), "python": rate(busy), "filling": rate(fill)}


def _gpu_apply_ms(vocab_size: int, stop: int, batch: int, steps: int) -> float:
    """ms per `TokenBitmask.apply` (copy, guard, kernel) on bf16 logits, all rows constrained."""
    from vlmbatch.structured.bitmask import TokenBitmask

    bitmask = TokenBitmask(batch, vocab_size, "cuda", stop_token_id=stop)
    logits = torch.randn(batch, vocab_size, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for timed in (False, True):  # the first round compiles the kernel
        start.record()
        for _ in range(steps):
            bitmask.filled_rows = list(range(batch))
            bitmask.apply(logits)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / steps


def _xgrammar(tokenizer: Any, vocab_size: int, stop: int, tokens: list[int], batches: list[int], steps: int, threads: list[int], echo: Echo) -> dict[str, Any]:
    import xgrammar as xgr

    from vlmbatch.structured.grammar import build_grammar
    from vlmbatch.structured.spec import parse_structured_output

    info, info_s = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[stop]))
    compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
    echo(f"xgrammar: tokenizer info {info_s * 1e3:.0f} ms")
    result: dict[str, Any] = {"tokenizer_ms": info_s * 1e3, "compile_ms": {}, "fill_ms": {}}

    def consume(matcher: Any, token: int) -> None:
        assert matcher.accept_token(token), token

    for schema_name, schema in SCHEMAS.items():
        grammar = build_grammar(parse_structured_output({"guided_json": schema}))
        compiled, compile_s = _timed(lambda: compiler.compile_grammar(grammar))
        result["compile_ms"][schema_name] = compile_s * 1e3
        echo(f"  xgrammar compile {schema_name}: {compile_s * 1e3:.1f} ms")
        for batch in batches:
            host = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
            paths: dict[str, Callable[[list[Any]], None]] = {
                "serial": lambda ms: [m.fill_next_token_bitmask(host, i) for i, m in enumerate(ms)],
            }
            for n in threads:
                paths[f"batch/{n}"] = lambda ms, bm=xgr.BatchGrammarMatcher(max_threads=n): bm.batch_fill_next_token_bitmask(ms, host)
                paths[f"pythreads/{n}"] = lambda ms, pool=ThreadPoolExecutor(n), n=n: list(pool.map(
                    lambda part: [ms[i].fill_next_token_bitmask(host, i) for i in part], [range(k, len(ms), n) for k in range(n)]))
            if schema_name == "plain" and batch == batches[0]:
                probe_matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
                result["gil_probe"] = probe = _gil_probe(lambda: paths["serial"](probe_matchers))
                echo("  GIL probe (counter thread, M it/s): " + ", ".join(f"main {k} {v / 1e6:.2f}" for k, v in probe.items()))
            for name, fill in paths.items():
                ms = _fill_times(lambda: xgr.GrammarMatcher(compiled), consume, fill, tokens, batch, steps)
                result["fill_ms"][f"{schema_name}/{name}@{batch}"] = ms
                echo(f"  xgrammar {schema_name} {name:13s} batch {batch:4d}: {ms['wall_ms']:7.3f} ms/step wall, {ms['cpu_ms']:7.3f} ms CPU")
    if torch.cuda.is_available():
        for batch in batches:
            result["fill_ms"][f"apply_gpu@{batch}"] = ms = _gpu_apply_ms(vocab_size, stop, batch, steps)
            echo(f"  TokenBitmask.apply on the GPU (bf16), batch {batch}: {ms:.3f} ms/step")
    return result


def _llguidance(tokenizer: Any, vocab_size: int, stop: int, tokens: list[int], batches: list[int], steps: int, threads: list[int], echo: Echo) -> dict[str, Any] | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llg_torch
    except ImportError:
        echo("llguidance is not installed: skipped (pip install llguidance)")
        return None
    lltokenizer, tokenizer_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop))
    echo(f"llguidance: tokenizer {tokenizer_s * 1e3:.0f} ms")
    result: dict[str, Any] = {"tokenizer_ms": tokenizer_s * 1e3, "compile_ms": {}, "fill_ms": {}}

    def consume(matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    for schema_name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )

        def first_mask() -> None:  # llguidance compiles lazily: the first mask is its compile
            matcher = llguidance.LLMatcher(lltokenizer, grammar)
            llg_torch.fill_next_token_bitmask(matcher, llg_torch.allocate_token_bitmask(1, vocab_size))

        result["compile_ms"][schema_name] = _timed(first_mask)[1] * 1e3
        echo(f"  llguidance matcher + first mask {schema_name}: {result['compile_ms'][schema_name]:.1f} ms")
        for batch in batches:
            host = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
            paths: dict[str, Callable[[list[Any]], None]] = {
                "serial": lambda ms: [llg_torch.fill_next_token_bitmask(m, host, i) for i, m in enumerate(ms)],
            }
            for n in threads:
                paths[f"par/{n}"] = lambda ms, ex=llguidance.LLExecutor(num_threads=n): llg_torch.fill_next_token_bitmask_par(
                    ex, [(m, i) for i, m in enumerate(ms)], host)
            for name, fill in paths.items():
                ms = _fill_times(lambda: llguidance.LLMatcher(lltokenizer, grammar), consume, fill, tokens, batch, steps)
                result["fill_ms"][f"{schema_name}/{name}@{batch}"] = ms
                echo(f"  llguidance {schema_name} {name:11s} batch {batch:4d}: {ms['wall_ms']:7.3f} ms/step wall, {ms['cpu_ms']:7.3f} ms CPU")
    return result


def run_structured_bench(vocab_size: int, batches: list[int], steps: int, threads: list[int], echo: Echo) -> dict[str, Any]:
    """Both libraries on one locally built tokenizer; returns the figures as a dict."""
    from vlmbatch.testing.vocab import make_large_tokenizer

    tokenizer, build_s = _timed(lambda: make_large_tokenizer(vocab_size))
    stop = tokenizer.eos_token_id
    tokens = tokenizer.encode(_instance_text(), add_special_tokens=False) + [stop]
    echo(f"tokenizer: {len(tokenizer)} tokens built in {build_s:.1f} s; the instance is {len(tokens)} tokens")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "structured",
        "vocab_size": vocab_size,
        "schemas": SCHEMAS,
        "instance_tokens": len(tokens),
        "steps": steps,
        "machine": {"cpus": os.cpu_count(), "load_avg": load, "platform": platform.platform(), "cuda": torch.cuda.is_available()},
        "xgrammar": _xgrammar(tokenizer, vocab_size, stop, tokens, batches, steps, threads, echo),
        "llguidance": _llguidance(tokenizer, vocab_size, stop, tokens, batches, steps, threads, echo),
    }
