# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""How the engine reads prompts while requests decode, two engine variants alternating over
several rounds in one process (in process). `--compare`:

- mix: prompts read inside the running requests' verification forward (`Engine.mix_prompts`:
  one pass over the weights a step) against prompts read in forwards of their own;
- budget: newcomers' prompts within the step's prompt-token budget (`--prefill-chunk`, shared
  with the chunked prompt's pieces: `Engine.newcomers_in_budget`) against read whole outside
  it (the policy before; both mixed).

Scenarios (`all`: long, arrivals, burst for mix; wave, arrivals for budget):

- long: `--streams` MT-bench questions decode (greedy, the default tree; they start together,
  in a prefill of their own either way: the engine is idle); once every one has its first
  token, a `--long-tokens` prompt (MT-bench questions joined) arrives and is read in chunks of
  `--prefill-chunk`. Reported: its time to first token, the streams' output tokens/s while it
  is read (from its arrival to its first token), their step-to-step gaps in that window
  (median, p99) against their median gap over the whole round, steps and mixed steps.
- wave: as long, but `--wave` chat prompts arrive together while the streams decode;
  the window ends at the last one's first token (their TTFT median and last reported too).
- burst: `--concurrency` chat prompts arriving together at an idle engine: the prefill step
  that starts them, one group a prompt (no padding through the layers) against right-padded.
- arrivals: a closed loop of `--concurrency` chat requests in flight over `--num-prompts`
  MT-bench prompts (a new one arrives as one finishes, as `eagle2 bench-service`'s in-process
  side; each asks for 0.5 .. 1.5 x `--arrival-tokens`, so they end apart): output tokens/s,
  TTFT, TPOT and ITL (mean, median, p99), mixed steps.

    .venv/bin/python benchmarks/chunked_prefill.py --out benchmarks/results/chunked-prefill.json
    .venv/bin/python benchmarks/chunked_prefill.py --compare budget --concurrency 32 \
        --num-prompts 64 --out benchmarks/results/prompt-budget.json

Prints and writes JSON (ratios of the first variant over the second); asserts nothing. Greedy
outputs of the two variants are compared (they must be equal).
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


# --compare -> (the Engine attribute it switches, the two variants' names, the ratio's key)
COMPARE = {"mix": ("mix_prompts", "mixed", "own_forward", "ratios_mixed_over_own"),
           "budget": ("newcomers_in_budget", "in_budget", "outside_budget",
                      "ratios_in_over_outside")}


def one_round(engine, short: list[list[int]], late: list[list[int]], max_tokens: int,
              on: bool, tag: str) -> dict:
    """`short` decode; once each has its first token the `late` prompts arrive together."""
    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.engine import Request

    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[tuple[float, int]]] = {}
    out: dict[str, list[int]] = {}
    for i, p in enumerate(short):
        engine.add(Request(f"{tag}-s{i}", tuple(p), greedy, TreeConfig()))
    arrived = None
    firsts: dict[str, float] = {}
    steps = mixed = 0
    mixed0 = engine.stats.mixed_steps
    while engine.has_work():
        if arrived is None and len(times) == len(short):
            for j, p in enumerate(late):
                engine.add(Request(f"{tag}-late{j}", tuple(p), SamplingParams(max_tokens=8),
                                   TreeConfig()))
            arrived = time.perf_counter()
            mixed0 = engine.stats.mixed_steps
        events = engine.step()
        now = time.perf_counter()
        if arrived is not None and len(firsts) < len(late):
            steps += 1
        for e in events:
            if e.token_ids:
                times.setdefault(e.seq_id, []).append((now, len(e.token_ids)))
                out.setdefault(e.seq_id, []).extend(e.token_ids)
                if "-late" in e.seq_id and e.seq_id not in firsts:
                    firsts[e.seq_id] = now
                    mixed = engine.stats.mixed_steps - mixed0
    last = max(firsts.values())
    gaps_all, gaps_window, window_tokens = [], [], 0
    for sid, ts in times.items():
        if "-late" in sid:
            continue
        for (a, _), (b, k) in itertools.pairwise(ts):
            gaps_all.append(b - a)
            if arrived < b <= last:
                gaps_window.append(b - a)
                window_tokens += k
    window = last - arrived
    p99 = sorted(gaps_window)[max(0, int(0.99 * len(gaps_window)) - 1)]
    return {"on": on, "last_ttft_s": round(window, 3),
            "ttft_median_s": round(statistics.median(firsts.values()) - arrived, 3),
            "steps_to_first_token": steps,
            "mixed_steps": mixed, "stream_tokens_per_s_in_window": round(window_tokens / window, 1),
            "gap_window_median_ms": round(1e3 * statistics.median(gaps_window), 2),
            "gap_window_p99_ms": round(1e3 * p99, 2),
            "gap_median_ms": round(1e3 * statistics.median(gaps_all), 2),
            "window_p99_over_median": round(p99 / statistics.median(gaps_all), 2),
            "outputs": [out[k] for k in sorted(out)]}


