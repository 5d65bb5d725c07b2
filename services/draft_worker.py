"""The draft worker: a Ray Serve deployment holding the EAGLE head, serving DraftService.

The replica starts a plain grpcio server (the internal API, protos/eagle2/v1/draft.proto);
the engine asks the deployment for its address through Serve (again after a failure: a
restarted replica listens on a new port), then talks gRPC directly at every decoding step.
The server binds to localhost by default: DraftService has no authentication. In
production the replica asks for its own GPU.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import grpc
import torch
from ray import serve

from eagle2.devices import device_lost, pick_device, pick_dtype
from eagle2.drafter import Drafter
from eagle2.head import load_head, new_head
from eagle2.target import load_vocab_modules
from services import convert
from services.config import ServiceConfig
from services.protos import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


def head_dir(cfg: ServiceConfig) -> str | None:
    """The head directory the service uses: cfg.draft, else the one shipped for the target;
    None for an untrained head."""
    from eagle2.api import shipped_head_dir
    from eagle2.target import EMBEDDED_NAME

    if cfg.draft == "untrained":
        return None
    path = cfg.draft or shipped_head_dir(EMBEDDED_NAME if cfg.target is None else
                                         os.path.basename(cfg.target.rstrip("/")))
    return None if path is None else str(path)


def feature_layers(cfg: ServiceConfig) -> tuple[int, ...] | None:
    """The target layers whose inputs the service's head reads (EAGLE-3), None for EAGLE-1/2:
    read from the head's config.json so the target side never loads the head."""
    from eagle2.head import head_feature_layers
    from eagle2.target import target_num_layers

    path = head_dir(cfg)
    return None if path is None else head_feature_layers(
        path, lambda: target_num_layers(cfg.target))


def lookup_table(cfg: ServiceConfig):
    """The prompt-lookup acceptance table fitted for the service's head (its
    calibration.json), for an engine whose drafter is a worker in another process; None
    where the head has none (the engine then keeps the conservative default)."""
    from eagle2.calibration import Calibration

    calibration = Calibration.of_head(head_dir(cfg))
    return calibration.lookup if calibration is not None else None


def ngram_store(cfg: ServiceConfig):
    """The n-gram store shipped beside the service's head (`ngram.npz`, `eagle2.ngram`), for
    an engine whose drafter is a worker in another process: its chains on steps without a
    draft call compete with prompt lookup's there too. None where the head has none."""
    from eagle2.ngram import NgramStore

    return NgramStore.of_head(head_dir(cfg))


