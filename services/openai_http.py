"""OpenAI-compatible HTTP on Ray Serve's HTTP proxy: the router's `__call__`.

    GET  /v1/models
    POST /v1/chat/completions   (messages; stream: SSE chunks, then `data: [DONE]`)
    POST /v1/completions        (prompt, raw text: no chat template)

under the application's route prefix (`http://HOST:8000/eagle2/v1` as the client's base
URL). A JSON body becomes the same `GenerateRequest` the gRPC API takes, so validation,
limits, API keys (`Authorization: Bearer`) and errors are shared; gRPC statuses map to the
HTTP codes the OpenAI clients expect.
"""

from __future__ import annotations

import json
import time
import uuid

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

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


def to_generate_request(body: dict, chat: bool) -> eagle2_pb2.GenerateRequest:
    """An OpenAI request body as a GenerateRequest (ValueError on a malformed body)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if body.get("n", 1) != 1:
        raise ValueError("n must be 1")
    req = eagle2_pb2.GenerateRequest(mode=str(body.get("mode", "")))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {role, content} objects")
        for m in messages:
            content = m.get("content")
            if not isinstance(content, str):
                raise ValueError("message content must be a string")
            req.chat.messages.append(eagle2_pb2.ChatMessage(role=str(m.get("role", "")),
                                                            content=content))
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
                               ("seed", body.get("seed"), int)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{field} must be a number")
            setattr(req, field, kind(value))
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    req.stop.extend(stops)
    return req


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
    if body.get("stream"):
        first = await stream.__anext__()  # errors before the first token: a plain error
        if isinstance(first, tuple):
            return error_response(*first)
        return StreamingResponse(_sse(stream, first, head, kind, chat),
                                 media_type="text/event-stream")
    text, last = "", None
    async for msg in stream:
        if isinstance(msg, tuple):
            return error_response(*msg)
        text += msg.text_delta
        last = msg
    choice = {"index": 0, "finish_reason": FINISH.get(last.finish_reason, "stop"),
              **({"message": {"role": "assistant", "content": text}} if chat else
                 {"text": text, "logprobs": None})}
    usage = {"prompt_tokens": last.usage.prompt_tokens,
             "completion_tokens": last.usage.completion_tokens,
             "total_tokens": last.usage.prompt_tokens + last.usage.completion_tokens}
    return JSONResponse({**head, "object": kind, "choices": [choice], "usage": usage})


async def _sse(stream, first, head: dict, kind: str, chat: bool):
    """Server-sent events: one chunk per streamed message, `[DONE]` at the end."""
    msg = first
    role_sent = False
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
        obj = "chat.completion.chunk" if chat else kind
        yield f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"
        msg = await anext(stream, None)
    yield "data: [DONE]\n\n"
