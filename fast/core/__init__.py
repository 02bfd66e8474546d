"""The certificate core: math on tensors (codecs, witnesses, TV forms, sums, kernels).

Imports neither transformers nor vLLM; the integrations (fast.integrations) are thin
adapters over it, the policies (fast.policies) decide what to compress or repair, and
the tools (fast.tools) are the CLI and traces.
"""
