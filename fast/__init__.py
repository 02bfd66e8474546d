"""kvcert's serving library: import `fast` in serving code.

Each section below is owned by one part of the library; add exports to your own section.
"""

# --- kernels and certificates (fast path) ---

# --- serving: schemes, certified cache, gating ---

# --- eviction: evictors, eviction certificate, PAGE ---
