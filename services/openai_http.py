"""OpenAI-compatible HTTP on Ray Serve's HTTP proxy: the router's `__call__`.

    GET  /v1/models
    POST /v1/chat/completions   (messages; stream: SSE chunks, then `data: [DONE]`)
    POST /v1/completions        (prompt, raw text: no chat template)

at `http://HOST:8000/v1` when one application is served (`eagle2 serve` and the shipped
Serve configs mount it at "/"), and under the application's name (`http://HOST:8000/eagle2/v1`)
as well. Fields the server does not implement are refused by name (400), never ignored
(`check_fields`). A JSON body becomes the same `GenerateRequest` the gRPC API takes, so
validation, limits, API keys (`Authorization: Bearer`) and errors are shared; gRPC statuses map
to the HTTP codes the OpenAI clients expect.
"""

from __future__ import annotations

import json
import time
import uuid

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from eagle2.config import MAX_LOGPROBS
from services.protos import eagle2_pb2

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INTERNAL: 500,
}
FINISH = {eagle2_pb2.FINISH_REASON_STOP: "stop", eagle2_pb2.FINISH_REASON_LENGTH: "length"}


class HttpCall:
    """The little of a gRPC context the router reads: credentials and no application."""

    def __init__(self, request: Request):
        self.headers = request.headers

    def invocation_metadata(self) -> list[tuple[str, str]]:
        auth = self.headers.get("authorization")
        return [] if auth is None else [("authorization", auth)]

    def application(self) -> None:
        return None


def error_response(code: grpc.StatusCode, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code.name.lower(),
                                   "code": code.name}},
                        status_code=HTTP_STATUS.get(code, 500))


# Fields the server implements, per endpoint (OpenAI's names; top_k, ignore_eos and
# return_token_ids are the common extensions of vLLM and SGLang, mode this server's
# speculation mode). return_token_ids: each choice (each streamed chunk's) also carries the
# generated token ids as "token_ids", as vLLM's. logprobs (chat: a boolean and top_logprobs;
# completions: the number of most likely tokens): the target's own log-probabilities, exact
# under speculation (`logprobs_asked`, `LogprobsFormat`).
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stream", "stream_options", "n", "user", "mode", "ignore_eos",
                 "return_token_ids", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
# Fields accepted only at the value that changes nothing (what a client sends by default);
# any other value is refused by name rather than ignored.
NO_OP_VALUES: dict[str, tuple] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "response_format": ({"type": "text"},),
    "echo": (False,), "best_of": (1,), "store": (False,), "service_tier": ("auto", "default"),
    "parallel_tool_calls": (), "function_call": ("none",), "suffix": (), "metadata": ({},),
}


def check_fields(body: dict, chat: bool) -> None:
    """ValueError naming the first field this server does not implement (never ignored)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name not in NO_OP_VALUES:
            raise ValueError(f"unsupported field {name!r}")
        if not any(value == ok and type(value) is type(ok) for ok in NO_OP_VALUES[name]):
            raise ValueError(f"{name}={json.dumps(value)[:64]} is not supported by this "
                             f"server; leave {name!r} unset")


def message_text(content) -> str:
    """A chat message's content: a string, or a list of content parts of which only text parts
    are supported (joined with newlines, as vLLM and SGLang join them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError("a content part must be an object with a string 'type'")
        if part["type"] != "text":
            raise ValueError(f"content part type {part['type'][:32]!r} is not supported "
                             "(text parts only)")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def include_usage(body: dict) -> bool:
    """stream_options.include_usage: a last chunk with the usage and no choices."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ValueError("stream_options takes only include_usage")
    if not isinstance(options.get("include_usage", False), bool):
        raise ValueError("stream_options.include_usage must be a boolean")
    if not body.get("stream"):
        raise ValueError("stream_options needs stream: true")
    return options.get("include_usage", False)


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many most likely tokens a position's log-probabilities list (None: not asked).
    Chat: logprobs true, top_logprobs 0 .. 20; completions: logprobs 0 .. 20."""
    asked = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise ValueError("logprobs must be a boolean (top_logprobs says how many)")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_LOGPROBS):
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]")
        if top and not asked:
            raise ValueError("top_logprobs needs logprobs: true")
        return (top or 0) if asked else None
    if asked is None or asked is False:  # some clients send false for "none"
        return None
    if isinstance(asked, bool) or not isinstance(asked, int) or not 0 <= asked <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")
    return asked


