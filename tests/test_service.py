"""The service end to end: real Ray Serve, real gRPC, the embedded model (no mocks).

One app is deployed for the module (about a minute to start on 2 cores): router -> target
engine (holding the whole target: tp_size 1, target_placement "auto" = "engine") -> draft
worker (its own replica process, reached over gRPC).
"""

from __future__ import annotations

import os
import threading

import grpc
import pytest
from conftest import kill_mid_stream

from eagle2.config import SamplingParams

pytest.importorskip("ray")

PORT = 19000
CONFIG = {"max_batch_size": 8, "max_context": 512, "max_tokens_limit": 256,
          "default_max_tokens": 24, "grpc_port": PORT, "max_queued_requests": 8}
PROMPTS = ["Write a haiku about the sea.", "Name three fruits.", "What is 7 times 8?",
           "Say hello in French.", "Describe a cat in one sentence.", "What is Python?",
           "Give me a color.", "Count from one to five."]


@pytest.fixture(scope="module")
def service():
    import ray

    from services.cli_serve import start

    handle = start(CONFIG, http_port=18000)  # not 8000: a running `eagle2 serve` may hold it
    yield handle
    ray.shutdown()  # Serve goes with the cluster (its graceful stop, ~7 s: test_serve_shutdown)


@pytest.fixture(scope="module")
def client(service):
    from services.client import Eagle2Client

    with Eagle2Client(f"localhost:{PORT}") as c:
        yield c


@pytest.fixture(scope="module")
def local():
    from eagle2.api import Eagle2

    # the service's dtype (auto); the test process keeps its thread count
    return Eagle2.load(max_batch=1, max_context=512, device="cpu", threads=None)


def stream_ids(client, prompt, **kw) -> tuple[list[int], str, object]:
    ids, text, last = [], "", None
    for msg in client.stream(prompt, **kw):
        ids.extend(msg.token_ids)
        text += msg.text_delta
        last = msg
    return ids, text, last


def test_stream_equals_inprocess_and_plain_greedy(client, local):
    ids, text, last = stream_ids(client, PROMPTS[0], max_tokens=24)
    params = SamplingParams(max_tokens=24)
    spec = local.generate([PROMPTS[0]], params, mode="eagle2")[0]
    plain = local.generate([PROMPTS[0]], params, mode="vanilla")[0]
    assert ids == spec.token_ids == plain.token_ids
    assert text == spec.text
    assert last.usage.completion_tokens == len(ids)
    assert last.stats.num_steps >= 1 and last.stats.mode == "eagle2"
    unary = client.generate(PROMPTS[0], max_tokens=24)
    assert list(unary.token_ids) == ids and unary.text == text


def test_concurrent_streams_are_batched_and_each_equals_solo(client, local, service):
    service.engine_stats.remote().result()  # warm
    before = len(service.engine_stats.remote().result()["batch_sizes"])
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = stream_ids(client, PROMPTS[i], max_tokens=20)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    solo = local.generate(PROMPTS, SamplingParams(max_tokens=20), mode="vanilla")
    for i in range(8):
        assert results[i] == solo[i].token_ids, PROMPTS[i]
    sizes = service.engine_stats.remote().result()["batch_sizes"][before:]
    assert max(sizes) >= 4, sizes  # verified together, not one by one


def test_draft_worker_is_another_process_reached_over_grpc(client, service):
    from services.draft_client import RemoteDrafter

    stats = service.engine_stats.remote().result()
    assert stats["draft"] == "worker" and stats["draft_address"].startswith("127.0.0.1:")
    worker = RemoteDrafter(stats["draft_address"])
    health = worker.health()
    assert health.status == "SERVING"
    assert health.pid not in (stats["pid"], os.getpid())
    # sampled: a greedy newcomer is drafted for only where recent trees' acceptance says its
    # drafts could pay (the budget's gates outlive idle periods for greedy traffic), which
    # depends on the tests before and the machine's load; a sampled newcomer always probes
    client.generate(PROMPTS[1], max_tokens=12, temperature=0.8, seed=5)
    after = worker.health()
    assert after.draft_requests > health.draft_requests  # the worker's own gRPC counter
    assert service.engine_stats.remote().result()["draft_rpc_calls"] > stats["draft_rpc_calls"]


