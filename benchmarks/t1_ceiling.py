# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""What a perfect head would accept at T = 1: the EAGLE-2 dynamic tree built from the target's
own probabilities, at positions of the target's own sampled answers.

Sampled verification accepts a draft node with probability the product of the target's
probabilities along its path (a child x of an accepted node is taken with probability p(x),
whatever the siblings tried before it: `eagle2.verify`), so a tree's expected accepted draft
tokens are the sum of its nodes' path probabilities. A head that knew the target's
distribution exactly would build its tree from those probabilities: first level the top k of
p, then `depth` rounds that expand the k best nodes of the last level by their top k, and the
`total_tokens - 1` best candidates kept (`eagle2.drafter`'s dynamic tree). No head can expect
more from that tree; the figure bounds the T = 1 tau a head can reach with it.

    .venv/bin/python benchmarks/t1_ceiling.py OUT.json --num-prompts 4 --every 10

Plain HF fp32 forwards over whole prefixes (no cache): ~1.5 minutes a prompt at --every 10
on two threads of a 2-core Xeon (4 + 4 prompts: ~13 minutes). The answers are sampled with
`torch.multinomial` from --seed, 128 tokens at most.
"""

from __future__ import annotations

import argparse
import json

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle2.bench.prompts import load_suite
from eagle2.target import embedded_model_dir
from eagle2.text import encode_prompt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON to write")
    p.add_argument("--suites", default="mt_bench,humaneval")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--every", type=int, default=10, help="a tree every N answer positions")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--total-tokens", type=int, default=26)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


class Target:
    def __init__(self, seed: int):
        path = embedded_model_dir()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.gen = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def next_probs(self, seqs: list[list[int]]) -> torch.Tensor:
        """[len(seqs), V] next-token probabilities after each sequence (equal lengths)."""
        return torch.softmax(self.model(torch.tensor(seqs)).logits[:, -1].float(), -1)

    @torch.inference_mode()
    def sample(self, ids: list[int], max_tokens: int) -> list[int]:
        out, past, x = [], None, torch.tensor([ids])
        for _ in range(max_tokens):
            o = self.model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            t = int(torch.multinomial(torch.softmax(o.logits[0, -1].float(), -1), 1,
                                      generator=self.gen))
            out.append(t)
            if t == self.tok.eos_token_id:
                break
            x = torch.tensor([[t]])
        return out


def perfect_tree(target: Target, ctx: list[int], args) -> tuple[float, float, float]:
    """-> (expected accepted draft tokens of the tree, p's top-1 mass, its top-k mass)."""
    k = args.top_k
    p0 = target.next_probs([ctx])[0]
    vals, toks = p0.topk(k)
    level = [(float(v), (int(t),)) for v, t in zip(vals, toks, strict=True)]
    cands = list(level)
    for _ in range(args.depth):
        front = sorted(level, key=lambda c: -c[0])[:k]
        probs = target.next_probs([ctx + list(path) for _, path in front])
        level = []
        for (value, path), p in zip(front, probs, strict=True):
            v, t = p.topk(k)
            level += [(value * float(v[i]), (*path, int(t[i]))) for i in range(k)]
        cands += level
    kept = sorted((c[0] for c in cands), reverse=True)[:args.total_tokens - 1]
    return sum(kept), float(vals[0]), float(vals.sum())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target = Target(args.seed)
    out = {"config": vars(args), "suites": {}}
    for suite in args.suites.split(","):
        rows = []
        for prompt in load_suite(suite, args.num_prompts):
            ids = encode_prompt(target.tok, prompt.user_message)
            answer = target.sample(ids, args.max_tokens)
            rows += [perfect_tree(target, ids + answer[:t], args)
                     for t in range(0, len(answer), args.every)]
        n = len(rows)
        acc, top1, topk = (sum(r[i] for r in rows) / n for i in range(3))
        out["suites"][suite] = {"trees": n, "expected_accepted": round(acc, 4),
                                "tau_decode": round(1 + acc, 4), "mean_top1": round(top1, 4),
                                f"mean_top{args.top_k}": round(topk, 4)}
        print(suite, json.dumps(out["suites"][suite]), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
