# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""How much the dynamic tree's ranking leaves on the table: every candidate of a large tree is
verified, then trees of a budget are chosen from them offline by different rankings.

    .venv/bin/python benchmarks/tree_ranking.py record OUT.pt --num-chat 32 --num-code 16
    .venv/bin/python benchmarks/tree_ranking.py analyze OUT.pt --budget 26 --json OUT.json

`record` runs the engine greedily (batch 4, 128 new tokens, head alone: no lookup, no n-gram
store, raw path values) with a fixed dynamic tree that keeps every candidate (depth 5, top_k
8: 1 + 8 + 5 x 64 = 329 nodes) on held-out prompts (the calibration's: synthetic chat prompts
from 11168 and code stubs from 256, which no shipped head trained on), and saves per step each
node's parent, depth, raw path value and whether it lies on the target's greedy path.
`analyze` counts, per step, the accepted draft tokens of the tree of `budget` nodes that each
ranking keeps: the raw path value (EAGLE-2's rerank: what the engine does), every candidate
(the ceiling of any ranking of these candidates), and products of calibrated conditional
probabilities P(on the path | parent on it), fitted per depth (and per sibling rank) on the
same steps by isotonic regression over the head's own probability, so an in-sample upper
bound for such a table. The trajectory is the all-candidates tree's (another tree accepts
other lengths and so reaches other contexts), which the figures share.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

DEPTH, TOP_K = 5, 8
PROB_EDGES = tuple(math.log(x) for x in (0.002, 0.005, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2,
                                         0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95))


