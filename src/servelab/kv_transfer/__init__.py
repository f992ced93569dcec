"""KV connectors: moving a request's KV blocks between engine instances (disaggregated prefill/decode)."""
