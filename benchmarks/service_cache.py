"""Through the running service (OpenAI streaming chat completions, greedy): what its KV cache
does for serving (docs/kv-cache.md "In the service").

1. Prefix caching: chat requests sharing a ~1,000-token system prompt, one after another: the
   time to first token of each request after the first against the first's, with the cache
   on and, on a second service, off (the outputs must be the same).
2. A ~2,000-token prompt arriving while 8 streams decode (chunked prefill): the streams'
   inter-token latency while it is read (from its arrival to its first token) against their
   median over the whole run.

    .venv/bin/python benchmarks/service_cache.py --out benchmarks/results/service-cache.json

The service's own dtype unless `--dtype` is given (bf16 on CPUs with the native operators,
whose attention reads the paged cache in place). Prints and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def texts(min_chars: int, skip: int = 0) -> str:
    """MT-bench questions joined until at least min_chars characters (~4 a token)."""
    out = []
    for p in questions(80, skip) * 4:
        out.append(p)
        if sum(map(len, out)) >= min_chars:
            break
    return "\n\n".join(out)


def questions(n: int, skip: int) -> list[str]:
    """n MT-bench questions from the skip-th on."""
    from eagle2.bench.prompts import load_suite

    return [p.user_message for p in load_suite("mt_bench", 80)][skip:skip + n]


async def stream(session, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy request (`bench_service.stream_request`: "sent", "chunks" are
    the perf_counter times of the request and of each chunk); an error stops the run."""
    from services.bench_service import stream_request

    rec = await stream_request(session, url, {
        "model": "eagle2", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True})
    assert rec["error"] is None, rec["error"]
    return rec


async def prefix_requests(url: str, system: str, n: int, max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        out = []
        for i, question in enumerate(questions(n, skip=40)):
            out.append(await stream(session, url, [{"role": "system", "content": system},
                                                   {"role": "user", "content": question}],
                                    max_tokens))
            out[-1]["request"] = i
        return out


async def long_prompt_during_decoding(url: str, long_text: str, streams: int,
                                      max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        running = [asyncio.create_task(stream(session, url, [{"role": "user", "content": q}],
                                              max_tokens)) for q in questions(streams, skip=10)]
        await asyncio.sleep(4.0)  # every stream decoding
        long = await stream(session, url, [{"role": "user", "content": long_text}], 4)
        recs = await asyncio.gather(*running)
    start, end = long["sent"], long["chunks"][0]
    gaps_all, gaps_window = [], []
    for r in recs:
        for a, b in zip(r["chunks"], r["chunks"][1:], strict=False):
            gaps_all.append(b - a)
            if start <= b <= end:
                gaps_window.append(b - a)
    median = statistics.median(gaps_all)
    p99 = sorted(gaps_window)[max(0, int(0.99 * len(gaps_window)) - 1)] if gaps_window else None
    return {"streams": streams, "long_prompt_tokens": long["prompt_tokens"],
            "long_ttft_s": round(long["ttft_s"], 3),
            "itl_median_ms": round(1e3 * median, 2),
            "itl_in_window": len(gaps_window),
            "itl_window_p99_ms": None if p99 is None else round(1e3 * p99, 2),
            "itl_window_max_ms": round(1e3 * max(gaps_window), 2) if gaps_window else None,
            "window_p99_over_median": None if p99 is None else round(p99 / median, 2)}


def serve_and_run(conf: dict, http_port: int, fn) -> tuple:
    import ray
    from ray import serve

    from services.cli_serve import start

    handle = start(conf, http_port=http_port)
    try:
        result = fn(f"http://127.0.0.1:{http_port}/v1/chat/completions")
        return result, handle.engine_stats.remote().result()
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default=None, help="default: the config's")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--system-chars", type=int, default=4000, help="~1,000 tokens")
    p.add_argument("--long-chars", type=int, default=8000, help="~2,000 tokens")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--kv-cache-memory", type=float, default=float(1 << 30))
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the config's")
    p.add_argument("--only-long", action="store_true", help="the long-prompt part alone")
    p.add_argument("--out", default="runs/service-cache.json")
    args = p.parse_args()
    conf = {"max_context": 4096, "max_tokens_limit": 1024,
            "max_running": 16, "kv_cache_memory": args.kv_cache_memory, "grpc_port": 19300,
            "max_queued_requests": 64}
    if args.dtype is not None:
        conf["dtype"] = args.dtype
    if args.prefill_chunk is not None:
        conf["prefill_chunk"] = args.prefill_chunk
    system, long_text = texts(args.system_chars), texts(args.long_chars, skip=20)
    report: dict = {"command": " ".join(["benchmarks/service_cache.py", *sys.argv[1:]]),
                    "config": conf, "machine": {"cpus": os.cpu_count(),
                                                "loadavg_start": list(os.getloadavg())}}

    def prefix_only(url: str) -> dict:
        asyncio.run(prefix_requests(url, "Warm up.", 1, 4))
        return {"prefix": asyncio.run(prefix_requests(url, system, args.requests, 32))}

    def both(url: str) -> dict:
        out = {} if args.only_long else prefix_only(url)
        out["long"] = asyncio.run(long_prompt_during_decoding(url, long_text, args.streams, 160))
        return out

    on, stats_on = serve_and_run({**conf, "prefix_caching": True}, 18300, both)
    report["long_prompt"] = on["long"]
    if args.only_long:
        return write(report, Path(args.out))
    off, _ = serve_and_run({**conf, "prefix_caching": False}, 18300, prefix_only)
    ttft_on = [r["ttft_s"] for r in on["prefix"]]
    ttft_off = [r["ttft_s"] for r in off["prefix"]]
    report["prefix"] = {
        "system_prompt_tokens": on["prefix"][0]["prompt_tokens"],
        "ttft_ms_cache_on": [round(1e3 * t, 1) for t in ttft_on],
        "ttft_ms_cache_off": [round(1e3 * t, 1) for t in ttft_off],
        "later_over_first_cache_on": round(statistics.median(ttft_on[1:]) / ttft_on[0], 3),
        "later_over_first_cache_off": round(statistics.median(ttft_off[1:]) / ttft_off[0], 3),
        "outputs_equal_on_off": [r["token_ids"] for r in on["prefix"]]
        == [r["token_ids"] for r in off["prefix"]],
        "engine_prefix_hit_rate": stats_on.get("prefix_hit_rate"),
        "kv_blocks": stats_on.get("kv_blocks"), "max_running": stats_on.get("max_running"),
        "target_dtype": stats_on.get("target_dtype")}
    return write(report, Path(args.out))


def write(report: dict, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("prefix", "long_prompt") if k in report},
                     indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
