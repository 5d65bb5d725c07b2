"""Benchmarks: the prompt suites and the speedup / tau measurements of BRIEF §7."""