def test_tp1_target_runs_in_the_engine_replica_without_rank_actors(client, service):
    import ray

    stats = service.engine_stats.remote().result()
    # engine_threads "auto" (the default): the count measured on this machine, following the
    # load (tests/test_service_units.py checks the choice)
    assert stats["target_placement"] == "engine"
    assert 1 <= stats["torch_threads"] <= (os.cpu_count() or 1)
    assert isinstance(stats["thread_switches"], list)
    assert client.model_info().target_placement == "engine"
    assert service.rank_pids.remote().result() == []
    assert stats["rank_bytes_out"] is None  # no call to a rank process, ever
    groups = ray.util.placement_group_table().values()  # a rank group would be one
    assert not [g for g in groups if g["state"] != "REMOVED"], list(groups)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "empty prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(mode="beam"), "mode"),
    (dict(prompt=[5] * 600), "context"),
])
def test_bad_requests_get_invalid_argument(client, kwargs, message):
    prompt = kwargs.pop("prompt", "Hello")
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_good_stream_unaffected_by_bad_requests(client, local):
    expected = local.generate([PROMPTS[2]], SamplingParams(max_tokens=24), mode="vanilla")[0]
    out = {}
    t = threading.Thread(target=lambda: out.update(ids=stream_ids(client, PROMPTS[2],
                                                                  max_tokens=24)[0]))
    t.start()
    for bad in ({"max_tokens": 0}, {"temperature": -2.0}, {"mode": "nope"}):
        with pytest.raises(grpc.RpcError):
            client.generate("Hi", **bad)
    t.join()
    assert out["ids"] == expected.token_ids


def test_model_info_and_health(client):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    info = client.model_info()
    assert info.tp_size == 1 and info.draft_placement == "worker"
    assert info.vocab_size == 49152 and info.max_context == 512
    # the target's kernels as the engine replica's runner reports them (CPU here: no graphs)
    assert info.device == "cpu" and info.dtype.startswith("torch.") and not info.cuda_graphs
    assert info.backend in ("cpu", "torch") and info.attention in (
        "sdpa", "flex", "exact", "native-exact")
    stub = health_pb2_grpc.HealthStub(client.channel)
    resp = stub.Check(health_pb2.HealthCheckRequest(), metadata=client.metadata)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_strings_and_seeded_sampling(client):
    a = client.generate(PROMPTS[7], max_tokens=40, temperature=0.8, seed=3)
    b = client.generate(PROMPTS[7], max_tokens=40, temperature=0.8, seed=3)
    assert list(a.token_ids) == list(b.token_ids)
    base = client.generate(PROMPTS[7], max_tokens=40)
    word = base.text.split()[2]
    cut = client.generate(PROMPTS[7], max_tokens=40, stop=[word])
    assert word not in cut.text and base.text.startswith(cut.text)


def test_cancelled_stream_frees_the_engine(client, service):
    import time

    stream = client.stream(PROMPTS[4], max_tokens=200, mode="vanilla")
    first = next(stream)
    assert first.token_ids
    stream.cancel()  # the client goes away
    deadline = time.time() + 60
    while time.time() < deadline and service.engine_stats.remote().result()["active"]:
        time.sleep(0.5)
    assert service.engine_stats.remote().result()["active"] == 0


def test_admission_queue_full_gives_resource_exhausted(client):
    codes: list = []

    def worker(i):
        try:
            client.generate(PROMPTS[i % 8], max_tokens=40, mode="vanilla")
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert codes.count(grpc.StatusCode.OK) >= 8
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


# ----- regressions: errors, isolation and abuse -------------------------------------------------
def test_stream_errors_reach_the_client_with_status_and_message(client):
    for kwargs, code, message in (
            (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (dict(mode="beam"), grpc.StatusCode.INVALID_ARGUMENT, "mode")):
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("Hello", **kwargs))
        assert err.value.code() == code and message in err.value.details()


def test_reused_request_id_cannot_touch_another_clients_request(client, local):
    expected = local.generate(PROMPTS[:2], SamplingParams(max_tokens=20), mode="vanilla")
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = stream_ids(client, PROMPTS[i], max_tokens=20, request_id="same")[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[0], results[1]] == [e.token_ids for e in expected]


