"""The measured default thread count (eagle2.threads): the choice, the cache, what sets it."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import save_tiny_target, tiny_target

from eagle2 import threads as thr


def test_choose_prefers_fewer_threads_unless_more_are_clearly_faster():
    assert thr.choose({1: 0.030, 2: 0.029}) == 1  # within GAIN: fewer threads
    assert thr.choose({1: 0.030, 2: 0.020}) == 2
    assert thr.choose({1: 0.030, 2: 0.031, 4: 0.020}) == 4
    assert thr.choose({1: 0.020, 2: 0.030}) == 1
    assert thr.candidates(1) == [1] and thr.candidates(2) == [1, 2]
    assert thr.candidates(6) == [1, 2, 4, 6] and thr.candidates(8) == [1, 2, 4, 8]


def test_an_explicit_count_in_the_environment_wins(monkeypatch):
    monkeypatch.delenv("EAGLE2_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thr.requested() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thr.requested() == 3
    monkeypatch.setenv("EAGLE2_THREADS", "1")
    assert thr.requested() == 1
    monkeypatch.setenv("EAGLE2_THREADS", "auto")  # not a count: the next source
    assert thr.requested() == 3


def test_auto_threads_are_measured_once_cached_and_set_before_the_next_load(tmp_path,
                                                                           monkeypatch):
    """A real load of a saved model: the first measures every candidate count with real
    decode steps and caches the fastest; the next reads it (no measuring) and sets it; an
    explicit count and threads=None are left as given. Output is the same at any count."""
    from eagle2.api import Eagle2
    from eagle2.config import SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE2_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = save_tiny_target(tiny_target(seed=3), tmp_path / "m")
    before = torch.get_num_threads()
    measured = []
    real = thr.measure

    def spy(engine, vocab, counts, rounds=thr.ROUNDS):
        timings = real(engine, vocab, counts, rounds)
        measured.append(timings)
        return timings

    monkeypatch.setattr(thr, "measure", spy)
    monkeypatch.setattr(thr, "cpu_busy_seconds", lambda cpus=None: None)  # others' load unknown
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        first = Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        counts = thr.candidates(thr.default_count())
        assert len(measured) == 1 and set(measured[0]) == set(counts)
        assert all(0 < s < 1 for s in measured[0].values())
        chosen = thr.choose(measured[0])
        assert torch.get_num_threads() == chosen
        saved = json.loads(thr.cache_path(first.target).read_text())
        assert saved["threads"] == chosen and set(saved["step_ms"]) == {str(n) for n in counts}
        assert first.engine.stats.steps == 0  # the probe's steps were not kept
        out = first.generate_ids([first.request([1, 2, 3], params)])[0].token_ids

        torch.set_num_threads(before)
        second = Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert len(measured) == 1 and torch.get_num_threads() == chosen
        assert second.generate_ids([second.request([1, 2, 3], params)])[0].token_ids == out

        torch.set_num_threads(before)
        Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=None)
        assert torch.get_num_threads() == before and len(measured) == 1
        Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("EAGLE2_THREADS", str(before))
        torch.set_num_threads(1)
        Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert torch.get_num_threads() == before and len(measured) == 1
        with pytest.raises(ValueError, match="threads must be >= 1"):
            Eagle2.load(model, "untrained", dtype="float32", device="cpu", threads=0)
    finally:
        torch.set_num_threads(before)


class FakeMachine:
    """A clock, the CPUs' busy seconds and this process's own CPU seconds, set by a test."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds: float, others: float, own: float = 1.0) -> None:
        """`seconds` pass, other processes using `others` cores and this one `own`."""
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def follower(self, most: int, ncpu: int = 2) -> thr.LoadFollower:
        f = thr.LoadFollower(most, interval=0.5, clock=lambda: self.t,
                             busy=lambda cpus: self.busy, own=lambda: self.own)
        f.ncpu = ncpu
        return f


