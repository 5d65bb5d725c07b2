# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The native exact attention alone (`eagle2_cpu::attention`), one layer of the embedded
model's layout (9 query heads over 3 KV heads of 64), batch 1: N tree tokens (a chain) after
L committed keys, microseconds a call (best of 5 rounds), one thread. Writes JSON and,
with --outputs, the outputs themselves, so two builds can be compared bitwise:

    .venv/bin/python benchmarks/attention_bench.py OUT.json [--outputs OUT.pt]
    PYTHONPATH=<a worktree of another commit> .venv/bin/python benchmarks/attention_bench.py ...
"""

import argparse
import json
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2.native import build_key, cpu_ops


def time_call(ops, num_n: int, length: int, reps: int) -> tuple[float, torch.Tensor]:
    heads, kv_heads, dh, size = 9, 3, 64, 4096
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, num_n, dh, generator=g).bfloat16()
    cache_k = torch.randn(1, kv_heads, size, dh, generator=g).bfloat16()
    cache_v = torch.randn(1, kv_heads, size, dh, generator=g).bfloat16()
    slots, base = torch.zeros(1, dtype=torch.long), torch.full((1,), length, dtype=torch.long)
    mask = torch.tril(torch.ones(num_n, num_n, dtype=torch.bool))[None]
    def call():
        return ops.attention(q, cache_k, cache_v, slots, base, mask, dh ** -0.5)
    for _ in range(20):
        out = call()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e6 * best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--outputs", default=None, help="also torch.save the outputs here")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--nodes", default="1,8,16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the fused CPU operations are not available here")
    cells, outputs = [], {}
    for length in map(int, args.lengths.split(",")):
        for num_n in map(int, args.nodes.split(",")):
            us, out = time_call(ops, num_n, length, 300 if length <= 1024 else 100)
            outputs[f"{num_n}x{length}"] = out
            cells.append({"nodes": num_n, "committed": length, "us": round(us, 1)})
            print(f"N={num_n:2d} after {length:4d}: {us:7.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump({"build": build_key(), "cells": cells}, f, indent=1)
    if args.outputs:
        torch.save(outputs, args.outputs)


if __name__ == "__main__":
    main()
