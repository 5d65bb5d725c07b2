"""Faults with real processes: kill -9 the draft worker mid-stream, kill -9 a tensor-parallel
rank. Every accepted greedy request either ends with exactly the target's plain greedy output
or with UNAVAILABLE and a message (never a truncated OK stream); the service recovers on its
own and the recovery times are printed (run with -s to see them). The same deployment checks
the metrics export and API-key authentication. The target runs on a rank actor
(target_placement "ranks"; tp_size 1 would otherwise hold it in the engine replica), so
that there is a rank to kill."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from conftest import kill_mid_stream

from eagle2.config import SamplingParams

pytest.importorskip("ray")

PORT = 19010
METRICS_PORT = 19091
# A fixed tree: every step calls the draft worker. With the auto budget a slow or busy machine
# may find that drafts do not pay and verify lookup chains alone for whole streams (an AVX2-only
# EPYC called the head on 2% of the steps at 1 stream), and then a killed worker goes unnoticed
# until the streams have ended.
CONFIG = {"max_batch_size": 4, "max_context": 512, "max_tokens_limit": 256,
          "default_max_tokens": 24, "grpc_port": PORT, "max_queued_requests": 16,
          "target_placement": "ranks",
          "tree": {"budget": "fixed", "total_tokens": 8, "depth": 3, "top_k": 4}}
PROMPTS = ["Write a long story about a dragon.", "Explain in detail how a computer works.",
           "Describe the history of Rome.", "List twenty animals and describe each one."]
MAX_TOKENS = 128  # long enough that every stream is still running when the worker dies


API_KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    import ray

    from services.cli_serve import start

    keys = tmp_path_factory.mktemp("auth") / "api_keys"
    keys.write_text(f"# one key per line\n{API_KEY}\n")
    handle = start({**CONFIG, "api_keys_file": str(keys)}, http_port=18010,
                   metrics_port=METRICS_PORT)
    yield handle
    ray.shutdown()  # Serve goes with the cluster (its graceful stop, ~7 s: test_serve_shutdown)


@pytest.fixture(scope="module")
def client(service):
    from services.client import Eagle2Client

    with Eagle2Client(f"localhost:{PORT}", timeout_s=300, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def plain():
    from eagle2.api import Eagle2

    model = Eagle2.load(max_batch=4, max_context=512, device="cpu",  # the service's dtype: auto
                        threads=None)
    outs = model.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), mode="vanilla")
    return {p: r.token_ids for p, r in zip(PROMPTS, outs, strict=True)}


def health(client):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(client.channel)
    return stub.Check(health_pb2.HealthCheckRequest(), metadata=client.metadata).status


def test_kill_draft_worker_mid_stream_keeps_every_greedy_output(client, service, plain):
    from grpc_health.v1 import health_pb2

    from services.draft_client import RemoteDrafter

    stats = service.engine_stats.remote().result()
    pid = RemoteDrafter(stats["draft_address"], timeout_s=10).health().pid
    results: dict[str, list[int]] = {}
    started = threading.Barrier(len(PROMPTS) + 1)

    def worker(prompt):
        ids, first = [], True
        for msg in client.stream(prompt, max_tokens=MAX_TOKENS):
            ids.extend(msg.token_ids)
            if first:
                first = False
                started.wait()
        results[prompt] = ids

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join()
    assert results == plain  # lossless through the fault: plain decoding took over
    assert service.engine_stats.remote().result()["draft_fallback_sequences"] >= 1
    assert health(client) == health_pb2.HealthCheckResponse.SERVING

    deadline = killed + 180
    while time.monotonic() < deadline:
        stats = service.engine_stats.remote().result()
        if stats["draft_reconnects"] >= 1:
            break
        time.sleep(0.5)
    recovery = time.monotonic() - killed
    assert stats["draft_fallbacks"] == 1 and stats["draft_reconnects"] == 1, stats
    print(f"\ndraft worker kill -9 -> speculation back: {recovery:.1f} s "
          f"(engine: lost -> reconnected {stats['draft_last_recovery_s']:.1f} s)")
    calls = stats["draft_rpc_calls"]
    out = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS)
    assert list(out.token_ids) == plain[PROMPTS[0]]
    assert service.engine_stats.remote().result()["draft_rpc_calls"] > calls  # resumed
    assert RemoteDrafter(stats["draft_address"], timeout_s=10).health().pid != pid


def test_kill_tp_rank_mid_stream_gives_unavailable_then_recovers(client, service, plain):
    info = client.model_info()
    assert info.target_placement == "ranks" and info.device == "cpu" and info.attention  # rank 0's
    pid = service.rank_pids.remote().result()[0]
    err, killed = kill_mid_stream(client, pid, PROMPTS[1])
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    details = err.details()
    assert "retry" in details and "pid" not in details and "127.0.0.1" not in details
    from grpc_health.v1 import health_pb2

    assert health(client) == health_pb2.HealthCheckResponse.NOT_SERVING  # rebuilding (~7 s)
    while True:  # clients retry UNAVAILABLE
        try:
            stream = client.stream(PROMPTS[1], max_tokens=MAX_TOKENS)
            ids = list(next(stream).token_ids)
            recovery = time.monotonic() - killed  # to the first token of a new request
            ids += [t for msg in stream for t in msg.token_ids]
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed < 240
            time.sleep(1)
    assert ids == plain[PROMPTS[1]]
    stats = service.engine_stats.remote().result()
    assert stats["rank_restarts"] == 1
    assert service.rank_pids.remote().result()[0] != pid
    print(f"\nTP rank kill -9 -> first token of a new request: {recovery:.1f} s "
          f"(rank rebuild {stats['last_rank_recovery_s']:.1f} s)")


def test_a_rank_killed_while_idle_is_rebuilt_before_the_next_request(client, service, plain):
    """kill -9 of a rank while no request runs: Serve's periodic health check finds it
    (`TargetEngine.check_health`, every 10 s; called here at once, as Serve calls it) and the
    step loop rebuilds the ranks, so the next request is served at once instead of failing
    with UNAVAILABLE."""
    import os
    import signal

    from ray import serve

    engine = serve.get_deployment_handle("TargetEngine", app_name=CONFIG.get("app_name",
                                                                              "eagle2"))
    restarts = service.engine_stats.remote().result()["rank_restarts"]
    pid = service.rank_pids.remote().result()[0]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(0.5)  # the connection's end reaches the engine
    engine.check_health.remote().result()
    while service.engine_stats.remote().result()["rank_restarts"] == restarts:
        assert time.monotonic() - killed < 90, "the idle engine never noticed the dead rank"
        time.sleep(0.5)
    rebuilt = time.monotonic() - killed
    ids = [t for msg in client.stream(PROMPTS[2], max_tokens=MAX_TOKENS) for t in msg.token_ids]
    assert ids == plain[PROMPTS[2]]  # no UNAVAILABLE: the first try is served
    assert pid not in service.rank_pids.remote().result()
    print(f"\nTP rank kill -9 while idle -> ranks rebuilt {rebuilt:.1f} s later, no "
          "request failed")


def test_a_rank_task_that_raises_gives_unavailable_at_once_then_recovers(client, service,
                                                                        plain):
    """A rank's task raises mid-stream (out of memory, injected: `TPRank.inject_fault`): the
    stream ends at once with UNAVAILABLE, as for a dead rank (before: INTERNAL, and the rank
    group kept), the ranks are rebuilt, and a retried request gets the plain greedy output."""
    from ray import serve

    engine = serve.get_deployment_handle("TargetEngine", app_name=CONFIG.get("app_name",
                                                                              "eagle2"))
    restarts = service.engine_stats.remote().result()["rank_restarts"]
    pids = service.rank_pids.remote().result()
    stream = client.stream(PROMPTS[3], max_tokens=MAX_TOKENS, mode="vanilla")
    assert next(stream).token_ids
    engine.inject_rank_fault.remote(0, 2).result()
    failed = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert time.monotonic() - failed < 60
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.value.details()
    while True:  # clients retry UNAVAILABLE
        try:
            ids = [t for msg in client.stream(PROMPTS[3], max_tokens=MAX_TOKENS)
                   for t in msg.token_ids]
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - failed < 240
            time.sleep(1)
    assert ids == plain[PROMPTS[3]]
    assert service.engine_stats.remote().result()["rank_restarts"] == restarts + 1
    assert service.rank_pids.remote().result() != pids
    print(f"\nTP rank task raised -> a new request served: {time.monotonic() - failed:.1f} s")


def scrape() -> dict[str, float]:
    """Ray's Prometheus endpoint: {'name{labels}': value} of the eagle2 series."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("ray_eagle2_"):
            key, value = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def total(series: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in series.items()
               if k.split("{")[0] == name and all(w in k for w in want))


