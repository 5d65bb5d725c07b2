"""How many CPU threads decode fastest on this machine (docs/cpu-backend.md "CPU performance").

torch starts with one thread per core. A decode step of a small model is ~120 linears and as
many small operators, each a parallel region whose threads must wake: on a 2-core VM two
threads decoded plainly at 18.6-23.1 tokens/s against 25.6-26.5 with one, and speculatively
at 9.2-22.9 against 27.0-27.5 (`eagle2 generate`, same prompt, alternated). Which count is
fastest depends on the machine and the model, so it is measured: plain decode steps of the
loaded model at 1, 2, 4, ... threads up to the CPUs it may use, alternated over a few rounds (a
slow phase of the machine then spoils one sample of each count, not all of one), the best
per count kept; a larger count must be `GAIN` faster to be chosen (fewer threads suffer less
beside other busy processes). The choice is cached per machine and model
(`~/.cache/eagle2/threads/`), so later loads set it before the kernels are planned.

An explicit count always wins: `threads=N`, `EAGLE2_THREADS=N`, or `OMP_NUM_THREADS`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eagle2.config import SamplingParams, TreeConfig

GAIN = 0.05  # a larger count must decode this much faster (fraction) to be chosen
PROMPT_TOKENS, STEPS, ROUNDS = 48, 12, 3


def requested(names: tuple[str, ...] = ("EAGLE2_THREADS", "OMP_NUM_THREADS")) -> int | None:
    """A thread count the user set in the environment (EAGLE2_THREADS, else OMP_NUM_THREADS;
    a Ray worker reads EAGLE2_THREADS only: Ray sets OMP_NUM_THREADS to the CPUs it reserved
    for the actor, which says nothing about what decodes fastest)."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def default_count() -> int:
    """The CPUs this process may use: the largest count measured, whatever the current one
    (a caller that set one thread before loading must not make one the only candidate)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def candidates(default: int) -> list[int]:
    """1, 2, 4, ... below default, and default. E.g. 6 -> [1, 2, 4, 6]."""
    counts, n = [], 1
    while n < default:
        counts.append(n)
        n *= 2
    return [*counts, max(default, 1)]


def cache_path(target) -> Path:
    """Where the choice for this machine (CPU, cores, CPUs this process may use, torch) and
    this target (name, dtype, the native operators' build) is kept; the same whatever the
    current thread count."""
    from eagle2.machine import cache_root, machine_key

    native = ""
    if target.dtype == torch.bfloat16:  # the fused operators' build, read before they load
        from eagle2.cpu.native import build_key

        native = build_key()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    key = machine_key(f"threads|{cpus}|{target.name}|{target.dtype}|{native}", threads=0)
    return cache_root() / "threads" / f"{key}.json"


def cached(target) -> int | None:
    """The cached choice, None where there is none or it was measured over other counts than
    this machine's candidates (e.g. only one, where a caller had set one thread before)."""
    path = cache_path(target)
    try:
        data = json.loads(path.read_text())
        if {int(n) for n in data["step_ms"]} != set(candidates(default_count())):
            return None
        return int(data["threads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def step_seconds(engine, vocab: int, steps: int = STEPS) -> float:
    """Mean seconds of `steps` plain decode steps of one request on an idle `Engine` (its
    prefill not timed)."""
    from eagle2.engine import Request

    prompt = tuple((7 * i + 3) % vocab for i in range(PROMPT_TOKENS))
    engine.add(Request("__threads_probe", prompt,
                       SamplingParams(max_tokens=steps + 1, ignore_eos=True),
                       TreeConfig("vanilla"), frozenset()))
    engine.step()  # the prefill
    t0 = time.perf_counter()
    done = 0
    while engine.has_work():
        engine.step()
        done += 1
    return (time.perf_counter() - t0) / max(done, 1)


def measure(engine, vocab: int, counts: list[int], rounds: int = ROUNDS) -> dict[int, float]:
    """Best mean step seconds per thread count, counts alternated `rounds` times (the first
    round also warms each count up and counts only where no later one is faster)."""
    before = torch.get_num_threads()
    best = dict.fromkeys(counts, float("inf"))
    try:
        for _ in range(rounds + 1):
            for n in counts:
                torch.set_num_threads(n)
                best[n] = min(best[n], step_seconds(engine, vocab))
    finally:
        torch.set_num_threads(before)
    return best


def choose(timings: dict[int, float], gain: float = GAIN) -> int:
    """The fewest threads unless more are at least `gain` faster. E.g. {1: 30 ms, 2: 29 ms}
    -> 1; {1: 30, 2: 20} -> 2."""
    pick = min(timings)
    for n in sorted(timings):
        if timings[n] < timings[pick] * (1 - gain):
            pick = n
    return pick


def measure_and_save(engine, target) -> int:
    """Measure the counts with an idle `Engine` of `target` on the CPU, cache the choice
    (unless other processes kept a core busy meanwhile), return it. The engine's stats then
    hold the probe's steps."""
    from eagle2.machine import write_json_atomic

    counts = candidates(default_count())
    follower = LoadFollower(max(counts), interval=0.0)
    timings = measure(engine, target.vocab_size, counts)
    pick = choose(timings)
    follower.poll()
    if follower.others >= LoadFollower.DOWN_FREE:
        # other processes held cores meanwhile: the counts above one lost to them, not to
        # this machine; the choice holds for this load only and is measured again at the next
        return pick
    write_json_atomic(cache_path(target), {
        "threads": pick, "step_ms": {str(n): round(s * 1e3, 3) for n, s in timings.items()},
        "target": target.name, "cpu_count": os.cpu_count(), "torch": torch.__version__})
    return pick


def settle(engine, target, count: int | None, follow: bool, cost_path_of=None) -> int:
    """Run `engine` (of `target`, on the CPU) on `count` threads (None: measure the counts now
    with the idle engine and cache the choice, the probe's steps dropped from its stats). With
    `cost_path_of` (the cost cache of the current count; None: the engine keeps the costs it
    was given) the engine reads that count's costs, and where `follow` and more than one
    thread, follows other processes' load (`LoadFollower`). Returns the count. What
    `Eagle2.load(threads="auto")` and the service's engine replica both do."""
    if count is None:
        from eagle2.engine import EngineStats

        count = measure_and_save(engine, target)
        engine.stats = EngineStats()  # the probe's steps are not the caller's
    torch.set_num_threads(count)
    if cost_path_of is not None:  # the costs of this count (their cache is per count)
        engine._costs = engine._cost_path = cost_path_of()
        if follow and count > 1:
            # the measured count is for a quiet machine: fewer while others take the cores
            engine.follow_load(LoadFollower(count), cost_path_of)
    return count


def cpu_busy_seconds(cpus: set[int] | None = None, stat: Path = Path("/proc/stat")
                     ) -> float | None:
    """Seconds the given CPUs (None: all) have run anything since boot (user, nice, system,
    irq, softirq and steal time: everything but idle and I/O wait), from /proc/stat; None
    where it cannot be read (not Linux)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class LoadFollower:
    """Fewer threads while other processes use this process's cores, all of them again once
    they are free (docs/cpu-backend.md, "CPU performance").

    On a quiet 2-core VM two threads decode ~1.6x faster than one (each core streams its half
    of the weights), yet beside one busy process they are ~1.7x slower than one thread: every
    parallel region waits for the thread whose core the other process holds. So the count
    measured on a quiet machine (`most`) is an upper bound, and every `interval` seconds this
    reads the CPU time spent on the CPUs this process may use (/proc/stat) less its own
    (`time.process_time`, every thread): the cores others use. `poll` returns a new count when
    one should change: down while fewer than `count - DOWN_FREE` cores are free, up when
    `count + 1 - UP_FREE` are (a gap between the two, so a load near a threshold does not flip
    it every interval). Where /proc/stat cannot be read, it never changes the count.
    """

    DOWN_FREE, UP_FREE = 0.5, 0.25
    STALE = 4

    def __init__(self, most: int, interval: float = 0.5, clock=time.monotonic,
                 busy=None, own=time.process_time):
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cpus = set(cpus) if cpus else None
        self.ncpu = default_count()
        self.most, self.interval = most, interval
        self._clock, self._busy, self._own = clock, busy or cpu_busy_seconds, own
        self.count = most
        self.others = 0.0  # cores other processes used over the last interval
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy(self.cpus)
        return None if busy is None else (self._clock(), busy, self._own())

    def poll(self) -> int | None:
        """The count to switch to (None: keep the current one). A window longer than
        `STALE` intervals (the engine sat idle, or started long after the follower) only
        starts a new one: what others did then says little about now."""
        if self._last is None or self._clock() - self._last[0] < self.interval:
            return None
        now = self._sample()
        if now is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        if self.interval > 0 and t1 - t0 > self.STALE * self.interval:
            return None
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
        free = self.ncpu - self.others
        count = self.count
        while count > 1 and free < count - self.DOWN_FREE:
            count -= 1
        while count < self.most and free >= count + 1 - self.UP_FREE:
            count += 1
        if count == self.count:
            return None
        self.count = count
        return count


class TorchThread:
    """One daemon thread that runs a process's torch work, calls in order. OpenMP gives each
    thread that starts parallel work its own team of threads, and once a process holds more of
    them than it has CPUs, libgomp lets idle ones spin only ~100 times before they sleep
    (GOMP_SPINCOUNT no longer applies), so every parallel region wakes them: a target loaded on
    one thread and stepped on another decoded at half speed on 2 cores (docs/cpu-backend.md
    "CPU performance"). Load and step on one of these instead. (Not a ThreadPoolExecutor:
    its threads are joined at interpreter exit, and a step loop never returns.)"""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:  # `close`
                return
            fn, args, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
                if not isinstance(e, Exception):
                    raise  # (SystemExit, KeyboardInterrupt: the thread ends, as asked)

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, future))
        return future

    def call(self, fn: Callable, *args):
        """fn(*args) on this thread, after the calls before it; its result or its error."""
        return self.submit(fn, *args).result()

    def close(self, timeout_s: float | None = None) -> None:
        """End the thread once the calls before this one have run."""
        self._calls.put(None)
        self.thread.join(timeout_s)