def build_drafter(cfg: ServiceConfig, max_slots: int) -> tuple[Drafter, str]:
    """The head for cfg.target plus the target's embedding and (EAGLE-1/2 heads, which draft
    through it) its lm_head; nothing else of the target. Its KV cache (docs/kv-cache.md "The
    draft head's KV cache") keeps max_slots sequences of max_context + the tree margin
    entries of one layer, allocated here once; a sequence's slot is taken at its first draft
    call and freed with the request (`Engine._remove` calls `release` when it finishes, is
    cancelled or preempted; a failed step releases its requests), so max_slots bounds it."""
    device = pick_device(cfg.device())
    dtype = pick_dtype(cfg.dtype, device)
    path = head_dir(cfg)
    eagle3 = feature_layers(cfg) is not None  # None for an untrained or EAGLE-1/2 head
    embed, lm_head = load_vocab_modules(cfg.target, dtype, str(device), lm_head=not eagle3)
    if path is None:
        from transformers import AutoConfig

        from eagle2.target import embedded_model_dir

        if cfg.draft != "untrained":
            log.warning("no draft head for %s: using an untrained one (lossless, slow)",
                        cfg.target)
        tcfg = AutoConfig.from_pretrained(cfg.target or embedded_model_dir())
        head, desc = new_head(tcfg, dtype=dtype).to(device), "untrained"
    else:
        head, desc = load_head(path, dtype=dtype, device=device), str(path)
    drafter = Drafter(head, embed, lm_head, max_slots=max_slots, max_len=cfg.max_context)
    return drafter, desc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Thin: decode the tensors, call the drafter, encode the tree."""

    def __init__(self, drafter: Drafter, head_desc: str):
        self.drafter = drafter
        self.head_desc = head_desc
        self.lock = threading.Lock()  # one drafter, one cache: calls are serialized
        self.draft_requests = 0
        self.busy_s = 0.0
        # set once a draft lost the GPU's CUDA context (`devices.device_lost`): every later
        # call would fail too; calls are refused UNAVAILABLE, Health says NOT_SERVING and the
        # replica's health check fails, so Serve replaces it (the engine decodes without
        # drafts meanwhile, then reconnects)
        self.device_failed: str | None = None

    def Draft(self, request, context):
        """The features may hold each row's last W positions only, W < the tokens' A (what a
        head keeping W reads: `RemoteDrafter`); the call's catch_up is then W, and they go
        back to their positions (`convert.widen_positions`) before the drafter runs."""
        if self.device_failed:
            self._refuse(context)
        try:
            tree_cfg = convert.tree_from_spec(request.tree)
            feats = convert.tensor_from_proto(request.features)
            tokens = convert.tensor_from_proto(request.tokens)
            counts = convert.tensor_from_proto(request.counts)
            if feats.dim() != 3 or tokens.dim() != 2 or feats.shape[0] != tokens.shape[0]:
                raise ValueError(f"features {tuple(feats.shape)} and tokens "
                                 f"{tuple(tokens.shape)} disagree")
            width, num_a = feats.shape[1], tokens.shape[1]
            if width < num_a:
                if tree_cfg.catch_up != width:
                    raise ValueError(f"features of the last {width} positions need catch_up "
                                     f"{width}, got {tree_cfg.catch_up}")
                feats = convert.widen_positions(feats, counts, num_a)
            t0 = time.perf_counter()
            with self.lock:
                tree = self.drafter.draft(list(request.seq_ids), feats, tokens, counts, tree_cfg,
                                          request.min_gain)
                self.draft_requests += 1
                self.busy_s += time.perf_counter() - t0
            return convert.draft_tree_to_proto(tree)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:
            lost = device_lost(e)
            if not lost:
                raise
            self.device_failed = lost
            log.critical("the draft worker's GPU failed (%s); refusing drafts until Serve "
                         "replaces this replica", self.device_failed)
            self._refuse(context)

    def _refuse(self, context) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"the draft worker's GPU failed ({self.device_failed})")

    def Release(self, request, context):
        with self.lock:
            known = [s for s in request.seq_ids if s in self.drafter.slot_of]
            for s in request.seq_ids:
                self.drafter.release(s)
        return draft_pb2.ReleaseResponse(released=len(known))

    def Health(self, request, context):
        return draft_pb2.HealthResponse(status="NOT_SERVING" if self.device_failed else
                                        "SERVING", draft_requests=self.draft_requests,
                                        active_sequences=len(self.drafter.slot_of),
                                        pid=os.getpid(), head=self.head_desc)


def start_server(servicer: DraftServicer, port: int, host: str = "127.0.0.1",
                 max_message_bytes: int = convert.MAX_MESSAGE_BYTES) -> tuple[grpc.Server, int]:
    """The internal DraftService; on localhost unless told otherwise (it has no auth)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", max_message_bytes),
                                  ("grpc.max_send_message_length", max_message_bytes)])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound


@serve.deployment(max_ongoing_requests=16)
class DraftWorker:
    """Serve replica wrapper; `address()` tells the engine where the gRPC server listens."""

    def __init__(self, config: dict):
        cfg = ServiceConfig(**config)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        # the engine's running requests, and as many again: ones just replaced (a request's
        # slot returns with its Release, sent by the engine as it finishes, is cancelled,
        # preempted or fails)
        drafter, desc = build_drafter(cfg, max_slots=cfg.max_running * 2)
        self.servicer = DraftServicer(drafter, desc)
        host = cfg.draft_bind_host
        if host == "node":
            import ray

            host = ray.util.get_node_ip_address()
        self.server, port = start_server(self.servicer, cfg.draft_grpc_port, host)
        self._address = f"{host}:{port}"
        log.info("draft worker (pid %d) serving DraftService on %s", os.getpid(), self._address)

    def address(self) -> str:
        return self._address

    def check_health(self) -> None:
        """Serve's periodic check: the gRPC server answers, and serves (not after a lost GPU
        context)."""
        with grpc.insecure_channel(self._address) as ch:
            health = draft_pb2_grpc.DraftServiceStub(ch).Health(draft_pb2.HealthRequest(),
                                                                timeout=10)
        if health.status != "SERVING":
            raise RuntimeError(f"draft worker {health.status}: {self.servicer.device_failed}")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace=1)
