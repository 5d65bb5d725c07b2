# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The target forward (features and logits, `LocalRunner.forward`) with each decoder layer as
one native operator (`eagle2_cpu::decoder_layer`) against the same operators called one by
one from Python (`fused.NATIVE_LAYER = False`), alternating in one process: batch 1, N tree
tokens after 256 committed, 10 rounds of 10 forwards each way, ms (best forward, and the
median of the rounds' best). One thread. Writes JSON:

    .venv/bin/python benchmarks/layer_op_bench.py OUT.json
"""

import argparse
import json
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2 import fused
from eagle2.api import Eagle2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--nodes", default="1,8")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    llm = Eagle2.load(threads=1)
    runner = llm.engine.runner
    vocab = runner.target.vocab_size
    slots = torch.arange(1)
    best: dict[tuple[int, bool], list[float]] = {}
    for num_n in map(int, args.nodes.split(",")):
        runner.set_lengths(slots, torch.full_like(slots, args.prefix))
        tokens = torch.randint(0, vocab, (1, num_n), generator=torch.Generator().manual_seed(0))
        positions = args.prefix + torch.arange(num_n).expand(1, num_n)
        mask = torch.ones(num_n, num_n, dtype=torch.bool).tril().expand(1, num_n, num_n)
        for _ in range(args.rounds):
            for native_layer in (False, True):
                fused.NATIVE_LAYER = native_layer
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    runner.forward(tokens, positions, mask, slots)
                    times.append(time.perf_counter() - t0)
                best.setdefault((num_n, native_layer), []).append(min(times))
    fused.NATIVE_LAYER = True
    cells = []
    for (num_n, native_layer), rounds in sorted(best.items()):
        rounds.sort()
        cells.append({"nodes": num_n, "one_operator": native_layer,
                      "best_ms": round(1e3 * rounds[0], 3),
                      "median_round_ms": round(1e3 * rounds[len(rounds) // 2], 3)})
        print(cells[-1])
    with open(args.out, "w") as f:
        json.dump({"prefix": args.prefix, "rounds": args.rounds, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
