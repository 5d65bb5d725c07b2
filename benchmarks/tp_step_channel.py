"""What a tensor-parallel step costs to drive over the step channel (`eagle2.tp_channel`),
beside the same target in this process.

A tiny random Llama (2 layers, hidden 64) is saved to a temporary directory; plain decoding
(the vanilla tree: one node a request) runs through the engine on three runners of it, in
turns, in one process and one local Ray:
  - local: `LocalRunner`, the whole target in this process (the in-process time per step);
  - after: `ShardedRunner` at tp 2 (one message a rank per step on the step channel, one reply
    from rank 0; no Ray call per step), its CPU ranks all-reducing over their socket group
    (`eagle2.tp_comm`);
  - after-gloo: the same runner with the ranks' all-reduces on gloo;
  - rank0-here: `ShardedRunner(local_rank0=True)`, the service's default on CPUs: rank 0 in
    this process, rank 1 on an actor (one message to it per step, no reply).
Per concurrency (requests decoded together) it prints the median and mean milliseconds per
decode step (prefill excluded), their excess over local, and what crossed processes per step
(channel frames and bytes as the channel counts them). Every runner's tokens must equal
local's: the script exits non-zero otherwise. (The Ray-call runner the step channel replaced,
one Ray task a rank per step, was measured by this script as of commit d851b1c, which ran
commit 2c75dda's services/tp_runner.py; docs/tensor-parallel.md keeps its figures.)

--probe also times the raw transports the channel chose between: a 4 KiB gloo broadcast from
the driver to two processes plus a 64 B reply, against the same over TCP sockets.

    .venv/bin/python benchmarks/tp_step_channel.py --steps 48 --reps 5
    .venv/bin/python benchmarks/tp_step_channel.py --embedded 3 --steps 32 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
class _GlooRank:
    """Rank start-up that leaves the layers' collectives on gloo (no `SocketGroup`)."""

    def start(self, master_addr, master_port, timeout_s=None):
        import eagle2.tp

        eagle2.tp.SocketGroup = lambda: None
        return super().start(master_addr, master_port, timeout_s)


def on_gloo(runner_module, *args, **kwargs):
    """runner_module.ShardedRunner(*args, **kwargs) whose ranks all-reduce with gloo (a rank
    class defined here is sent to Ray by value)."""
    import ray.cloudpickle

    rank_cls = type("GlooTPRank", (_GlooRank, runner_module.TPRank), {})
    if __name__ != "__main__":  # (a script's classes go by value anyway)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    saved, runner_module.TPRank = runner_module.TPRank, rank_cls
    try:
        return runner_module.ShardedRunner(*args, **kwargs)
    finally:
        runner_module.TPRank = saved


