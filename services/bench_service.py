"""`eagle2 bench-service`: the service over its OpenAI endpoint against the in-process engine.

A serving benchmark in the manner of vLLM's `benchmark_serving.py` and SGLang's
`bench_serving`: at each concurrency C of a list, C clients (asyncio + aiohttp) each stream
`POST /v1/chat/completions` (greedy, `ignore_eos`, `max_tokens`; the chat template is applied
by the server) and take the next prompt when one finishes, until every prompt has run once.
Reported per level, like those tools:

- output tokens/s (all completion tokens / the level's wall time) and requests/s;
- TTFT (request sent -> first chunk with tokens), TPOT ((latency - TTFT) / (tokens - 1), per
  request) and ITL (the gap between successive chunks that carry tokens: one chunk is one
  engine step, which may carry several tokens), each as mean, median and p99 in ms;
- errors, and the engine's step breakdown over the level (`engine_stats` deltas: batch sizes,
  draft / verify / other ms per step, bytes per step, the step loop's host time).

Beside it, in the same run and process, the in-process engine (`eagle2.api.Eagle2`, the
service's tree, measured costs, thread count, prefill chunk and the requests its engine runs
at most) on the same prompts at batch C; its TTFT /
TPOT / ITL are measured on its events the same way. The two sides take turns: the prompts go
in groups of C, each group through the service and then in process or the other way round,
alternating, so that a shared machine's changing load falls on both alike (`_level`). Ratios
service / in-process are reported per level, and every service output is compared token for
token with the in-process batch-1 output and with plain decoding (`vanilla`) of the same
prompt (`return_token_ids`: each chunk carries its token ids).

The service is started here (`services.cli_serve.start`, a fresh local Ray, stopped at the
end) or, with `--url`, a running one is used (then without engine stats, and the in-process
engine uses its own costs and `--inprocess-threads`). Prompts: the first `--num-prompts` of a
bench suite (`eagle2.bench.prompts`: MT-bench by default), sent as one user message each.

The gRPC variant this replaces also compared a draft worker with the head in the engine
replica (the gRPC hop per step); run this twice with `--draft-placement worker` and
`inprocess` for that: each row's `engine` block has draft ms per step and the RPC's share.
Writes a JSON file (--out) and a PNG of tokens/s and TPOT against concurrency beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

STAT_SCALARS = ("draft_s", "verify_s", "prefill_s", "other_s", "steps",
                "draft_rpc_calls", "draft_rpc_s", "rank_bytes_out", "rank_bytes_in",
                "draft_bytes_out", "draft_bytes_in", "rank_wait_s", "rank_busy_s")
TRAFFIC = ("rank_bytes_out", "rank_bytes_in", "draft_bytes_out", "draft_bytes_in")
LOOP_SCALARS = ("loop_steps", "loop_step_s", "loop_host_s", "loop_dispatch_s",
                "loop_step_cpu_s", "loop_host_cpu_s",
                "router_messages", "router_delivery_s", "router_work_s",
                "event_frames", "event_messages", "event_bytes")


def add_arguments(p) -> None:
    p.add_argument("--url", default=None,
                   help="base URL of a running service (http://HOST:PORT); default: start one")
    p.add_argument("--suite", default="mt_bench", help="prompt suite (eagle2.bench.prompts)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--mode", default="eagle2", choices=["eagle2", "static", "chain", "vanilla"])
    p.add_argument("--no-inprocess", action="store_true",
                   help="service only (no in-process rows, no token comparison)")
    p.add_argument("--no-plain-check", action="store_true",
                   help="skip the plain-decoding (vanilla) reference run")
    p.add_argument("--draft-placement", default="worker", choices=["worker", "inprocess"])
    p.add_argument("--ha-proxy", action=argparse.BooleanOptionalAction, default=None,
                   help="the started service behind Serve's HAProxy ingress or (--no-ha-proxy) "
                        "its Python proxy (default: as eagle2 serve, HAProxy where found)")
    p.add_argument("--engine-threads", default=None,
                   help="the started service's engine_threads: N or auto (default: config's)")
    p.add_argument("--inprocess-threads", type=int, default=None,
                   help="torch threads in process (default: the service engine's)")
    p.add_argument("--port", type=int, default=19100, help="gRPC port of a started service")
    p.add_argument("--http-port", type=int, default=18100, help="HTTP port of a started one")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-running", "--max-batch-size", dest="max_running", type=int,
                   default=None, help="the started service's max_running (default: config's)")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="the started service's kv_cache_memory in bytes (default: config's)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="the started service's target dtype, and in process (default: auto)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--out", default=None,
                   help="JSON path (default runs/bench-service-<ts>.json); the PNG beside it")


# ----- metrics (pure; unit-tested) -------------------------------------------------------------
def dist_ms(values: list[float]) -> dict:
    """mean, median and p99 of seconds, in ms (None when empty)."""
    import numpy as np

    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * 1000.0
    return {"mean": round(float(a.mean()), 3), "median": round(float(np.median(a)), 3),
            "p99": round(float(np.percentile(a, 99)), 3)}


def serving_metrics(requests: list[dict], wall_s: float) -> dict:
    """vLLM's serving metrics over one level. requests: {"token_ids", "ttft_s", "latency_s",
    "itl_s": [gap per chunk after the first], "error"} each."""
    ok = [r for r in requests if not r.get("error")]
    tokens = sum(len(r["token_ids"]) for r in ok)
    tpot = [(r["latency_s"] - r["ttft_s"]) / (len(r["token_ids"]) - 1)
            for r in ok if len(r["token_ids"]) > 1]
    chunks = sum(len(r["itl_s"]) + 1 for r in ok if r["token_ids"])
    return {
        "requests": len(requests), "completed": len(ok), "errors": len(requests) - len(ok),
        "error_messages": sorted({str(r["error"])[:200] for r in requests if r.get("error")}),
        "output_tokens": tokens, "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
        "ttft_ms": dist_ms([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot_ms": dist_ms(tpot),
        "itl_ms": dist_ms([g for r in ok for g in r["itl_s"]]),
    }


def stats_delta(before: dict, after: dict) -> dict:
    """Engine stats accumulated between two engine_stats() snapshots of the same engine."""
    out: dict = {}
    for key in STAT_SCALARS + LOOP_SCALARS:
        a, b = after.get(key), before.get(key)
        out[key] = None if a is None else a - (b or 0)
    out["batch_sizes"] = list(after.get("batch_sizes", []))[len(before.get("batch_sizes", [])):]
    return out


def _ms(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(1000.0 * num / den, 3)


def engine_summary(delta: dict, tokens: int) -> dict:
    """Per-step figures of one level from a `stats_delta`: the engine's phases, its batch,
    the traffic to ranks / draft worker, and (service only) the step loop's host time and the
    router's delivery and per-message work."""
    steps = delta.get("steps") or 0
    sizes = delta.get("batch_sizes") or []
    rpc_s, draft_s = delta.get("draft_rpc_s"), delta.get("draft_s")
    loop_steps, messages = delta.get("loop_steps"), delta.get("router_messages")
    out = {
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 3) if steps else None,
        "draft_ms_per_step": _ms(draft_s, steps),
        "verify_ms_per_step": _ms(delta.get("verify_s"), steps),
        "other_ms_per_step": _ms(delta.get("other_s"), steps),
        "prefill_s": delta.get("prefill_s"),
        "batch_size_mean": round(statistics.fmean(sizes), 3) if sizes else None,
        "batch_size_max": max(sizes) if sizes else None,
        "draft_rpc_calls": delta.get("draft_rpc_calls"),
        "draft_rpc_ms_per_call": _ms(rpc_s, delta.get("draft_rpc_calls")),
        "draft_outside_rpc_ms_per_step": _ms(draft_s - rpc_s, steps)
        if rpc_s is not None and draft_s is not None else None,
        "rank_wait_ms_per_step": _ms(delta.get("rank_wait_s"), steps),
        # the service's step loop: Engine.step's wall, the loop's own host time around it
        # (commands, events, metrics) and, of that, handing the events to the streams; the
        # CPU time its thread used in the step and around it
        "loop_step_ms_per_step": _ms(delta.get("loop_step_s"), loop_steps),
        "loop_host_ms_per_step": _ms(delta.get("loop_host_s"), loop_steps),
        "loop_dispatch_ms_per_step": _ms(delta.get("loop_dispatch_s"), loop_steps),
        "loop_step_cpu_ms_per_step": _ms(delta.get("loop_step_cpu_s"), loop_steps),
        "loop_host_cpu_ms_per_step": _ms(delta.get("loop_host_cpu_s"), loop_steps),
        # the router: engine handing a step's tokens -> the router holding them (the events
        # connection), and its own work per message (detokenize, stop strings, message)
        "router_delivery_ms_per_message": _ms(delta.get("router_delivery_s"), messages),
        "router_work_ms_per_message": _ms(delta.get("router_work_s"), messages),
        # the engine -> routers frames (services/event_channel.py): requests' events a frame
        # (the streams a router had in one step) and frames a step (routers)
        "events_per_frame": ratio(delta.get("event_messages"), delta.get("event_frames")),
        "frames_per_step": ratio(delta.get("event_frames"), loop_steps),
    }
    per = {f"{k}_per_step": round(delta[k] / steps) if steps and delta.get(k) is not None
           else None for k in TRAFFIC}
    known = [v for v in per.values() if v is not None]
    out.update(per, bytes_per_step=sum(known) if known else None)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare_ids(service: list[dict], reference: dict[int, list[int]]) -> dict:
    """Service outputs against a reference per prompt index: how many equal it token for token,
    and the first prompts that do not."""
    ok = [r for r in service if not r.get("error")]
    differ = [r["prompt"] for r in ok if r["token_ids"] != reference.get(r["prompt"])]
    return {"compared": len(ok), "equal": len(ok) - len(differ), "differ": differ[:8]}


