# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The target's greedy tokens with and without the logits (`kernels.GreedyArgmax` against the
lm_head's logits and their argmax) for 1-16 final hidden states of a forward, one thread, best
of 7 sweeps (`LocalRunner.head_seconds`, as the cost model times the head), with the caches
flushed before each call (a 512 MB read, as a verification's forward flushes them) and warm.
Prints each row count and writes JSON.

    .venv/bin/python benchmarks/argmax_bench.py OUT.json
"""

import json
import sys

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

import torch

from eagle2 import Eagle2
from eagle2.config import TreeConfig

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    llm = Eagle2.load(threads=1, tree=TreeConfig(mode="vanilla"), max_batch=1)
    runner = llm.engine.runner
    if not runner.greedy_argmax:
        raise SystemExit("this target has no greedy head (needs bf16 on a CPU and the FMA "
                         "kernel for every row count)")
    flush = torch.ones(128 * 1024 * 1024)
    out = {}
    for cold in (True, False):
        logits, greedy = runner.head_seconds(ROWS, 7, argmax=True,
                                             before=flush.sum if cold else None)
        for rows, a, g in zip(ROWS, logits, greedy, strict=True):
            cell = {"greedy": round(1e3 * g, 3), "logits": round(1e3 * a, 3)}
            out[f"{'cold' if cold else 'warm'}-{rows}"] = cell
            print("cold" if cold else "warm", rows, cell, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
