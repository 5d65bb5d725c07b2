# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The target's greedy tokens with and without the logits (`kernels.GreedyArgmax` against the
lm_head's logits and their argmax) for 1-32 final hidden states of a forward, one thread
(--threads), best
of 7 sweeps (`LocalRunner.head_seconds`, as the cost model times the head), with the caches
flushed before each call (a 512 MB read, as a verification's forward flushes them) and warm.
Prints each row count and writes JSON.

    .venv/bin/python benchmarks/argmax_bench.py OUT.json \
        [--against OTHER/eagle2/cpu/csrc/cpu_ops.cpp]
        [--threads N]

--against: also the greedy tokens through another commit's greedy_argmax and int8 pack (built
under its own namespace, `native.load_variant`), the two heads timed in turn, three times
each way; "base-greedy" in the JSON.
"""

import argparse
import json
from pathlib import Path

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

import torch

from eagle2 import Eagle2
from eagle2.config import TreeConfig

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--against", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    llm = Eagle2.load(threads=args.threads, tree=TreeConfig(mode="vanilla"), max_batch=1)
    runner = llm.engine.runner
    if not runner.greedy_argmax:
        raise SystemExit("this target has no greedy head (needs bf16 on a CPU and the FMA "
                         "kernel for every row count)")
    heads = {"greedy": llm.target.backend.greedy_head}
    if args.against:
        from engine_ab import base_greedy_argmax  # (beside this script)

        from eagle2.cpu.native import load_variant

        base = load_variant("eagle2_ab_base", Path(args.against))
        heads["base-greedy"] = base_greedy_argmax(llm.target.backend.greedy_head.proj, base)
    flush = torch.ones(128 * 1024 * 1024)
    out = {}
    for cold in (True, False):
        best: dict[str, list[float]] = {}
        for _ in range(3 if args.against else 1):
            for name, head in heads.items():
                llm.target.backend.greedy_head = head
                logits, greedy = runner.head_seconds(ROWS, 7, argmax=True,
                                                     before=flush.sum if cold else None)
                for key, times in (("logits", logits), (name, greedy)):
                    best[key] = [min(a, b) for a, b in zip(best.get(key, times), times,
                                                           strict=True)]
        llm.target.backend.greedy_head = heads["greedy"]
        for i, rows in enumerate(ROWS):
            cell = {k: round(1e3 * v[i], 3) for k, v in best.items()}
            out[f"{'cold' if cold else 'warm'}-{rows}"] = cell
            print("cold" if cold else "warm", rows, cell, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
