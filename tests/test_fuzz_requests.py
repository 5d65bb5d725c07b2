"""Fuzzing the public request path without Ray: any GenerateRequest, and any raw bytes as a
body, is either accepted (valid token ids and sampling parameters) or refused with a
ValueError / RequestError (a status with a message); nothing else may escape, since that would
be INTERNAL or a wedged replica. CI runs 1000 cases; `-m slow` runs 20000."""

from __future__ import annotations

import asyncio

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("ray")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eagle2.config import SamplingParams  # noqa: E402
from services.protos import _lenient, eagle2_pb2  # noqa: E402

CONFIG = {"max_context": 256, "max_tokens_limit": 128, "default_max_tokens": 16,
          "max_prompt_bytes": 4096, "max_chat_messages": 8, "max_stop_sequences": 4,
          "max_stop_bytes": 16}
INT32 = st.integers(-(2**31), 2**31 - 1)


@pytest.fixture(scope="module")
def router():
    from services.router import Router

    return Router.func_or_class(CONFIG, engine=None)


def requests():
    text = st.text(max_size=300)
    chat = st.lists(st.builds(eagle2_pb2.ChatMessage,
                              role=st.sampled_from(["user", "system", "assistant", "", "tool",
                                                    "\x00", "USER"]), content=text),
                    max_size=10)
    token_ids = st.lists(st.one_of(st.integers(0, 49151), INT32), max_size=300)
    optional = lambda s: st.one_of(st.none(), s)  # noqa: E731
    return st.builds(
        _request, st.sampled_from(["text", "chat", "token_ids", None]), text, chat, token_ids,
        raw=st.booleans(), max_tokens=optional(INT32),
        temperature=optional(st.floats(width=32)), top_p=optional(st.floats(width=32)),
        top_k=optional(INT32), seed=optional(st.integers(-(2**63), 2**63 - 1)),
        stop=st.lists(st.text(max_size=20), max_size=6),
        mode=st.sampled_from(["", "eagle2", "static", "chain", "vanilla", "beam", "\u00e9"]),
        request_id=st.text(max_size=80))


def _request(kind, text, chat, token_ids, **fields):
    fields = {k: v for k, v in fields.items() if v is not None}
    req = eagle2_pb2.GenerateRequest(**fields)
    if kind == "text":
        req.text = text
    elif kind == "chat":
        req.chat.messages.extend(chat)
    elif kind == "token_ids":
        req.token_ids.ids.extend(token_ids)
    return req


def check_one(router, req) -> None:
    from services.router import RequestError

    try:
        router._check_call(req, None)
        ids, params, _ = asyncio.run(router._prepare(req))
    except (ValueError, RequestError):
        return
    assert all(0 <= t < router.model_config.vocab_size for t in ids)
    assert len(ids) < CONFIG["max_context"]
    params.pop("eos_ids")
    SamplingParams(**{**params, "stop": tuple(params["stop"])})  # what the engine builds


def run_fuzz(router, max_examples: int) -> None:
    parse = _lenient(eagle2_pb2.GenerateRequest)
    body = st.one_of(requests(), st.binary(max_size=400).map(parse),
                     requests().map(lambda r: parse(r.SerializeToString()[:-1])))

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body)
    def prop(req):
        check_one(router, req)

    prop()


def test_fuzz_requests_and_raw_bodies(router):
    run_fuzz(router, 1000)


@pytest.mark.slow
def test_fuzz_requests_and_raw_bodies_long(router):
    run_fuzz(router, 20000)
