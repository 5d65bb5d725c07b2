"""Benchmarks: the prompt suites and the speedup / tau measurements (docs/architecture.md
"Metrics")."""