def test_wrong_application_is_not_found():
    from services.client import Eagle2Client

    with Eagle2Client(f"localhost:{PORT}", application="other") as c:
        for call in (lambda: c.generate("Hi", max_tokens=2),
                     lambda: list(c.stream("Hi", max_tokens=2)), c.model_info):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_malformed_body_is_invalid_argument(client):
    for method in ("Generate", "GenerateStream"):
        kind = client.channel.unary_stream if method == "GenerateStream" else \
            client.channel.unary_unary
        call = kind(f"/eagle2.v1.Eagle2/{method}", request_serializer=lambda b: b,
                    response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            out = call(b"\xff\xff\xff\xff\x0f", metadata=client.metadata, timeout=30)
            list(out) if method == "GenerateStream" else out
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "malformed" in err.value.details()


def test_giant_prompts_are_rejected_before_tokenizing_without_stalling_streams(client, local):
    import time

    expected = local.generate([PROMPTS[3]], SamplingParams(max_tokens=24), mode="vanilla")[0]
    out = {}
    t = threading.Thread(target=lambda: out.update(ids=stream_ids(client, PROMPTS[3],
                                                                  max_tokens=24)[0]))
    t.start()
    giant = "word " * (1 << 20)  # 5 MB
    t0 = time.perf_counter()
    for _ in range(4):
        with pytest.raises(grpc.RpcError) as err:
            client.generate(giant)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bytes" in err.value.details()
    elapsed = time.perf_counter() - t0
    t.join()
    assert out["ids"] == expected.token_ids
    assert elapsed < 20, elapsed  # tokenizing 20 MB alone takes far longer on 2 cores


def test_chat_roles_are_checked(client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate([{"role": "wizard", "content": "Hi"}], max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in err.value.details()


def test_high_bits_of_the_seed_take_effect(client):
    a = client.generate(PROMPTS[5], max_tokens=24, temperature=1.0, seed=11)
    b = client.generate(PROMPTS[5], max_tokens=24, temperature=1.0, seed=11 + (1 << 40))
    assert list(a.token_ids) != list(b.token_ids)


def test_model_info_names_no_internal_address(client):
    assert ":" not in client.model_info().draft


# ----- OpenAI-compatible HTTP on Serve's HTTP proxy ----------------------------------------------
@pytest.fixture(scope="module")
def openai_client(service):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://127.0.0.1:18000/v1", api_key="none",
                         max_retries=0, timeout=120)


def post_json(path: str, body: dict) -> tuple[int, list[dict] | dict]:
    """A raw-JSON client (what the benchmark tools send): (status, the JSON answer, or the
    stream's events as a list)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:18000{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not body.get("stream"):
        return status, json.loads(text)
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.strip()]
    assert events[-1] == "[DONE]"
    return status, [json.loads(e) for e in events[:-1]]


def test_openai_chat_completions_equal_grpc(openai_client, client):
    messages = [{"role": "user", "content": PROMPTS[6]}]
    expected = client.generate(messages, max_tokens=20)
    out = openai_client.chat.completions.create(model="eagle2", messages=messages,
                                                max_tokens=20)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(expected.token_ids)
    chunks = list(openai_client.chat.completions.create(model="eagle2", messages=messages,
                                                        max_tokens=20, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_completions_models_and_errors(openai_client, client):
    import openai

    expected = client.generate(PROMPTS[2], max_tokens=12, raw=True)
    out = openai_client.completions.create(model="eagle2", prompt=PROMPTS[2], max_tokens=12)
    assert out.choices[0].text == expected.text
    streamed = openai_client.completions.create(model="eagle2", prompt=PROMPTS[2],
                                                max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert [m.id for m in openai_client.models.list()] == ["smollm2-135m-instruct"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai_client.chat.completions.create(model="eagle2", max_tokens=0,
                                              messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        openai_client.chat.completions.create(model="eagle2", max_tokens=4,
                                              messages=[{"role": "wizard", "content": "Hi"}])


def test_openai_content_parts_usage_chunk_and_both_base_urls(openai_client, client):
    """The SDK's typed content parts, stream_options.include_usage, and the same app under
    /eagle2/v1 (a multi-application path) as under /v1."""
    messages = [{"role": "user", "content": PROMPTS[6]}]
    expected = client.generate(messages, max_tokens=16)
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[6]}]}]
    chunks = list(openai_client.chat.completions.create(
        model="eagle2", messages=parts, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    status, out = post_json("/eagle2/v1/chat/completions",
                            {"model": "eagle2", "messages": messages, "max_tokens": 16})
    assert status == 200 and out["choices"][0]["message"]["content"] == expected.text


def test_openai_benchmark_payloads_and_ignore_eos(client):
    """vLLM's serving-benchmark payloads through a raw-JSON client; ignore_eos runs a request
    that stops early on its own to max_tokens (the first prompt that does: which ones end
    within 64 tokens depends on the CPU's bf16 kernels, e.g. "What is 7 times 8?" does with
    the FMA kernels, not with AMX)."""
    for prompt in PROMPTS:
        alone = client.generate(prompt, max_tokens=64)
        if alone.finish_reason == 1:  # FINISH_REASON_STOP
            break
    assert alone.finish_reason == 1 and len(alone.token_ids) < 64, "no prompt ends by itself"
    status, events = post_json("/v1/chat/completions", {
        "model": "eagle2", "messages": [{"role": "user", "content": [{"type": "text",
                                                                       "text": prompt}]}],
        "temperature": 0.0, "max_completion_tokens": 64, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True})
    assert status == 200 and events[-1]["usage"]["completion_tokens"] == 64
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text.startswith(alone.text)
    status, events = post_json("/v1/completions", {
        "model": "eagle2", "prompt": prompt, "temperature": 0.0, "repetition_penalty": 1.0,
        "max_tokens": 8, "logprobs": None, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": False})
    assert status == 200 and events[-1]["usage"]["completion_tokens"] <= 8


def test_logprobs_through_grpc_and_openai_equal_in_process_plain_decodings(openai_client,
                                                                           client, local):
    """Speculated through the service (gRPC, OpenAI chat and completions, streamed or not):
    each token's log-probability and the most likely tokens' are plain decoding's in
    process, position by position (fp32 on the wire)."""
    from eagle2.config import SamplingParams, TreeConfig

    messages = [{"role": "user", "content": PROMPTS[5]}]
    ids = local.encode(messages)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)
    plain = local.generate_ids([local.request(ids, params, TreeConfig("vanilla"))])[0]
    want = [(e.logprob, [i for i, _ in e.top]) for e in plain.logprobs]

    def close(entries) -> None:
        assert len(entries) == len(want)
        for (lp, top), (wlp, wtop) in zip(entries, want, strict=True):
            assert lp == pytest.approx(wlp, abs=1e-5) and top == wtop

    got = client.generate(messages, max_tokens=20, ignore_eos=True, logprobs=3,
                          mode="eagle2")
    assert list(got.token_ids) == plain.token_ids and got.stats.num_steps < 20
    assert [e.token_id for e in got.logprobs] == plain.token_ids
    close([(e.logprob, [t.token_id for t in e.top]) for e in got.logprobs])
    streamed = [e for m in client.stream(messages, max_tokens=20, ignore_eos=True,
                                         logprobs=3) for e in m.logprobs]
    assert [e.token_id for e in streamed] == plain.token_ids
    assert client.generate(messages, max_tokens=4).logprobs == []  # not asked: none

    tok = local.tokenizer
    out = openai_client.chat.completions.create(model="eagle2", messages=messages,
                                                max_tokens=20, logprobs=True, top_logprobs=3,
                                                extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in plain.token_ids]
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    top_tokens = [[t.token for t in c.top_logprobs] for c in content]
    assert top_tokens == [[tok.decode([i]) for i in w] for _, w in want]
    close([(c.logprob, w) for c, (_, w) in zip(content, want, strict=True)])
    chunks = openai_client.chat.completions.create(
        model="eagle2", messages=messages, max_tokens=20, logprobs=True, stream=True,
        extra_body={"ignore_eos": True})
    lps = [c.logprob for ch in chunks for c in ch.choices[0].logprobs.content]
    assert lps == pytest.approx([w for w, _ in want], abs=1e-5)

    raw = client.generate(PROMPTS[2], max_tokens=8, ignore_eos=True, raw=True, logprobs=2)
    status, body = post_json("/v1/completions", {"model": "eagle2", "prompt": PROMPTS[2],
                                                 "max_tokens": 8, "ignore_eos": True,
                                                 "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and lp["token_logprobs"] == pytest.approx(
        [e.logprob for e in raw.logprobs], abs=1e-6)
    assert lp["tokens"] == [tok.decode([e.token_id]) for e in raw.logprobs]  # specials too
    assert lp["text_offset"][0] == 0 and all(len(d) == 2 for d in lp["top_logprobs"])
    status, body = post_json("/v1/completions", {"model": "eagle2", "prompt": "Hi",
                                                 "max_tokens": 2, "logprobs": 21})
    assert status == 400 and "logprobs must be an integer in [0, 20]" in \
        body["error"]["message"]


def test_openai_fields_it_does_not_implement_get_400_naming_them(openai_client):
    import openai

    hi = [{"role": "user", "content": "Hi"}]
    for kwargs, name in (({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be"),
                         ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                          "tools")):
        with pytest.raises(openai.BadRequestError, match=name):
            openai_client.chat.completions.create(model="eagle2", messages=hi, max_tokens=4,
                                                  **kwargs)
    image = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        openai_client.chat.completions.create(model="eagle2", messages=image, max_tokens=4)


@pytest.mark.slow  # 20 s of load; `eagle2 soak` is the long form
def test_short_soak_is_clean(client):
    from services.soak import Soak

    soak = Soak(client, max_tokens=12, seed=1)
    soak.run(seconds=20, concurrency=3)
    out = soak.summary(healthy=True)
    assert out["ok"], out
    assert out["requests"] >= 6


# ----- last: they replace the engine replica -----------------------------------------------------
def served_after_retries(client, prompt: str, since: float) -> tuple[list[int], int]:
    """Retry a 24-token stream while it is refused UNAVAILABLE (what clients do), each second,
    for at most 240 s after `since`: -> (its tokens, the refusals before)."""
    import time

    refused = 0
    while True:
        try:
            return stream_ids(client, prompt, max_tokens=24)[0], refused
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            refused += 1
            assert time.monotonic() - since < 240
            time.sleep(1)


def test_a_lost_gpu_context_gives_unavailable_and_serve_replaces_the_replica(client, service,
                                                                            local):
    """A step fails as on a GPU whose CUDA context is lost (an illegal memory access:
    `torch.AcceleratorError`, injected): the stream ends UNAVAILABLE, the replica refuses new
    requests with UNAVAILABLE instead of running them on the dead device (INTERNAL each,
    before, and the replica kept, its health check passing), its health check fails, and
    Serve's new replica serves the same output."""
    import time

    from ray import serve

    engine = serve.get_deployment_handle("TargetEngine", app_name=CONFIG.get("app_name",
                                                                              "eagle2"))
    expected = local.generate([PROMPTS[1]], SamplingParams(max_tokens=24), mode="vanilla")[0]
    pid = service.engine_stats.remote().result()["pid"]
    stream = client.stream(PROMPTS[4], max_tokens=200, mode="vanilla")
    assert next(stream).token_ids
    engine.inject_device_fault.remote(1).result()
    failed = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "GPU failed" in err.value.details()
    ids, refused = served_after_retries(client, PROMPTS[1], failed)
    print(f"\nGPU lost -> a new request served: {time.monotonic() - failed:.1f} s "
          f"({refused} refused meanwhile)")
    assert refused > 0 and ids == expected.token_ids
    assert service.engine_stats.remote().result()["pid"] != pid


def test_kill_engine_holding_the_target_gives_unavailable_then_recovers(client, service, local):
    """At tp_size 1 the target dies with the engine replica: its streams end UNAVAILABLE at
    once, and Serve's new replica serves the same output."""
    import time

    expected = local.generate([PROMPTS[0]], SamplingParams(max_tokens=24), mode="vanilla")[0]
    pid = service.engine_stats.remote().result()["pid"]
    err, killed = kill_mid_stream(client, pid, PROMPTS[4])
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details()
    ids = served_after_retries(client, PROMPTS[0], killed)[0]
    print(f"\nengine replica kill -9 -> a new request served: {time.monotonic() - killed:.1f} s")
    assert ids == expected.token_ids
    assert service.engine_stats.remote().result()["pid"] != pid