def arrivals_round(llm, prompt_ids: list[list[int]], conc: int, max_tokens: int,
                   on: bool) -> dict:
    """A closed loop of `conc` requests in flight (`services.bench_service.inprocess_level`;
    each request asks for max_tokens x 0.5 .. 1.5 tokens by its index, so they end apart and
    newcomers arrive while others decode)."""
    from services.bench_service import inprocess_level, serving_metrics

    engine = llm.engine
    before = engine.stats.mixed_steps, engine.stats.steps
    recs, wall = inprocess_level(llm, prompt_ids, conc,
                                 lambda i: max(1, max_tokens * (8 + (i * 5) % 17) // 16),
                                 llm.tree.mode)
    m = serving_metrics(recs, wall)
    return {"on": on, "output_tokens_per_s": m["output_tokens_per_s"],
            "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "itl_ms": m["itl_ms"],
            "steps": engine.stats.steps - before[1],
            "mixed_steps": engine.stats.mixed_steps - before[0],
            "outputs": [r["token_ids"] for r in recs]}


def burst_round(llm, prompt_ids: list[list[int]], on: bool) -> dict:
    """Every prompt arriving at once at an idle engine: the prefill step that starts them
    (one group a prompt with mixing on, else right-padded into one batch), timed."""
    from eagle2.config import SamplingParams

    engine = llm.engine
    for i, ids in enumerate(prompt_ids):
        engine.add(llm.request(ids, SamplingParams(max_tokens=1), llm.tree, f"burst-{on}-{i}"))
    t0 = time.perf_counter()
    events = engine.step()
    dt = time.perf_counter() - t0
    while engine.has_work():
        events += engine.step()
    lengths = [len(ids) for ids in prompt_ids]
    return {"on": on, "prefill_ms": round(1e3 * dt, 2), "prompt_tokens": sum(lengths),
            "padded_tokens": len(lengths) * max(lengths),
            "outputs": sorted((e.seq_id.split("-")[-1], e.token_ids) for e in events)}


def summarize(rows: list[dict], keys: dict[str, tuple[str, ...]], compare: str) -> dict:
    """Medians over the rounds of each variant; key -> path into a row ("ttft_ms.p99")."""
    def get(row, path):
        for part in path.split("."):
            row = row[part]
        return row

    _, on_name, off_name, ratios = COMPARE[compare]
    out = {}
    for on, name in ((True, on_name), (False, off_name)):
        mine = [r for r in rows if r["on"] == on]
        out[name] = {k: round(statistics.median(get(r, k) for r in mine), 3)
                     for k in keys["all"]}
    a, b = out[on_name], out[off_name]
    out[ratios] = {k: round(a[k] / b[k], 3) for k in keys["ratios"]}
    return out


def alternate(rounds: int, engine, compare: str, run) -> list[dict]:
    """run(on, round) for both variants each round (the `--compare` switch of the engine set
    on or off), the order swapped every round."""
    rows = []
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            setattr(engine, COMPARE[compare][0], on)
            row = run(on, r)
            print({k: v for k, v in row.items() if k != "outputs"}, flush=True)
            rows.append(row)
    return rows


def late_report(rows: list[dict], compare: str, **extra) -> dict:
    keys = ("last_ttft_s", "ttft_median_s", "stream_tokens_per_s_in_window",
            "gap_window_median_ms", "gap_window_p99_ms", "gap_median_ms",
            "window_p99_over_median")
    return {**extra,
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": (*keys, "steps_to_first_token", "mixed_steps"),
                               "ratios": keys}, compare),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=tuple(COMPARE), default="mix")
    p.add_argument("--scenario", choices=("long", "wave", "arrivals", "burst", "all"),
                   default="all")
    p.add_argument("--dtype", default=None, help="default: the target's default on this device")
    p.add_argument("--streams", type=int, default=8, help="long, wave: streams decoding")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=160, help="long, wave: each stream's")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16,
                   help="arrivals: requests in flight; burst: prompts arriving together")
    p.add_argument("--wave", type=int, default=16, help="wave: prompts arriving together")
    p.add_argument("--num-prompts", type=int, default=48, help="arrivals")
    p.add_argument("--arrival-tokens", type=int, default=64,
                   help="arrivals: a request's mean max_tokens")
    p.add_argument("--rounds", type=int, default=3, help="per variant, alternating")
    p.add_argument("--out", default="runs/chunked-prefill.json")
    args = p.parse_args()
    load = os.getloadavg()  # before the model loads
    scenarios = ({args.scenario} if args.scenario != "all" else
                 {"mix": {"long", "arrivals", "burst"}, "budget": {"wave", "arrivals"}}[
                     args.compare])

    from eagle2.api import Eagle2
    from eagle2.bench.prompts import load_suite

    e = Eagle2.load(dtype=args.dtype, max_batch=max(args.streams + max(1, args.wave),
                                                    args.concurrency),
                    max_context=2048 + 256)
    engine = e.engine
    engine.prefill_chunk = args.prefill_chunk
    report: dict = {"config": {**vars(args), "threads": torch.get_num_threads(),
                               "backend": engine.runner.info},
                    "command": "benchmarks/chunked_prefill.py " + " ".join(sys.argv[1:]),
                    "machine": {"cpus": os.cpu_count(), "loadavg_start": load}}
    suite = load_suite("mt_bench", max(args.num_prompts, args.concurrency, args.wave))
    ids = [e.encode(p.user_message) for p in suite]
    if "long" in scenarios:
        short, long = prompts(e.tokenizer, args.streams, args.long_tokens)
        one_round(engine, short, [long[:300]], 16, True, "warm")  # costs measured, kernels warm
        rows = alternate(args.rounds, engine, args.compare, lambda on, r: one_round(
            engine, short, [long], args.max_tokens, on, f"r{r}{int(on)}"))
        report["long"] = late_report(rows, args.compare, long_prompt_tokens=len(long))
    if "wave" in scenarios:
        short, _ = prompts(e.tokenizer, args.streams, 0)
        wave = ids[:args.wave]
        one_round(engine, short, wave[:2], 16, True, "warm")
        rows = alternate(args.rounds, engine, args.compare, lambda on, r: one_round(
            engine, short, wave, args.max_tokens, on, f"r{r}{int(on)}"))
        report["wave"] = late_report(rows, args.compare, prompts=len(wave),
                                     prompt_tokens=sum(map(len, wave)))
    if "burst" in scenarios:
        burst_round(e, ids[:2], True)  # warm
        rows = alternate(args.rounds, engine, args.compare,
                         lambda on, r: burst_round(e, ids[:args.concurrency], on))
        report["burst"] = {
            "prompts": args.concurrency, "prompt_tokens": rows[0]["prompt_tokens"],
            "padded_tokens": rows[0]["padded_tokens"],
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": ("prefill_ms",), "ratios": ("prefill_ms",)},
                        args.compare),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    if "arrivals" in scenarios:
        arrivals_round(e, ids[:args.concurrency], args.concurrency, 8, True)  # warm
        rows = alternate(args.rounds, engine, args.compare, lambda on, r: arrivals_round(
            e, ids[:args.num_prompts], args.concurrency, args.arrival_tokens, on))
        metrics = ("output_tokens_per_s", "ttft_ms.median", "ttft_ms.p99", "tpot_ms.median",
                   "tpot_ms.p99", "itl_ms.median", "itl_ms.p99")
        report["arrivals"] = {
            "outputs_equal": all(a["outputs"] == b["outputs"] for a in rows for b in rows),
            **summarize(rows, {"all": (*metrics, "steps", "mixed_steps"), "ratios": metrics},
                        args.compare),
            "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    print(json.dumps({k: {kk: vv for kk, vv in report[k].items() if kk != "rounds"}
                      for k in ("long", "wave", "arrivals", "burst") if k in report}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
