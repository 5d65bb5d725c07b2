"""Benchmarks: the prompt suites and the speedup / tau measurements of docs/DESIGN.md "Metrics"."""
