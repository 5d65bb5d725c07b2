"""The service behind Serve's HAProxy ingress (`eagle2 serve --ha-proxy`): the router replica
serves HTTP and gRPC itself and HAProxy forwards each connection to it (docs/processes.md,
"CPU beside the engine"). Runs where the haproxy binary is installed."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from eagle2.config import SamplingParams

pytest.importorskip("ray")

PORT, HTTP_PORT = 19400, 18400
CONFIG = {"max_batch_size": 4, "max_context": 512, "max_tokens_limit": 64,
          "default_max_tokens": 16, "grpc_port": PORT, "max_queued_requests": 8}
PROMPT = "Name three fruits."


def test_ha_proxy_without_the_binary_says_what_is_missing(monkeypatch):
    from services import cli_serve

    monkeypatch.setattr(cli_serve.shutil, "which", lambda name: None)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with pytest.raises(RuntimeError, match="haproxy binary"):
        cli_serve.start(CONFIG, ha_proxy=True)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in cli_serve.serve_env()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="no haproxy binary here")
def test_haproxy_ingress_streams_grpc_and_openai_equal_to_plain_decoding(monkeypatch):
    """gRPC (unary and streamed) and the OpenAI endpoint's SSE stream, through HAProxy: the
    tokens of in-process plain greedy decoding."""
    import psutil
    import ray

    from eagle2.api import Eagle2
    from services.cli_serve import start
    from services.client import Eagle2Client

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # restored after: start sets it
    local = Eagle2.load(max_batch=1, max_context=512, device="cpu", threads=None)
    plain = local.generate([PROMPT], SamplingParams(max_tokens=16), mode="vanilla")[0]
    start(CONFIG, http_port=HTTP_PORT, address="local", ha_proxy=True)
    try:
        assert any(p.info["name"] == "haproxy" for p in psutil.process_iter(["name"]))
        with Eagle2Client(f"localhost:{PORT}") as client:
            unary = client.generate(PROMPT, max_tokens=16)
            assert list(unary.token_ids) == plain.token_ids and unary.text == plain.text
            streamed = [i for msg in client.stream(PROMPT, max_tokens=16)
                        for i in msg.token_ids]
            assert streamed == plain.token_ids
        body = json.dumps({"model": "eagle2", "max_tokens": 16, "stream": True,
                           "messages": [{"role": "user", "content": PROMPT}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/v1/chat/completions",
                                     data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                      if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"])
        assert text == plain.text
    finally:
        ray.shutdown()