def test_the_load_follower_takes_fewer_threads_while_others_hold_cores():
    """Down while fewer than count - 0.5 cores are free, up once count + 0.75 are, nothing
    between the two (a load near one threshold does not flip the count), never above the
    quiet machine's count, polls within the interval read nothing."""
    m = FakeMachine()
    f = m.follower(most=2)
    m.advance(0.6, others=0.1)
    assert f.poll() is None and f.count == 2  # quiet: keep both
    m.advance(0.6, others=1.0)
    assert f.poll() == 1 and abs(f.others - 1.0) < 1e-9  # a busy process: one thread
    m.advance(0.2, others=0.0)
    assert f.poll() is None  # within the interval: not read
    m.advance(0.6, others=0.4)
    assert f.poll() is None and f.count == 1  # 1.6 cores free: between the thresholds
    m.advance(0.6, others=0.1)
    assert f.poll() == 2  # free again
    m.advance(0.6, others=0.6)
    assert f.poll() == 1
    m.advance(0.6, others=0.0)
    assert f.poll() == 2 and f.count == 2  # never above `most`
    m.advance(0.6, others=0.0)
    assert f.poll() is None
    m.advance(5.0, others=2.0)  # a window of 10 intervals (idle engine): a new one starts
    assert f.poll() is None and f.count == 2
    m.advance(0.6, others=1.0)
    assert f.poll() == 1

    m = FakeMachine()
    f = m.follower(most=8, ncpu=8)
    m.advance(1.0, others=3.0)  # 5 free of 8: 5 threads (5 < 8 - 0.5 ... 5 >= 5 - 0.5)
    assert f.poll() == 5
    m.advance(1.0, others=0.0)
    assert f.poll() == 8


