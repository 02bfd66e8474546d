"""Thin adapters of the certificate core to serving engines: transformers (hf_cache,
hf_meter), vLLM (vllm), and the shipped model loader (model)."""
