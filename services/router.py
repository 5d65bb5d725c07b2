"""The router: the Ray Serve ingress serving the public gRPC API (eagle2.v1.Eagle2).

Validation, tokenization, admission control (a bounded number of admitted requests;
RESOURCE_EXHAUSTED beyond it), forwarding to the engine (which batches everything that is
running), incremental detokenization and stop strings, and cancellation: when the client
goes away Serve cancels this coroutine, which cancels the engine stream.
Also answers grpc.health.v1 Check on the same port.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from transformers import AutoConfig, AutoTokenizer

from eagle2.config import MODES
from eagle2.target import embedded_model_dir
from eagle2.text import TextStream, encode_prompt
from services import convert
from services.config import ServiceConfig
from services.protos import eagle2_pb2

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many admitted requests."""


def set_status(grpc_context, e: Exception) -> None:
    """The one mapping from exceptions to gRPC status codes (anything else: INTERNAL)."""
    code = {ValueError: grpc.StatusCode.INVALID_ARGUMENT,
            Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED}.get(type(e), grpc.StatusCode.INTERNAL)
    grpc_context.set_code(code)
    grpc_context.set_details(str(e))
    if code == grpc.StatusCode.INTERNAL:
        log.exception("request failed", exc_info=e)


@serve.deployment(max_ongoing_requests=1024)
class Router:
    def __init__(self, config: dict, engine):
        self.cfg = cfg = ServiceConfig(**config)
        self.engine = engine
        source = cfg.target or str(embedded_model_dir())
        kwargs = {}
        if source.endswith(".gguf"):
            import os

            kwargs["gguf_file"], source = os.path.basename(source), os.path.dirname(source)
        self.tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        self.model_config = AutoConfig.from_pretrained(source, **kwargs)
        eos = self.model_config.eos_token_id
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *(eos if isinstance(eos, list)
                                                              else [eos])} - {None})
        self.admitted = 0

    # ----- request handling ------------------------------------------------------------------
    def _prepare(self, request) -> tuple[list[int], dict, str]:
        """Validate and tokenize (ValueError with a message on anything wrong)."""
        params = convert.sampling_from_request(request, self.cfg.default_max_tokens,
                                               self.cfg.max_tokens_limit)
        if request.mode and request.mode not in MODES:
            raise ValueError(f"unknown mode {request.mode!r}; use one of {MODES}")
        prompt = convert.prompt_from_request(request)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = prompt
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab})")
        else:
            ids = encode_prompt(self.tokenizer, prompt, chat=not request.raw)
        if len(ids) >= self.cfg.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is "
                             f"{self.cfg.max_context} (prompt + at least one new token)")
        p = asdict(params)
        p["eos_ids"] = self.eos_ids
        return ids, p, request.mode

    async def _stream(self, request):
        """Yields GenerateStreamResponse messages; the last one carries the totals."""
        ids, params, mode = self._prepare(request)
        if self.admitted >= self.cfg.max_queued_requests:
            raise Overloaded(f"server busy: {self.admitted} requests admitted "
                             f"(max_queued_requests={self.cfg.max_queued_requests})")
        self.admitted += 1
        seq_id = request.request_id or uuid.uuid4().hex
        text = TextStream(self.tokenizer, tuple(params["stop"]))
        gen = self.engine.options(stream=True).generate.remote(seq_id, ids, params, mode)
        try:
            async for ev in gen:
                delta = text.add(ev["token_ids"], final=ev["finished"])
                done = ev["finished"] or text.stopped
                msg = eagle2_pb2.GenerateStreamResponse(text_delta=delta,
                                                        token_ids=ev["token_ids"])
                if done:
                    reason = "stop" if text.stopped else ev["finish_reason"]
                    msg.finish_reason = convert.FINISH[reason]
                    msg.usage.prompt_tokens = len(ids)
                    msg.usage.completion_tokens = len(text.token_ids)
                    msg.stats.CopyFrom(convert.stats_to_proto(
                        mode or self.cfg.tree.mode, ev["num_steps"], len(text.token_ids),
                        {int(k): v for k, v in ev["accepted_at_depth"].items()}))
                yield msg
                if done:
                    break
        finally:
            gen.cancel()  # no-op when finished; stops the engine's work when the client left
            self.admitted -= 1

    async def GenerateStream(self, request, grpc_context):
        try:
            async for msg in self._stream(request):
                yield msg
        except (ValueError, Overloaded, RuntimeError) as e:
            set_status(grpc_context, e)

    async def Generate(self, request, grpc_context):
        out = eagle2_pb2.GenerateResponse()
        try:
            async for msg in self._stream(request):
                out.text += msg.text_delta
                out.token_ids.extend(msg.token_ids)
                if msg.HasField("usage"):
                    out.finish_reason = msg.finish_reason
                    out.usage.CopyFrom(msg.usage)
                    out.stats.CopyFrom(msg.stats)
        except (ValueError, Overloaded, RuntimeError) as e:
            set_status(grpc_context, e)
            return eagle2_pb2.GenerateResponse()
        return out

    async def ModelInfo(self, request, grpc_context):
        info = await self.engine.info.remote()
        t = self.cfg.tree
        return eagle2_pb2.ModelInfoResponse(
            target=self.cfg.target or "smollm2-135m-instruct (embedded)", draft=info["draft"],
            tp_size=self.cfg.tp_size, draft_placement=self.cfg.draft_placement, mode=t.mode,
            total_tokens=info["tree"]["total_tokens"], depth=info["tree"]["depth"],
            top_k=info["tree"]["top_k"], max_context=self.cfg.max_context,
            max_tokens_limit=self.cfg.max_tokens_limit, max_batch_size=self.cfg.max_batch_size,
            vocab_size=self.model_config.vocab_size)

    async def Check(self, request, grpc_context):
        """grpc.health.v1.Health/Check: SERVING once the app is deployed."""
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    # ----- for benchmarks and tests (through a Serve handle) ---------------------------------
    async def engine_stats(self) -> dict:
        return await self.engine.stats.remote()