def to_generate_request(body: dict, chat: bool) -> eagle2_pb2.GenerateRequest:
    """An OpenAI request body as a GenerateRequest (ValueError on a malformed body)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    check_fields(body, chat)
    if body.get("n", 1) not in (1, None):
        raise ValueError("n must be 1")
    include_usage(body)
    req = eagle2_pb2.GenerateRequest(mode=str(body.get("mode") or ""))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {role, content} objects")
        for m in messages:
            req.chat.messages.append(eagle2_pb2.ChatMessage(
                role=str(m.get("role", "")), content=message_text(m.get("content"))))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (or a list of one string)")
        req.text, req.raw = prompt, True
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    for field, value, kind in (("max_tokens", max_tokens, int),
                               ("temperature", body.get("temperature"), float),
                               ("top_p", body.get("top_p"), float),
                               ("top_k", body.get("top_k"), int),
                               ("seed", body.get("seed"), int)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{field} must be a number")
            if kind is int and value != int(value):
                raise ValueError(f"{field} must be an integer")
            if field == "top_k" and value == -1:  # vLLM's "off"
                value = 0
            setattr(req, field, kind(value))
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    req.stop.extend(stops)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ValueError("ignore_eos must be a boolean")
    req.ignore_eos = bool(ignore_eos)
    if not isinstance(body.get("return_token_ids", False), bool):
        raise ValueError("return_token_ids must be a boolean")
    top = logprobs_asked(body, chat)
    if top is not None:
        req.logprobs = top
    return req


class LogprobsFormat:
    """A request's log-probabilities in OpenAI's form, message by message (token strings
    from the tokenizer, one token each): chat {"content": [{token, logprob, bytes,
    top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs, text_offset}, the
    offsets running on across a stream's chunks."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tokenizer, self.chat, self.top, self.offset = tokenizer, chat, top, 0

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, entries) -> dict:
        """entries: a message's TokenLogprob messages."""
        if self.chat:
            def one(token_id: int, logprob: float) -> dict:
                s = self._text(token_id)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            return {"content": [{**one(e.token_id, e.logprob),
                                 "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                                for e in entries]}
        tokens = [self._text(e.token_id) for e in entries]
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._text(t.token_id): t.logprob for t in e.top}
                                 for e in entries] if self.top else None,
                "text_offset": offsets}


async def handle(router, request: Request) -> Response:
    """Route one HTTP request (router: the Router replica)."""
    path = request.url.path.rstrip("/")
    model = router.cfg.target or "smollm2-135m-instruct"
    if path.endswith("/v1/models") and request.method == "GET":
        err = router.http_auth_error(HttpCall(request))
        if err is not None:
            return error_response(err.code, err.message)
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "eagle2"}]})
    chat = path.endswith("/v1/chat/completions")
    if request.method != "POST" or not (chat or path.endswith("/v1/completions")):
        return error_response(grpc.StatusCode.NOT_FOUND, f"no route {request.method} {path}")
    try:
        body = json.loads(await request.body())
        req = to_generate_request(body, chat)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        return error_response(grpc.StatusCode.INVALID_ARGUMENT, f"bad request body: {e}")
    kind = "chat.completion" if chat else "text_completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": model}
    stream = router.http_stream(req, HttpCall(request))
    fmt = (LogprobsFormat(router.tokenizer, chat, req.logprobs)
           if req.HasField("logprobs") else None)
    if body.get("stream"):
        first = await stream.__anext__()  # errors before the first token: a plain error
        if isinstance(first, tuple):
            return error_response(*first)
        return StreamingResponse(_sse(stream, first, head, kind, chat, include_usage(body),
                                      bool(body.get("return_token_ids")), fmt),
                                 media_type="text/event-stream")
    text, ids, entries, last = "", [], [], None
    async for msg in stream:
        if isinstance(msg, tuple):
            return error_response(*msg)
        text += msg.text_delta
        ids.extend(msg.token_ids)
        entries.extend(msg.logprobs)
        last = msg
    choice = {"index": 0, "finish_reason": FINISH.get(last.finish_reason, "stop"),
              **({"message": {"role": "assistant", "content": text}} if chat else
                 {"text": text}), "logprobs": fmt(entries) if fmt is not None else None}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    return JSONResponse({**head, "object": kind, "choices": [choice], "usage": _usage(last)})


def _usage(msg) -> dict:
    return {"prompt_tokens": msg.usage.prompt_tokens,
            "completion_tokens": msg.usage.completion_tokens,
            "total_tokens": msg.usage.prompt_tokens + msg.usage.completion_tokens}


async def _sse(stream, first, head: dict, kind: str, chat: bool, with_usage: bool = False,
               with_ids: bool = False, fmt: LogprobsFormat | None = None):
    """Server-sent events: one chunk per streamed message (one engine step's tokens; with
    `"usage": null` when the client asked for usage, and the step's `token_ids` when it asked
    for them), then the usage chunk (no choices) if asked, then `[DONE]`."""
    msg = first
    role_sent = False
    last = None
    obj = "chat.completion.chunk" if chat else kind
    while msg is not None:
        if isinstance(msg, tuple):  # failed mid-stream: an error event, then stop
            yield f"data: {json.dumps({'error': {'message': msg[1], 'code': msg[0].name}})}\n\n"
            break
        finish = FINISH.get(msg.finish_reason) if msg.HasField("usage") else None
        if chat:
            delta = {"content": msg.text_delta}
            if not role_sent:
                delta["role"], role_sent = "assistant", True
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": msg.text_delta, "finish_reason": finish}
        if with_ids:
            choice["token_ids"] = list(msg.token_ids)
        if fmt is not None:
            choice["logprobs"] = fmt(msg.logprobs)
        chunk = {**head, "object": obj, "choices": [choice]}
        if with_usage:
            chunk["usage"] = None
        yield f"data: {json.dumps(chunk)}\n\n"
        last = msg
        msg = await anext(stream, None)
    if with_usage and last is not None and last.HasField("usage"):
        usage = {**head, "object": obj, "choices": [], "usage": _usage(last)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