# ----- the service's side: streaming chat completions ------------------------------------------
async def stream_request(session, url: str, body: dict) -> dict:
    """One streamed OpenAI request: its token ids, TTFT, inter-chunk latencies, and "sent"
    / "chunks" (perf_counter times of the request and of each chunk with tokens); an error
    is recorded, not raised."""
    t0 = last = time.perf_counter()
    rec = {"token_ids": [], "ttft_s": None, "itl_s": [], "latency_s": None, "error": None,
           "usage_completion_tokens": None, "prompt_tokens": None, "text": "",
           "finish_reason": None, "sent": t0, "chunks": []}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = f"stream error: {chunk['error']}"
                    break
                if chunk.get("usage"):
                    rec["usage_completion_tokens"] = chunk["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids:
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = now - t0
                        else:
                            rec["itl_s"].append(now - last)
                        last = now
                        rec["chunks"].append(now)
                        rec["token_ids"].extend(ids)
                    rec["text"] += choice.get("delta", {}).get("content") or ""
                    rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
        rec["latency_s"] = last - t0
    except Exception as e:  # a broken connection counts as an error of this request
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def _service_level(base_url: str, prompts: list[str], conc: int, max_tokens: int,
                         mode: str) -> tuple[list[dict], float]:
    import aiohttp

    work: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        work.put_nowait((i, p))
    out: list[dict] = []
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc),
                                     timeout=timeout) as session:
        async def client():
            while not work.empty():
                i, prompt = work.get_nowait()
                body = {"model": "eagle2", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True},
                        "return_token_ids": True, "mode": mode}
                rec = await stream_request(session, url, body)
                rec["prompt"] = i
                out.append(rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return out, wall


# ----- the in-process side ----------------------------------------------------------------------
def inprocess_level(llm, prompt_ids: list[list[int]], conc: int,
                    max_tokens: int | Callable[[int], int], mode: str
                    ) -> tuple[list[dict], float]:
    """Closed loop of `conc` requests in flight on the in-process engine, timed per event.
    max_tokens: every request's, or a function of its prompt's index."""
    from dataclasses import replace

    from eagle2.config import SamplingParams

    tree = replace(llm.tree, mode=mode)
    engine, todo = llm.engine, list(enumerate(prompt_ids))
    recs: dict[str, dict] = {}
    t_start = time.perf_counter()
    while todo or engine.has_work():
        while todo and len(engine.ids()) < conc:  # running, waiting, preempted, chunked
            i, ids = todo.pop(0)
            sid = f"bench-{uuid.uuid4().hex[:8]}-{i}"
            n = max_tokens(i) if callable(max_tokens) else max_tokens
            engine.add(llm.request(ids, SamplingParams(max_tokens=n, ignore_eos=True), tree,
                                   sid))
            recs[sid] = {"prompt": i, "token_ids": [], "ttft_s": None, "itl_s": [],
                         "latency_s": None, "error": None, "t0": time.perf_counter()}
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            r = recs[ev.seq_id]
            if ev.token_ids:
                if r["ttft_s"] is None:
                    r["ttft_s"] = now - r["t0"]
                else:
                    r["itl_s"].append(now - r["last"])
                r["last"] = now
                r["token_ids"].extend(ev.token_ids)
            if ev.finished:
                r["latency_s"] = r["last"] - r["t0"]
    wall = time.perf_counter() - t_start
    return sorted(recs.values(), key=lambda r: r["prompt"]), wall


# ----- running -----------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[bench-service {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _service_config(args) -> dict:
    conf = {"max_context": args.max_context,
            "max_tokens_limit": min(1024, args.max_context - 1),
            "default_max_tokens": min(args.max_tokens, args.max_context - 1),
            "grpc_port": args.port, "max_queued_requests": 256, "target": args.target,
            "draft": args.draft, "draft_placement": args.draft_placement,
            "tree": {"mode": args.mode}}
    for key in ("max_running", "kv_cache_memory", "dtype"):
        if getattr(args, key, None) is not None:
            conf[key] = getattr(args, key)
    if args.engine_threads is not None:
        conf["engine_threads"] = (args.engine_threads if args.engine_threads == "auto"
                                  else int(args.engine_threads))
    return conf


def _stats(handle) -> dict | None:
    return None if handle is None else handle.engine_stats.remote().result()


def run(args) -> int:
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs levels >= 1, got {args.concurrency!r}")
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    from eagle2.bench.prompts import load_suite

    prompts = [p.user_message for p in load_suite(args.suite, args.num_prompts)]
    out_path = Path(args.out or f"runs/bench-service-{time.strftime('%Y%m%d-%H%M%S')}.json")
    report: dict = {"command": "bench-service", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "args": {k: v for k, v in vars(args).items() if not callable(v)},
                    "prompts": prompts, "machine": {"cpus": os.cpu_count(),
                                                    "loadavg_start": os.getloadavg()}}
    handle = None
    if args.url is None:
        from services.cli_serve import start, use_ha_proxy

        conf = _service_config(args)
        report["service_config"] = conf
        report["ha_proxy"] = use_ha_proxy(args.ha_proxy)  # the ingress it runs behind
        t0 = time.perf_counter()
        handle = start(conf, http_port=args.http_port, address="local",
                       ha_proxy=report["ha_proxy"])
        _log(f"service started in {time.perf_counter() - t0:.0f} s")
    base_url = args.url or f"http://127.0.0.1:{args.http_port}"
    try:  # the report is written before the service stops
        report.update(_measure(args, handle, base_url, prompts, levels))
        report["machine"]["loadavg_end"] = os.getloadavg()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2))
        png = out_path.with_suffix(".png")
        plot(report, png)
        print(format_summary(report))
        print(f"wrote {out_path} and {png}", file=sys.stderr, flush=True)
    finally:
        if handle is not None:
            from services.cli_serve import shutdown

            shutdown(handle, drain_s=2.0, serve_timeout_s=60.0)
    return 0


