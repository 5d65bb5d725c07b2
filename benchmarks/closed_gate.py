# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""What the cost-aware path costs when it does not draft (docs/DESIGN.md, "Choosing the tree
size each step"): eagle2 with its gate held shut (no probes, no newcomer drafts) against
vanilla, B MT-bench prompts x 96 tokens generated together, alternating R times, one thread.
Prints per-run wall and phase seconds, the totals, and writes JSON.

    .venv/bin/python benchmarks/closed_gate.py [--batch 8] [--repeats 4] [--out FILE]
"""

import argparse
import collections
import json
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

from eagle2.api import Eagle2
from eagle2.bench.prompts import load_suite
from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Engine

PHASES = ("draft_s", "verify_s", "prefill_s", "other_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = Eagle2.load(max_batch=args.batch, threads=1)
    ids = [llm.encode(p.user_message) for p in load_suite("mt_bench", args.batch)]
    draft = Engine._draft

    def shut(self, draft_auto=True):
        for s in self.seqs:
            s.probe = False
        return draft(self, False)

    llm.generate_ids([llm.request(ids[0], SamplingParams(max_tokens=8), TreeConfig())])
    totals: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    for r in range(args.repeats):
        for mode in ("vanilla", "shut") if r % 2 == 0 else ("shut", "vanilla"):
            Engine._draft = shut if mode == "shut" else draft
            tree = TreeConfig() if mode == "shut" else TreeConfig("vanilla")
            stats = llm.engine.stats
            before = [getattr(stats, p) for p in PHASES]
            t0 = time.perf_counter()
            llm.generate_ids([llm.request(i, SamplingParams(max_tokens=96), tree) for i in ids])
            wall = time.perf_counter() - t0
            Engine._draft = draft
            phases = [getattr(stats, p) - b for p, b in zip(PHASES, before, strict=True)]
            totals[mode]["wall_s"] += wall
            for p, v in zip(PHASES, phases, strict=True):
                totals[mode][p] += v
            print(mode, r, round(wall, 3), [round(v, 3) for v in phases], flush=True)
    result = {m: {k: round(v, 3) for k, v in t.items()} for m, t in totals.items()}
    result["shut_over_vanilla_wall"] = round(totals["shut"]["wall_s"] /
                                             totals["vanilla"]["wall_s"], 4)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"batch": args.batch, "repeats": args.repeats, **result}, f, indent=1)


if __name__ == "__main__":
    main()
