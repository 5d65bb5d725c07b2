"""`eagle2 bench-service`: what the service costs on top of the in-process engine.

Starts a local Ray + Serve with the gRPC proxy (like `services.cli_serve.start`) and deploys
the app twice, side by side on the same gRPC port: `<app>` with draft_placement "worker" (the
head in its own replica, reached over gRPC by `RemoteDrafter`) and `<app>-ip` with
draft_placement "inprocess". Both live at once so that their requests can be interleaved
(the machine is shared and noisy; an idle app costs nothing but memory). Then:

1. concurrency 1, greedy, mode eagle2, the same prompts: the in-process API
   (`Eagle2.load().generate`, one prompt at a time, torch threads = the service target's
   (engine_threads, measured where 0), the service's tree sizes, budget and measured forward
   and draft costs: both choose the same trees)
   against
   the service over gRPC GenerateStream (`Eagle2Client.stream`), both apps, the three paths
   interleaved per prompt (order rotated); tokens/s = new tokens / client wall time;
2. aggregate tokens/s through the service at each --concurrency (threads, each its own
   client, pulling distinct prompts from a queue): total new tokens / wall time, with the
   engine's verified batch sizes over that run (from engine_stats deltas);
3. the draft hop: engine draft ms/step with the worker (gRPC) against in-process, both from
   phase 1's engine_stats deltas; for the worker also the RPC wall per call (draft_rpc_s) and
   the engine-side remainder (request/response proto encoding: draft_s - draft_rpc_s).
   DraftServicer.busy_s (the worker's own compute) is not exposed by engine_stats or by the
   Health RPC, so it is reported as null; the in-process draft ms/step is the estimate of the
   worker's compute (same Drafter code, same head).

The target runs where the service config puts it (`target_placement`, "auto": in the engine
replica at tp_size 1); "target_placement" in the JSON says where it ran in each app.

Prints a summary and writes one JSON file (--out, default runs/bench-service-<ts>.json).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "Write a haiku about the sea.",
    "Name three fruits and their colors.",
    "Explain what a CPU does in two sentences.",
    "Give me a short tip for learning Python.",
    "Describe a cat in one sentence.",
    "What is the capital of France and why is it famous?",
    "List four things to pack for a beach trip.",
    "Tell me a one-line joke about computers.",
    "How do plants make food? Answer briefly.",
    "Suggest a name for a friendly robot.",
]

STAT_SCALARS = ("draft_s", "verify_s", "prefill_s", "other_s", "steps",
                "draft_rpc_calls", "draft_rpc_s", "rank_bytes_out", "rank_bytes_in",
                "draft_bytes_out", "draft_bytes_in", "rank_wait_s", "rank_busy_s")
TRAFFIC = ("rank_bytes_out", "rank_bytes_in", "draft_bytes_out", "draft_bytes_in")


def add_arguments(p) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=4,
                   help="prompts for the concurrency-1 comparisons (and the minimum number of "
                        "requests per concurrency level)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the interleaved concurrency-1 comparison")
    p.add_argument("--mode", default="eagle2", choices=["eagle2", "static", "chain", "vanilla"])
    p.add_argument("--tree-tokens", type=int, default=None,
                   help="total_tokens of the draft tree (default: the service's)")
    p.add_argument("--port", type=int, default=19100, help="gRPC port of the Serve proxy")
    p.add_argument("--http-port", type=int, default=None,
                   help="Serve's HTTP port (default: --port + 80; unused, but must be free)")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--engine-threads", default=None,
                   help="the service's engine_threads: N, or auto (measured, following the "
                        "load); default: the config's")
    p.add_argument("--inprocess-threads", type=int, default=None,
                   help="torch threads of the in-process API (default: the service target's)")
    p.add_argument("--target-placement", default="auto", choices=["auto", "ranks", "engine"],
                   help="where the service's target runs (auto: in the engine at tp 1)")
    p.add_argument("--sweep-apps", default="worker",
                   help="apps for the concurrency sweep: worker, inprocess or both (comma)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--out", default=None, help="JSON path (default runs/bench-service-<ts>.json)")


# ----- metric aggregation (pure; unit-tested) --------------------------------------------------
def stats_delta(before: dict, after: dict) -> dict:
    """Engine stats accumulated between two engine_stats() snapshots of the same engine."""
    out: dict = {}
    for key in STAT_SCALARS:
        a, b = after.get(key), before.get(key)
        out[key] = None if a is None else a - (b or 0)
    out["batch_sizes"] = list(after.get("batch_sizes", []))[len(before.get("batch_sizes", [])):]
    return out


def _ms(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else 1000.0 * num / den


def summarize(requests: list[dict], wall_s: float | None = None,
              delta: dict | None = None) -> dict:
    """requests: {"tokens": int, "wall_s": float[, "ttft_s": float]} per request.

    wall_s: the wall time of the whole run (concurrent runs); None = the requests ran one
    after another, and the sum of their walls is used. delta: `stats_delta` over the run.
    """
    tokens = sum(r["tokens"] for r in requests)
    req_wall = sum(r["wall_s"] for r in requests)
    wall = req_wall if wall_s is None else wall_s
    per_req = [r["tokens"] / r["wall_s"] for r in requests if r["wall_s"] > 0]
    out = {
        "requests": len(requests),
        "new_tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "per_request_tokens_per_s_median": round(statistics.median(per_req), 3)
        if per_req else None,
    }
    ttft = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    if ttft:
        out["ttft_ms_mean"] = round(1000.0 * statistics.fmean(ttft), 2)
    if delta is not None:
        steps = delta.get("steps") or 0
        sizes = delta.get("batch_sizes") or []
        calls = delta.get("draft_rpc_calls")
        rpc_s = delta.get("draft_rpc_s")
        eng = {
            "steps": steps,
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "draft_ms_per_step": _ms(delta.get("draft_s"), steps),
            "verify_ms_per_step": _ms(delta.get("verify_s"), steps),
            "other_ms_per_step": _ms(delta.get("other_s"), steps),
            "prefill_s": delta.get("prefill_s"),
            "batch_size_mean": round(statistics.fmean(sizes), 3) if sizes else None,
            "batch_size_max": max(sizes) if sizes else None,
            "draft_rpc_calls": calls,
            "draft_rpc_ms_per_call": _ms(rpc_s, calls),
            # engine-side cost of the hop outside the RPC (tensor/tree proto en- and decoding)
            "draft_outside_rpc_ms_per_step": _ms(delta["draft_s"] - rpc_s, steps)
            if rpc_s is not None and delta.get("draft_s") is not None else None,
            # the engine's wait for its TP rank calls (prefill included) and rank 0's compute
            # inside them: their difference is the Ray hop
            "rank_wait_ms_per_step": _ms(delta.get("rank_wait_s"), steps),
            "rank_busy_ms_per_step": _ms(delta.get("rank_busy_s"), steps),
        }
        eng.update(traffic_per_step(delta, steps))
        out["engine"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in eng.items()}
    return out


def traffic_per_step(delta: dict, steps: int) -> dict:
    """Bytes per engine step (decode steps; prefill traffic included) between the engine and
    its TP ranks and draft worker; "bytes_per_step" is their sum."""
    per = {f"{k}_per_step": round(delta[k] / steps) if steps and delta.get(k) is not None
           else None for k in TRAFFIC}
    known = [v for v in per.values() if v is not None]
    per["bytes_per_step"] = sum(known) if known else None
    return per


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def draft_hop(worker: dict, inprocess: dict) -> dict:
    """Section 3 from two `summarize(...)["engine"]` dicts on the same prompts."""
    w, i = worker.get("draft_ms_per_step"), inprocess.get("draft_ms_per_step")
    hop = round(w - i, 3) if w is not None and i is not None else None
    return {
        "worker_draft_ms_per_step": w,
        "inprocess_draft_ms_per_step": i,
        "grpc_hop_ms_per_step": hop,
        "worker_over_inprocess": ratio(w, i),
        "worker_rpc_ms_per_call": worker.get("draft_rpc_ms_per_call"),
        "worker_outside_rpc_ms_per_step": worker.get("draft_outside_rpc_ms_per_step"),
        "worker_verify_ms_per_step": worker.get("verify_ms_per_step"),
        "inprocess_verify_ms_per_step": inprocess.get("verify_ms_per_step"),
        "draft_worker_busy_s": None,
    }


# ----- running -----------------------------------------------------------------------------
def _stream_one(client, prompt: str, max_tokens: int, mode: str) -> dict:
    t0 = time.perf_counter()
    ids, ttft = [], None
    for msg in client.stream(prompt, max_tokens=max_tokens, mode=mode):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - t0
        ids.extend(msg.token_ids)
    wall = time.perf_counter() - t0
    return {"tokens": len(ids), "wall_s": wall, "ttft_s": ttft, "token_ids": ids}


def _inprocess_one(llm, prompt: str, max_tokens: int, mode: str) -> dict:
    from eagle2.config import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens), mode=mode)[0]
    wall = time.perf_counter() - t0
    return {"tokens": len(out.token_ids), "wall_s": wall, "token_ids": out.token_ids,
            "num_steps": out.num_steps}


def _concurrent(address: str, app: str, prompts: list[str], conc: int, max_tokens: int,
                mode: str) -> tuple[list[dict], float]:
    from services.client import Eagle2Client

    work: queue.Queue = queue.Queue()
    for p in prompts:
        work.put(p)
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    clients = [Eagle2Client(address, application=app) for _ in range(conc)]
    start = threading.Barrier(conc + 1)

    def worker(c):
        start.wait()
        while True:
            try:
                p = work.get_nowait()
            except queue.Empty:
                return
            try:
                r = _stream_one(c, p, max_tokens, mode)
            except BaseException as e:
                with lock:
                    errors.append(e)
                return
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    return results, wall


def _start(apps: dict[str, dict], port: int, http_port: int) -> dict:
    """As cli_serve.start, for several apps on one gRPC proxy; a fresh local Ray."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from services.app import build_app
    from services.config import ServiceConfig
    from services.protos import SERVICER_FUNCTIONS

    tp = max(ServiceConfig(**c).tp_size for c in apps.values())
    # logical CPUs: every replica asks for one; 2 apps need ~7
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1) + 2 * tp,
                 include_dashboard=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(grpc_options=gRPCOptions(port=port, grpc_servicer_functions=SERVICER_FUNCTIONS),
                http_options={"host": "127.0.0.1", "port": http_port})
    handles = {}
    for name, conf in apps.items():
        t0 = time.perf_counter()
        handles[name] = serve.run(build_app(conf), name=name, route_prefix=f"/{name}")
        _log(f"deployed {name} ({conf['draft_placement']}) in {time.perf_counter() - t0:.0f} s")
    return handles