def _measure(args, handle, base_url: str, prompts: list[str], levels: list[int]) -> dict:
    """Warm both sides, then per level the service and (unless --no-inprocess) the in-process
    engine at batch = the level on the same prompts, interleaved (`_level`)."""
    import torch

    asyncio.run(_service_level(base_url, prompts[:1], 1, 8, args.mode))  # warm-up
    first = _stats(handle)
    out: dict = {"service": {"url": base_url, "draft": first and first["draft"],
                             "target_placement": first and first["target_placement"],
                             "target_dtype": first and first["target_dtype"],
                             "torch_threads": first and first["torch_threads"]}}
    llm, prompt_ids = None, None
    if not args.no_inprocess:
        from eagle2.api import Eagle2
        from eagle2.budget import CostModel
        from services.config import ServiceConfig

        cfg = ServiceConfig(**(_service_config(args)))
        costs = first and first["costs"]
        threads = args.inprocess_threads or (first and first["torch_threads"]) or "auto"
        dtype = None if getattr(args, "dtype", None) in (None, "auto") else args.dtype
        # the service engine's limits: the requests a step runs (its cache's slots or
        # max_running) and how long a prompt is read in chunks beside running requests
        running = min(max(levels), (first and first.get("max_running")) or max(levels))
        llm = Eagle2.load(args.target, args.draft, tree=cfg.tree.to_core(), max_batch=running,
                          max_context=args.max_context, threads=threads, dtype=dtype,
                          costs=CostModel.from_json(costs) if costs else None)
        llm.engine.prefill_chunk = cfg.resolved_prefill_chunk()
        out["inprocess"] = {"torch_threads": torch.get_num_threads(),
                            "costs": "service's" if costs else "own", "max_running": running,
                            "prefill_chunk": llm.engine.prefill_chunk}
        prompt_ids = [llm.encode(p) for p in prompts]
        inprocess_level(llm, prompt_ids[:1], 1, 8, args.mode)  # warm-up
    reference = None
    if llm is not None and 1 not in levels:
        recs, wall = inprocess_level(llm, prompt_ids, 1, args.max_tokens, args.mode)
        out["inprocess_batch1"] = serving_metrics(recs, wall)
        reference = {r["prompt"]: r["token_ids"] for r in recs}
    rows, all_service = [], []
    for conc in levels:
        row, recs, recs_ip = _level(args, handle, llm, base_url, prompts, prompt_ids, conc)
        if conc == 1 and llm is not None:
            out["inprocess_batch1"] = row["inprocess"]
            reference = {r["prompt"]: r["token_ids"] for r in recs_ip}
        all_service += [{**r, "concurrency": conc} for r in recs]
        rows.append(row)
    for row in rows:
        if llm is None:
            continue
        recs = [r for r in all_service if r["concurrency"] == row["concurrency"]]
        row["service_over_inprocess_batch1"] = ratio(
            row["service"]["output_tokens_per_s"],
            out["inprocess_batch1"]["output_tokens_per_s"])
        row["service_ids_equal_inprocess_batch1"] = compare_ids(recs, reference)
    out["levels"] = rows
    if llm is not None and not args.no_plain_check:
        recs, _ = inprocess_level(llm, prompt_ids, max(levels), args.max_tokens, "vanilla")
        plain = {r["prompt"]: r["token_ids"] for r in recs}
        out["service_ids_equal_plain_decoding"] = compare_ids(all_service, plain)
    out["service_outputs"] = [{k: r[k] for k in ("concurrency", "prompt", "token_ids",
                                                  "usage_completion_tokens", "finish_reason")}
                              for r in all_service]
    return out