def decode(runner, prompts, max_tokens: int, counts=Counter):
    """Plain greedy decoding of `prompts` together: -> (tokens per prompt, seconds of each
    decode step, what crossed in the decode steps: counts() after them less before)."""
    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.engine import Engine, Request

    engine = Engine(runner, None, max_batch=len(prompts), max_context=256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add(Request(f"s{i}", tuple(p), params, TreeConfig("vanilla")))
        out[f"s{i}"] = []
    times = []
    start = None
    while engine.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        if start is None:  # the prefill
            start = counts()
        else:
            times.append(time.perf_counter() - t0)
        for ev in events:
            out[ev.seq_id].extend(ev.token_ids)
    return [out[f"s{i}"] for i in range(len(prompts))], times, counts() - start


def snapshot(name, runner) -> Counter:
    if name == "local":
        return Counter()
    t = runner.traffic
    return Counter({"rank0_s": runner.rank_busy_s(), "wait_s": t["wait_s"],
                    "ray_calls": t["ray_calls"], "bytes_out": t["bytes_out"],
                    "bytes_in": t["bytes_in"], "frames_out": t["frames_out"],
                    "replies": t["frames_in"]})


def probe(n: int = 500) -> None:
    """A 4 KiB gloo broadcast to two processes + a 64 B reply vs the same over sockets."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    import datetime
    import socket

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    listener = socket.create_server(("127.0.0.1", 0))
    procs = [ctx.Process(target=_probe_member, args=(r, store.port, listener.getsockname()[1]))
             for r in (1, 2)]
    for p in procs:
        p.start()
    pg = dist.ProcessGroupGloo(store, 0, 3, datetime.timedelta(seconds=120))
    conns = {}
    for _ in range(2):
        c, _ = listener.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[c.recv(1)[0]] = c
    buf, reply, msg = torch.zeros(4096, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8), \
        bytes(4096)
    gloo, sock = [], []  # the members run the gloo turns first, then the socket turns
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            pg.broadcast(buf, 0).wait()
            pg.recv([reply], 1, 0).wait()
        gloo.append((time.perf_counter() - t0) / n)
    buf[0] = 255
    pg.broadcast(buf, 0).wait()
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            for c in conns.values():
                c.sendall(msg)
            got = 0
            while got < 64:
                got += len(conns[1].recv(64 - got))
        sock.append((time.perf_counter() - t0) / n)
    print("probe, us per 4 KiB to two processes + 64 B back (3 turns): gloo "
          + " ".join(f"{t * 1e6:.0f}" for t in gloo) + ", sockets "
          + " ".join(f"{t * 1e6:.0f}" for t in sock))
    for c in conns.values():
        c.close()
    for p in procs:
        p.join(10)


def _probe_member(rank: int, store_port: int, sock_port: int) -> None:
    import datetime
    import socket

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    pg = dist.ProcessGroupGloo(store, rank, 3, datetime.timedelta(seconds=120))
    s = socket.create_connection(("127.0.0.1", sock_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(bytes([rank]))
    buf = torch.zeros(4096, dtype=torch.uint8)
    while True:
        pg.broadcast(buf, 0).wait()
        if buf[0] == 255:
            break
        if rank == 1:
            pg.send([buf[:64]], 0, 0).wait()
    while True:
        got = 0
        while got < 4096:
            data = s.recv(4096 - got)
            if not data:
                return
            got += len(data)
        if rank == 1:
            s.sendall(bytes(64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per request")
    ap.add_argument("--reps", type=int, default=5, help="turns of each runner")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--probe", action="store_true", help="also time gloo against sockets")
    ap.add_argument("--embedded", type=int, default=None, metavar="TP",
                    help="the embedded SmolLM2 in bf16 at this tp_size (3 divides its KV heads) "
                    "instead of the tiny Llama: local and after only; bf16 shards sum in "
                    "another order than the whole model, so tokens are not compared")
    args = ap.parse_args()
    import os

    import ray
    from conftest import random_prompts, save_tiny_target, tiny_target

    from eagle2.engine import Engine
    from eagle2.runner import LocalRunner
    from services import tp_runner
    from services.tp_runner import ShardedRunner

    print(f"load: {os.getloadavg()}, cores: {os.cpu_count()}, torch threads 1")
    if args.probe:
        probe()
    torch.set_num_threads(1)
    if args.embedded:
        from eagle2.target import TargetModel

        target, path, dtype = TargetModel.load(dtype="bfloat16", device="cpu"), None, "bfloat16"
    else:
        target = tiny_target(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, seed=1)
        path, dtype = save_tiny_target(target, tempfile.mkdtemp()), "float32"
    vocab = target.config.vocab_size
    max_batch, max_len = max(args.concurrency), 256 + Engine.tree_margin
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    runners = {"local": LocalRunner(target, max_batch, max_len)}
    try:
        kwargs = {"target": path, "dtype": dtype, "cpus_per_rank": 1}
        if not args.embedded:
            runners["after-gloo"] = on_gloo(tp_runner, 2, max_batch, max_len, **kwargs)
        runners["after"] = ShardedRunner(args.embedded or 2, max_batch, max_len, **kwargs)
        runners["rank0-here"] = ShardedRunner(args.embedded or 2, max_batch, max_len,
                                              local_rank0=True, **kwargs)
        ok = True
        for c in args.concurrency:
            prompts = random_prompts(c, vocab, seed=c)
            times = {name: [] for name in runners}
            crossed = {name: Counter() for name in runners}
            expected = None
            for _ in range(args.reps):
                for name, runner in runners.items():
                    tokens, t, n = decode(runner, prompts, args.steps,
                                          lambda n=name, r=runner: snapshot(n, r))
                    times[name] += t
                    crossed[name] += n
                    expected = expected or tokens
                    if tokens != expected and not args.embedded:
                        ok = False
                        print(f"MISMATCH: {name} at concurrency {c}")
            report(c, times, crossed)
        print("tokens not compared (bf16 shards)" if args.embedded else
              "greedy tokens equal local's on every runner" if ok else "TOKENS DIFFER")
        print(f"load after: {os.getloadavg()}")
    finally:
        for name in ("after-gloo", "after", "rank0-here"):
            if name in runners:
                runners[name].shutdown()
        ray.shutdown()
    sys.exit(0 if ok else 1)


def report(c: int, times: dict, crossed: dict) -> None:
    local = statistics.median(times["local"])
    steps = len(times["local"])
    print(f"\nconcurrency {c}: {len(times['local'])} decode steps per runner")
    print(f"{'runner':10} {'median ms':>10} {'mean ms':>8} {'excess ms':>10} {'wait ms':>8} "
          f"{'rank0 ms':>9} {'ray calls':>10} {'frames out':>11} {'bytes out':>10} "
          f"{'replies':>8} {'bytes in':>9}   (per step; wait: driver waits for the ranks, "
          "rank0: inside the call on rank 0)")
    for name, t in times.items():
        med = statistics.median(t)
        n = crossed[name]
        per = {k: n[k] / steps for k in ("ray_calls", "frames_out", "bytes_out", "replies",
                                         "bytes_in", "wait_s", "rank0_s")}
        print(f"{name:10} {med * 1e3:10.3f} {statistics.mean(t) * 1e3:8.3f} "
              f"{(med - local) * 1e3:10.3f} {per['wait_s'] * 1e3:8.3f} {per['rank0_s'] * 1e3:9.3f} "
              f"{per['ray_calls']:10.1f} {per['frames_out']:11.1f} "
              f"{per['bytes_out']:10.0f} {per['replies']:8.1f} {per['bytes_in']:9.0f}")


if __name__ == "__main__":
    main()
