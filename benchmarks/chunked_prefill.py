# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""Prompts read inside the running requests' verification forward (`Engine.mix_prompts`: one
pass over the weights a step) against prompts read in forwards of their own, in process, the
two alternating over several rounds in one process. Two scenarios:

- long: `--streams` MT-bench questions decode (greedy, the default tree; they start together,
  in a prefill of their own either way: the engine is idle); once every one has its first
  token, a `--long-tokens` prompt (MT-bench questions joined) arrives and is read in chunks of
  `--prefill-chunk`. Reported: its time to first token, the streams' output tokens/s while it
  is read (from its arrival to its first token), their step-to-step gaps in that window
  (median, p99) against their median gap over the whole round, steps and mixed steps.
- burst: `--concurrency` chat prompts arriving together at an idle engine: the prefill step
  that starts them, one group a prompt (no padding through the layers) against right-padded.
- arrivals: a closed loop of `--concurrency` chat requests in flight over `--num-prompts`
  MT-bench prompts (a new one arrives as one finishes, as `eagle2 bench-service`'s in-process
  side; each asks for 0.5 .. 1.5 x `--arrival-tokens`, so they end apart): output tokens/s,
  TTFT, TPOT and ITL (mean, median, p99), mixed steps.

    .venv/bin/python benchmarks/chunked_prefill.py --out benchmarks/results/chunked-prefill.json

Prints and writes JSON (ratios mixed / own forward); asserts nothing. Greedy outputs of the two
variants are compared (they must be equal).
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