def _level(args, handle, llm, base_url: str, prompts: list[str], prompt_ids, conc: int):
    """One concurrency level. The prompts go in groups of `conc`; each group runs through the
    service (`conc` clients) and in process (batch `conc`), the two in turn, which goes first
    alternating by group, so that a shared machine's changing load falls on both sides alike.
    Rates are summed tokens over summed group walls."""
    groups = [list(range(i, min(i + conc, len(prompts)))) for i in range(0, len(prompts), conc)]
    svc, ip, walls = [], [], {"service": 0.0, "inprocess": 0.0}
    before = _stats(handle)
    s0 = asdict(llm.engine.stats) if llm is not None else None
    procs = service_processes() if handle is not None else {}
    cpu = {"service": {}, "inprocess": {}}

    def service(idx):
        c0 = cpu_seconds(procs)
        recs, wall = asyncio.run(_service_level(base_url, [prompts[i] for i in idx], conc,
                                                args.max_tokens, args.mode))
        add_cpu(cpu["service"], c0, cpu_seconds(procs))
        svc.extend({**r, "prompt": idx[r["prompt"]]} for r in recs)
        walls["service"] += wall

    def inprocess(idx):
        c0 = cpu_seconds({"inprocess": [os.getpid()]})
        recs, wall = inprocess_level(llm, [prompt_ids[i] for i in idx], conc, args.max_tokens,
                                     args.mode)
        add_cpu(cpu["inprocess"], c0, cpu_seconds({"inprocess": [os.getpid()]}))
        ip.extend({**r, "prompt": idx[r["prompt"]]} for r in recs)
        walls["inprocess"] += wall

    for k, idx in enumerate(groups):
        sides = [service] if llm is None else [service, inprocess][::1 if k % 2 == 0 else -1]
        for side in sides:
            side(idx)
    after = _stats(handle)
    row: dict = {"concurrency": conc, "service": serving_metrics(svc, walls["service"])}
    sv = row["service"]
    sv["usage_equals_token_ids"] = all(r["usage_completion_tokens"] == len(r["token_ids"])
                                       for r in svc if not r.get("error"))
    if handle is not None:
        sv["engine"] = engine_summary(stats_delta(before, after), sv["output_tokens"])
        sv["cpu_ms_per_token"] = per_token(cpu["service"], sv["output_tokens"])
    if llm is not None:
        row["inprocess"] = ip_ = serving_metrics(ip, walls["inprocess"])
        ip_["engine"] = engine_summary(stats_delta(s0, asdict(llm.engine.stats)),
                                       ip_["output_tokens"])
        ip_["cpu_ms_per_token"] = per_token(cpu["inprocess"], ip_["output_tokens"])
        row["service_over_inprocess"] = {
            "output_tokens_per_s": ratio(sv["output_tokens_per_s"], ip_["output_tokens_per_s"]),
            "tpot_mean": ratio(sv["tpot_ms"]["mean"], ip_["tpot_ms"]["mean"]),
            "ttft_mean": ratio(sv["ttft_ms"]["mean"], ip_["ttft_ms"]["mean"])}
    _log(f"c={conc}: service {sv['output_tokens_per_s']} tok/s, in-process "
         f"{row.get('inprocess', {}).get('output_tokens_per_s')} tok/s")
    return row, sorted(svc, key=lambda r: r["prompt"]), sorted(ip, key=lambda r: r["prompt"])