def test_metrics_are_exported_on_rays_prometheus_endpoint(client):
    with pytest.raises(grpc.RpcError):
        client.generate("Hi", max_tokens=0)
    client.generate(PROMPTS[2], max_tokens=16)
    wanted = [  # after the fault tests above: their fallback and rank restart are counted
        ("ray_eagle2_requests_total", {"status": "OK"}),
        ("ray_eagle2_requests_total", {"status": "INVALID_ARGUMENT"}),
        ("ray_eagle2_requests_total", {"status": "UNAVAILABLE"}),
        ("ray_eagle2_time_to_first_token_seconds_count", {}),
        ("ray_eagle2_inter_token_latency_seconds_count", {}),
        ("ray_eagle2_generation_tokens_total", {}),
        ("ray_eagle2_spec_decode_acceptance_length_count", {}),
        ("ray_eagle2_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}),
        ("ray_eagle2_draft_worker_fallbacks_total", {}),
        ("ray_eagle2_draft_worker_reconnects_total", {}),
        ("ray_eagle2_tp_rank_restarts_total", {}),
    ]
    deadline = time.monotonic() + 90  # Ray exports every few seconds
    while True:
        series = scrape()
        missing = [(n, labels) for n, labels in wanted if total(series, n, **labels) <= 0]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, (missing, sorted(series)[:40])
    assert "ray_eagle2_num_requests_running" in {k.split("{")[0] for k in series}


@pytest.mark.parametrize("key, code", [
    (None, grpc.StatusCode.UNAUTHENTICATED),
    ("wrong-key", grpc.StatusCode.PERMISSION_DENIED),
])
def test_api_keys_are_required(client, key, code):
    from grpc_health.v1 import health_pb2

    from services.client import Eagle2Client

    with Eagle2Client(f"localhost:{PORT}", timeout_s=60, api_key=key) as c:
        for call in (lambda: c.generate("Hi", max_tokens=2),
                     lambda: list(c.stream("Hi", max_tokens=2)), c.model_info):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == code
            assert API_KEY not in err.value.details()
        assert health(c) == health_pb2.HealthCheckResponse.SERVING  # probes need no key
    assert client.generate("Hi", max_tokens=2).token_ids
