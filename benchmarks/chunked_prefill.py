# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""A long prompt arriving while streams decode, in process: its chunks read inside the running
requests' verification forward (`Engine.mix_prompts`, one pass over the weights a step) against
chunks in a forward of their own, the two alternating over several rounds in one process.
(The streams start together in a prefill of their own either way: the engine is idle.)

Each round: `--streams` MT-bench questions decode (greedy, the default tree); once every one
has its first token, a `--long-tokens` prompt (MT-bench questions joined) arrives; reported per
variant: its time to first token, the streams' output tokens/s while it is read (from its
arrival to its first token), their step-to-step gaps in that window (median, p99) against
their median gap over the whole round, the engine's steps and mixed steps.

    .venv/bin/python benchmarks/chunked_prefill.py --out benchmarks/results/chunked-prefill.json

Prints and writes JSON (ratios mixed / own-forward); asserts nothing. Outputs of the two
variants are compared (greedy: they must be equal).
"""

from __future__ import annotations

import eagle2  # noqa: F401

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import itertools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(tokenizer, streams: int, long_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The streams' prompts (one question each) and the long prompt (questions joined, cut to
    long_tokens)."""
    from eagle2.bench.prompts import load_suite

    suite = [p.user_message for p in load_suite("mt_bench", 80)]
    short = [tokenizer(q)["input_ids"] for q in suite[10:10 + streams]]
    long: list[int] = []
    for q in suite[20:] * 8:
        long += tokenizer(q + "\n\n")["input_ids"]
        if len(long) >= long_tokens:
            break
    return short, long[:long_tokens]


def one_round(engine, short: list[list[int]], long: list[int], max_tokens: int,
              mix: bool, tag: str) -> dict:
    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.engine import Request

    engine.mix_prompts = mix
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[tuple[float, int]]] = {}
    out: dict[str, list[int]] = {}
    for i, p in enumerate(short):
        engine.add(Request(f"{tag}-s{i}", tuple(p), greedy, TreeConfig()))
    arrived = first = None
    steps = mixed = 0
    mixed0 = engine.stats.mixed_steps
    while engine.has_work():
        if arrived is None and len(times) == len(short):
            engine.add(Request(f"{tag}-long", tuple(long), SamplingParams(max_tokens=8),
                               TreeConfig()))
            arrived = time.perf_counter()
            mixed0 = engine.stats.mixed_steps
        events = engine.step()
        now = time.perf_counter()
        if arrived is not None and first is None:
            steps += 1
        for e in events:
            if e.token_ids:
                times.setdefault(e.seq_id, []).append((now, len(e.token_ids)))
                out.setdefault(e.seq_id, []).extend(e.token_ids)
            if e.seq_id == f"{tag}-long" and first is None and e.token_ids:
                first = now
                mixed = engine.stats.mixed_steps - mixed0
    gaps_all, gaps_window, window_tokens = [], [], 0
    for sid, ts in times.items():
        if sid.endswith("-long"):
            continue
        for (a, _), (b, k) in itertools.pairwise(ts):
            gaps_all.append(b - a)
            if arrived < b <= first:
                gaps_window.append(b - a)
                window_tokens += k
    window = first - arrived
    p99 = sorted(gaps_window)[max(0, int(0.99 * len(gaps_window)) - 1)]
    return {"mix": mix, "long_ttft_s": round(window, 3), "steps_to_first_token": steps,
            "mixed_steps": mixed, "stream_tokens_per_s_in_window": round(window_tokens / window, 1),
            "gap_window_median_ms": round(1e3 * statistics.median(gaps_window), 2),
            "gap_window_p99_ms": round(1e3 * p99, 2),
            "gap_median_ms": round(1e3 * statistics.median(gaps_all), 2),
            "window_p99_over_median": round(p99 / statistics.median(gaps_all), 2),
            "outputs": [out[k] for k in sorted(out)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default=None, help="default: the target's default on this device")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=160, help="each stream's")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="per variant, alternating")
    p.add_argument("--out", default="runs/chunked-prefill.json")
    args = p.parse_args()

    from eagle2.api import Eagle2

    e = Eagle2.load(dtype=args.dtype, max_batch=args.streams + 1, max_context=2048 + 256)
    engine = e.engine
    engine.prefill_chunk = args.prefill_chunk
    short, long = prompts(e.tokenizer, args.streams, args.long_tokens)
    one_round(engine, short, long[:300], 16, True, "warm")  # costs measured, kernels warm
    rows = []
    for r in range(args.rounds):
        for mix in ((True, False) if r % 2 == 0 else (False, True)):
            row = one_round(engine, short, long, args.max_tokens, mix, f"r{r}{int(mix)}")
            print({k: v for k, v in row.items() if k != "outputs"}, flush=True)
            rows.append(row)
    same = all(a["outputs"] == b["outputs"] for a in rows for b in rows)
    summary = {}
    for mix in (True, False):
        mine = [r for r in rows if r["mix"] == mix]
        summary["mixed" if mix else "own_forward"] = {
            k: round(statistics.median(r[k] for r in mine), 3)
            for k in ("long_ttft_s", "stream_tokens_per_s_in_window", "gap_window_median_ms",
                      "gap_window_p99_ms", "gap_median_ms", "window_p99_over_median",
                      "steps_to_first_token", "mixed_steps")}
    m, o = summary["mixed"], summary["own_forward"]
    summary["ratios_mixed_over_own"] = {
        k: round(m[k] / o[k], 3) for k in ("long_ttft_s", "stream_tokens_per_s_in_window",
                                           "gap_window_median_ms", "gap_window_p99_ms")}
    report = {"config": {**vars(args), "long_prompt_tokens": len(long),
                         "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                         "backend": e.engine.runner.info},
              "outputs_equal": same, "summary": summary,
              "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    print(json.dumps({"outputs_equal": same, **summary}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