# ----- CPU time per process (what the service's processes cost besides the step) ----------------
ROLES = (("TargetEngine", "engine"), ("Router", "router"), ("ProxyActor", "proxy"),
         ("DraftWorker", "draft_worker"), ("ServeController", "controller"),
         ("TPRank", "ranks"), ("HAProxyManager", "haproxy"))


def service_processes() -> dict[str, list[int]]:
    """The processes of the service this bench started (its descendants) by role: the Serve
    replicas, proxy and controller by their Ray names, "haproxy" (HAProxy and the actor that
    runs it), "client" (this process: the HTTP clients) and "ray_other" (GCS, raylet, agents,
    idle workers)."""
    import psutil

    out: dict[str, list[int]] = {"client": [os.getpid()]}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd, name = " ".join(proc.cmdline()), proc.name()
        except psutil.Error:
            continue
        role = "haproxy" if name == "haproxy" else next(
            (r for key, r in ROLES if key in cmd), "ray_other")
        out.setdefault(role, []).append(proc.pid)
    return out


def cpu_seconds(procs: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds so far of each role's processes (all their threads)."""
    import psutil

    out = {}
    for role, pids in procs.items():
        total = 0.0
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[role] = total
    return out


def add_cpu(acc: dict, before: dict, after: dict) -> None:
    for role, value in after.items():
        acc[role] = acc.get(role, 0.0) + value - before.get(role, 0.0)


def per_token(cpu: dict, tokens: int) -> dict | None:
    """CPU ms per generated token by role, and their total."""
    if not cpu or not tokens:
        return None
    out = {role: round(1000.0 * s / tokens, 3) for role, s in sorted(cpu.items())}
    out["total"] = round(1000.0 * sum(cpu.values()) / tokens, 3)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["levels"]
    conc = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, style in (("service", "o-"), ("inprocess", "s--")):
        if all(side in r for r in rows):
            ax1.plot(conc, [r[side]["output_tokens_per_s"] for r in rows], style, label=side)
            ax2.plot(conc, [r[side]["tpot_ms"]["mean"] for r in rows], style,
                     label=f"{side} (mean)")
            ax2.plot(conc, [r[side]["tpot_ms"]["p99"] for r in rows], style, alpha=0.4,
                     label=f"{side} (p99)")
    ax1.set(xlabel="concurrency (in-process: batch)", ylabel="output tokens/s",
            title="throughput")
    ax2.set(xlabel="concurrency (in-process: batch)", ylabel="TPOT ms", title="time per token")
    for ax in (ax1, ax2):
        ax.set_xticks(conc)
        ax.grid(alpha=0.3)
        ax.legend()
    args = report["args"]
    fig.suptitle(f"eagle2 bench-service: {args['suite']} x {args['num_prompts']} prompts x "
                 f"{args['max_tokens']} tokens, mode {args['mode']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_summary(report: dict) -> str:
    lines = []
    b1 = report.get("inprocess_batch1")
    if b1:
        lines.append(f"in-process batch 1: {b1['output_tokens_per_s']} tok/s, TPOT mean "
                     f"{b1['tpot_ms']['mean']} ms")
    for r in report["levels"]:
        s = r["service"]
        line = (f"c={r['concurrency']}: service {s['output_tokens_per_s']} tok/s "
                f"({s['requests_per_s']} req/s, {s['errors']} errors), TTFT "
                f"{s['ttft_ms']['mean']}/{s['ttft_ms']['median']}/{s['ttft_ms']['p99']} ms, "
                f"TPOT {s['tpot_ms']['mean']}/{s['tpot_ms']['median']}/{s['tpot_ms']['p99']}, "
                f"ITL {s['itl_ms']['mean']}/{s['itl_ms']['median']}/{s['itl_ms']['p99']} "
                "(mean/median/p99)")
        if "inprocess" in r:
            ip = r["inprocess"]
            line += (f"; in-process batch {r['concurrency']} {ip['output_tokens_per_s']} tok/s "
                     f"TPOT {ip['tpot_ms']['mean']} ms; service/in-process "
                     f"x{r['service_over_inprocess']['output_tokens_per_s']}; ids equal "
                     f"{r['service_ids_equal_inprocess_batch1']['equal']}/"
                     f"{r['service_ids_equal_inprocess_batch1']['compared']}")
        lines.append(line)
        if s.get("cpu_ms_per_token"):
            ip_cpu = (r.get("inprocess") or {}).get("cpu_ms_per_token") or {}
            lines.append(f"    CPU ms per token: service {s['cpu_ms_per_token']}; in-process "
                         f"{ip_cpu.get('total')}")
    plain = report.get("service_ids_equal_plain_decoding")
    if plain:
        lines.append(f"service outputs equal to plain decoding: {plain['equal']}/"
                     f"{plain['compared']}")
    return "\n".join(lines)