def _log(msg: str) -> None:
    print(f"[bench-service {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    from dataclasses import asdict

    import torch

    from eagle2.api import Eagle2
    from eagle2.budget import CostModel
    from services.config import ServiceConfig

    t_start = time.time()
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    n = args.num_prompts
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(max(n, 1))]
    out_path = Path(args.out or f"runs/bench-service-{time.strftime('%Y%m%d-%H%M%S')}.json")
    http_port = args.http_port or args.port + 80
    base = {"max_batch_size": args.max_batch_size, "max_context": args.max_context,
            "max_tokens_limit": min(1024, args.max_context - 1),
            "default_max_tokens": min(args.max_tokens, args.max_context - 1),
            "grpc_port": args.port, "max_queued_requests": 64,
            "target": args.target, "draft": args.draft,
            "target_placement": args.target_placement,
            **({} if args.engine_threads is None else {"engine_threads": (
                args.engine_threads if args.engine_threads == "auto"
                else int(args.engine_threads))}),
            "tree": {"mode": args.mode, **({"total_tokens": args.tree_tokens, "depth": 5,
                                            "top_k": 8} if args.tree_tokens else {})}}
    names = {"worker": "eagle2", "inprocess": "eagle2-ip"}
    apps = {names[pl]: {**base, "draft_placement": pl, "app_name": names[pl]}
            for pl in ("worker", "inprocess")}
    address = f"localhost:{args.port}"
    report: dict = {
        "command": "bench-service", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
        "prompts": prompts, "service_config": base,
        "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
    }

    import ray
    from ray import serve

    try:
        handles = _start(apps, args.port, http_port)
        from services.client import Eagle2Client

        clients = {pl: Eagle2Client(address, application=names[pl]) for pl in names}
        first = {pl: handles[names[pl]].engine_stats.remote().result() for pl in names}
        report["draft"] = {pl: first[pl]["draft"] for pl in names}
        report["target_placement"] = {pl: first[pl]["target_placement"] for pl in names}
        report["target_dtype"] = {pl: first[pl]["target_dtype"] for pl in names}
        # warm-up: one short request per path (first-call costs out of the numbers)
        for pl in names:
            _stream_one(clients[pl], prompts[0], 8, args.mode)

        t0 = time.perf_counter()
        # the service's tree (sizes, budget) and its measured forward and draft costs, so
        # that both choose the same trees: costs are measured once per process and cached,
        # and two measurements on a shared machine differ enough to change the choices
        tree = ServiceConfig(**apps[names["inprocess"]]).tree.to_core()
        service_stats = handles[names["inprocess"]].engine_stats.remote().result()
        costs = service_stats["costs"]
        threads = args.inprocess_threads or service_stats["torch_threads"]
        report["torch_threads"] = {"service_engine": service_stats["torch_threads"],
                                   "inprocess": threads}
        torch.set_num_threads(threads)
        report["inproc_costs"] = "service" if costs else "own"
        llm = Eagle2.load(args.target, args.draft, tree=tree, max_batch=args.max_batch_size,
                          max_context=args.max_context,
                          costs=CostModel.from_json(costs) if costs else None,
                          threads=threads)
        _log(f"in-process model loaded in {time.perf_counter() - t0:.0f} s "
             f"(torch threads {torch.get_num_threads()})")
        _inprocess_one(llm, prompts[0], 8, args.mode)
        if report["draft"]["inprocess"] == "untrained":
            report["note"] = ("no trained draft head for this target: the head is untrained, "
                              "so tau ~ 1 (lossless, slow); draft/verify costs per step are "
                              "still those of a real tree")
        _log("warm")

        # ----- 1 + 3: concurrency 1, the three paths interleaved ------------------------
        paths = ["inproc", "worker", "inprocess"]
        recs: dict[str, list[dict]] = {p: [] for p in paths}
        before = {pl: handles[names[pl]].engine_stats.remote().result() for pl in names}
        before_local = asdict(llm.engine.stats)
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(paths)
                for path in paths[k:] + paths[:k]:
                    if path == "inproc":
                        r = _inprocess_one(llm, prompt, args.max_tokens, args.mode)
                    else:
                        r = _stream_one(clients[path], prompt, args.max_tokens, args.mode)
                    r["prompt"] = i
                    recs[path].append(r)
            _log(f"concurrency-1 round {rep + 1}/{args.repeats} done")
        after = {pl: handles[names[pl]].engine_stats.remote().result() for pl in names}
        c1 = {"inproc": summarize(recs["inproc"], None,
                                  stats_delta(before_local, asdict(llm.engine.stats)))}
        for pl in names:
            c1[f"service_{pl}"] = summarize(recs[pl], None, stats_delta(before[pl], after[pl]))
        ref = {r["prompt"]: r["token_ids"] for r in recs["inproc"]}
        c1["token_ids_match_inproc"] = {
            pl: all(r["token_ids"] == ref[r["prompt"]] for r in recs[pl]) for pl in names}
        c1["service_over_inproc"] = {
            pl: ratio(c1[f"service_{pl}"]["tokens_per_s"], c1["inproc"]["tokens_per_s"])
            for pl in names}
        report["concurrency1"] = c1
        report["draft_hop"] = draft_hop(c1["service_worker"]["engine"],
                                        c1["service_inprocess"]["engine"])
        report["draft_hop"]["draft_worker_busy_s_note"] = (
            "DraftServicer.busy_s is not exposed (engine_stats / DraftService.Health carry "
            "no busy time); inprocess_draft_ms_per_step estimates the worker's compute")
        try:
            from services.draft_client import RemoteDrafter

            addr = handles[names["worker"]].engine_stats.remote().result()["draft_address"]
            h = RemoteDrafter(addr, timeout_s=10).health()
            report["draft_hop"]["draft_worker_health"] = {
                "draft_requests": h.draft_requests, "pid": h.pid, "head": h.head}
        except Exception as e:
            report["draft_hop"]["draft_worker_health"] = f"unavailable: {e}"

        # ----- 2: concurrency sweep -------------------------------------------------------
        sweep_apps = [a.strip() for a in args.sweep_apps.split(",") if a.strip()]
        if "both" in sweep_apps:
            sweep_apps = ["worker", "inprocess"]
        sweep: list[dict] = []
        for pl in sweep_apps:
            for conc in levels:
                reqs = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(max(n, conc))]
                b = handles[names[pl]].engine_stats.remote().result()
                res, wall = _concurrent(address, names[pl], reqs, conc, args.max_tokens,
                                        args.mode)
                a = handles[names[pl]].engine_stats.remote().result()
                s = summarize(res, wall, stats_delta(b, a))
                sweep.append({"placement": pl, "concurrency": conc, **s})
                _log(f"{pl} concurrency {conc}: {s['tokens_per_s']} tok/s, "
                     f"batch mean {s['engine']['batch_size_mean']}")
        for pl in sweep_apps:
            rows = [r for r in sweep if r["placement"] == pl]
            c1row = next((r for r in rows if r["concurrency"] == 1), None)
            for r in rows:
                r["speedup_over_c1"] = ratio(r["tokens_per_s"], c1row["tokens_per_s"]) \
                    if c1row else None
        report["concurrency_sweep"] = sweep
        for c in clients.values():
            c.close()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["total_s"] = round(time.time() - t_start, 1)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("target_placement", "concurrency1", "draft_hop",
                                              "concurrency_sweep")}, indent=2))
    print(format_summary(report), file=sys.stderr)
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


