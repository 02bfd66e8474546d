"""The certificate core: math on tensors (codecs, witnesses, TV forms, sums, kernels).

Imports neither transformers nor vLLM; the integrations (fast.integrations) are thin
adapters over it, the policies (fast.policies) decide what to compress or repair, and
the tools (fast.tools) are the CLI and traces.

Laid out by stage; a module imports only from its own stage or earlier ones (tests/test_layout.py):
  base       _checks, floats, threads, native, rope       checks, float helpers, threads, the C++ loader, RoPE bands
  forms      certify, box                                 TV forms from weights and per-token bounds (T1, T2, T9)
  codecs     quant, schemes, prerope                      what is stored for a key or value
  kernels    triton_kernels                               GPU kernels of the stages below
  witnesses  witness, subspace, dither, evict, pagebox    what bounds a stored key's error (T4, T6, T7)
  reads      attention, cpu_fused, sparse                 one read and its certificate: the torch twin, C++, Triton
"""
