"""Exact mpmath mirror of every statement in spec/theorems.toml (mp.dps >= 50).

Boring on purpose: plain loops over Python lists, no numpy. A reader checks each function
against ../shared/docs/math.md line by line.
"""