def format_summary(report: dict) -> str:
    c1, hop = report["concurrency1"], report["draft_hop"]
    lines = ["", f"target placement: {report.get('target_placement')}",
             "== concurrency 1 (same prompts, greedy) ==",
             f"in-process API          {c1['inproc']['tokens_per_s']} tok/s"]
    for pl in ("worker", "inprocess"):
        s = c1[f"service_{pl}"]
        lines.append(f"service, draft {pl:<9} {s['tokens_per_s']} tok/s "
                     f"(x{c1['service_over_inproc'][pl]} of in-process; "
                     f"ids match: {c1['token_ids_match_inproc'][pl]})")
    for pl in ("worker", "inprocess"):
        e = c1[f"service_{pl}"].get("engine") or {}
        lines.append(f"bytes/step, draft {pl:<9} {e.get('bytes_per_step')} (ranks out "
                     f"{e.get('rank_bytes_out_per_step')} in {e.get('rank_bytes_in_per_step')}; "
                     f"draft out {e.get('draft_bytes_out_per_step')} in "
                     f"{e.get('draft_bytes_in_per_step')})")
    lines += ["== draft hop (engine draft time per step) ==",
              f"worker (gRPC) {hop['worker_draft_ms_per_step']} ms/step "
              f"(RPC {hop['worker_rpc_ms_per_call']} ms/call, outside RPC "
              f"{hop['worker_outside_rpc_ms_per_step']} ms/step); in-process "
              f"{hop['inprocess_draft_ms_per_step']} ms/step; hop "
              f"{hop['grpc_hop_ms_per_step']} ms/step (x{hop['worker_over_inprocess']})",
              "== aggregate through the service =="]
    for r in report.get("concurrency_sweep", []):
        lines.append(f"{r['placement']:<9} c={r['concurrency']}: {r['tokens_per_s']} tok/s "
                     f"(x{r['speedup_over_c1']} of c=1), batch mean "
                     f"{r['engine']['batch_size_mean']} max {r['engine']['batch_size_max']}, "
                     f"{r['engine'].get('bytes_per_step')} bytes/step")
    return "\n".join(lines)