def arrivals_round(llm, prompt_ids: list[list[int]], conc: int, max_tokens: int,
                   mix: bool) -> dict:
    """A closed loop of `conc` requests in flight (`services.bench_service.inprocess_level`;
    each request asks for max_tokens x 0.5 .. 1.5 tokens by its index, so they end apart and
    newcomers arrive while others decode), with or without mixing."""
    from services.bench_service import inprocess_level, serving_metrics

    engine = llm.engine
    engine.mix_prompts = mix
    before = engine.stats.mixed_steps, engine.stats.steps
    recs, wall = inprocess_level(llm, prompt_ids, conc,
                                 lambda i: max(1, max_tokens * (8 + (i * 5) % 17) // 16),
                                 llm.tree.mode)
    m = serving_metrics(recs, wall)
    return {"mix": mix, "output_tokens_per_s": m["output_tokens_per_s"],
            "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "itl_ms": m["itl_ms"],
            "steps": engine.stats.steps - before[1],
            "mixed_steps": engine.stats.mixed_steps - before[0],
            "outputs": [r["token_ids"] for r in recs]}


def burst_round(llm, prompt_ids: list[list[int]], mix: bool) -> dict:
    """Every prompt arriving at once at an idle engine: the one prefill step that starts them
    (one group a prompt with mixing on, else right-padded into one batch), timed."""
    from eagle2.config import SamplingParams

    engine = llm.engine
    engine.mix_prompts = mix
    for i, ids in enumerate(prompt_ids):
        engine.add(llm.request(ids, SamplingParams(max_tokens=1), llm.tree, f"burst-{mix}-{i}"))
    t0 = time.perf_counter()
    events = engine.step()
    dt = time.perf_counter() - t0
    while engine.has_work():
        events += engine.step()
    lengths = [len(ids) for ids in prompt_ids]
    return {"mix": mix, "prefill_ms": round(1e3 * dt, 2), "prompt_tokens": sum(lengths),
            "padded_tokens": len(lengths) * max(lengths),
            "outputs": sorted((e.seq_id.split("-")[-1], e.token_ids) for e in events)}


def summarize(rows: list[dict], keys: dict[str, tuple[str, ...]]) -> dict:
    """Medians over the rounds of each variant; key -> path into a row ("ttft_ms.p99")."""
    def get(row, path):
        for part in path.split("."):
            row = row[part]
        return row

    out = {}
    for mix in (True, False):
        mine = [r for r in rows if r["mix"] == mix]
        out["mixed" if mix else "own_forward"] = {
            k: round(statistics.median(get(r, k) for r in mine), 3) for k in keys["all"]}
    m, o = out["mixed"], out["own_forward"]
    out["ratios_mixed_over_own"] = {k: round(m[k] / o[k], 3) for k in keys["ratios"]}
    return out


def alternate(rounds: int, run) -> list[dict]:
    """run(mix) for both variants each round, the order swapped every round."""
    rows = []
    for r in range(rounds):
        for mix in ((True, False) if r % 2 == 0 else (False, True)):
            row = run(mix, r)
            print({k: v for k, v in row.items() if k != "outputs"}, flush=True)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("long", "arrivals", "burst", "all"), default="all")
    p.add_argument("--dtype", default=None, help="default: the target's default on this device")
    p.add_argument("--streams", type=int, default=8, help="long: streams decoding")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=160, help="long: each stream's")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="arrivals: requests in flight")
    p.add_argument("--num-prompts", type=int, default=48, help="arrivals")
    p.add_argument("--arrival-tokens", type=int, default=64,
                   help="arrivals: a request's mean max_tokens")
    p.add_argument("--rounds", type=int, default=3, help="per variant, alternating")
    p.add_argument("--out", default="runs/chunked-prefill.json")
    args = p.parse_args()
    load = os.getloadavg()  # before the model loads

    from eagle2.api import Eagle2
    from eagle2.bench.prompts import load_suite

    e = Eagle2.load(dtype=args.dtype, max_batch=max(args.streams + 1, args.concurrency),
                    max_context=2048 + 256)
    engine = e.engine
    engine.prefill_chunk = args.prefill_chunk
    report: dict = {"config": {**vars(args), "threads": torch.get_num_threads(),
                               "backend": engine.runner.info},
                    "command": "benchmarks/chunked_prefill.py " + " ".join(sys.argv[1:]),
                    "machine": {"cpus": os.cpu_count(), "loadavg_start": load}}
    if args.scenario in ("long", "all"):
        short, long = prompts(e.tokenizer, args.streams, args.long_tokens)
        one_round(engine, short, long[:300], 16, True, "warm")  # costs measured, kernels warm
        rows = alternate(args.rounds, lambda mix, r: one_round(
            engine, short, long, args.max_tokens, mix, f"r{r}{int(mix)}"))
        report["long"] = {
            "long_prompt_tokens": len(long),
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": (
                "long_ttft_s", "stream_tokens_per_s_in_window", "gap_window_median_ms",
                "gap_window_p99_ms", "gap_median_ms", "window_p99_over_median",
                "steps_to_first_token", "mixed_steps"), "ratios": (
                "long_ttft_s", "stream_tokens_per_s_in_window", "gap_window_median_ms",
                "gap_window_p99_ms")}),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    if args.scenario in ("arrivals", "burst", "all"):
        suite = load_suite("mt_bench", args.num_prompts)
        ids = [e.encode(p.user_message) for p in suite]
    if args.scenario in ("burst", "all"):
        burst_round(e, ids[:2], True)  # warm
        rows = alternate(args.rounds, lambda mix, r: burst_round(e, ids[:args.concurrency],
                                                                 mix))
        report["burst"] = {
            "prompts": args.concurrency, "prompt_tokens": rows[0]["prompt_tokens"],
            "padded_tokens": rows[0]["padded_tokens"],
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": ("prefill_ms",), "ratios": ("prefill_ms",)}),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    if args.scenario in ("arrivals", "all"):
        arrivals_round(e, ids[:args.concurrency], args.concurrency, 8, True)  # warm
        rows = alternate(args.rounds, lambda mix, r: arrivals_round(
            e, ids, args.concurrency, args.arrival_tokens, mix))
        metrics = ("output_tokens_per_s", "ttft_ms.median", "ttft_ms.p99", "tpot_ms.median",
                   "tpot_ms.p99", "itl_ms.median", "itl_ms.p99")
        report["arrivals"] = {
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": (*metrics, "steps", "mixed_steps"), "ratios": metrics}),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    print(json.dumps({k: {kk: vv for kk, vv in report[k].items() if kk != "rounds"}
                      for k in ("long", "arrivals", "burst") if k in report}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
