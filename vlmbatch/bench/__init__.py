"""Benchmark harnesses behind `vlmbatch bench ...` (the one entry point; see BENCHMARKS.md).

Product code never imports this package: it measures the product from outside, with the
peers (`transformers` `generate()`, vLLM) run on the same workloads in the same process
run. Raw logs and JSON of recorded runs stay in `benchmarks/`.
"""
