"""`eagle2 soak --minutes N`: a bounded mixed load against the service, with a verdict.

Starts a local service (or uses --address), then for N minutes runs --concurrency client
loops, each picking at random: a greedy stream checked against that prompt's first answer
(greedy output must never change), a sampled request, a request cancelled after its first
token, or an invalid one. Prints one JSON summary (requests by status, latency percentiles,
mismatches) and exits non-zero when any request ended INTERNAL/UNKNOWN, a greedy output
changed, or health was not SERVING at the end.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter

PROMPTS = ["Write a haiku about the sea.", "Name three fruits.", "What is 7 times 8?",
           "Say hello in French.", "Describe a cat in one sentence.", "What is Python?"]


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, required=True, help="how long to run (bounded)")
    p.add_argument("--address", default=None,
                   help="a running service (default: start one locally on --port)")
    p.add_argument("--port", type=int, default=19030)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)


class Soak:
    def __init__(self, client, max_tokens: int, seed: int):
        self.client, self.max_tokens = client, max_tokens
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()
        self.latencies: list[float] = []
        self.reference: dict[str, list[int]] = {}
        self.mismatches: list[str] = []

    def one(self) -> None:
        import grpc

        with self.lock:
            kind = self.rng.choice(["greedy", "greedy", "sampled", "cancel", "invalid"])
            prompt = self.rng.choice(PROMPTS)
            seed = self.rng.getrandbits(63)
        t0 = time.perf_counter()
        try:
            if kind == "invalid":
                self.client.generate(prompt, max_tokens=0)
            elif kind == "cancel":
                stream = self.client.stream(prompt, max_tokens=self.max_tokens)
                next(stream)
                stream.cancel()
            elif kind == "sampled":
                self.client.generate(prompt, max_tokens=self.max_tokens, temperature=0.8,
                                     top_p=0.95, seed=seed)
            else:
                ids = [t for m in self.client.stream(prompt, max_tokens=self.max_tokens)
                       for t in m.token_ids]
                with self.lock:
                    if self.reference.setdefault(prompt, ids) != ids:
                        self.mismatches.append(prompt)
            status = "CANCELLED" if kind == "cancel" else "OK"
        except grpc.RpcError as e:
            status = e.code().name
        with self.lock:
            self.statuses[f"{kind}:{status}"] += 1
            if kind in ("greedy", "sampled"):
                self.latencies.append(time.perf_counter() - t0)

    def run(self, seconds: float, concurrency: int) -> None:
        deadline = time.monotonic() + seconds

        def loop():
            while time.monotonic() < deadline:
                self.one()

        threads = [threading.Thread(target=loop) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def summary(self, healthy: bool) -> dict:
        lat = sorted(self.latencies)
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else (
            lambda q: None)
        bad = {k: v for k, v in self.statuses.items()
               if k.endswith((":INTERNAL", ":UNKNOWN")) or
               (k.startswith("invalid:") and k != "invalid:INVALID_ARGUMENT")}
        return {"requests": sum(self.statuses.values()), "by_kind_status": dict(self.statuses),
                "latency_s": {"p50": pct(0.5), "p95": pct(0.95), "max": lat[-1] if lat else None},
                "greedy_mismatches": self.mismatches, "unexpected": bad, "healthy_at_end": healthy,
                "ok": not bad and not self.mismatches and healthy}


def run(args) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.client import Eagle2Client

    if not args.minutes > 0:
        raise ValueError("--minutes must be > 0")
    address, started = args.address, False
    if address is None:
        from services.cli_serve import start

        start({"grpc_port": args.port, "max_queued_requests": 64}, http_port=18030)
        address, started = f"localhost:{args.port}", True
    try:
        with Eagle2Client(address, api_key=args.api_key, timeout_s=300) as client:
            soak = Soak(client, args.max_tokens, args.seed)
            soak.run(args.minutes * 60, args.concurrency)
            stub = health_pb2_grpc.HealthStub(client.channel)
            status = stub.Check(health_pb2.HealthCheckRequest(), metadata=client.metadata,
                                timeout=30).status
            out = soak.summary(status == health_pb2.HealthCheckResponse.SERVING)
    finally:
        if started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    print(json.dumps(out, indent=1))
    if not out["ok"]:
        print("eagle2 soak: FAILED", file=sys.stderr)
    return 0 if out["ok"] else 1
