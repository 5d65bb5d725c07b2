"""The target engine deployment: tensor-parallel target, continuous batching, one step loop.

A background thread owns the core `Engine` and runs draft -> verify -> commit steps while any
request is active; requests join between steps and leave when finished or cancelled. Each
request's events go back to its caller (the router) through an asyncio queue, streamed over a
Serve handle. The target runs on tp_size rank actors (`ShardedRunner`); the drafter is the
draft worker over gRPC (`RemoteDrafter`) or, for single-GPU set-ups, in this process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import asdict

import torch
from ray import serve

from eagle2.config import SamplingParams
from eagle2.engine import Engine, Event, Request
from services.config import ServiceConfig
from services.tp_runner import ShardedRunner

log = logging.getLogger(__name__)


@serve.deployment(max_ongoing_requests=1024)
class TargetEngine:
    async def __init__(self, config: dict, draft_worker=None):
        self.cfg = cfg = ServiceConfig(**config)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        runner = ShardedRunner(cfg.tp_size, cfg.max_batch_size,
                               cfg.max_context + Engine.tree_margin, target=cfg.target,
                               dtype=None if cfg.dtype == "auto" else cfg.dtype,
                               use_gpu=cfg.use_gpu, cpus_per_rank=cfg.cpus_per_rank,
                               gpu_per_rank=cfg.gpu_per_rank())
        self.drafter, self.draft_desc = await self._make_drafter(cfg, draft_worker)
        self.engine = Engine(runner, self.drafter, cfg.max_batch_size, cfg.max_context,
                             costs=_cost_path(cfg))
        self.tree = cfg.tree.to_core()
        if self.drafter is not None and self.tree.budget == "auto":
            _ = self.engine.costs  # measured (or read) before serving, not at the first request
        self.inbox: queue.Queue = queue.Queue()
        self.outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.thread.start()

    @staticmethod
    async def _make_drafter(cfg: ServiceConfig, draft_worker):
        if cfg.tree.mode == "vanilla" and cfg.draft is None and draft_worker is None:
            return None, "none"
        if cfg.draft_placement == "inprocess" or draft_worker is None:
            from services.draft_worker import build_drafter

            return build_drafter(cfg, max_slots=cfg.max_batch_size)
        from services.draft_client import RemoteDrafter

        address = await draft_worker.address.remote()
        return RemoteDrafter(address), f"worker@{address}"

    # ----- called by the router (through a streaming handle) ---------------------------------
    async def generate(self, seq_id: str, prompt_ids: list[int], params: dict, mode: str):
        """Stream this request's events as dicts; cancelling the stream cancels the request."""
        params = dict(params)
        eos_ids = frozenset(params.pop("eos_ids", ()))
        sp = SamplingParams(**{**params, "stop": tuple(params.get("stop", ()))})
        req = Request(seq_id, tuple(prompt_ids), sp, self.cfg.tree.to_core(mode or None),
                      eos_ids)
        loop, box = asyncio.get_running_loop(), asyncio.Queue()
        self.outboxes[seq_id] = (loop, box)
        self.inbox.put(("add", req))
        finished = False
        try:
            while not finished:
                item = await box.get()
                if isinstance(item, Exception):
                    raise item
                finished = item["finished"]
                yield item
        finally:
            self.outboxes.pop(seq_id, None)
            if not finished:
                self.inbox.put(("cancel", seq_id))

    def stats(self) -> dict:
        s = self.engine.stats
        out = asdict(s)
        out["pid"] = os.getpid()
        out["active"] = len(self.engine.seqs) + len(self.engine.waiting)
        out["draft"] = self.draft_desc
        out["draft_rpc_calls"] = getattr(self.drafter, "calls", None)
        out["draft_rpc_s"] = getattr(self.drafter, "rpc_s", None)
        out.update(traffic_stats(self.engine.runner, self.drafter))
        return out

    def reset_stats(self) -> None:
        self.inbox.put(("reset_stats", None))

    def info(self) -> dict:
        return {"draft": self.draft_desc, "tree": asdict(self.tree), "pid": os.getpid()}

    # ----- the step loop (its own thread) ------------------------------------------------------
    def _loop(self) -> None:
        while True:
            block = not self.engine.has_work()
            try:
                while True:
                    cmd, arg = self.inbox.get(block=block, timeout=None if block else 0)
                    self._command(cmd, arg)
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # a broken step must not kill the loop: fail its requests
                log.exception("engine step failed")
                for sid in list(self.engine.ids()):
                    self.engine.cancel(sid)
                    self._send(sid, RuntimeError(f"engine step failed: {e}"))
                continue
            for ev in events:
                self._send(ev.seq_id, _event_dict(ev))

    def _command(self, cmd: str, arg) -> None:
        if cmd == "add":
            try:
                self.engine.add(arg)
            except ValueError as e:
                self._send(arg.seq_id, e)
        elif cmd == "cancel":
            self.engine.cancel(arg)
        elif cmd == "reset_stats":
            self.engine.stats = type(self.engine.stats)()
            if hasattr(self.drafter, "calls"):
                self.drafter.calls, self.drafter.rpc_s = 0, 0.0

    def _send(self, seq_id: str, item) -> None:
        box = self.outboxes.get(seq_id)
        if box is not None:
            loop, q = box
            loop.call_soon_threadsafe(q.put_nowait, item)


def traffic_stats(runner, drafter) -> dict:
    """Bytes moved between processes so far: engine <-> TP ranks (tensors in the calls, the
    same inputs counted once per rank) and engine <-> draft worker (serialized protobuf)."""
    traffic = getattr(runner, "traffic", {})
    return {"rank_bytes_out": traffic.get("bytes_out"), "rank_bytes_in": traffic.get("bytes_in"),
            "draft_bytes_out": getattr(drafter, "bytes_sent", None),
            "draft_bytes_in": getattr(drafter, "bytes_received", None)}


def _event_dict(ev: Event) -> dict:
    return {"token_ids": ev.token_ids, "finished": ev.finished,
            "finish_reason": ev.finish_reason, "num_steps": ev.num_steps,
            "accepted_at_depth": ev.accepted_at_depth, "time": time.time()}


def _cost_path(cfg: ServiceConfig):
    """This machine's measured forward costs for this deployment's target and layout."""
    from eagle2.kernels import machine_key
    from eagle2.target import cache_root

    key = machine_key(f"service|{cfg.target}|{cfg.tp_size}|{cfg.dtype}|{cfg.use_gpu}|"
                      f"{cfg.cpus_per_rank}")
    return cache_root() / "costs" / f"{key}.json"
