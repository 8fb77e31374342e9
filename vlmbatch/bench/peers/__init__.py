"""The engines we measure ours against, each fed the same workloads (`bench.workloads`):
`hf` = `transformers` `generate()` on static batches, `vllm` = vLLM's offline `LLM.generate`."""

PEERS = ("hf", "vllm")