def test_the_load_follower_reads_proc_stat_and_never_acts_without_it(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  50 0 50 900 0 0 0 0 0 0\n"
                    "cpu0 10 1 20 400 7 2 3 4 0 0\n"
                    "cpu1 30 0 10 500 0 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert thr.cpu_busy_seconds(None, stat) == pytest.approx((40 + 40) / hz)
    assert thr.cpu_busy_seconds({1}, stat) == pytest.approx(40 / hz)
    assert thr.cpu_busy_seconds(None, tmp_path / "missing") is None
    f = thr.LoadFollower(2, interval=0.0, busy=lambda cpus: None)
    assert f.poll() is None and f.count == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_a_real_busy_process_takes_a_thread_and_gives_it_back():
    """Real busy-loop processes on all but one of this process's CPUs: the follower (real
    /proc/stat, real clock) goes down to fewer threads; once they are killed, back up."""
    from eagle2.bench.load import busy_processes

    ncpu = len(os.sched_getaffinity(0))
    f = thr.LoadFollower(ncpu, interval=0.4)
    with busy_processes(ncpu - 1):
        deadline = time.monotonic() + 10
        while f.count == ncpu and time.monotonic() < deadline:
            time.sleep(0.45)
            f.poll()
        assert f.count < ncpu and f.others > 0.5, f.others
    deadline = time.monotonic() + 20  # a CI machine's own work may delay it
    while f.count < ncpu and time.monotonic() < deadline:
        time.sleep(0.45)
        f.poll()
    assert f.count == ncpu, f.others


class Scripted:
    """A follower whose counts a test gives, one per step (None: keep)."""

    def __init__(self, counts):
        self.counts = list(counts)

    def poll(self):
        return self.counts.pop(0) if self.counts else None


def test_the_engine_switches_threads_keeps_each_counts_timing_and_stays_lossless(tmp_path):
    """Greedy output with the thread count switched between steps is plain decoding's; the
    costs of a count are read from that count's cache path, and what was measured at a count
    is taken up again when the engine returns to it."""
    from conftest import make_engine, random_prompts, run

    from eagle2.config import SamplingParams, TreeConfig

    target = tiny_target(seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = random_prompts(3, target.vocab_size, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        plain = run(make_engine(target, head_seed=None), prompts, params, TreeConfig("vanilla"))
        torch.set_num_threads(2)
        engine = make_engine(target, head_seed=0)
        paths = []

        def path_of():
            paths.append(tmp_path / f"costs-{torch.get_num_threads()}.json")
            return paths[-1]

        engine._costs = engine._cost_path = tmp_path / "costs-2.json"
        engine.follow_load(Scripted([None, None, 1, None, None, 2, None, 1]), path_of)
        out = run(engine, prompts, params, TreeConfig())
        assert out == plain
        assert engine.stats.thread_switches == [1, 2, 1] and torch.get_num_threads() == 1
        assert paths == [tmp_path / "costs-1.json"]  # 2 and then 1 again: taken up
        assert engine._cost_path == tmp_path / "costs-1.json"
        assert set(engine._timing_of) == {2}
        assert engine._timing_of[2][1] == tmp_path / "costs-2.json"
    finally:
        torch.set_num_threads(before)


def test_a_count_measured_beside_busy_processes_is_used_but_not_cached(tmp_path, monkeypatch):
    from eagle2.api import Eagle2

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE2_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # other processes keep two cores busy the whole time
    monkeypatch.setattr(thr, "cpu_busy_seconds",
                        lambda cpus=None: 2 * time.monotonic() + time.process_time())
    model = save_tiny_target(tiny_target(seed=3), tmp_path / "m")
    before = torch.get_num_threads()
    try:
        llm = Eagle2.load(model, "untrained", dtype="float32", device="cpu")
        assert torch.get_num_threads() in thr.candidates(thr.default_count())
        assert not thr.cache_path(llm.target).exists()
    finally:
        torch.set_num_threads(before)


def test_a_cached_choice_measured_over_other_counts_is_measured_again(tmp_path, monkeypatch):
    """A choice cached from a load whose caller had set one thread (only count 1 measured)
    is not this machine's: it reads as missing, so the next load measures every count."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(thr, "default_count", lambda: 2)
    target = tiny_target(seed=3)
    path = thr.cache_path(target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"threads": 1, "step_ms": {"1": 19.0}}))
    assert thr.cached(target) is None
    path.write_text(json.dumps({"threads": 2, "step_ms": {"1": 19.0, "2": 11.0}}))
    assert thr.cached(target) == 2
    path.write_text("{")
    assert thr.cached(target) is None


def test_a_seeded_request_samples_the_same_after_a_thread_switch(tmp_path):
    """A seeded sampled request whose engine switches thread count mid-request (another
    process took a core) samples what it samples without the switch: a sampled batch's
    trees are cut by the costs of the count the follower began at, though the other count's
    costs (here: trees that never pay) differ. Without that (the current count's costs) the
    sample parts."""
    import json

    from conftest import make_engine, random_prompts, run

    from eagle2.config import SamplingParams, TreeConfig

    target = tiny_target(seed=5)
    params = SamplingParams(max_tokens=32, temperature=0.8, ignore_eos=True)
    prompts = random_prompts(2, target.vocab_size, seed=7)
    before = torch.get_num_threads()

    def engine_at(path_of):
        engine = make_engine(target, head_seed=0)
        engine._costs = engine._cost_path = tmp_path / "costs-2.json"
        if path_of is not None:
            engine.follow_load(Scripted([None, None, 1]), path_of)
        return engine

    try:
        torch.set_num_threads(2)
        quiet = run(engine_at(None), prompts, params, TreeConfig(), seeds=[11, 12])
        data = json.loads((tmp_path / "costs-2.json").read_text())  # what the count-2 run wrote
        for grid in ("seconds", "long_seconds"):  # at 1 thread, trees cost their size
            data[grid] = [[row[0] * n for n in data["nodes"]] for row in data.get(grid) or []]
        (tmp_path / "costs-1.json").write_text(json.dumps(data))

        def path_of():
            return tmp_path / f"costs-{torch.get_num_threads()}.json"

        switched = engine_at(path_of)
        assert run(switched, prompts, params, TreeConfig(), seeds=[11, 12]) == quiet
        assert switched.stats.thread_switches == [1]
        torch.set_num_threads(2)
        current = engine_at(path_of)
        current._sampled_costs = lambda costs: costs  # the count's own costs
        assert run(current, prompts, params, TreeConfig(), seeds=[11, 12]) != quiet
    finally:
        torch.set_num_threads(before)


def test_torch_thread_runs_calls_in_order_on_one_thread_and_returns_their_errors():
    """`TorchThread`: loading and stepping on one OS thread (one OpenMP team), whoever calls."""
    import threading

    worker = thr.TorchThread("torch-test")
    seen: list[tuple[int, int]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.get_ident())) or i)
               for i in range(5)]
    assert [f.result(10) for f in futures] == list(range(5))
    assert [i for i, _ in seen] == list(range(5))
    assert {ident for _, ident in seen} == {worker.thread.ident} != {threading.get_ident()}
    other = threading.Thread(target=lambda: seen.append((9, worker.call(threading.get_ident))))
    other.start()
    other.join(10)
    assert seen[-1] == (9, worker.thread.ident)  # from another thread: still the same one
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    assert worker.call(lambda: "alive") == "alive" and worker.thread.is_alive()
    worker.close(10)
    assert not worker.thread.is_alive()
