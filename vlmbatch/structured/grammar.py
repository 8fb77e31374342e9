"""Grammar compilation on xgrammar: each distinct spec once per process, off the engine's thread.

`build_grammar(spec)` needs no tokenizer: `submit` calls it (through `check_job_spec`) to
refuse an uncompilable job-level spec before anything is written. `GrammarCompiler` takes
the model's tokenizer once and compiles specs on one background thread; `submit` returns a
future at once, so the engine never blocks on a compile: a constrained sequence waits (is
not scheduled) until its future is done. A failed compile is cached like a good one (the
same spec fails the same way) and surfaces as `RowError(INVALID_ROW, param=spec.source)`.

Why xgrammar alone, without llguidance as a fallback: on a 151,936-token byte-level BPE
(the Qwen vocabulary size) and a 6-field schema, xgrammar fills a step's masks 3-20x faster
than llguidance on plain types and 30-400x faster on pattern-bounded strings (batch 64 and
256), and prepares the tokenizer in half the time; it accepts every schema of our tests, and
the two keywords llguidance handles that it refuses (`minProperties`, `maxProperties`) are
refused clearly at submit. docs/structured.md has the figures; `vlmbatch bench structured`
repeats them.

JSON is generated in one layout: no free whitespace, `", "` and `": "` separators (what
`json.dumps` writes). Free whitespace lets a weak (or random-weight) model pad forever.

Strings with `minLength`/`maxLength` (and no `pattern`) are compiled as the equivalent
`pattern` `^.{min,max}$`: xgrammar 0.2.9 lowers length bounds to a character class that
admits raw control characters (invalid JSON; mlc-ai/xgrammar#800), its pattern path does not.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.structured.spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutput

_FREE_OBJECT = '{"type": "object"}'
# xgrammar's C++ errors start with "[12:00:00] /project/cpp/file.cc:123: " and may carry
# "Check failed: (...) is false: "; users get the sentence after them.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def _reason(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", first).strip()


def _bounded_strings_as_patterns(node: Any) -> Any:
    """A copy of a schema in which length-bounded strings without a pattern carry the
    equivalent pattern instead of the bounds (see the module docstring)."""
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _bounded_strings_as_patterns(value) for key, value in node.items()}
    types = node.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and ("minLength" in node or "maxLength" in node) and "pattern" not in node and "format" not in node:
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^.{{{low},{high}}}$"
    return node


def build_grammar(spec: StructuredOutput) -> xgr.Grammar:
    """The tokenizer-independent grammar of a constrained spec.

    Raises `RowError(INVALID_ROW, param=spec.source)` naming xgrammar's reason when the
    spec cannot be compiled (an unsupported schema keyword, a bad regex, an EBNF error).
    """
    try:
        if spec.kind == JSON_SCHEMA:
            schema = json.dumps(_bounded_strings_as_patterns(spec.schema))
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if spec.kind == JSON_OBJECT:
            return xgr.Grammar.from_json_schema(_FREE_OBJECT, any_whitespace=False)
        if spec.kind == CHOICE:  # JSON string literals are valid EBNF literals (escapes included)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in spec.choices))
        if spec.kind == REGEX:
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == GRAMMAR:
            return xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise RowError(ErrorType.INVALID_ROW, f"{spec.source}: cannot compile this {spec.kind}: {_reason(exc)}", spec.source) from None
    raise ValueError(f"{spec.kind!r} specs have no grammar")


def check_job_spec(spec: StructuredOutput | None, where: str) -> None:
    """Submit-time refusal of a job-level spec that cannot be compiled (nothing written yet)."""
    if spec is None or not spec.constrained:
        return
    try:
        build_grammar(spec)
    except RowError as exc:
        raise JobError(f"{where}: {exc.message}") from None


class GrammarCompiler:
    """Compiles specs against one tokenizer, each distinct spec once, on a background thread.

    `vocab_size` is the width of the model's logits (checkpoints pad it past the
    tokenizer's length; ids past the tokenizer are never allowed). `stop_token_ids` are the
    engine's EOS ids: a grammar allows them exactly when its text is complete. Building
    xgrammar's tokenizer tables takes ~1 s for a 150k vocabulary, so that is the first task
    of the thread too and the engine's start-up does not wait for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *, max_threads: int | None = None):
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.num_compiles = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmbatch-grammar")
        self._compiler = self._pool.submit(self._make_compiler, tokenizer, max_threads or min(8, os.cpu_count() or 1))
        self._futures: dict[StructuredOutput, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()

    def _make_compiler(self, tokenizer: Any, max_threads: int) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids))
        # Our own cache (keyed by spec) is the only one: xgrammar's would hold a second copy.
        return xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        self.num_compiles += 1  # only the pool's one thread writes it
        return self._compiler.result().compile_grammar(build_grammar(spec))

    def submit(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, now or later; never blocks. Its `exception()` is
        the `RowError` of a spec that cannot be compiled."""
        with self._lock:
            future = self._futures.get(spec)
            if future is None:
                future = self._futures[spec] = self._pool.submit(self._compile, spec)
            return future

    def compiled(self, spec: StructuredOutput, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Blocking form of `submit` (for tests, `LLM` start-up checks and the server's 400s)."""
        return self.submit(spec).result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
