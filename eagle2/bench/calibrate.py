"""`eagle2 calibrate`: fit the head's value calibration on held-out prompts.

Runs the engine greedily with a large fixed tree and an uncalibrated drafter, records for
every draft node its raw path value and whether it lies on the target's greedy path
(`calibration.accepted_nodes`), fits `Calibration` on half of the steps and checks it on the
other half: the predicted number of accepted draft tokens per tree against the measured one.
It also measures prompt lookup (docs/draft-tree.md "Prompt lookup"): every chain the drafter
proposed is compared with the target's greedy output after its root, and the acceptance rate
of the tokens the head had not proposed itself, by match length and depth, becomes the
calibration's lookup table (fitted and checked the same way).
The prompts are training-source prompts the shipped head was not trained on (see its model
card); nothing from MT-bench or HumanEval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from eagle2.cli import add_model_arguments
from eagle2.config import SamplingParams, TreeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help="calibration.json to write (default: in the head's directory)")
    p.add_argument("--num-chat", type=int, default=16, help="held-out synthetic chat prompts")
    p.add_argument("--num-code", type=int, default=8, help="held-out code-completion prompts")
    p.add_argument("--first-chat", type=int, default=1088,
                   help="index of the first chat prompt (the head trained on those before it)")
    p.add_argument("--first-code", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--total-tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--tree-top-k", type=int, default=8)
    p.add_argument("--bins", type=int, default=20)
    p.add_argument("--lookup", type=int, default=TreeConfig.lookup,
                   help="prompt-lookup chain length to measure (0: no lookup table)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--samples", default=None,
                   help="also save the recorded (value, accepted) samples here (torch.save)")
    add_model_arguments(p)


def held_out_prompts(args) -> list[str]:
    from eagle2.train.code_prompts import make_code_prompts
    from eagle2.train.prompts import make_prompts

    chat = make_prompts(args.first_chat + args.num_chat, seed=0)[args.first_chat:]
    code = make_code_prompts(args.first_code + args.num_code, seed=0)[args.first_code:]
    return chat + code


class Recorder:
    """Engine observer: (raw value, accepted) of every draft node, and per-tree sums."""

    def __init__(self):
        self.values: list[torch.Tensor] = []
        self.accepted: list[torch.Tensor] = []

    def __call__(self, tree, logits: torch.Tensor) -> None:
        from eagle2.calibration import accepted_nodes

        if tree.size < 2:
            return
        acc = accepted_nodes(tree.tokens, tree.parents, tree.tree_mask, tree.num_nodes,
                             logits.argmax(-1).to(tree.tokens.device))
        head = ~tree.lookup[:, 1:]  # lookup nodes are fitted from the drafter's log
        self.values.append(torch.where(head, tree.values[:, 1:], 0.0).cpu())
        self.accepted.append((acc[:, 1:] & head).cpu())


def run(args) -> int:
    from eagle2.api import Eagle2
    from eagle2.calibration import FILE_NAME
    from eagle2.drafter import Drafter

    llm = Eagle2.load(args.target, args.draft, dtype=args.dtype, device=args.device,
                      max_batch=args.batch, threads=args.threads)
    if llm.head is None:
        raise ValueError("calibration needs a draft head")
    llm.engine.drafter = Drafter(llm.head, llm.target.embed, llm.target.lm_head,
                                 max_slots=args.batch, max_len=llm.max_context, calibrated=False)
    llm.engine.drafter.lookup_log = []
    # every prompt-lookup chain goes into the tree and the log (the n-gram store would replace
    # the ones it expects to beat: the table is fitted on all of prompt lookup's proposals)
    llm.engine.drafter.ngram = None
    rec = Recorder()
    llm.target.backend.greedy_head = None  # verify through the logits: the observer reads them
    _observe_verification(llm.engine.runner, rec)
    tree = TreeConfig("eagle2", args.total_tokens, args.depth, args.tree_top_k, budget="fixed",
                      lookup=args.lookup)
    params = SamplingParams(max_tokens=args.max_tokens)
    prompts = held_out_prompts(args)
    full: dict[str, list[int]] = {}  # seq id -> the drafter's history at the end
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        reqs = [llm.request(llm.encode(p), params, tree) for p in prompts[i:i + args.batch]]
        for req, out in zip(reqs, llm.generate_ids(reqs), strict=True):
            full[req.seq_id] = list(req.prompt_ids[1:]) + out.token_ids
        print(f"{min(i + args.batch, len(prompts))}/{len(prompts)} prompts, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report = fit_and_check(rec, args.bins)
    out = Path(args.out) if args.out else Path(args.draft or _shipped(llm)) / FILE_NAME
    calib = report.pop("calibration")
    if args.lookup:
        report["lookup"] = fit_lookup(llm.engine.drafter.lookup_log, full, args.lookup)
        calib = replace(calib, lookup=report["lookup"].pop("table"))
    calib.save(out)
    if args.samples:
        torch.save({"values": rec.values, "accepted": rec.accepted}, args.samples)
    report.update(prompts=len(prompts), max_tokens=args.max_tokens, tree=[
        args.total_tokens, args.depth, args.tree_top_k], wall_s=round(time.perf_counter() - t0))
    print(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


def _observe_verification(runner, observe) -> None:
    """Call observe(tree, logits [B, N, V]) at each verification of an in-process runner
    (`LocalRunner.verified`, which every step's acceptance goes through, the logits computed
    from its forward's output here whether or not the step needs them)."""
    verified = runner.verified

    def verified_and_observe(tree, out, *args, **kwargs):
        observe(tree, runner.target.logits(out.hidden))
        return verified(tree, out, *args, **kwargs)

    runner.verified = verified_and_observe


def fit_and_check(rec: Recorder, bins: int) -> dict:
    """Fit on the even steps, check on the odd ones (step-level split, no shared trees); the
    calibration returned for shipping is then fitted on all steps."""
    from eagle2.calibration import Calibration

    fit_v = torch.cat([v.flatten() for v in rec.values[0::2]])
    fit_a = torch.cat([a.flatten() for a in rec.accepted[0::2]])
    keep = fit_v > 0
    calib = Calibration.fit(fit_v[keep], fit_a[keep], bins)
    pred_cal, pred_raw, actual = 0.0, 0.0, 0.0
    for v, a in zip(rec.values[1::2], rec.accepted[1::2], strict=True):
        valid = v > 0
        pred_cal += float(torch.where(valid, calib(v), 0.0).sum())
        pred_raw += float(v.sum())
        actual += float(a.sum())
    trees = sum(v.shape[0] for v in rec.values[1::2])
    every_v = torch.cat([v.flatten() for v in rec.values])
    every_a = torch.cat([a.flatten() for a in rec.accepted])
    shipped = Calibration.fit(every_v[every_v > 0], every_a[every_v > 0], bins)  # all steps
    return {"calibration": shipped, "fit_nodes": int(keep.sum()), "check_trees": trees,
            "accepted_per_tree": round(actual / trees, 4),
            "predicted_per_tree_calibrated": round(pred_cal / trees, 4),
            "predicted_per_tree_raw": round(pred_raw / trees, 4),
            "rates": [round(r, 4) for r in calib.rates]}


def lookup_outcomes(log, full: dict[str, list[int]], depth: int, max_ngram: int):
    """Per logged proposal: [(match length, depth, accepted)] of its tokens new to the head's
    candidates, judged against the greedy continuation after its root (tokens past the end
    of the output are unknown and left out)."""
    out = []
    for sid, length, match, toks, fresh in log:
        truth = full[sid][length:length + depth]
        on_path = True
        nodes = []
        for d, (tok, new) in enumerate(zip(toks[:len(truth)], fresh, strict=False)):
            on_path = on_path and tok == truth[d]
            if new:
                nodes.append((min(match, max_ngram), d + 1, on_path))
        out.append(nodes)
    return out


def _lookup_counts(outcomes, max_ngram: int, depth: int):
    counts = [[0] * depth for _ in range(max_ngram)]
    accepted = [[0] * depth for _ in range(max_ngram)]
    for nodes in outcomes:
        for m, d, ok in nodes:
            counts[m - 1][d - 1] += 1
            accepted[m - 1][d - 1] += ok
    return counts, accepted


def fit_lookup(log, full: dict[str, list[int]], depth: int) -> dict:
    """Fit the lookup table on the even proposals, check it on the odd ones, ship one fitted
    on all (like `fit_and_check`)."""
    from eagle2.lookup import MAX_NGRAM, LookupTable

    outcomes = lookup_outcomes(log, full, depth, MAX_NGRAM)
    fit = LookupTable.fit(*_lookup_counts(outcomes[0::2], MAX_NGRAM, depth))
    check = outcomes[1::2]
    predicted = sum(fit.value(m, d) for nodes in check for m, d, _ in nodes)
    measured = sum(ok for nodes in check for _, _, ok in nodes)
    counts, accepted = _lookup_counts(outcomes, MAX_NGRAM, depth)
    shipped = LookupTable.fit(counts, accepted)
    return {"table": shipped, "proposals": len(outcomes),
            "check_proposals": len(check), "accepted_per_check_proposal": round(
                measured / max(len(check), 1), 4),
            "predicted_per_check_proposal": round(predicted / max(len(check), 1), 4),
            "nodes_by_match_length": [sum(row) for row in counts],
            "rates": [[round(r, 4) for r in row] for row in shipped.rates]}


def _shipped(llm) -> str:
    from eagle2.api import shipped_head_dir
    from eagle2.target import EMBEDDED_NAME

    path = shipped_head_dir(EMBEDDED_NAME if llm.target.name == EMBEDDED_NAME else
                            Path(llm.target.name).name)
    if path is None:
        raise ValueError("no shipped head for this target: give --draft DIR or --out FILE")
    return str(path)
