# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The target forward (features and logits, `LocalRunner.forward`) with each decoder layer as
one native operator (`eagle2_cpu::decoder_layer`) against the same operators called one by
one from Python (`fused.NATIVE_LAYER = False`), alternating in one process: batch 1, N tree
tokens after 256 committed, 10 rounds of 10 forwards each way, ms (best forward, and the
median of the rounds' best). One thread. Writes JSON:

    .venv/bin/python benchmarks/layer_op_bench.py OUT.json [--base-fused OTHER/eagle2/cpu/fused.py]

--base-fused: a third way, the one operator called by another commit's `_native_layer` (the
Python around it: its arguments, the cache's layer views), to A/B that Python in one process.
"""

import argparse
import json
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2.cpu import fused
from eagle2.api import Eagle2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--nodes", default="1,8")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--base-fused", default=None)
    args = ap.parse_args()
    ways = {"python": (False, fused._native_layer), "one_operator": (True, fused._native_layer)}
    if args.base_fused:
        scope: dict = {}
        exec(compile(open(args.base_fused).read(), args.base_fused, "exec"), scope)
        ways["base_python_one_operator"] = (True, scope["_native_layer"])
    llm = Eagle2.load(threads=1)
    runner = llm.engine.runner
    vocab = runner.target.vocab_size
    slots = torch.arange(1)
    best: dict[tuple[int, str], list[float]] = {}
    for num_n in map(int, args.nodes.split(",")):
        runner.set_lengths(slots, torch.full_like(slots, args.prefix))
        tokens = torch.randint(0, vocab, (1, num_n), generator=torch.Generator().manual_seed(0))
        positions = args.prefix + torch.arange(num_n).expand(1, num_n)
        mask = torch.ones(num_n, num_n, dtype=torch.bool).tril().expand(1, num_n, num_n)
        for _ in range(args.rounds):
            for way, (native_layer, layer) in ways.items():
                fused.NATIVE_LAYER, fused._native_layer = native_layer, layer
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    runner.forward(tokens, positions, mask, slots)
                    times.append(time.perf_counter() - t0)
                best.setdefault((num_n, way), []).append(min(times))
    fused.NATIVE_LAYER, fused._native_layer = ways["one_operator"]
    cells = []
    for (num_n, way), rounds in sorted(best.items()):
        rounds.sort()
        cells.append({"nodes": num_n, "way": way,
                      "best_ms": round(1e3 * rounds[0], 3),
                      "median_round_ms": round(1e3 * rounds[len(rounds) // 2], 3)})
        print(cells[-1])
    with open(args.out, "w") as f:
        json.dump({"prefix": args.prefix, "rounds": args.rounds, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
