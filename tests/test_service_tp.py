"""The service at tp_size 2 on CPUs, as deployed by default: rank 0 of the target in the engine
replica, rank 1 on an actor (target_placement "auto" = "engine"; docs/tensor-parallel.md
"Rank 0 in the engine"). A tiny random Llama (2 KV heads: the embedded SmolLM2's 3 do not
split in two) served with plain decoding, no draft worker. Through gRPC: greedy streams equal
in-process plain decoding of the unsharded target, seeded sampling equals in-process seeded
sampling, and kill -9 of rank 1 mid-stream ends the stream UNAVAILABLE, after which the ranks
are rebuilt inside the same engine replica (its process group joined anew) and a retried
request gets the same tokens as before."""

from __future__ import annotations

import time

import grpc
import psutil
import pytest
from conftest import kill_mid_stream, random_prompts, run, save_tiny_target, tiny_target

from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Engine
from eagle2.runner import LocalRunner

pytest.importorskip("ray")

PORT = 19310
VOCAB, MAX_TOKENS = 256, 48


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, seed=1)


@pytest.fixture(scope="module")
def service(target, tmp_path_factory):
    import ray

    from services.cli_serve import start

    path = save_tiny_target(target, tmp_path_factory.mktemp("tiny-llama"))
    handle = start({"target": path, "tp_size": 2, "cpus_per_rank": 1, "dtype": "float32",
                    "max_batch_size": 4, "max_context": 512, "max_tokens_limit": 256,
                    "grpc_port": PORT, "tree": {"mode": "vanilla"}}, http_port=18310)
    yield handle
    ray.shutdown()


@pytest.fixture(scope="module")
def client(service):
    from services.client import Eagle2Client

    with Eagle2Client(f"localhost:{PORT}", timeout_s=300) as c:
        yield c


def in_process(target, prompts, params, seeds=None) -> list[list[int]]:
    runner = LocalRunner(target, len(prompts), 512 + Engine.tree_margin)
    engine = Engine(runner, None, max_batch=len(prompts), max_context=512)
    return run(engine, prompts, params, TreeConfig("vanilla"), seeds)


def tokens(client, prompt, **kw) -> list[int]:
    return [t for msg in client.stream(prompt, **kw) for t in msg.token_ids]


def test_tp2_greedy_and_seeded_sampling_equal_in_process(client, service, target):
    info = client.model_info()
    assert info.tp_size == 2 and info.target_placement == "engine"
    (pid,) = service.rank_pids.remote().result()  # rank 1; rank 0 is the engine
    # Ray's workers at niceness 0, not Ray's 15 (services/cli_serve.py RAY_ENV)
    assert psutil.Process(pid).nice() == 0
    prompts = random_prompts(3, VOCAB, seed=3)
    greedy = in_process(target, prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [tokens(client, p, max_tokens=MAX_TOKENS, mode="vanilla") for p in prompts] == greedy
    sampled = in_process(target, prompts, SamplingParams(temperature=0.8, top_p=0.9,
                                                         max_tokens=16, ignore_eos=True),
                         seeds=[5, 6, 7])
    assert [tokens(client, p, max_tokens=16, temperature=0.8, top_p=0.9, seed=s,
                   mode="vanilla") for p, s in zip(prompts, (5, 6, 7), strict=True)] == sampled


def test_tp2_rank_1_killed_mid_stream_gives_unavailable_then_the_same_tokens(client, service,
                                                                           target):
    prompt = random_prompts(1, VOCAB, seed=4)[0]
    expected = in_process(target, [prompt], SamplingParams(max_tokens=200, ignore_eos=True))[0]
    restarts = service.engine_stats.remote().result()["rank_restarts"]
    pid = service.rank_pids.remote().result()[0]
    err, killed = kill_mid_stream(client, pid, prompt)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details()
    while True:  # clients retry UNAVAILABLE
        try:
            ids = tokens(client, prompt, max_tokens=200, mode="vanilla")
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed < 240
            time.sleep(1)
    recovery = time.monotonic() - killed
    assert ids == expected
    stats = service.engine_stats.remote().result()
    assert stats["rank_restarts"] == restarts + 1
    assert pid not in service.rank_pids.remote().result()
    print(f"\ntp 2 rank 1 kill -9 -> a retried request served: {recovery:.1f} s "
          f"(rank rebuild {stats['last_rank_recovery_s']:.1f} s)")
