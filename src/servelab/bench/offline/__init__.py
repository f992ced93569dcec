"""Offline benchmarks on an in-process engine, as `vllm bench latency | throughput`: a fixed batch's latency, a
request set's throughput, and the Hugging Face static-batching baseline they are compared with."""
