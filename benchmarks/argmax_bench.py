# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The target's greedy tokens with and without the logits (`kernels.GreedyArgmax` against the
lm_head's logits and their argmax) for 1-16 final hidden states of a real forward, one thread:
median of 7 calls with the caches flushed before each (a 512 MB read, as a verification's
forward flushes them) and warm. Prints each row count and writes JSON.

    .venv/bin/python benchmarks/argmax_bench.py OUT.json
"""

import json
import sys
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

import torch

from eagle2 import Eagle2
from eagle2.config import TreeConfig

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    llm = Eagle2.load(threads=1, tree=TreeConfig(mode="vanilla"), max_batch=1)
    t, cache = llm.target, llm.engine.runner.cache
    if not llm.engine.runner.greedy_argmax:
        raise SystemExit("this target has no greedy head (needs bf16 on a CPU and the FMA "
                         "kernel for every row count)")
    num = max(ROWS)
    tokens = torch.randint(0, t.vocab_size, (1, num), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(num, num, dtype=torch.bool).tril()[None]
    hidden = t.forward(tokens, torch.arange(num)[None], mask, cache, torch.tensor([0])).hidden[0]
    flush = torch.ones(128 * 1024 * 1024)
    fns = {"greedy": t.greedy_tokens, "logits": lambda h: t.logits(h).argmax(-1)}
    out = {}
    for cold in (True, False):
        for rows in ROWS:
            cell = {}
            for name, fn in fns.items():
                times = []
                for _ in range(7):
                    if cold:
                        flush.sum()
                    t0 = time.perf_counter()
                    fn(hidden[:rows])
                    times.append(time.perf_counter() - t0)
                cell[name] = round(1000 * sorted(times)[len(times) // 2], 3)
            out[f"{'cold' if cold else 'warm'}-{rows}"] = cell
            print("cold" if cold else "warm", rows, cell, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
