"""The router: the Ray Serve ingress serving the public gRPC API (eagle2.v1.Eagle2).

Validation (raw size limits first, then tokenization in a worker thread, never on the event
loop), admission control (a bounded number of admitted requests; RESOURCE_EXHAUSTED beyond
it), forwarding to the engine (which batches everything that is running), incremental
detokenization and stop strings, and cancellation: when the client goes away Serve cancels
this coroutine, which cancels the engine stream. Also answers grpc.health.v1 Check on the
same port, truthfully: NOT_SERVING while the engine cannot make progress.

Errors reach the client as a gRPC status with a message. Ray Serve's proxy copies the status
set here onto the call only together with a yielded message, so a failing GenerateStream
yields one last, empty message after setting the status (docs/failures.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import asdict

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from transformers import AutoConfig, AutoTokenizer

from eagle2.config import MODES
from eagle2.target import embedded_model_dir
from eagle2.text import TextStream, encode_prompt
from services import auth, convert
from services.config import ServiceConfig
from services.event_channel import LOST, EventClient, merge
from services.metrics import RouterMetrics
from services.protos import MalformedRequest, eagle2_pb2

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request that ends with a gRPC status other than OK; the message goes to the client
    as it is, so it must never name hosts, ports, pids or actor ids."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def to_request_error(e: BaseException) -> RequestError:
    """The one mapping from exceptions to gRPC statuses."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ValueError):
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    if isinstance(e, BackPressureError):
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy; retry later")
    if isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError,
                      DeploymentUnavailableError, ReplicaUnavailableError)):
        log.warning("engine replica unavailable: %s", type(e).__name__)
        return RequestError(grpc.StatusCode.UNAVAILABLE, LOST["message"])
    ref = uuid.uuid4().hex[:12]
    log.error("request failed (ref %s)", ref, exc_info=e)
    return RequestError(grpc.StatusCode.INTERNAL, f"internal error (ref {ref}; see the log)")


def ended_early() -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE,
                        "the engine ended the stream early; retry the request")


async def _watch(gen, box: asyncio.Queue, grace_s: float = 30.0) -> None:
    """The engine call's end: an error event when the call failed (the engine replica died:
    its events connection may not have said so yet); when it ended, its last event was sent,
    so one that has not come within grace_s never will: an error event too (the request
    cancels this task when it ends first)."""
    from ray.serve.exceptions import RequestCancelledError

    try:
        async for _ in gen:
            pass
        await asyncio.sleep(grace_s)
        err = ended_early()
    except (asyncio.CancelledError, RequestCancelledError):  # the request ended here first
        return
    except Exception as e:
        err = to_request_error(e)
    box.put_nowait({"error": err.code.name, "message": err.message, "finished": True})


def set_status(grpc_context, e: RequestError) -> None:
    grpc_context.set_code(e.code)
    grpc_context.set_details(e.message)


