# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The native exact attention alone (`eagle2_cpu::attention`), one layer of the embedded
model's layout (9 query heads over 3 KV heads of 64), batch 1: N tree tokens (a chain) after
L committed keys, microseconds a call (best of the rounds), one thread. Writes JSON and,
with --outputs, the outputs themselves:

    .venv/bin/python benchmarks/attention_bench.py OUT.json [--outputs OUT.pt]

With --against OTHER.cpp (another commit's `eagle2/cpu/csrc/cpu_ops.cpp`, `eagle2/csrc/` in
commits before the CPU backend moved, e.g. from a `git worktree`), that source is built too,
under its own operator namespace, and the two builds are timed in turn in this one process,
round after round (machine drift between separate runs is as large as the differences
measured here); the JSON then has both builds' cells and which outputs differ:

    .venv/bin/python benchmarks/attention_bench.py OUT.json \
        --against /tmp/old/eagle2/cpu/csrc/cpu_ops.cpp [--march haswell]

(--march haswell: both sources built for AVX2, the kernels an AVX2 machine runs.)

A build whose operator keeps the committed keys transposed from call to call (`key_blocks`)
is timed that way, as decoding runs it: the blocks are brought up to date by the warm-up calls,
so a timed call transposes only the partial last block and the tree's keys (`--fresh`: this
checkout's build without kept blocks, transposing every key at every call).
"""

import argparse
import json
import time
from pathlib import Path

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2.cpu.attention import empty_key_blocks
from eagle2.cpu.native import build_key, cpu_ops, load_variant


def load_other(source: Path, march: str = "native"):
    """`source` built as torch.ops.eagle2_cpu_other (its operators renamed)."""
    return load_variant("eagle2_cpu_other", source, march)


def inputs(num_n: int, length: int):
    heads, kv_heads, dh, size = 9, 3, 64, 4096
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, num_n, dh, generator=g).bfloat16()
    cache_k = torch.randn(1, kv_heads, size, dh, generator=g).bfloat16()
    cache_v = torch.randn(1, kv_heads, size, dh, generator=g).bfloat16()
    slots, base = torch.zeros(1, dtype=torch.long), torch.full((1,), length, dtype=torch.long)
    mask = torch.tril(torch.ones(num_n, num_n, dtype=torch.bool))[None]
    return q, cache_k, cache_v, slots, base, mask, dh ** -0.5


def keeps_blocks(ops) -> bool:
    """Whether this build's attention takes kept key blocks."""
    return "key_blocks" in str(ops.attention.default._schema)


def key_blocks(cache_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_blocks, key_blocks_valid) for one layer's K cache [slots, KVH, S, Dh], none valid
    (with room for the values' AMX tiles, which a build with them keeps there)."""
    slots, kv_heads, size, dh = cache_k.shape
    return empty_key_blocks((slots, kv_heads), size, dh, value_tiles=True)


def time_round(ops, args: tuple, reps: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    for _ in range(reps):
        out = ops.attention(*args)
    return (time.perf_counter() - t0) / reps, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--outputs", default=None, help="also torch.save the outputs here")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--nodes", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--against", type=Path, default=None,
                    help="another cpu_ops.cpp, timed in turn with this checkout's")
    ap.add_argument("--fresh", action="store_true",
                    help="this checkout's build without kept key blocks")
    ap.add_argument("--march", default=None,
                    help="build both sources for this -march instead (e.g. haswell: the AVX2 "
                         "kernels on an AVX-512 machine)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.march:
        builds = {"this": load_variant("eagle2_cpu_this", march=args.march)}
    else:
        builds = {"this": cpu_ops()}
    if builds["this"] is None:
        raise SystemExit("the fused CPU operations are not available here")
    if args.against is not None:
        builds["other"] = load_other(args.against, args.march or "native")
    cases = [(n, length) for length in map(int, args.lengths.split(","))
             for n in map(int, args.nodes.split(","))]
    kept = {name: keeps_blocks(ops) and not (args.fresh and name == "this")
            for name, ops in builds.items()}
    calls = {case: inputs(*case) for case in cases}
    blocks = {(name, case): key_blocks(calls[case][1]) if kept[name] else ()
              for name in builds for case in cases}
    best = {(b, c): float("inf") for b in builds for c in cases}
    outputs = {}
    for case in cases:
        for name, ops in builds.items():
            for _ in range(20):  # warm-up (kept blocks: brought up to date)
                ops.attention(*calls[case], *blocks[(name, case)])
    for _ in range(args.rounds):
        for case in cases:
            reps = 200 if case[1] <= 1024 else 60
            for name, ops in builds.items():
                sec, out = time_round(ops, calls[case] + blocks[(name, case)], reps)
                best[(name, case)] = min(best[(name, case)], sec)
                outputs[(name, case)] = out
    cells = []
    for n, length in cases:
        cell = {"nodes": n, "committed": length,
                "us": round(1e6 * best[("this", (n, length))], 1)}
        line = f"N={n:2d} after {length:4d}: {cell['us']:7.1f} us"
        if "other" in builds:
            a, b = outputs[("this", (n, length))], outputs[("other", (n, length))]
            cell["other_us"] = round(1e6 * best[("other", (n, length))], 1)
            cell["bitwise_equal"] = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
            cell["max_abs_diff"] = float((a.float() - b.float()).abs().max())
            line += (f"   against {cell['other_us']:7.1f} us"
                     f"{'' if cell['bitwise_equal'] else '  (outputs differ)'}")
        cells.append(cell)
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump({"build": build_key(), "march": args.march or "native",
                   "isa": {name: ops.isa() for name, ops in builds.items()},
                   "against": str(args.against) if args.against else None,
                   "kept_key_blocks": kept, "rounds": args.rounds, "cells": cells}, f, indent=1)
    if args.outputs:
        torch.save({f"{n}x{length}": outputs[("this", (n, length))] for n, length in cases},
                   args.outputs)


if __name__ == "__main__":
    main()
