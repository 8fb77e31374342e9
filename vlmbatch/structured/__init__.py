"""Structured outputs: specs (`spec`), grammar compilation (`grammar`), per-sequence matchers
(`matcher`) and device bitmasks (`bitmask`). Only `spec` is imported here: it is pure, so
rows, manifests and the server parse specs without loading xgrammar or torch."""

from vlmbatch.structured.spec import STRUCTURED_KEYS, StructuredOutput, parse_structured_output, resolve

__all__ = ["STRUCTURED_KEYS", "StructuredOutput", "parse_structured_output", "resolve"]
