"""How many CPU threads decode fastest on this machine (docs/DESIGN.md "CPU performance").

torch starts with one thread per core. A decode step of a small model is ~120 linears and as
many small operators, each a parallel region whose threads must wake: on a 2-core VM two
threads decoded plainly at 18.6-23.1 tokens/s against 25.6-26.5 with one, and speculatively
at 9.2-22.9 against 27.0-27.5 (`eagle2 generate`, same prompt, alternated). Which count is
fastest depends on the machine and the model, so it is measured: plain decode steps of the
loaded model at 1, 2, 4, ... threads up to torch's default, alternated over a few rounds (a
slow phase of the machine then spoils one sample of each count, not all of one), the best
per count kept; a larger count must be `GAIN` faster to be chosen (fewer threads suffer less
beside other busy processes). The choice is cached per machine and model
(`~/.cache/eagle2/threads/`), so later loads set it before the kernels are planned.

An explicit count always wins: `threads=N`, `EAGLE2_THREADS=N`, or `OMP_NUM_THREADS`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from eagle2.config import SamplingParams, TreeConfig

GAIN = 0.05  # a larger count must decode this much faster (fraction) to be chosen
PROMPT_TOKENS, STEPS, ROUNDS = 48, 12, 3


def requested() -> int | None:
    """A thread count the user set in the environment (EAGLE2_THREADS, else OMP_NUM_THREADS)."""
    for name in ("EAGLE2_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def candidates(default: int) -> list[int]:
    """1, 2, 4, ... below torch's default, and the default. E.g. 6 -> [1, 2, 4, 6]."""
    counts, n = [], 1
    while n < default:
        counts.append(n)
        n *= 2
    return [*counts, max(default, 1)]


def cache_path(target) -> Path:
    """Where the choice for this machine (CPU, cores, CPUs this process may use, torch) and
    this target (name, dtype, the native operators' build) is kept; the same whatever the
    current thread count."""
    from eagle2.kernels import machine_key
    from eagle2.target import cache_root

    native = ""
    if target.dtype == torch.bfloat16:  # the fused operators' build, read before they load
        from eagle2.native import build_key

        native = build_key()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    key = machine_key(f"threads|{cpus}|{target.name}|{target.dtype}|{native}", threads=0)
    return cache_root() / "threads" / f"{key}.json"


def cached(target) -> int | None:
    path = cache_path(target)
    try:
        return int(json.loads(path.read_text())["threads"])
    except (OSError, ValueError, KeyError):
        return None


def step_seconds(llm, steps: int = STEPS) -> float:
    """Mean seconds of `steps` plain decode steps of one request (its prefill not timed)."""
    engine = llm.engine
    vocab = llm.target.vocab_size
    prompt = tuple((7 * i + 3) % vocab for i in range(PROMPT_TOKENS))
    req = llm.request(list(prompt), SamplingParams(max_tokens=steps + 1, ignore_eos=True),
                      TreeConfig("vanilla"), seq_id="__threads_probe")
    engine.add(req)
    engine.step()  # the prefill
    t0 = time.perf_counter()
    done = 0
    while engine.has_work():
        engine.step()
        done += 1
    return (time.perf_counter() - t0) / max(done, 1)


def measure(llm, counts: list[int], rounds: int = ROUNDS) -> dict[int, float]:
    """Best mean step seconds per thread count, counts alternated `rounds` times (the first
    round also warms each count up and counts only where no later one is faster)."""
    before = torch.get_num_threads()
    best = dict.fromkeys(counts, float("inf"))
    try:
        for _ in range(rounds + 1):
            for n in counts:
                torch.set_num_threads(n)
                best[n] = min(best[n], step_seconds(llm))
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


def measure_and_save(llm) -> int:
    """Measure the counts for a loaded Eagle2 on the CPU, cache the choice, return it."""
    from eagle2.kernels import write_json_atomic

    counts = candidates(torch.get_num_threads())
    timings = measure(llm, counts)
    pick = choose(timings)
    write_json_atomic(cache_path(llm.target), {
        "threads": pick, "step_ms": {str(n): round(s * 1e3, 3) for n, s in timings.items()},
        "target": llm.target.name, "cpu_count": os.cpu_count(), "torch": torch.__version__})
    return pick
