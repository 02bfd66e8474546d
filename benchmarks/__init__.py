"""Benchmarks: each module writes one JSON file under results/ (see spec/readme.py)."""
