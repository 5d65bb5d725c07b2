"""The target engine deployment: the target, continuous batching, one step loop.

A background thread owns the core `Engine` and runs draft -> verify -> commit steps while any
request is active; requests join between steps and leave when finished or cancelled. The same
thread builds the target and the drafter first: this replica runs torch on no other thread
(`__init__`). A request arrives as a Serve streaming call (`generate`) whose one item names
this replica's event server; each step's events (all the tokens the step gave each request)
go to each router as one frame on its connection (`services/event_channel.py`), and a router
that has fallen behind reads every step it has not read yet as one message. The loop never
waits on a router: it hands a step's events to the replica's event loop in one call and goes
on; Ray's metrics are flushed from another thread (`_flush_metrics`), and the loop times
itself (`LoopTimes`: the step, its own host time, the hand-off), reported by `stats()`.
The target runs in this process (`LocalRunner`, target_placement "engine", the default at
tp_size 1), on tp_size rank actors (`ShardedRunner`, "ranks"), or split with rank 0 in this
process and ranks 1.. on actors ("engine" at tp_size > 1, the default on CPUs); the drafter
is the draft worker over gRPC (`ResilientDrafter`: plain decoding while the worker is away)
or, for single-GPU set-ups, in this process.

Faults (docs/failures.md): the step loop never dies. A failed step ends the requests it was
running with an error event (UNAVAILABLE when a tensor-parallel rank died, INTERNAL
otherwise), never a silently truncated stream; a dead rank group is rebuilt in place while
`health()` says not serving; `check_health` lets Serve replace a replica whose loop is gone.
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
from eagle2.devices import device_lost, pick_device, pick_dtype
from eagle2.engine import Engine, Event, Request
from eagle2.runner import LocalRunner
from eagle2.threads import TorchThread
from services.config import ServiceConfig
from services.event_channel import EventServer
from services.metrics import EngineMetrics
from services.tp_runner import RankFailure, ShardedRunner

log = logging.getLogger(__name__)
GPU_FAILED = "the replica's GPU failed; retry the request"  # (UNAVAILABLE)
# what of the runner's info names the kernels a step runs: ModelInfo reports it, and costs
# measured with one set misguide the tree budget with another (`_cost_path`)
KERNEL_INFO = ("backend", "attention", "device", "dtype", "cuda_graphs")


@serve.deployment(max_ongoing_requests=1024)
class TargetEngine:
    async def __init__(self, config: dict, draft_worker=None):
        self.cfg = cfg = ServiceConfig(**config)
        self.placement = cfg.resolved_target_placement()
        self.inbox: queue.Queue = queue.Queue()
        # request id -> (its router's id, a future done once its last event is sent)
        self.outboxes: dict[str, tuple[str, asyncio.Future]] = {}
        self.events = EventServer()  # started by the first request, on the serving loop
        self.events_host = _node_ip()
        self.events_loop: asyncio.AbstractEventLoop | None = None
        self.rebuilding = False
        # set once a step failed with the GPU's context lost (`devices.device_lost`): the
        # replica refuses requests and fails its health check until Serve replaces it
        self.device_failed: str | None = None
        self.device_fault_in = 0  # fault tests: `inject_device_fault`
        self.rank_restarts = 0
        self.last_rank_recovery_s: float | None = None
        self.metrics = EngineMetrics()
        self.times = LoopTimes()
        niceness = os.nice(0)  # (adds 0: reads it)
        if niceness > 0:  # a cluster started without RAY_ENV (services/cli_serve.py)
            log.warning("the engine replica runs at niceness %d: every process on the node at "
                        "0 takes its cores when it wakes; start Ray with "
                        "RAY_worker_niceness=0 (docs/processes.md)", niceness)
        address = None
        if draft_worker is not None and cfg.draft_placement != "inprocess":
            address = await draft_worker.address.remote()  # (the drafter: `_make_drafter`)
        # Every torch operation of this replica runs on one thread, the step loop's: it
        # builds the target and the drafter, then loops (`TorchThread`: two OpenMP teams in
        # one process halved the speed on 2 cores)
        torch_thread = TorchThread("engine-loop")
        self.thread = torch_thread.thread
        await asyncio.wrap_future(torch_thread.submit(self._build, draft_worker, address))
        torch_thread.submit(self._loop)
        threading.Thread(target=self._flush_metrics, name="engine-metrics", daemon=True).start()

    def _build(self, draft_worker, address) -> None:
        cfg = self.cfg
        # the target's threads where it runs here: engine_threads ("auto": `_auto_threads`,
        # once the target is loaded; None: cpus_per_rank)
        if cfg.engine_threads is None:
            torch.set_num_threads(max(1, int(cfg.cpus_per_rank)))
        elif cfg.engine_threads != "auto":
            torch.set_num_threads(cfg.engine_threads)
        self.drafter, self.draft_desc = self._make_drafter(cfg, draft_worker, address)
        runner = self._new_runner()
        self.cost_path = _cost_path(cfg, self.placement, runner.info)
        from services.draft_worker import lookup_table, ngram_store

        # a draft worker in another process holds the head: the engine's lookup chains on
        # steps without a draft call take their values (and the n-gram store) from the
        # head's files here
        remote = self.draft_desc == "worker"
        self.lookup_table = lookup_table(cfg) if remote else None
        self.ngram = ngram_store(cfg) if remote else None
        self.engine = self._new_engine(runner)
        if cfg.target_in_engine() and cfg.engine_threads == "auto" and runner.info.get(
                "device", "cpu").startswith("cpu"):
            self._auto_threads(runner)
        self.tree = cfg.tree.to_core()
        if self.drafter is not None and self.tree.budget == "auto":
            _ = self.engine.costs  # measured (or read) before serving, not at the first request
        self.last_progress = time.monotonic()  # last finished step, or idle

    def _auto_threads(self, runner: LocalRunner) -> None:
        """The target's thread count as `Eagle2.load(threads="auto")` sets it (EAGLE2_THREADS,
        the cached choice, else measured now with plain decode steps of the idle engine and
        cached), then, unless the user set it, fewer while other processes keep cores busy;
        the cost cache follows the count. OMP_NUM_THREADS is Ray's (the replica's reserved
        CPUs), not the user's."""
        from eagle2 import threads as thr

        requested = thr.requested(("EAGLE2_THREADS",))  # Ray sets OMP_NUM_THREADS
        cfg, placement = self.cfg, self.placement
        thr.settle(self.engine, runner.target, requested or thr.cached(runner.target),
                   follow=requested is None,
                   cost_path_of=lambda: _cost_path(cfg, placement, runner.info))
        self.cost_path = self.engine._cost_path

    def _new_runner(self) -> LocalRunner | ShardedRunner:
        """The whole target in this process (what a rank actor holds at tp_size 1), or the
        rank actors; max_running slots over a cache of kv_cache_memory (docs/kv-cache.md "In
        the service": blocks where the target pages, else the slots it holds)."""
        from services.draft_worker import feature_layers

        cfg = self.cfg
        max_len = cfg.max_context + Engine.tree_margin
        if cfg.target_in_engine():
            from eagle2.cuda_graphs import runner_class  # CUDA graphs: $EAGLE2_CUDA_GRAPHS

            device = pick_device(cfg.device())
            return runner_class(device).load(cfg.target, pick_dtype(cfg.dtype, device), device,
                                             cfg.max_running, max_len, feature_layers(cfg),
                                             block_size=cfg.block_size,
                                             kv_cache_memory=cfg.kv_cache_budget())
        return ShardedRunner(cfg.tp_size, cfg.max_running, max_len, target=cfg.target,
                             dtype=None if cfg.dtype == "auto" else cfg.dtype,
                             use_gpu=cfg.use_gpu, cpus_per_rank=cfg.cpus_per_rank,
                             gpu_per_rank=cfg.gpu_per_rank(),
                             feature_layers=feature_layers(cfg), block_size=cfg.block_size,
                             kv_cache_memory=cfg.rank_kv_cache_memory(),
                             local_rank0=cfg.rank0_in_engine())

    def _new_engine(self, runner: LocalRunner | ShardedRunner) -> Engine:
        """The core engine over `runner` (at start and after a failed step): max_running
        requests a step, or the fewer slots a slotted cache of kv_cache_memory holds."""
        cfg, cap = self.cfg, runner.capacity
        running = min(cfg.max_running, cap["num_slots"])
        if cap["kv_blocks"]:
            log.info("target cache: %d blocks of %d entries (%.2f GiB a rank), max_running %d, "
                     "prefix caching %s", cap["kv_blocks"], cap["block_size"],
                     cap["kv_cache_bytes"] / 2**30, running, cfg.prefix_caching)
        elif running < cfg.max_running:
            log.warning("target cache: slotted (%s attention), kv_cache_memory holds %d slots "
                        "of %d entries: max_running %d, not %d", runner.info.get("attention"),
                        running, cfg.max_context + Engine.tree_margin, running, cfg.max_running)
        engine = Engine(runner, self.drafter, max_context=cfg.max_context, max_running=running,
                        prefix_caching=cfg.prefix_caching,
                        costs=_cost_path(cfg, self.placement, runner.info),  # cached after one
                        lookup_table=self.lookup_table, ngram=self.ngram)
        engine.prefill_chunk = cfg.resolved_prefill_chunk()
        return engine

    @staticmethod
    def _make_drafter(cfg: ServiceConfig, draft_worker, address):
        """(drafter, description): none, the head in this process, or the draft worker at
        `address` (gRPC; asked of Serve again after a failure)."""
        if cfg.tree.mode == "vanilla" and cfg.draft is None and draft_worker is None:
            return None, "none"
        if cfg.draft_placement == "inprocess" or draft_worker is None:
            from services.draft_worker import build_drafter

            return build_drafter(cfg, max_slots=cfg.max_running)
        from services.draft_client import ResilientDrafter

        def lookup() -> str:  # called from threads: the worker's current address via Serve
            return draft_worker.address.remote().result(timeout_s=10)

        drafter = ResilientDrafter(lambda: address, cfg.draft_timeout_s)
        drafter.lookup = lookup
        return drafter, "worker"

    # ----- called by the router (through a streaming handle) ---------------------------------
    async def generate(self, seq_id: str, prompt_ids: list[int], params: dict, mode: str,
                       router: str):
        """Start this request; its events go to `router`'s connection to this replica
        (`services.event_channel`: one frame a step for all of that router's requests). The
        stream's one item is that connection's address; it ends when the request has
        finished (or failed: a last event {"error": <grpc status name>, "message": ...});
        cancelling it cancels the request."""
        params = dict(params)
        eos_ids = frozenset(params.pop("eos_ids", ()))
        sp = SamplingParams(**{**params, "stop": tuple(params.get("stop", ()))})
        req = Request(seq_id, tuple(prompt_ids), sp, self.cfg.tree.to_core(mode or None),
                      eos_ids)
        address = await self.events.start(self.events_host)
        self.events_loop = asyncio.get_running_loop()
        done = self.events_loop.create_future()
        self.outboxes[seq_id] = (router, done)
        self.events.opened(router)
        self.inbox.put(("add", req))
        try:
            yield {"events": address}
            await done
        finally:
            self.outboxes.pop(seq_id, None)
            self.events.closed(router)
            if not done.done():
                self.inbox.put(("cancel", seq_id))

    def stats(self) -> dict:
        s = self.engine.stats
        out = asdict(s)
        out["pid"] = os.getpid()
        out["torch_threads"] = torch.get_num_threads()
        out["target_placement"] = self.placement
        out["target_dtype"] = self.engine.runner.info["dtype"]
        costs = self.engine.known_costs  # what the tree budget decides with
        out["costs"] = None if costs is None else costs.to_json()
        out["costs_path"] = str(self.cost_path)
        out["active"] = len(self.engine.ids())  # running, chunking, preempted, waiting
        out["prefix_hit_rate"] = s.prefix_hit_rate
        out.update(cache_stats(self.engine))
        out["draft"] = self.draft_desc
        d = self.drafter
        out["draft_address"] = getattr(getattr(d, "remote", None), "address", None)
        out["draft_rpc_calls"] = getattr(d, "calls", None)
        out["draft_rpc_s"] = getattr(d, "rpc_s", None)
        out["draft_fallbacks"] = getattr(d, "fallbacks", 0)
        out["draft_fallback_sequences"] = getattr(d, "fallback_sequences", 0)
        out["draft_reconnects"] = getattr(d, "reconnects", 0)
        out["draft_last_recovery_s"] = getattr(d, "last_recovery_s", None)
        out["rank_restarts"] = self.rank_restarts
        out["last_rank_recovery_s"] = self.last_rank_recovery_s
        out["loop_alive"] = self.thread.is_alive()
        out.update(self.times.as_dict())
        out.update(self.events.stats())
        out.update(traffic_stats(self.engine.runner, getattr(d, "remote", None) or d))
        return out

    def rank_pids(self) -> list[int]:
        """The tensor-parallel rank actors' process ids (for fault tests and operators), in
        rank order: ranks 1.. where rank 0 runs in this replica; [] when the whole target
        does (this replica's pid is stats()["pid"])."""
        import ray

        actors = getattr(self.engine.runner, "actors", [])
        return ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in actors])

    def inject_rank_fault(self, rank: int, after_calls: int = 1) -> None:
        """Fault tests: tensor-parallel rank `rank` raises out of memory at its
        `after_calls`-th call from now (`ShardedRunner.inject_fault`); ValueError when the
        target runs in this replica (no rank)."""
        runner = self.engine.runner
        if not isinstance(runner, ShardedRunner):
            raise ValueError("the target runs in the engine replica: it has no rank to fail")
        runner.inject_fault(rank, after_calls)

    def inject_device_fault(self, after_steps: int = 1) -> None:
        """Fault tests: the step loop's `after_steps`-th step from now raises the error a lost
        CUDA context raises (`torch.AcceleratorError`), as an illegal memory access would."""
        self.device_fault_in = after_steps

    def reset_stats(self) -> None:
        self.inbox.put(("reset_stats", None))

    def info(self) -> dict:
        """What `ModelInfo` reports from here: the draft, the tree, the target's kernels
        (`runner.info`: backend, attention, device, dtype, CUDA graphs) and its cache
        (`cache_stats`)."""
        kernels = self.engine.runner.info
        return {"draft": self.draft_desc, "tree": asdict(self.tree), "pid": os.getpid(),
                "target_placement": self.placement,
                "kernels": {k: kernels.get(k) for k in KERNEL_INFO},
                **{k: v for k, v in cache_stats(self.engine).items() if k != "kv_free_blocks"}}

    def health(self) -> dict:
        """serving: the step loop runs, the ranks are up, and waiting work makes progress."""
        stalled = (self.engine.has_work() and
                   time.monotonic() - self.last_progress > self.cfg.stall_timeout_s)
        reason = ("step loop stopped" if not self.thread.is_alive() else
                  f"the GPU failed: {self.device_failed}" if self.device_failed else
                  "rebuilding tensor-parallel ranks" if self.rebuilding else
                  "no step finished within stall_timeout_s" if stalled else "")
        return {"serving": not reason, "reason": reason,
                "draft_connected": getattr(self.drafter, "connected", True)}

    def check_health(self) -> None:
        """Serve's periodic check: raising makes Serve replace this replica. Rank actors are
        checked too, between steps (`ShardedRunner.check_health`: a dead rank's connection
        has ended): a rank lost while the engine is idle is rebuilt now, by the step loop,
        rather than failing the next request with UNAVAILABLE."""
        if not self.thread.is_alive():
            raise RuntimeError("engine step loop stopped")
        if self.device_failed:
            raise RuntimeError(f"the GPU failed ({self.device_failed}): this replica's CUDA "
                               "context is lost, replace it")
        runner = self.engine.runner
        if isinstance(runner, ShardedRunner) and not self.rebuilding and runner.failed is None:
            try:
                runner.check_health()
            except RankFailure as e:
                log.error("a tensor-parallel rank failed between steps: %s", e)
                self.inbox.put(("ranks_failed", (runner, e)))

    # ----- the step loop (its own thread) ------------------------------------------------------
    def _flush_metrics(self) -> None:
        """Ray's metrics from what the step loop counted, about once a second (off its path)."""
        while True:
            time.sleep(1.0)
            try:
                self.metrics.flush()
            except Exception:
                log.exception("metrics flush failed")

    def _loop(self) -> None:
        while True:
            try:
                self._once()
            except Exception:
                log.exception("engine loop error; continuing")
                time.sleep(0.1)

    def _once(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        block = not self.engine.has_work()
        if block:
            self.last_progress = time.monotonic()
            self.metrics.step(0, 0, [])
        try:
            while True:
                cmd, arg = self.inbox.get(block=block, timeout=None if block else 0)
                if block:  # idle until now: the wait is not the loop's host time
                    t0, c0, block = time.perf_counter(), time.thread_time(), False
                self._command(cmd, arg)
        except queue.Empty:
            pass
        if not self.engine.has_work():
            return
        t_step, c_step = time.perf_counter(), time.thread_time()
        try:
            if self.device_fault_in:
                self.device_fault_in -= 1
                if not self.device_fault_in:
                    raise torch.AcceleratorError("CUDA error: an illegal memory access was "
                                                 "encountered (injected)")
            events = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        t_events, c_events = time.perf_counter(), time.thread_time()
        self.last_progress = time.monotonic()
        self._dispatch(events)
        t_sent = time.perf_counter()
        d = self.drafter
        eng = self.engine
        self.metrics.step(len(eng.seqs), len(eng.ids()) - len(eng.seqs),
                          [len(ev.token_ids) for ev in events if ev.num_steps > 1])  # 1: prefill
        paging, st = eng.paging, eng.stats
        self.metrics.cache(0.0 if paging is None else
                           1 - paging.blocks.num_free / paging.blocks.num_blocks,
                           st.preemptions, st.prefix_query_tokens, st.prefix_hit_tokens)
        self.metrics.drafter(getattr(d, "fallbacks", 0), getattr(d, "reconnects", 0))
        self.times.add(t_events - t_step, time.perf_counter() - t0 - (t_events - t_step),
                       t_sent - t_events, c_events - c_step,
                       time.thread_time() - c0 - (c_events - c_step))

    def _dispatch(self, events: list[Event]) -> None:
        """Hand a step's events to the event loop in one call, which sends each router one
        frame with all of its requests' events (`_deliver`)."""
        now = time.time()
        by_router: dict[str, list] = {}
        for ev in events:
            box = self.outboxes.get(ev.seq_id)
            if box is not None:
                by_router.setdefault(box[0], []).append((ev.seq_id, _event_dict(ev, now)))
        if by_router:
            self.events_loop.call_soon_threadsafe(self._deliver, by_router)

    def _deliver(self, by_router: dict[str, list]) -> None:
        """(On the event loop.) One frame a router; a request's stream ends after its last."""
        for router, items in by_router.items():
            self.events.send(router, items)
            for seq_id, item in items:
                if item["finished"] or "error" in item:
                    box = self.outboxes.get(seq_id)
                    if box is not None and not box[1].done():
                        box[1].set_result(None)

    def _step_failed(self, e: Exception) -> None:
        """End every running request with an error event and start over with a clean engine
        on the same runner (rebuilding the rank group when a rank failed: its process died,
        its task raised, e.g. out of memory, or the call timed out, `RankFailure`; the target
        in this process has no rank to lose: its errors are INTERNAL)."""
        import ray.exceptions

        rank_died = isinstance(self.engine.runner, ShardedRunner) and isinstance(
            e, (RankFailure, ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                TimeoutError))
        if rank_died:
            log.error("a tensor-parallel rank failed (%s); failing %d requests and rebuilding "
                      "the ranks", type(e).__name__, len(self.engine.ids()))
            code, message = "UNAVAILABLE", "a model shard failed; retry the request"
        elif lost := device_lost(e):
            self.device_failed = lost
            log.critical("the GPU failed (%s): failing %d requests; the health check fails "
                         "until Serve replaces this replica", self.device_failed,
                         len(self.engine.ids()))
            code, message = "UNAVAILABLE", GPU_FAILED
        else:
            log.exception("engine step failed", exc_info=e)
            code, message = "INTERNAL", "the engine failed on this batch; see the server log"
        failed = list(self.engine.ids())
        for sid in failed:
            self._send(sid, {"error": code, "message": message, "finished": True})
            if self.drafter is not None:
                try:
                    self.drafter.release(sid)
                except Exception:
                    log.debug("release of %s failed", sid)
        runner = self.engine.runner
        if rank_died:
            t0 = time.monotonic()
            self.rebuilding = True
            try:
                runner.shutdown()
                runner = self._new_runner()  # raises into _loop on failure; retried next step
            finally:
                self.rebuilding = False
            self.rank_restarts += 1
            self.metrics.rank_restarts.inc()
            self.last_rank_recovery_s = time.monotonic() - t0
            log.warning("tensor-parallel ranks rebuilt in %.1f s", self.last_rank_recovery_s)
        self.engine = self._new_engine(runner)

    def _command(self, cmd: str, arg) -> None:
        if cmd == "add":
            if self.device_failed:
                self._send(arg.seq_id, {"error": "UNAVAILABLE", "message": GPU_FAILED,
                                        "finished": True})
                return
            try:
                self.engine.add(arg)
            except ValueError as e:
                self._send(arg.seq_id, {"error": "INVALID_ARGUMENT", "message": str(e),
                                        "finished": True})
        elif cmd == "cancel":
            self.engine.cancel(arg)
        elif cmd == "ranks_failed":  # from check_health; not if a step rebuilt them already
            runner, error = arg
            if runner is self.engine.runner:
                self._step_failed(error)
        elif cmd == "reset_stats":
            self.engine.stats = type(self.engine.stats)()
            self.times = LoopTimes()
            if hasattr(self.drafter, "calls"):
                self.drafter.calls, self.drafter.rpc_s = 0, 0.0

    def _send(self, seq_id: str, item: dict) -> None:
        """One event outside a step (errors and refusals: rare)."""
        box = self.outboxes.get(seq_id)
        if box is not None:
            self.events_loop.call_soon_threadsafe(self._deliver, {box[0]: [(seq_id, item)]})


def cache_stats(engine: Engine) -> dict:
    """The target cache as the engine runs it (docs/kv-cache.md "In the service"):
    max_running (requests a step runs at most), and where paged kv_blocks, kv_free_blocks
    (free now, cached prefixes included), block_size and prefix_caching (None where slotted).
    Read from other threads: a torn read is off by one step at most."""
    out = {"max_running": engine.max_batch, "kv_blocks": None, "kv_free_blocks": None,
           "block_size": None, "prefix_caching": None}
    if engine.paging is not None:
        b = engine.paging.blocks
        out.update(kv_blocks=b.num_blocks, kv_free_blocks=b.num_free, block_size=b.block_size,
                   prefix_caching=b.prefix_caching)
    return out


def traffic_stats(runner, drafter) -> dict:
    """Bytes moved between processes so far: engine <-> TP ranks (tensors in the calls, the
    same inputs counted once per rank) and engine <-> draft worker (serialized protobuf);
    seconds the engine waited for its rank calls and rank 0 computed in them (their
    difference is the cost of the hop). None where there is no such process (the target or
    the head in the engine)."""
    traffic = getattr(runner, "traffic", {})
    busy = getattr(runner, "rank_busy_s", None)
    return {"rank_bytes_out": traffic.get("bytes_out"), "rank_bytes_in": traffic.get("bytes_in"),
            "draft_bytes_out": getattr(drafter, "bytes_sent", None),
            "draft_bytes_in": getattr(drafter, "bytes_received", None),
            "rank_wait_s": traffic.get("wait_s"), "rank_busy_s": busy() if busy else None}


class LoopTimes:
    """Where the step loop's time goes, summed over its steps: `Engine.step` (compute: draft,
    verify, commit, with their own host work), the loop's host time around it (commands,
    events, metrics) and, of that, handing the events to the streams; and the CPU time the
    loop's own thread used in each of the first two (`time.thread_time`; a CPU target's other
    OpenMP threads not included: with one torch thread, the wall time less it is how long the
    step waited, for a core or a rank). Read from other threads as plain floats (a torn read
    is off by one step at most)."""

    def __init__(self):
        self.steps, self.step_s, self.host_s, self.dispatch_s = 0, 0.0, 0.0, 0.0
        self.step_cpu_s, self.host_cpu_s = 0.0, 0.0

    def add(self, step_s: float, host_s: float, dispatch_s: float, step_cpu_s: float,
            host_cpu_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.host_s += host_s
        self.dispatch_s += dispatch_s
        self.step_cpu_s += step_cpu_s
        self.host_cpu_s += host_cpu_s

    def as_dict(self) -> dict:
        return {"loop_steps": self.steps, "loop_step_s": self.step_s,
                "loop_host_s": self.host_s, "loop_dispatch_s": self.dispatch_s,
                "loop_step_cpu_s": self.step_cpu_s, "loop_host_cpu_s": self.host_cpu_s}


def _event_dict(ev: Event, now: float) -> dict:
    """time: when the step loop handed it over (the router measures the delivery from it).
    logprobs: (token id, log-probability, [(id, log-probability)]) per token, or None."""
    logprobs = None if ev.logprobs is None else [
        (t, e.logprob, list(e.top)) for t, e in zip(ev.token_ids, ev.logprobs, strict=True)]
    return {"token_ids": ev.token_ids, "finished": ev.finished,
            "finish_reason": ev.finish_reason, "num_steps": ev.num_steps,
            "accepted_at_depth": ev.accepted_at_depth, "logprobs": logprobs, "time": now}


def _node_ip() -> str:
    """Where routers reach this replica's events: this node's address in the Ray cluster."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests)
        return "127.0.0.1"


def _cost_path(cfg: ServiceConfig, placement: str, runner_info: dict):
    """This machine's measured forward costs for this deployment's target and layout, and for
    how it runs: in the engine or through Ray calls to ranks, in which dtype, fused layers or
    the modules (costs measured one way misguide the tree budget the other way)."""
    from eagle2.budget import COSTS_VERSION
    from eagle2.machine import cache_root, machine_key

    kernels = "|".join(f"{k}={runner_info.get(k)}" for k in KERNEL_INFO)
    key = machine_key(f"service|{cfg.target}|{cfg.tp_size}|{placement}|{cfg.use_gpu}|"
                      f"{cfg.cpus_per_rank}|{kernels}|fused={runner_info.get('fused')}|"
                      f"native={runner_info.get('native')}|v{COSTS_VERSION}")
    return cache_root() / "costs" / f"{key}.json"