def record(args) -> None:
    from eagle2.api import Eagle2
    from eagle2.bench.calibrate import _observe_verification, held_out_prompts
    from eagle2.calibration import accepted_nodes
    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine

    total = 1 + TOP_K + DEPTH * TOP_K * TOP_K
    Engine.tree_margin = total + 1
    batch = 4
    llm = Eagle2.load(None, args.draft, max_batch=batch, threads=args.threads)
    llm.engine.drafter = Drafter(llm.head, llm.target.embed, llm.target.lm_head,
                                 max_slots=batch, max_len=llm.max_context, calibrated=False)
    llm.engine.drafter.ngram = None
    llm.target.greedy_head = None  # verify through the logits: the observer reads them
    steps, group = [], [""]

    def observe(tree, logits):
        if tree.size < 2:
            return
        acc = accepted_nodes(tree.tokens, tree.parents, tree.tree_mask, tree.num_nodes,
                             logits.argmax(-1).to(tree.tokens.device))
        for b in range(tree.batch_size):
            n = int(tree.num_nodes[b])
            steps.append({"group": group[0], "parents": tree.parents[b, :n].clone(),
                          "depths": tree.depths[b, :n].clone(),
                          "values": tree.values[b, :n].clone(), "accepted": acc[b, :n].clone()})

    _observe_verification(llm.engine.runner, observe)
    tree = TreeConfig("eagle2", total, DEPTH, TOP_K, budget="fixed", lookup=0)
    params = SamplingParams(max_tokens=args.max_tokens)
    prompts = held_out_prompts(argparse.Namespace(  # the recipe's calibration prompts
        first_chat=11168, num_chat=args.num_chat, first_code=256, num_code=args.num_code))
    groups = (("chat", prompts[:args.num_chat]), ("code", prompts[args.num_chat:]))
    t0 = time.perf_counter()
    for name, prompts in groups:
        group[0] = name
        for i in range(0, len(prompts), batch):
            list(llm.generate_ids([llm.request(llm.encode(p), params, tree)
                                   for p in prompts[i:i + batch]]))
            print(f"{name} {min(i + batch, len(prompts))}/{len(prompts)}: {len(steps)} steps, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    torch.save(steps, args.out)


class Step:
    """One recorded tree: per node its conditional log-prob (its path value over its
    parent's), its rank among its siblings, children lists."""

    def __init__(self, rec: dict):
        self.parents = rec["parents"].tolist()
        self.depths = rec["depths"].tolist()
        self.accepted = rec["accepted"].tolist()
        self.log_value = rec["values"].double().clamp(min=1e-30).log().tolist()
        n = len(self.parents)
        self.local = [self.log_value[i] - (self.log_value[p] if p > 0 else 0.0)
                      for i, p in enumerate(self.parents)]
        self.rank = [0] * n
        children = defaultdict(list)
        for i in range(1, n):
            children[self.parents[i]].append(i)
        for kids in children.values():
            for r, i in enumerate(sorted(kids, key=lambda i: -self.local[i])):
                self.rank[i] = r

    def accepted_in(self, score: list[float], budget: int) -> int:
        """Accepted draft tokens of the budget-node tree of the best-scoring nodes (scores
        never exceed their parent's, so the kept set is connected: checked)."""
        order = sorted(range(1, len(score)), key=lambda i: -score[i])[:budget - 1]
        kept = set(order) | {0}
        assert all(self.parents[i] in kept for i in order), "ranking not path-monotone"
        return sum(self.accepted[i] for i in order)


class ConditionalTable:
    """P(node on the greedy path | parent on it) by (key, bin of the node's own log-prob),
    non-decreasing over the bins of each key (pool-adjacent-violators, counts as weights)."""

    def __init__(self, steps: list[Step], key):
        self.key = key
        counts = defaultdict(lambda: [0.0, 0.0])
        for s in steps:
            for i in range(1, len(s.parents)):
                p = s.parents[i]
                if p == 0 or s.accepted[p]:
                    c = counts[(key(s, i), self._bin(s.local[i]))]
                    c[0] += s.accepted[i]
                    c[1] += 1
        self.rate = {}
        for k in {k for k, _ in counts}:
            blocks = []  # [weighted sum, weight, bins]
            for b in range(len(PROB_EDGES) + 1):
                a, n = counts.get((k, b), (0.0, 0.0))
                blocks.append([a + 0.5, n + 1.0, 1])  # add-half smoothing
                while len(blocks) > 1 and \
                        blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    s_, w, c = blocks.pop()
                    blocks[-1][0] += s_
                    blocks[-1][1] += w
                    blocks[-1][2] += c
            rates = [s_ / w for s_, w, c in blocks for _ in range(c)]
            self.rate.update({(k, b): r for b, r in enumerate(rates)})

    @staticmethod
    def _bin(log_prob: float) -> int:
        return sum(log_prob > e for e in PROB_EDGES)

    def scores(self, s: Step) -> list[float]:
        out = [0.0] * len(s.parents)
        for i in range(1, len(s.parents)):
            rate = self.rate.get((self.key(s, i), self._bin(s.local[i])), 1e-6)
            out[i] = out[s.parents[i]] + math.log(max(rate, 1e-9))
        return out


KEYS = {"depth": lambda s, i: min(s.depths[i], DEPTH + 1),
        "depth and sibling rank": lambda s, i: (min(s.depths[i], DEPTH + 1),
                                                min(s.rank[i], 3))}


def analyze(args) -> None:
    records = torch.load(args.records)
    steps = [Step(r) for r in records]
    tables = {name: ConditionalTable(steps, key) for name, key in KEYS.items()}
    out = {"records": args.records, "budget": args.budget, "groups": {}}
    for group in sorted({r["group"] for r in records}):
        mine = [s for s, r in zip(steps, records, strict=True) if r["group"] == group]
        raw = sum(s.accepted_in(s.log_value, args.budget) for s in mine) / len(mine)
        row = {"steps": len(mine), "raw_value": round(raw, 4),
               "all_candidates": round(sum(sum(s.accepted[1:]) for s in mine) / len(mine), 4)}
        for name, table in tables.items():
            got = sum(s.accepted_in(table.scores(s), args.budget) for s in mine) / len(mine)
            row[f"calibrated conditionals by {name}"] = round(got, 4)
        out["groups"][group] = row
        print(group, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--num-chat", type=int, default=32)
    r.add_argument("--num-code", type=int, default=16)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--draft", default=None, help="head directory (default: the shipped head)")
    r.add_argument("--threads", type=int, default=2)
    a = sub.add_parser("analyze")
    a.add_argument("records")
    a.add_argument("--budget", type=int, default=26)
    a.add_argument("--json", default=None)
    args = p.parse_args()
    (record if args.cmd == "record" else analyze)(args)


if __name__ == "__main__":
    main()
