# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""What `TreeConfig.catch_up` costs in acceptance (docs/DESIGN.md, "Choosing the tree size
each step"): tau of a fixed 26-token tree (depth 5, top_k 8, prompt lookup 16) on 10 MT-bench +
10 HumanEval prompts x 128 tokens, batch 1, for each cap (0 = no limit). tau does not depend on
load or speed. Prints and writes JSON.

    .venv/bin/python benchmarks/catch_up_tau.py [--caps 0,64,32] [--out FILE]
"""

import argparse
import json

import eagle2  # noqa: F401  (first: passive OpenMP waiting)

from eagle2.api import Eagle2
from eagle2.bench.prompts import load_suite
from eagle2.config import SamplingParams, TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,64,32")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = Eagle2.load(max_batch=1, threads=1)
    out: dict[str, dict] = {}
    for suite in ("mt_bench", "humaneval"):
        ids = [llm.encode(p.user_message) for p in load_suite(suite, args.prompts)]
        out[suite] = {"prompt_tokens": [len(i) for i in ids]}
        for cap in (int(c) for c in args.caps.split(",")):
            tree = TreeConfig("eagle2", total_tokens=26, depth=5, top_k=8, budget="fixed",
                              catch_up=cap)
            tokens = steps = 0
            for i in ids:
                done = llm.generate_ids([llm.request(i, SamplingParams(max_tokens=128), tree)])
                tokens += len(done[0].token_ids)
                steps += done[0].num_steps
            out[suite][f"tau_catch_up_{cap}"] = round(tokens / steps, 4)
            print(suite, "catch_up", cap, "tau", round(tokens / steps, 3), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