@serve.deployment(max_ongoing_requests=1024)
class Router:
    def __init__(self, config: dict, engine):
        self.cfg = cfg = ServiceConfig(**config)
        self.engine = engine
        source = cfg.target or str(embedded_model_dir())
        kwargs = {}
        if source.endswith(".gguf"):
            kwargs["gguf_file"], source = os.path.basename(source), os.path.dirname(source)
        self.tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        self.model_config = AutoConfig.from_pretrained(source, **kwargs)
        eos = self.model_config.eos_token_id
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *(eos if isinstance(eos, list)
                                                              else [eos])} - {None})
        try:  # the name Serve deployed this application under (what clients must send)
            self.app_name = serve.get_replica_context().app_name
        except Exception:  # outside a replica (unit tests)
            self.app_name = cfg.app_name
        self.admitted = 0
        self.draining = False
        self.events = EventClient(uuid.uuid4().hex)  # the engine replicas' token events
        self.metrics = RouterMetrics()
        # per streamed message: the engine's hand-off -> here (the events connection), the work
        # here (detokenizing, stop strings, the message); engine_stats() reports the sums
        self.times = {"router_messages": 0, "router_delivery_s": 0.0, "router_work_s": 0.0}
        self.api_keys = auth.load_keys(cfg.api_keys_file, cfg.api_keys_env)
        if not self.api_keys:
            log.warning("no API keys configured: anyone who reaches the gRPC port can call it")

    # ----- request handling ------------------------------------------------------------------
    def _check_call(self, request, grpc_context) -> None:
        """Credentials, the application named in the metadata, and a well-formed body."""
        try:
            auth.check(grpc_context.invocation_metadata() if grpc_context else [], self.api_keys)
        except auth.AuthError as e:
            raise RequestError(grpc.StatusCode[e.code_name], e.message) from None
        app = grpc_context.application() if grpc_context is not None else None
        if app is not None and app != self.app_name:
            # Serve routes every call to the only application, whatever it names.
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"application {app[:64]!r} not "
                               f"found; this server serves {self.app_name!r}")
        if isinstance(request, MalformedRequest):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"malformed request body ({request.num_bytes} bytes): not an "
                               "eagle2.v1.GenerateRequest")

    async def _prepare(self, request) -> tuple[list[int], dict, str]:
        """Validate (raw limits first) and tokenize in a thread (ValueError on anything wrong)."""
        cfg = self.cfg
        convert.check_request_size(request, cfg.max_prompt_bytes, cfg.max_chat_messages,
                                   cfg.max_stop_sequences, cfg.max_stop_bytes)
        params = convert.sampling_from_request(request, cfg.default_max_tokens,
                                               cfg.max_tokens_limit)
        if request.mode and request.mode not in MODES:
            raise ValueError(f"unknown mode {request.mode[:32]!r}; use one of {MODES}")
        prompt = convert.prompt_from_request(request)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = prompt
            if len(ids) >= cfg.max_context:
                raise ValueError(f"prompt has {len(ids)} tokens; the context is "
                                 f"{cfg.max_context} (prompt + at least one new token)")
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab})")
        else:
            ids = await asyncio.to_thread(encode_prompt, self.tokenizer, prompt,
                                          chat=not request.raw)
        if len(ids) >= cfg.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is "
                             f"{cfg.max_context} (prompt + at least one new token)")
        p = asdict(params)
        p["eos_ids"] = self.eos_ids
        return ids, p, request.mode

    async def _stream(self, request, grpc_context):
        """Yields GenerateStreamResponse messages; the last one carries the totals."""
        t_last = time.monotonic()
        self._check_call(request, grpc_context)
        ids, params, mode = await self._prepare(request)
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               "the server is shutting down; retry on another replica")
        if self.admitted >= self.cfg.max_queued_requests:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: {self.admitted} requests admitted "
                               f"(max_queued_requests={self.cfg.max_queued_requests})")
        self.admitted += 1
        # The engine's id is this call's own: a client's request_id is only a log label, so
        # no client can reach another's request.
        seq_id = uuid.uuid4().hex
        label = request.request_id[:64] or seq_id
        text = TextStream(self.tokenizer, tuple(params["stop"]))
        self.metrics.prompt_tokens.inc(len(ids))
        first, gen, watch = True, None, None
        box = self.events.open(seq_id)  # before the engine can send
        try:
            gen = self.engine.options(stream=True).generate.remote(seq_id, ids, params, mode,
                                                                   self.events.router_id)
            try:
                reply = await gen.__anext__()  # where this request's events come from
            except StopAsyncIteration:
                raise ended_early() from None  # never a truncated OK stream
            await self.events.attach(seq_id, reply["events"])
            watch = asyncio.ensure_future(_watch(gen, box))
            while True:
                ev = await box.get()
                while not box.empty() and "error" not in ev:  # a step's worth came at once
                    ev = merge(ev, box.get_nowait())
                received = time.time()
                if "error" in ev:
                    raise RequestError(grpc.StatusCode[ev["error"]], ev["message"])
                self._observe(first, t_last, len(ev["token_ids"]))
                first, t_last = False, time.monotonic()
                delta = text.add(ev["token_ids"], final=ev["finished"])
                done = ev["finished"] or text.stopped
                msg = eagle2_pb2.GenerateStreamResponse(
                    text_delta=delta, token_ids=ev["token_ids"],
                    logprobs=convert.logprobs_to_proto(ev.get("logprobs")))
                if done:
                    reason = "stop" if text.stopped else ev["finish_reason"]
                    msg.finish_reason = convert.FINISH[reason]
                    msg.usage.prompt_tokens = len(ids)
                    msg.usage.completion_tokens = len(text.token_ids)
                    msg.stats.CopyFrom(convert.stats_to_proto(
                        mode or self.cfg.tree.mode, ev["num_steps"], len(text.token_ids),
                        {int(k): v for k, v in ev["accepted_at_depth"].items()}))
                times = self.times
                times["router_messages"] += 1
                times["router_delivery_s"] += received - ev["time"]
                times["router_work_s"] += time.time() - received
                yield msg
                if done:
                    return
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", label)  # one line, no traceback
            raise
        finally:
            self.events.close(seq_id)
            if watch is not None:
                watch.cancel()
            if gen is not None:  # no-op when finished; stops the engine's work when the
                gen.cancel()  # client left
            self.admitted -= 1

    def _observe(self, first: bool, since: float, num_tokens: int) -> None:
        gap = time.monotonic() - since
        if num_tokens:
            self.metrics.generation_tokens.inc(num_tokens)
        if first:
            self.metrics.ttft.observe(gap)
        elif num_tokens:  # one observation per message (a step's tokens arrive together)
            self.metrics.itl.observe(gap / num_tokens)

    async def GenerateStream(self, request, grpc_context):
        try:
            async for msg in self._stream(request, grpc_context):
                yield msg
        except asyncio.CancelledError:
            self.metrics.finished("CANCELLED")
            raise
        except Exception as e:
            self._fail(e, grpc_context)
            yield eagle2_pb2.GenerateStreamResponse()  # carries the status through the proxy
            return
        self.metrics.finished("OK")

    async def Generate(self, request, grpc_context):
        out = eagle2_pb2.GenerateResponse()
        try:
            async for msg in self._stream(request, grpc_context):
                out.text += msg.text_delta
                out.token_ids.extend(msg.token_ids)
                out.logprobs.extend(msg.logprobs)
                if msg.HasField("usage"):
                    out.finish_reason = msg.finish_reason
                    out.usage.CopyFrom(msg.usage)
                    out.stats.CopyFrom(msg.stats)
        except asyncio.CancelledError:
            self.metrics.finished("CANCELLED")
            raise
        except Exception as e:
            self._fail(e, grpc_context)
            return eagle2_pb2.GenerateResponse()
        self.metrics.finished("OK")
        return out

    def _fail(self, e: Exception, grpc_context) -> None:
        """Map a request's exception to its status, count it and set it on the call."""
        err = to_request_error(e)
        self.metrics.finished(err.code.name)
        set_status(grpc_context, err)

    async def ModelInfo(self, request, grpc_context):
        try:
            self._check_call(request, grpc_context)
            info = await self.engine.info.remote()
        except Exception as e:
            set_status(grpc_context, to_request_error(e))
            return eagle2_pb2.ModelInfoResponse()
        t = self.cfg.tree
        return eagle2_pb2.ModelInfoResponse(
            target=self.cfg.target or "smollm2-135m-instruct (embedded)", draft=info["draft"],
            tp_size=self.cfg.tp_size, draft_placement=self.cfg.draft_placement, mode=t.mode,
            total_tokens=info["tree"]["total_tokens"], depth=info["tree"]["depth"],
            top_k=info["tree"]["top_k"], max_context=self.cfg.max_context,
            max_tokens_limit=self.cfg.max_tokens_limit, max_batch_size=info["max_running"],
            vocab_size=self.model_config.vocab_size,
            target_placement=info["target_placement"], kv_blocks=info["kv_blocks"] or 0,
            block_size=info["block_size"] or 0, prefix_caching=bool(info["prefix_caching"]),
            **{k: v for k, v in info["kernels"].items() if v is not None})

    async def Check(self, request, grpc_context):
        """grpc.health.v1.Health/Check: SERVING only while the engine can make progress."""
        status = health_pb2.HealthCheckResponse
        try:
            health = await asyncio.wait_for(self.engine.health.remote(), timeout=5.0)
        except Exception:
            return status(status=status.NOT_SERVING)
        return status(status=status.SERVING if health["serving"] else status.NOT_SERVING)

    # ----- OpenAI-compatible HTTP (Serve's HTTP proxy; services/openai_http.py) --------------
    async def __call__(self, request):
        from services import openai_http

        return await openai_http.handle(self, request)

    def http_auth_error(self, call) -> RequestError | None:
        try:
            auth.check(call.invocation_metadata(), self.api_keys)
        except auth.AuthError as e:
            return RequestError(grpc.StatusCode[e.code_name], e.message)
        return None

    async def http_stream(self, request, call):
        """_stream's messages, or one (code, message) tuple when the request fails."""
        try:
            async for msg in self._stream(request, call):
                yield msg
        except Exception as e:
            err = to_request_error(e)
            self.metrics.finished(err.code.name)
            yield err.code, err.message
            return
        self.metrics.finished("OK")

    # ----- shutdown, benchmarks and tests (through a Serve handle) ---------------------------
    async def drain(self) -> int:
        """Refuse new requests (UNAVAILABLE) and say how many are still running."""
        self.draining = True
        return self.admitted

    async def engine_stats(self) -> dict:
        """The engine's stats and this router's per-message times (`self.times`)."""
        return {**await self.engine.stats.remote(), **self.times}

    async def engine_health(self) -> dict:
        return await self.engine.health.remote()

    async def rank_pids(self) -> list[int]:
        return await self.engine.rank_pids.remote()
