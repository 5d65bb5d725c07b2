"""The service's time per output token (tp 2, or --tp 1) against the same target in process.

A tiny random Llama (2 layers, hidden 64, vocabulary 256: a forward of ~1 ms, as short next
to the host's work as a GPU forward is) is saved to a temporary directory and served
(`services.cli_serve.start`, a fresh local Ray) with plain decoding (the vanilla tree) at
`tp_size` 2 (the engine replica drives two rank actors) or 1 (the target in the engine
replica), behind the service's default ingress (HAProxy; --no-ha-proxy: Serve's Python proxy).
At each concurrency C, C clients stream `GenerateStream` over gRPC (token-id
prompts, `max_tokens` new tokens each), several rounds; per request TPOT = (latency - time to
first token) / (tokens - 1). In this process the same prompts are decoded together at batch C
on `LocalRunner` through the engine, with the service's target cache (its default: paged
blocks; --inprocess-cache slotted for a slotted one) (time per decode step = the in-process
time per token), in turns with the service's rounds. Prints the medians and their difference
(the bounds asked: <= 2 ms at C = 1 and <= 6 ms at 8 for tp 1, <= 3 and <= 8 ms for tp 2), the
engine's time per step and each service process's CPU per output token, writes them with
--out (JSON), and checks that the service's tokens equal the in-process ones (exit 1
otherwise).

    .venv/bin/python benchmarks/tp_service_tpot.py --tp 1 --max-tokens 48 --rounds 3
    .venv/bin/python benchmarks/tp_service_tpot.py --tp 2 --max-tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
PORT, HTTP_PORT = 19210, 18210


def stream(client, prompt: list[int], max_tokens: int, out: dict) -> None:
    first, ids = None, []
    for msg in client.stream(prompt, max_tokens=max_tokens, mode="vanilla"):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        ids += list(msg.token_ids)
    end = time.perf_counter()
    out["ids"], out["tpot"] = ids, (end - first) / max(len(ids) - 1, 1)


def service_round(client, prompts, max_tokens: int) -> list[dict]:
    outs = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(client, p, max_tokens, o))
               for p, o in zip(prompts, outs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tp", type=int, default=2, help="tp_size (1: the target in the engine)")
    ap.add_argument("--target-placement", choices=["auto", "ranks", "engine"], default="auto",
                    help="the service's target_placement (auto: at tp 2 rank 0 in the engine "
                         "replica, rank 1 on an actor; ranks: every rank on an actor)")
    ap.add_argument("--inprocess-cache", choices=["service", "slotted"], default="service",
                    help="the in-process engine's target cache: the service's (its default: "
                         "1 GiB of paged blocks) or a slotted one (runs before this option)")
    ap.add_argument("--out", default=None, help="also write the figures here (JSON)")
    ap.add_argument("--ha-proxy", action=argparse.BooleanOptionalAction, default=None,
                    help="the service behind HAProxy or (--no-ha-proxy) Serve's Python proxy "
                         "(default: as eagle2 serve)")
    args = ap.parse_args()
    from conftest import random_prompts, save_tiny_target, tiny_target
    from tp_step_channel import decode

    from eagle2.engine import Engine
    from eagle2.runner import LocalRunner
    from services.bench_service import add_cpu, cpu_seconds, per_token, service_processes
    from services.cli_serve import shutdown, start, use_ha_proxy
    from services.client import Eagle2Client
    from services.config import ServiceConfig

    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}, cores: {os.cpu_count()}")
    target = tiny_target(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, seed=1)
    path = save_tiny_target(target, tempfile.mkdtemp())
    conf = {"target": path, "tp_size": args.tp, "cpus_per_rank": 1, "dtype": "float32",
            "max_batch_size": max(args.concurrency), "max_context": 256,
            "max_tokens_limit": 200, "default_max_tokens": 64, "grpc_port": PORT,
            "tree": {"mode": "vanilla"}, "target_placement": args.target_placement}
    ha_proxy = use_ha_proxy(args.ha_proxy)
    handle = start(conf, http_port=HTTP_PORT, address="local", ha_proxy=ha_proxy)
    ok = True
    report = {"command": " ".join(["benchmarks/tp_service_tpot.py", *sys.argv[1:]]),
              "tp_size": args.tp, "target_placement": args.target_placement,
              "max_tokens": args.max_tokens, "rounds": args.rounds,
              "ha_proxy": ha_proxy,
              "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
              "levels": []}
    try:
        served = ServiceConfig(**conf)
        cache = {} if args.inprocess_cache == "slotted" else {
            "kv_cache_memory": served.kv_cache_budget(),
            "block_size": served.block_size}  # the blocks every rank holds
        local = LocalRunner(target, max(args.concurrency), 256 + Engine.tree_margin, **cache)
        blocks = local.capacity["kv_blocks"]
        report["inprocess_cache"] = (f"paged: {blocks} blocks of {cache['block_size']}"
                                     if blocks else "slotted")
        with Eagle2Client(f"localhost:{PORT}", timeout_s=300) as client:
            service_round(client, random_prompts(1, 256, seed=99), 8)  # warm-up
            for c in args.concurrency:
                prompts = random_prompts(c, 256, seed=c)
                svc, ip, cpu, tokens_out = [], [], {}, 0
                procs = service_processes()
                before = handle.engine_stats.remote().result()
                for _ in range(args.rounds):
                    cpu0 = cpu_seconds(procs)
                    outs = service_round(client, prompts, args.max_tokens)
                    add_cpu(cpu, cpu0, cpu_seconds(procs))
                    tokens_out += sum(len(o["ids"]) for o in outs)
                    svc += [o["tpot"] for o in outs]
                    tokens, times, _ = decode(local, prompts, args.max_tokens)
                    ip += times
                    if [o["ids"] for o in outs] != tokens:
                        ok = False
                        print(f"MISMATCH at concurrency {c}")
                s, i = statistics.median(svc), statistics.median(ip)
                after = handle.engine_stats.remote().result()
                steps = after["steps"] - before["steps"]
                per = {k: (after[k] - before[k]) / steps * 1e3
                       for k in ("verify_s", "prefill_s", "other_s", "rank_wait_s",
                                 "rank_busy_s", "loop_host_s", "loop_dispatch_s",
                                 "loop_step_cpu_s", "loop_host_cpu_s")
                       if after.get(k) is not None}
                print(f"concurrency {c}: service TPOT median {s * 1e3:.2f} ms (mean "
                      f"{statistics.mean(svc) * 1e3:.2f}, {len(svc)} requests), in-process "
                      f"{i * 1e3:.2f} ms per token ({len(ip)} steps): overhead "
                      f"{(s - i) * 1e3:.2f} ms")
                print(f"  engine, ms per step over {steps} steps: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in per.items()))
                cpu_ms = per_token(cpu, tokens_out)
                print("  CPU ms per output token by process (client: the gRPC streams): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in cpu_ms.items()))
                report["levels"].append({
                    "concurrency": c, "service_tpot_ms_median": s * 1e3,
                    "service_tpot_ms_mean": statistics.mean(svc) * 1e3,
                    "inprocess_ms_per_token": i * 1e3, "overhead_ms": (s - i) * 1e3,
                    "requests": len(svc), "engine_ms_per_step": per,
                    "cpu_ms_per_token": cpu_ms})
        print("service tokens equal in-process plain decoding" if ok else "TOKENS DIFFER")
        print(f"load after: {os.getloadavg()}")
        report.update(tokens_equal=ok)
        report["machine"]["loadavg_end"] = os.getloadavg()
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            print(f"wrote {args.out}")
    finally:
        shutdown(handle, drain_s=2.0, serve_timeout_s=60.0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
